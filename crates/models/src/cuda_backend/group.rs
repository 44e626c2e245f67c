//! A CUDA rank's place in a tensor-parallel group ([`crate::parallel`]): the collectives it
//! meets the other ranks in, through NCCL among GPUs of their own or through host memory,
//! and the buffers they pass through.
//!
//! The all-reduce sums in rank order, `((p0 + p1) + p2) + …`, on every rank
//! ([`NcclGroup::all_reduce_in_rank_order`]): the same bits whatever the batch, and the same
//! bits as the host group's ([`HostGroup`], the CPU's).

use std::sync::{Arc, Mutex};

use ember_tensor::cuda::{CudaDevice, DeviceBuffer, NcclGroup};
use ember_tensor::{Buffer, BufferKind};

use super::CudaBackend;
use crate::backend::Slot;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::parallel::{GroupAborted, HostGroup, Shard};

/// How a CUDA group's ranks meet.
#[derive(Clone)]
pub enum CudaCollectives {
    /// NCCL, each rank on a GPU of its own: the collectives are enqueued on the stream like
    /// any kernel (and recorded in graphs with the rest of a decode step).
    Nccl(Arc<NcclRanks>),
    /// Through host memory ([`HostGroup`]): ranks may share a GPU (one GPU checking a split,
    /// a machine without NCCL). Every collective waits for the device, so passes are run op
    /// by op, never recorded.
    Host(Arc<HostGroup>),
}

impl CudaCollectives {
    /// Stops the group: ranks waiting in a collective, now or later, fail with `why`.
    pub fn abort(&self, why: &str) {
        match self {
            CudaCollectives::Nccl(ranks) => ranks.abort(why),
            CudaCollectives::Host(group) => group.abort(why),
        }
    }

    pub fn ranks(&self) -> usize {
        match self {
            CudaCollectives::Nccl(ranks) => ranks.group.ranks(),
            CudaCollectives::Host(group) => group.ranks(),
        }
    }
}

/// NCCL's communicators for a group of GPUs, and why it was stopped once it has been.
pub struct NcclRanks {
    group: NcclGroup,
    stopped: Mutex<Option<String>>,
}

impl NcclRanks {
    /// Rank `r` on `devices[r]`, each a GPU of its own.
    pub fn new(devices: &[CudaDevice]) -> Result<NcclRanks> {
        Ok(NcclRanks {
            group: NcclGroup::new(devices)?,
            stopped: Mutex::new(None),
        })
    }

    fn abort(&self, why: &str) {
        self.lock().get_or_insert_with(|| why.to_string());
        self.group.abort();
    }

