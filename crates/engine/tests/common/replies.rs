//! What the tests that compare a request's replies bit for bit share: the golden fixtures,
//! and a reply as tokens with each token's logits' bits.

use std::ops::ControlFlow;
use std::path::PathBuf;

use ember_engine::{Engine, GenerateParams};

pub fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

/// Tokens and each token's logits' bits.
pub type Reply = (Vec<u32>, Vec<Vec<u32>>);

pub fn bits(logits: &[f32]) -> Vec<u32> {
    logits.iter().map(|x| x.to_bits()).collect()
}

/// The request alone on the one-sequence road (which neither batches nor drafts); `params`
/// must ask for step logits.
pub fn alone(engine: &mut Engine, prompt: &[u32], params: &GenerateParams) -> Reply {
    let mut logits = Vec::new();
    let generation = engine
        .generate(prompt, params, |step| {
            logits.push(bits(step.logits.expect("step logits asked for")));
            ControlFlow::Continue(())
        })
        .unwrap();
    (generation.tokens, logits)
}
