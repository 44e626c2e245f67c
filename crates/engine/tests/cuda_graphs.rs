//! On CUDA, a decode step replayed from a recorded graph gives the same bits as the same
//! step launched op by op, and a second sequence replaying the graphs of the first gives the
//! same bits as the first. Prints "skipped" and passes where no GPU opens.

use std::path::PathBuf;

use ember_engine::{Device, Engine, EngineOptions};
use ember_tensor::cuda::CudaDevice;

fn load(name: &str, cuda_graphs: bool) -> Engine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name);
    let options = EngineOptions {
        context: Some(96),
        prefill_chunk: Some(16),
        device: Device::Cuda(0),
        cuda_graphs,
        ..EngineOptions::default()
    };
    Engine::load(&dir, &options).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The logits' bits after the prompt and after each of `steps` greedy tokens.
fn greedy_logits(engine: &mut Engine, prompt: &[u32], steps: usize) -> Vec<Vec<u32>> {
    let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    engine.reset();
    let mut all = vec![bits(engine.prefill(prompt).unwrap())];
    for _ in 0..steps {
        let last = all.last().unwrap();
        let token = (0..last.len())
            .max_by(|&a, &b| f32::from_bits(last[a]).total_cmp(&f32::from_bits(last[b])))
            .unwrap() as u32;
        all.push(bits(engine.step(token).unwrap()));
    }
    all
}

#[test]
fn graph_replays_equal_unrecorded_steps() {
    if let Err(e) = CudaDevice::probe() {
        println!("skipped: no CUDA ({e})");
        return;
    }
    // A context past one attention chunk (32 keys) and a prompt long enough for several.
    for name in [
        "qwen3-f32",
        "qwen3-bf16",
        "qwen2-f32",
        "qwen2-bf16",
        "llama-f32",
        "llama-bf16",
        "qwen3moe-f32",
        "qwen3moe-bf16",
    ] {
        let mut eager = load(name, false);
        let prompt = eager
            .encode_prompt("Graphs replay the same kernels on new positions, bit for bit.")
            .unwrap();
        let steps = 48;
        let want = greedy_logits(&mut eager, &prompt, steps);
        let mut graphed = load(name, true);
        // The first sequence records the step; the second replays it from its first token.
        for run in 0..2 {
            let got = greedy_logits(&mut graphed, &prompt, steps);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g == w,
                    "{name} run {run}: logits after step {i} differ from op by op"
                );
            }
        }
    }
}
