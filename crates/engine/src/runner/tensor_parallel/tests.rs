//! The group's coordination, with ranks that only meet in a host group's collectives: a rank
//! that fails or panics (before its collective, so the others wait on it) fails the call with
//! its reason and never hangs; every call after fails at once; picks must agree; pool copies
//! reach every rank in order.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ember_models::parallel::HostGroup;
use ember_models::{BlockTable, KV_BLOCK_SIZE, KvDtype, KvLayout, KvStore, Logits};
use ember_models::{ModelConfig, PassInput, SequencePass};
use ember_tensor::BufferOwner;

use super::{AbortGroup, Runner, TensorParallelRunner};
use crate::error::{Error, Result};

/// The pool copies the ranks made: rank, which way, block, slot.
type Copies = Arc<Mutex<Vec<(usize, &'static str, u32, u32)>>>;

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    /// An error before the pass's collective: the other ranks wait in it.
    Fails,
    Panics,
}

/// A rank whose pass is an all-reduce of one number, whose greedy pick is its `pick`, and
/// whose pool records the copies asked of it.
struct FakeRank {
    rank: usize,
    group: Arc<HostGroup>,
    fault: Fault,
    pick: u32,
    copies: Copies,
    layout: KvLayout,
    config: ModelConfig,
}

impl FakeRank {
    fn pass(&mut self) -> Result<()> {
        match self.fault {
            Fault::None => {}
            Fault::Fails => {
                return Err(Error::Model(ember_models::Error::Unsupported {
                    what: "a test's fault".into(),
                    backend: "fake",
                }));
            }
            Fault::Panics => panic!("a test's panic"),
        }
        let mut x = [self.rank as f32];
        self.group
            .all_reduce(self.rank, &mut x)
            .map_err(ember_models::Error::from)?;
        Ok(())
    }
}

impl Runner for FakeRank {
    fn forward(&mut self, _: &mut BlockTable, _: &[u32], _: Logits) -> Result<&[f32]> {
        self.pass()?;
        Ok(&[])
    }
    fn forward_batch(&mut self, _: &mut [SequencePass<'_, '_>]) -> Result<usize> {
        self.pass()?;
        Ok(0)
    }
    fn logits(&mut self, _: usize) -> Result<&[f32]> {
        Ok(&[])
    }
    fn greedy_tokens(&mut self, rows: usize) -> Result<Vec<u32>> {
        Ok(vec![self.pick; rows])
    }
    fn forward_greedy(&mut self, _: &mut BlockTable, _: &[u32]) -> Result<u32> {
        self.pass()?;
        Ok(self.pick)
    }
    fn forward_ahead(&mut self, _: &mut BlockTable, _: PassInput<'_>) -> Result<()> {
        self.pass()
    }
    fn read_pick(&mut self) -> Result<u32> {
        Ok(self.pick)
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn max_batch(&self) -> usize {
        1
    }
    fn logit_rows(&self) -> usize {
        1
    }
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }
    fn kv(&mut self) -> &mut dyn KvStore {
        self
    }
    fn context(&self) -> usize {
        KV_BLOCK_SIZE
    }
    fn weight_bytes_per_token(&self) -> usize {
        10
    }
    fn threads(&self) -> usize {
        1
    }
    fn device_label(&self) -> String {
        "fake".into()
    }
    fn measure_bandwidth(&self, _: &BufferOwner, _: usize, _: usize) -> Result<f64> {
        Ok(1.0)
    }
    fn profiler_capture(&self, _: bool) -> Result<()> {
        Ok(())
    }
}

impl KvStore for FakeRank {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }
    fn blocks(&self) -> usize {
        4
    }
    fn host_blocks(&self) -> usize {
        2
    }
    fn save_to_host(&mut self, block: u32, slot: u32) -> ember_models::Result<()> {
        self.copies
            .lock()
            .unwrap()
            .push((self.rank, "save", block, slot));
        Ok(())
    }
    fn load_from_host(&mut self, slot: u32, block: u32) -> ember_models::Result<()> {
        self.copies
            .lock()
            .unwrap()
            .push((self.rank, "load", block, slot));
        Ok(())
    }
}

struct Group {
    runner: TensorParallelRunner,
    copies: Copies,
}

