//! Runs the same greedy generation on the CPU and on CUDA and prints, for each step, how far
//! the CUDA logits are from the CPU's (the CPU's greedy tokens drive both, so one bad step
//! does not derail the rest): the tool for telling which step, and so which road (prompt
//! GEMMs, decode kernels, chunked prefill), a CUDA difference comes from.
//!
//! `cargo run --release -p ember-engine --example device_diff -- MODEL PROMPT STEPS [MAX_BATCH]`
use ember_engine::{Device, Engine, EngineOptions};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: device_diff MODEL PROMPT STEPS [MAX_BATCH]");
        std::process::exit(2);
    }
    let steps: usize = args[3].parse().expect("STEPS: a count");
    let max_batch: usize = args.get(4).map_or(512, |b| b.parse().expect("MAX_BATCH"));
    let load = |device| {
        let options = EngineOptions {
            threads: Some(2),
            context: Some(256),
            prefill_chunk: Some(max_batch),
            device,
            ..EngineOptions::default()
        };
        Engine::load(std::path::Path::new(&args[1]), &options).expect("loading")
    };
    let (mut cpu, mut gpu) = (load(Device::Cpu), load(Device::Cuda(0)));
    let prompt = cpu.encode_prompt(&args[2]).expect("encoding");
    println!("prompt of {} tokens, max_batch {max_batch}", prompt.len());
    let mut want = cpu.prefill(&prompt).expect("cpu prefill").to_vec();
    let mut got = gpu.prefill(&prompt).expect("cuda prefill").to_vec();
    for step in 0..=steps {
        let argmax = |l: &[f32]| {
            (0..l.len())
                .max_by(|&a, &b| l[a].total_cmp(&l[b]))
                .expect("logits") as u32
        };
        let diff = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let (token, gpu_token) = (argmax(&want), argmax(&got));
        println!(
            "step {step}: max |logit diff| {diff:.5}, cpu token {token}, cuda token {gpu_token}"
        );
        if step == steps {
            break;
        }
        want = cpu.step(token).expect("cpu step").to_vec();
        got = gpu.step(token).expect("cuda step").to_vec();
    }
}