    /// Fails once the group has been stopped, with the reason it was.
    fn check(&self) -> std::result::Result<(), GroupAborted> {
        match self.lock().as_ref() {
            Some(why) => Err(GroupAborted(why.clone())),
            None => Ok(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.stopped.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A backend's group, its rank, and the room its collectives pass through.
pub(super) struct RankGroup {
    collectives: CudaCollectives,
    shard: Shard,
    scratch: Scratch,
}

enum Scratch {
    /// NCCL: every rank's values of a collective, gathered (`ranks ×` the largest one's).
    Gathered(DeviceBuffer),
    /// Host: the largest collective's values on their way through host memory (a staging
    /// buffer, page-locked with the driver while the residency set holds it), and past them
    /// room for this rank's part of the logits.
    Staging(Buffer),
}

impl CudaBackend {
    /// Makes this backend rank `shard.rank` of a group meeting through `collectives`: its
    /// model is that shard's ([`crate::Transformer::load_shard`]) and `config` the whole
    /// model's shapes (this backend was made for the shard's: the hidden size and the
    /// vocabulary are the same).
    pub fn join_group(
        mut self,
        collectives: CudaCollectives,
        shard: Shard,
        config: &ModelConfig,
    ) -> Result<Self> {
        assert_eq!(
            collectives.ranks(),
            shard.ranks,
            "a group of {} ranks",
            shard.ranks
        );
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let widest_part = vocab.div_ceil(shard.ranks);
        let reduced = self.max_batch * hidden;
        let scratch = match &collectives {
            CudaCollectives::Nccl(_) => {
                let values = shard.ranks * reduced.max(self.logit_rows * widest_part);
                Scratch::Gathered(self.owner.alloc_device(
                    BufferKind::Activations,
                    "tensor-parallel gathers",
                    &self.device,
                    values * 4,
                )?)
            }
            CudaCollectives::Host(_) => {
                // Host collectives wait for the device inside a pass: nothing to record.
                self.graphs = None;
                let values = reduced.max(self.logit_rows * (vocab + widest_part));
                Scratch::Staging(self.owner.alloc_staging(
                    BufferKind::Activations,
                    "tensor-parallel staging (host)",
                    values * 4,
                )?)
            }
        };
        self.group = Some(RankGroup {
            collectives,
            shard,
            scratch,
        });
        Ok(self)
    }

    /// [`crate::Backend::all_reduce`]: `slot[offset..offset + len]` becomes every rank's
    /// summed in rank order.
    pub(super) fn reduce_across_ranks(
        &mut self,
        slot: Slot,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let CudaBackend {
            device,
            slots,
            group,
            ..
        } = self;
        let RankGroup {
            collectives,
            shard,
            scratch,
        } = group.as_mut().ok_or_else(outside_a_group)?;
        let mut values = slots[slot.index()].as_mut_slice::<f32>();
        let mut values = values.slice_mut(offset..offset + len);
        match (collectives, scratch) {
            (CudaCollectives::Nccl(nccl), Scratch::Gathered(gathered)) => {
                nccl.check()?;
                let mut gathered = gathered.as_mut_slice::<f32>();
                nccl.group.all_reduce_in_rank_order(
                    shard.rank,
                    device,
                    &mut values,
                    &mut gathered,
                )?;
            }
            (CudaCollectives::Host(host), Scratch::Staging(staging)) => {
                let through = &mut staging.as_mut_slice::<f32>()[..len];
                device.download(values.as_slice(), through)?;
                host.all_reduce(shard.rank, through)?;
                device.upload(&mut values, through)?;
            }
            _ => unreachable!("scratch made for the group's collectives"),
        }
        Ok(())
    }

    /// [`crate::Backend::gather_logits`]: the first `rows` rows of every rank's part of the
    /// vocabulary (this rank's at the start of the logits, `rows × part` values) gathered
    /// into whole rows of `vocab`.
    pub(super) fn gather_logit_parts(&mut self, rows: usize, vocab: usize) -> Result<()> {
        let CudaBackend {
            device,
            logits,
            group,
            ..
        } = self;
        let RankGroup {
            collectives,
            shard,
            scratch,
        } = group.as_mut().ok_or_else(outside_a_group)?;
        let part = |rank| Shard { rank, ..*shard }.part(vocab);
        let widest = vocab.div_ceil(shard.ranks);
        let mine = shard.part(vocab).len();
        let mut logits = logits.as_mut_slice::<f32>();
        match (collectives, scratch) {
            (CudaCollectives::Nccl(nccl), Scratch::Gathered(gathered)) => {
                nccl.check()?;
                // Equal parts for the gather: each rank sends its widest part's room (past
                // its own values, whatever is there, never read).
                let step = rows * widest;
                let mut all = gathered.as_mut_slice::<f32>();
                let mut all = all.slice_mut(0..shard.ranks * step);
                let send = logits.as_slice().slice(0..step);
                nccl.group.all_gather(shard.rank, device, send, &mut all)?;
                let all = all.as_slice();
                for rank in 0..shard.ranks {
                    let part = part(rank);
                    let mut to = logits.slice_mut(part.start..rows * vocab);
                    let from = all.slice(rank * step..(rank + 1) * step);
                    device.copy_rows(from, part.len(), &mut to, vocab, [rows, part.len()])?;
                }
            }
            (CudaCollectives::Host(host), Scratch::Staging(staging)) => {
                let (whole, own) = staging.as_mut_slice::<f32>().split_at_mut(rows * vocab);
                let own = &mut own[..rows * mine];
                device.download(logits.as_slice().slice(0..rows * mine), own)?;
                host.all_gather_columns(*shard, own, [rows, vocab], whole)?;
                device.upload(&mut logits.slice_mut(0..rows * vocab), whole)?;
            }
            _ => unreachable!("scratch made for the group's collectives"),
        }
        Ok(())
    }

    /// Whether this backend's MoE sums are partial (a rank of a group).
    pub(super) fn in_group(&self) -> bool {
        self.group.is_some()
    }
}

fn outside_a_group() -> Error {
    Error::Unsupported {
        what: "a collective outside a tensor-parallel group".into(),
        backend: "CUDA",
    }
}
