//! The ranks of a tensor-parallel group as threads of one process: their all-reduce and
//! all-gather through host memory (the CPU's collective, and the reference a GPU's is held to).

use std::sync::{Condvar, Mutex, MutexGuard};

use super::Shard;

/// A rank stopped the group ([`HostGroup::abort`]): every collective after fails with why, so
/// that no rank waits forever on one that is gone.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GroupAborted(pub String);

/// The collectives of `ranks` threads. Each call is a rendezvous: every rank makes the same
/// calls in the same order, each waits for the others. Sums run in rank order, the same on
/// every rank, whatever order the ranks arrive in: a group's results are the same bits run to
/// run.
pub struct HostGroup {
    ranks: usize,
    state: Mutex<State>,
    turn: Condvar,
}

struct State {
    /// Rendezvous completed, so a waiting rank tells the one it waits on from the next.
    generation: u64,
    arrived: usize,
    aborted: Option<String>,
    /// Each rank's contribution to the collective in progress.
    inputs: Vec<Vec<f32>>,
}

impl HostGroup {
    pub fn new(ranks: usize) -> HostGroup {
        assert!(ranks > 0, "a group of no ranks");
        HostGroup {
            ranks,
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                aborted: None,
                inputs: vec![Vec::new(); ranks],
            }),
            turn: Condvar::new(),
        }
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// `data` becomes the sum over the ranks of their `data` (all of one length), added in
    /// rank order: `((d0 + d1) + d2) + …`.
    pub fn all_reduce(&self, rank: usize, data: &mut [f32]) -> Result<(), GroupAborted> {
        self.gather(rank, data, |inputs, data| {
            data.copy_from_slice(&inputs[0]);
            for other in &inputs[1..] {
                for (d, x) in data.iter_mut().zip(other) {
                    *d += *x;
                }
            }
        })
    }

    /// Every rank's `mine` (of any lengths), in rank order, to `take` on every rank.
    pub fn all_gather(
        &self,
        rank: usize,
        mine: &[f32],
        mut take: impl FnMut(usize, &[f32]),
    ) -> Result<(), GroupAborted> {
        let mut own = mine.to_vec();
        self.gather(rank, &mut own, |inputs, _| {
            for (r, input) in inputs.iter().enumerate() {
                take(r, input);
            }
        })
    }

    /// Every rank's columns of `rows` rows `width` wide (rank `r` holding
    /// `Shard { rank: r, .. }.part(width)`; `mine` this rank's, `rows ×` its part) gathered
    /// into whole rows in `whole`, on every rank: a split vocabulary's logits.
    pub fn all_gather_columns(
        &self,
        shard: Shard,
        mine: &[f32],
        [rows, width]: [usize; 2],
        whole: &mut [f32],
    ) -> Result<(), GroupAborted> {
        self.all_gather(shard.rank, mine, |rank, theirs| {
            let cols = Shard { rank, ..shard }.part(width);
            for row in 0..rows {
                let at = row * width + cols.start;
                whole[at..at + cols.len()]
                    .copy_from_slice(&theirs[row * cols.len()..(row + 1) * cols.len()]);
            }
        })
    }

    /// Stops the group: collectives waiting now and later fail with `why`.
    pub fn abort(&self, why: impl Into<String>) {
        let mut state = self.lock();
        state.aborted.get_or_insert_with(|| why.into());
        self.turn.notify_all();
    }

    /// Every rank's `data` in, then `f` of them all on each rank, then out (the inputs are
    /// the next collective's only once every rank has read them).
    fn gather(
        &self,
        rank: usize,
        data: &mut [f32],
        f: impl FnOnce(&[Vec<f32>], &mut [f32]),
    ) -> Result<(), GroupAborted> {
        assert!(
            rank < self.ranks,
            "rank {rank} of a group of {}",
            self.ranks
        );
        let mut state = self.lock();
        let input = &mut state.inputs[rank];
        input.clear();
        input.extend_from_slice(data);
        state = self.rendezvous(state)?;
        f(&state.inputs, data);
        self.rendezvous(state).map(drop)
    }

    /// Waits until every rank has arrived (or the group is aborted).
    fn rendezvous<'a>(
        &self,
        mut state: MutexGuard<'a, State>,
    ) -> Result<MutexGuard<'a, State>, GroupAborted> {
        if let Some(why) = &state.aborted {
            return Err(GroupAborted(why.clone()));
        }
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.ranks {
            state.arrived = 0;
            state.generation += 1;
            self.turn.notify_all();
            return Ok(state);
        }
        loop {
            state = self.turn.wait(state).unwrap_or_else(|p| p.into_inner());
            if let Some(why) = &state.aborted {
                return Err(GroupAborted(why.clone()));
            }
            if state.generation != generation {
                return Ok(state);
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked holding the lock left the state whole (no step half done).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        let ranks = 3;
        let group = Arc::new(HostGroup::new(ranks));
        // 1e8 + 1 - 1e8 is 0 in f32 added in rank order: a sum in any other order may differ.
        let inputs = [vec![1e8f32, 1.0], vec![1.0, 2.0], vec![-1e8, 3.0]];
        let want = [(1e8f32 + 1.0) + -1e8, 1.0 + 2.0 + 3.0];
        std::thread::scope(|s| {
            for (r, input) in inputs.iter().enumerate() {
                let group = Arc::clone(&group);
                s.spawn(move || {
                    // Many rounds, so the ranks arrive in many orders.
                    for _ in 0..200 {
                        let mut data = input.clone();
                        group.all_reduce(r, &mut data).unwrap();
                        assert_eq!(data, want, "rank {r}");
                    }
                });
            }
        });
    }

    #[test]
    fn all_gather_gives_every_rank_every_part_in_order() {
        let group = Arc::new(HostGroup::new(2));
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    let group = Arc::clone(&group);
                    s.spawn(move || {
                        let mine = vec![r as f32; r + 1];
                        let mut all = Vec::new();
                        group
                            .all_gather(r, &mine, |from, part| {
                                all.push(from as f32 * 10.0);
                                all.extend_from_slice(part);
                            })
                            .unwrap();
                        all
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for got in results {
            assert_eq!(got, [0.0, 0.0, 10.0, 1.0, 1.0]);
        }
    }

    #[test]
    fn a_rank_that_aborts_releases_the_others() {
        let group = Arc::new(HostGroup::new(3));
        let results: Vec<Result<(), GroupAborted>> = std::thread::scope(|s| {
            let waiting: Vec<_> = (0..2)
                .map(|r| {
                    let group = Arc::clone(&group);
                    s.spawn(move || group.all_reduce(r, &mut [1.0]))
                })
                .collect();
            std::thread::sleep(std::time::Duration::from_millis(20));
            group.abort("rank 2: its device was lost");
            waiting.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            assert_eq!(r, Err(GroupAborted("rank 2: its device was lost".into())));
        }
        // And every later collective fails at once.
        assert!(group.all_reduce(2, &mut [1.0]).is_err());
    }
}
