//! What the tests that compare a request's replies bit for bit share: the golden fixtures,
//! requests drawn from a seed, and a reply as tokens with each token's logits' bits.

use std::ops::ControlFlow;
use std::path::PathBuf;

use ember_engine::{Collectives, Device, Engine, EngineOptions, GenerateParams};

pub fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

/// The device under test: `EMBER_TEST_DEVICE` (cpu, cuda, cuda:N), the CPU by default.
pub fn device() -> Device {
    std::env::var("EMBER_TEST_DEVICE")
        .map(|d| d.parse().expect("EMBER_TEST_DEVICE: cpu, cuda or cuda:N"))
        .unwrap_or(Device::Cpu)
}

/// How a split model's GPUs meet in the tests: `EMBER_TEST_COLLECTIVES` (nccl, host),
/// through host memory by default, so that one GPU holds every rank.
pub fn collectives() -> Collectives {
    std::env::var("EMBER_TEST_COLLECTIVES")
        .map(|c| c.parse().expect("EMBER_TEST_COLLECTIVES: nccl or host"))
        .unwrap_or(Collectives::Host)
}

/// `options` on the device under test. On CUDA with the batch-invariant kernels, the only ones
/// that promise a row the same bits in any pass (and graphs unless `EMBER_TEST_CUDA_GRAPHS=0`).
pub fn on_test_device(options: EngineOptions) -> EngineOptions {
    EngineOptions {
        device: device(),
        batch_invariant: device() != Device::Cpu,
        cuda_graphs: std::env::var("EMBER_TEST_CUDA_GRAPHS").map_or(true, |v| v != "0"),
        collectives: collectives(),
        ..options
    }
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

/// The request alone on the one-sequence road, undrafted (an engine that drafts takes the
/// batched loop for a drafted request); it must ask for step logits.
pub fn alone(engine: &mut Engine, r: &Request) -> Reply {
    let mut logits = Vec::new();
    let params = GenerateParams {
        draft: false,
        ..r.params
    };
    let generation = engine
        .generate(&r.prompt, &params, |step| {
            logits.push(bits(step.logits.expect("step logits asked for")));
            ControlFlow::Continue(())
        })
        .unwrap();
    (generation.tokens, logits)
}
