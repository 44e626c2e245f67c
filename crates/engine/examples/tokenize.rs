//! Prints a model's token ids for a text: `cargo run -p ember-engine --example tokenize -- MODEL TEXT [--special]`.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let engine = ember_engine::Engine::load(
        std::path::Path::new(&args[1]),
        &ember_engine::EngineOptions {
            threads: Some(1),
            context: Some(64),
            prefill_chunk: Some(8),
            ..Default::default()
        },
    )
    .expect("loading the model");
    let text = args[2].replace("\\n", "\n");
    let special = args.get(3).is_some_and(|a| a == "--special");
    let ids = if special {
        engine.tokenizer().encode(&text, false).expect("encoding")
    } else {
        engine.encode_prompt(&text).expect("encoding")
    };
    println!("{ids:?}");
}
