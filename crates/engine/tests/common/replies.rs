//! What the tests that compare a request's replies bit for bit share: the golden fixtures,
//! requests drawn from a seed, and a reply as tokens with each token's logits' bits.

use std::ops::ControlFlow;
use std::path::PathBuf;

use ember_engine::{Engine, GenerateParams};

pub fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

pub struct Request {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
}

/// Numbers below `n` from a seed (xorshift): the same requests every run.
pub struct Draws(pub u64);

impl Draws {
    pub fn below(&mut self, n: usize) -> usize {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        (*s % n as u64) as usize
    }
}

/// Tokens and each token's logits' bits.
pub type Reply = (Vec<u32>, Vec<Vec<u32>>);

pub fn bits(logits: &[f32]) -> Vec<u32> {
    logits.iter().map(|x| x.to_bits()).collect()
}

/// The request alone on the one-sequence road (which neither batches nor drafts); it must ask
/// for step logits.
pub fn alone(engine: &mut Engine, r: &Request) -> Reply {
    let mut logits = Vec::new();
    let generation = engine
        .generate(&r.prompt, &r.params, |step| {
            logits.push(bits(step.logits.expect("step logits asked for")));
            ControlFlow::Continue(())
        })
        .unwrap();
    (generation.tokens, logits)
}
