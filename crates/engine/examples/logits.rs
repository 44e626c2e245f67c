//! Prints the top-2 logits at each greedy step: `cargo run --release -p ember-engine --example logits -- MODEL PROMPT N [f32|f16|bf16]`.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let kv_dtype = match args.get(4).map(String::as_str) {
        Some("f32") => Some(ember_engine::KvDtype::F32),
        Some("f16") => Some(ember_engine::KvDtype::F16),
        Some("bf16") => Some(ember_engine::KvDtype::Bf16),
        _ => None,
    };
    let options = ember_engine::EngineOptions {
        threads: Some(2),
        context: Some(256),
        prefill_chunk: Some(256),
        kv_dtype,
        ..Default::default()
    };
    let mut engine =
        ember_engine::Engine::load(std::path::Path::new(&args[1]), &options).expect("loading");
    let prompt = engine.encode_prompt(&args[2]).expect("encoding");
    let steps: usize = args[3].parse().expect("a step count");
    let mut logits = engine.prefill(&prompt).expect("prefill").to_vec();
    for _ in 0..steps {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        println!(
            "{} {:.4} {} {:.4}",
            idx[0], logits[idx[0]], idx[1], logits[idx[1]]
        );
        logits = engine.step(idx[0] as u32).expect("step").to_vec();
    }
}