/// A group of `ranks`, each with its fault and pick.
fn group(ranks: &[(Fault, u32)]) -> Group {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/qwen3-f32");
    let config = ModelConfig::from_dir(&dir).unwrap();
    let host = Arc::new(HostGroup::new(ranks.len()));
    let copies = Arc::new(Mutex::new(Vec::new()));
    let runners = ranks
        .iter()
        .enumerate()
        .map(|(rank, &(fault, pick))| {
            Box::new(FakeRank {
                rank,
                group: Arc::clone(&host),
                fault,
                pick,
                copies: Arc::clone(&copies),
                layout: KvLayout::new(&config, KvDtype::F32),
                config: config.clone(),
            }) as Box<dyn Runner>
        })
        .collect();
    let abort: AbortGroup = Arc::new(move |why: &str| host.abort(why));
    Group {
        runner: TensorParallelRunner::new(runners, config, abort, None).unwrap(),
        copies,
    }
}

fn table() -> BlockTable {
    BlockTable::with_blocks(vec![0], 0)
}

#[test]
fn a_healthy_group_answers_with_rank_zeros_pick_and_sums_its_counts() {
    let mut g = group(&[(Fault::None, 7), (Fault::None, 7), (Fault::None, 7)]);
    for _ in 0..50 {
        assert_eq!(g.runner.forward_greedy(&mut table(), &[1]).unwrap(), 7);
        g.runner.forward(&mut table(), &[1], Logits::Last).unwrap();
        g.runner
            .forward_ahead(&mut table(), PassInput::Fed)
            .unwrap();
        assert_eq!(g.runner.read_pick().unwrap(), 7);
    }
    assert_eq!(g.runner.weight_bytes_per_token(), 30);
    // Every rank's memory, measured at once and added.
    let rate = g
        .runner
        .measure_bandwidth(&BufferOwner::new(), 64, 1)
        .unwrap();
    assert_eq!(rate, 3.0);
    assert_eq!(g.runner.threads(), 3);
    assert_eq!(g.runner.device_label(), "fake x 3 ranks (tensor parallel)");
}

#[test]
fn pool_copies_reach_every_rank_in_order() {
    let mut g = group(&[(Fault::None, 1), (Fault::None, 1)]);
    g.runner.kv().save_to_host(3, 1).unwrap();
    g.runner.kv().load_from_host(1, 2).unwrap();
    // A pass waits for every rank: the copies sent before it have run.
    g.runner.forward(&mut table(), &[1], Logits::None).unwrap();
    let copies = g.copies.lock().unwrap().clone();
    for rank in 0..2 {
        let mine: Vec<_> = copies.iter().filter(|c| c.0 == rank).collect();
        assert_eq!(mine, [&(rank, "save", 3, 1), &(rank, "load", 2, 1)]);
    }
    assert_eq!(
        (g.runner.kv().blocks(), g.runner.kv().host_blocks()),
        (4, 2)
    );
}

/// The call that meets the fault fails within a moment, naming the rank and why; every call
/// after fails at once with the same reason; dropping the group joins every thread.
fn check_fails(ranks: &[(Fault, u32)], failing: usize, why: &str) {
    let mut g = group(ranks);
    let started = Instant::now();
    let e = g
        .runner
        .forward(&mut table(), &[1], Logits::Last)
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    let message = e.to_string();
    // The failing rank's own reason, not another's report that the group stopped.
    assert!(
        message.contains(&format!("(rank {failing}: {why}")),
        "{message}"
    );
    for _ in 0..3 {
        let e = g.runner.forward_greedy(&mut table(), &[1]).unwrap_err();
        assert!(e.is_fatal(), "{e}");
        assert!(e.to_string().contains(why), "{e}");
        assert!(g.runner.kv().save_to_host(0, 0).is_err());
    }
    drop(g);
}

#[test]
fn a_rank_that_fails_stops_the_group_without_a_hang() {
    let fails = [(Fault::None, 1), (Fault::Fails, 1), (Fault::None, 1)];
    check_fails(&fails, 1, "a test's fault");
    let lead_fails = [(Fault::Fails, 1), (Fault::None, 1)];
    check_fails(&lead_fails, 0, "a test's fault");
}

#[test]
fn a_rank_that_panics_stops_the_group_without_a_hang() {
    let panics = [(Fault::None, 1), (Fault::None, 1), (Fault::Panics, 1)];
    check_fails(&panics, 2, "panicked: a test's panic");
}

#[test]
fn ranks_that_pick_differently_fail_the_group() {
    let mut g = group(&[(Fault::None, 4), (Fault::None, 5)]);
    let e = g.runner.forward_greedy(&mut table(), &[1]).unwrap_err();
    assert!(
        e.to_string().contains("rank 0 Some(4), rank 1 Some(5)"),
        "{e}"
    );
    assert!(g.runner.forward(&mut table(), &[1], Logits::Last).is_err());
}
