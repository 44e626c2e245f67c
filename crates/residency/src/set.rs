//! The residency set: every engine buffer held, or none; changes staged and committed between
//! requests; removals committed before the free.

use std::collections::HashMap;
use std::collections::TryReserveError;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use crate::report::{LoadReport, NoSet};

use crate::backend::{Backend, BackendError, Region, RegionKind};
use crate::bound::{Bound, fmt_gib};

/// Which way the set went at load; fixed for its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResidencyState {
    /// The whole set is held; joins and leaves act.
    Held,
    /// The set did not fit or the backend refused: nothing is held, and joins, leaves and
    /// commits are no-ops so the engine's code is the same either way.
    Inactive,
    /// Turned off (`--no-residency`, `EMBER_NO_RESIDENCY=1`); behaves as inactive.
    Disabled,
}

impl ResidencyState {
    /// The word `/health` reports: `held`, `inactive`, `disabled`.
    pub fn as_str(self) -> &'static str {
        match self {
            ResidencyState::Held => "held",
            ResidencyState::Inactive => "inactive",
            ResidencyState::Disabled => "disabled",
        }
    }
}

impl fmt::Display for ResidencyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a join refused. In every case the set is unchanged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JoinError {
    #[error(
        "joining {} would pass the {kind} bound: {} held + {} staged + {} new > {}",
        fmt_gib(*new), fmt_gib(*held), fmt_gib(*staged), fmt_gib(*new), fmt_gib(*bound)
    )]
    OverBound {
        kind: &'static str,
        held: u64,
        staged: u64,
        new: u64,
        bound: u64,
    },
    #[error("no memory for the residency set's {what}")]
    NoMemory { what: &'static str },
    #[error("buffer {0} is already a member of the residency set")]
    AlreadyMember(u64),
}

/// What a commit did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommitReport {
    /// Staged members now held.
    pub joined: usize,
    pub joined_bytes: u64,
    /// Staged members dropped because a hold failed (the whole batch).
    pub dropped: usize,
    /// The hold that failed.
    pub refused: Option<BackendError>,
}

impl CommitReport {
    /// True when there was nothing to commit.
    pub fn is_empty(&self) -> bool {
        self.joined == 0 && self.dropped == 0
    }
}

/// What `leave` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Left {
    /// Was held: released and removed, as its own commit.
    Released,
    /// Was staged: dropped, nothing to release.
    Unstaged,
    /// Never a member (or the set is not held): nothing done.
    NotMember,
}

/// Where an id stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Membership {
    Held,
    Staged,
    None,
}

/// Figures for `/metrics` and `/health`.
///
/// Prometheus names: `ember_residency_bytes` = `bytes`, `ember_residency_buffers` = `buffers`,
/// `ember_residency_staged` = `staged`, `ember_residency_commits_total` = `commits`,
/// `ember_residency_refusals_total` = `refusals`, `ember_keepalive_ticks_total` = `ticks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stats {
    pub state: ResidencyState,
    /// Held bytes, host and device.
    pub bytes: u64,
    /// The device part of `bytes`.
    pub device_bytes: u64,
    /// Held members.
    pub buffers: usize,
    /// Members waiting for the next commit.
    pub staged: usize,
    pub staged_bytes: u64,
    /// Commits that changed the held set: the load, each commit that held staged members, and
    /// each leave of a held member.
    pub commits: u64,
    /// Refusals: the load's (over the bound or by the backend), each refused join (bound or
    /// bookkeeping memory) and each commit whose hold failed.
    pub refusals: u64,
    /// Keepalive ticks.
    pub ticks: u64,
}

/// GPUs whose device regions a set counts apart ([`Region::on_gpu`]): more than a host holds.
pub const MAX_GPUS: usize = 16;

/// Bytes by kind; host memory and each GPU's count against different bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Bytes {
    host: u64,
    /// By GPU ordinal.
    device: [u64; MAX_GPUS],
}

impl Bytes {
    fn of(r: &Region) -> Bytes {
        let mut bytes = Bytes::default();
        if r.kind.is_host() {
            bytes.host = r.len as u64;
        } else {
            bytes.device[r.gpu as usize] = r.len as u64;
        }
        bytes
    }

    fn add(&mut self, r: &Region) {
        let b = Bytes::of(r);
        self.host += b.host;
        self.device[r.gpu as usize] += b.device[r.gpu as usize];
    }

    fn sub(&mut self, r: &Region) {
        let b = Bytes::of(r);
        self.host -= b.host;
        self.device[r.gpu as usize] -= b.device[r.gpu as usize];
    }

    fn device_total(&self) -> u64 {
        self.device.iter().sum()
    }

    fn total(&self) -> u64 {
        self.host + self.device_total()
    }

    /// `(ordinal, bytes)` of the GPUs holding any.
    fn by_gpu(&self) -> Vec<(usize, u64)> {
        let gpus = self.device.iter().enumerate();
        gpus.filter(|&(_, &b)| b > 0)
            .map(|(g, &b)| (g, b))
            .collect()
    }
}

struct Inner {
    held: HashMap<u64, Region>,
    /// Kept as counters, not summed from the lists, so a count moved ahead of the
    /// allocations in `join` shows (the join-failure test pins exactly this).
    held_bytes: Bytes,
    /// Staged joins in join order; committed in that order.
    staged: Vec<(u64, Region)>,
    staged_bytes: Bytes,
    commits: u64,
    refusals: u64,
    /// Where the next warm pass starts: a member's id and the page inside it.
    warm_cursor: (u64, usize),
}

/// The engine's memory held resident: all of it, or none.
///
/// Internally synchronised; share it through `Arc`. Backend calls happen under the set's lock,
/// which is what makes leave-before-free hold across threads: a `leave` returns only after any
/// commit in flight is done, so no hold can land on memory its owner is about to free.
pub struct ResidencySet {
    backend: Option<Arc<dyn Backend>>,
    bound: Option<Bound>,
    state: ResidencyState,
    inner: Mutex<Inner>,
    ticks: AtomicU64,
    /// Refusals after the load are warned about once; later ones go to debug (the refusal
    /// counter still counts them), so a full bound cannot flood the log once per request.
    warned_join: AtomicBool,
    warned_commit: AtomicBool,
    /// Test hook: fail the n-th bookkeeping allocation inside `join` from now (0 = none).
    #[cfg(test)]
    alloc_fault: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for ResidencySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResidencySet")
            .field("stats", &self.stats())
            .finish()
    }
}

impl ResidencySet {
    fn new(
        backend: Option<Arc<dyn Backend>>,
        bound: Option<Bound>,
        state: ResidencyState,
        held: HashMap<u64, Region>,
        held_bytes: Bytes,
        commits: u64,
        refusals: u64,
    ) -> ResidencySet {
        ResidencySet {
            backend,
            bound,
            state,
            inner: Mutex::new(Inner {
                held,
                held_bytes,
                staged: Vec::new(),
                staged_bytes: Bytes::default(),
                commits,
                refusals,
                warm_cursor: (0, 0),
            }),
            ticks: AtomicU64::new(0),
            warned_join: AtomicBool::new(false),
            warned_commit: AtomicBool::new(false),
            #[cfg(test)]
            alloc_fault: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Holds every region in one step, or none.
    ///
    /// Over the bound, nothing is held and the backend is not touched. Otherwise the backend is
    /// prepared and each region held in order; if any hold fails, the ones already held are
    /// released in reverse and the set is inactive. The report says which way it went; log it
    /// with [`LoadReport::log`] (this function does not, so the line appears exactly once).
    pub fn establish(
        backend: Arc<dyn Backend>,
        bound: Bound,
        regions: Vec<(u64, Region)>,
    ) -> (Arc<ResidencySet>, LoadReport) {
        let mut total = Bytes::default();
        for (_, r) in &regions {
            total.add(r);
        }
        let mut report = LoadReport {
            held: false,
            buffers: regions.len(),
            bytes: total.total(),
            host_bytes: total.host,
            device_bytes: total.device_total(),
            gpu_bytes: total.by_gpu(),
            bound: Some(bound.clone()),
            reason: None,
        };
        let refuse = |mut report: LoadReport, reason: NoSet| {
            report.reason = Some(reason);
            let set = ResidencySet::new(
                None,
                Some(bound.clone()),
                ResidencyState::Inactive,
                HashMap::new(),
                Bytes::default(),
                0,
                1,
            );
            (Arc::new(set), report)
        };

        // The bound first: a set that cannot be whole is never started.
        if total.host > bound.host_bytes() {
            return refuse(report, NoSet::OverBound);
        }
        if let Some(limit) = bound.device_bytes()
            && let Some((gpu, bytes)) = total.by_gpu().into_iter().find(|&(_, b)| b > limit)
        {
            return refuse(report, NoSet::OverDeviceBound { gpu, bytes, limit });
        }

        // All bookkeeping before the first hold, so a hold is never followed by a failure
        // that would have to undo it for a reason other than the backend.
        let mut held = HashMap::new();
        if held.try_reserve(regions.len()).is_err() {
            return refuse(report, NoSet::NoMemory);
        }
        for (id, r) in &regions {
            if held.insert(*id, *r).is_some() {
                return refuse(report, NoSet::DuplicateId(*id));
            }
        }

        if let Err(error) =
            backend.prepare(usize::try_from(bound.host_bytes()).unwrap_or(usize::MAX))
        {
            let backend = backend.name();
            return refuse(report, NoSet::Refused { backend, error });
        }
        for (i, (_, r)) in regions.iter().enumerate() {
            if let Err(error) = backend.hold(r) {
                for (_, done) in regions[..i].iter().rev() {
                    if let Err(e) = backend.release(done) {
                        tracing::debug!("residency: undoing a partial load: {e}");
                    }
                }
                let backend = backend.name();
                return refuse(report, NoSet::Refused { backend, error });
            }
        }

        report.held = true;
        // The load is the set's first commit.
        let set = ResidencySet::new(
            Some(backend),
            Some(bound),
            ResidencyState::Held,
            held,
            total,
            1,
            0,
        );
        (Arc::new(set), report)
    }

    /// A set turned off by the operator (`--no-residency`, `EMBER_NO_RESIDENCY=1`): holds
    /// nothing, touches no backend, and its report's line is `residency: off (--no-residency)`.
    pub fn disabled() -> (Arc<ResidencySet>, LoadReport) {
        let set = ResidencySet::new(
            None,
            None,
            ResidencyState::Disabled,
            HashMap::new(),
            Bytes::default(),
            0,
            0,
        );
        let report = LoadReport {
            held: false,
            buffers: 0,
            bytes: 0,
            host_bytes: 0,
            device_bytes: 0,
            gpu_bytes: Vec::new(),
            bound: None,
            reason: Some(NoSet::Disabled),
        };
        (Arc::new(set), report)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every mutation below keeps the counters and lists in step before any call that can
        // panic, so a poisoned lock still guards a consistent set.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Which way the load went.
    pub fn state(&self) -> ResidencyState {
        self.state
    }

    /// True when the set is held (joins and leaves act).
    pub fn is_held(&self) -> bool {
        self.state == ResidencyState::Held
    }

    /// The bound the set was checked against (`None` when disabled).
    pub fn bound(&self) -> Option<&Bound> {
        self.bound.as_ref()
    }

    /// One bookkeeping allocation of `join`, failable on demand in tests.
    fn reserve(
        &self,
        what: &'static str,
        reserve: impl FnOnce() -> Result<(), TryReserveError>,
    ) -> Result<(), JoinError> {
        #[cfg(test)]
        {
            let n = self.alloc_fault.load(Ordering::Relaxed);
            if n > 0 {
                self.alloc_fault.store(n - 1, Ordering::Relaxed);
                if n == 1 {
                    return Err(JoinError::NoMemory { what });
                }
            }
        }
        reserve().map_err(|_| JoinError::NoMemory { what })
    }

    /// Test hook: the `n`-th bookkeeping allocation inside `join` from now fails (1 = the next
    /// one; 0 clears it).
    #[cfg(test)]
    pub(crate) fn fail_allocation(&self, n: usize) {
        self.alloc_fault.store(n, Ordering::Relaxed);
    }

    /// Stages a region made after load; it is held at the next commit (keepalive tick or
    /// request start), never at once.
    ///
    /// All bookkeeping is reserved first — room in the staged list, and room in the held map
    /// for every staged member so that commit never allocates — then the bound is checked
    /// against held + staged + new, and only then is the region staged and counted. Any
    /// failure leaves the set unchanged (only the refusal counter moves) and a later join
    /// still works. On a set that is not held this is a no-op returning `Ok`.
    pub fn join(&self, id: u64, region: Region) -> Result<(), JoinError> {
        if !self.is_held() {
            return Ok(());
        }
        let mut inner = self.lock();
        if inner.held.contains_key(&id) || inner.staged.iter().any(|(s, _)| *s == id) {
            return Err(JoinError::AlreadyMember(id));
        }
        let result = self.try_stage(&mut inner, id, region);
        if let Err(e) = &result {
            inner.refusals += 1;
            if !self.warned_join.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "residency: a buffer made after load stays outside the set: {e} \
                     (later refusals are counted in ember_residency_refusals_total)"
                );
            } else {
                tracing::debug!("residency: join refused: {e}");
            }
        }
        result
    }

    fn try_stage(&self, inner: &mut Inner, id: u64, region: Region) -> Result<(), JoinError> {
        // 1. Every allocation, before anything is counted.
        self.reserve("staged list", || inner.staged.try_reserve(1))?;
        let for_commit = inner.staged.len() + 1;
        self.reserve("held map", || inner.held.try_reserve(for_commit))?;

        // 2. The bound, against everything held and staged.
        let new = Bytes::of(&region);
        let (kind, held, staged, bound) = match region.kind {
            RegionKind::Host | RegionKind::Staging => (
                "host",
                inner.held_bytes.host,
                inner.staged_bytes.host,
                self.bound.as_ref().map_or(0, Bound::host_bytes),
            ),
            RegionKind::Device => (
                "device",
                inner.held_bytes.device[region.gpu as usize],
                inner.staged_bytes.device[region.gpu as usize],
                self.bound
                    .as_ref()
                    .and_then(Bound::device_bytes)
                    .unwrap_or(u64::MAX),
            ),
        };
        let new_bytes = new.total();
        if held.saturating_add(staged).saturating_add(new_bytes) > bound {
            return Err(JoinError::OverBound {
                kind,
                held,
                staged,
                new: new_bytes,
                bound,
            });
        }

        // 3. Stage and count; nothing here allocates or fails.
        inner.staged.push((id, region));
        inner.staged_bytes.add(&region);
        Ok(())
    }

    /// Holds every staged member, as one commit.
    ///
    /// If a hold fails, the members this commit already held are released (in reverse), the
    /// whole staged batch is dropped — those buffers stay outside the set — and a refusal is
    /// counted. No-op on a set that is not held or has nothing staged.
    pub fn commit(&self) -> CommitReport {
        let Some(backend) = self.backend.as_ref().filter(|_| self.is_held()) else {
            return CommitReport::default();
        };
        let mut inner = self.lock();
        if inner.staged.is_empty() {
            return CommitReport::default();
        }
        let mut staged = std::mem::take(&mut inner.staged);
        for (i, (_, r)) in staged.iter().enumerate() {
            if let Err(error) = backend.hold(r) {
                for (_, done) in staged[..i].iter().rev() {
                    if let Err(e) = backend.release(done) {
                        tracing::debug!("residency: undoing a partial commit: {e}");
                    }
                }
                let dropped = staged.len();
                staged.clear();
                inner.staged = staged; // keep the capacity for the next joins
                inner.staged_bytes = Bytes::default();
                inner.refusals += 1;
                if !self.warned_commit.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "residency: {dropped} buffers made after load stay outside the set: \
                         {} refused ({error}); {} (later refusals are counted in \
                         ember_residency_refusals_total)",
                        backend.name(),
                        error.advice
                    );
                } else {
                    tracing::debug!("residency: commit of {dropped} buffers refused: {error}");
                }
                return CommitReport {
                    joined: 0,
                    joined_bytes: 0,
                    dropped,
                    refused: Some(error),
                };
            }
        }
        let mut report = CommitReport::default();
        for (id, r) in staged.drain(..) {
            // Room was reserved by join: this insert does not allocate.
            inner.held.insert(id, r);
            inner.held_bytes.add(&r);
            report.joined += 1;
            report.joined_bytes += r.len as u64;
        }
        inner.staged = staged;
        inner.staged_bytes = Bytes::default();
        inner.commits += 1;
        report
    }

    /// [`commit`](Self::commit), named for its call site: at the start of every request, so a
    /// long busy stretch without idle ticks still commits.
    pub fn commit_before_request(&self) -> CommitReport {
        self.commit()
    }

    /// Takes a member out; call it before the owner frees the region.
    ///
    /// A held member is released and removed at once, as its own commit (the owner frees next,
    /// so it cannot wait for a tick). A staged member is just dropped. An id the set never had
    /// does nothing. A release the backend refuses still removes the member (its memory is
    /// about to go) and returns the error for the caller to log.
    pub fn leave(&self, id: u64) -> Result<Left, BackendError> {
        let Some(backend) = self.backend.as_ref().filter(|_| self.is_held()) else {
            return Ok(Left::NotMember);
        };
        let mut inner = self.lock();
        if let Some(r) = inner.held.remove(&id) {
            inner.held_bytes.sub(&r);
            inner.commits += 1;
            return backend.release(&r).map(|()| Left::Released);
        }
        if let Some(pos) = inner.staged.iter().position(|(s, _)| *s == id) {
            let (_, r) = inner.staged.remove(pos);
            inner.staged_bytes.sub(&r);
            return Ok(Left::Unstaged);
        }
        Ok(Left::NotMember)
    }

    /// Where `id` stands.
    pub fn membership(&self, id: u64) -> Membership {
        let inner = self.lock();
        if inner.held.contains_key(&id) {
            Membership::Held
        } else if inner.staged.iter().any(|(s, _)| *s == id) {
            Membership::Staged
        } else {
            Membership::None
        }
    }

    /// Warms the held regions through the backend ([`Backend::warm`]), in id order, until
    /// `stop` says to stop or every region has been warmed once; returns the pages touched. A
    /// pass that was stopped is taken up where it stopped by the next one, so a set too big to
    /// warm in one pass is still covered, over several. Runs under the set's lock, so no member
    /// can leave (and be freed) while it is touched. No-op on a set that is not held.
    pub fn warm(&self, stop: &dyn Fn() -> bool) -> usize {
        let Some(backend) = self.backend.as_ref().filter(|_| self.is_held()) else {
            return 0;
        };
        let mut inner = self.lock();
        let mut ids: Vec<u64> = inner.held.keys().copied().collect();
        if ids.is_empty() {
            return 0;
        }
        ids.sort_unstable();
        let (at_id, at_page) = inner.warm_cursor;
        let start = ids.iter().position(|&id| id >= at_id).unwrap_or(0);
        let first_skip = if ids[start] == at_id { at_page } else { 0 };
        // Every region once, from the cursor (the first region's head, warmed by the pass
        // before, waits for the next pass, which starts from it).
        let order = (0..ids.len()).map(|k| {
            (
                ids[(start + k) % ids.len()],
                if k == 0 { first_skip } else { 0 },
            )
        });
        let mut touched = 0;
        for (id, skip) in order {
            let region = inner.held[&id];
            let n = backend.warm(&region, skip, stop);
            touched += n;
            if stop() {
                inner.warm_cursor = (id, skip + n);
                return touched;
            }
        }
        inner.warm_cursor = (ids[start], 0);
        touched
    }

    /// Counts one keepalive tick.
    pub(crate) fn count_tick(&self) {
        self.ticks.fetch_add(1, Ordering::Relaxed);
    }

    /// Figures for `/metrics` and `/health`.
    pub fn stats(&self) -> Stats {
        let inner = self.lock();
        Stats {
            state: self.state,
            bytes: inner.held_bytes.total(),
            device_bytes: inner.held_bytes.device_total(),
            buffers: inner.held.len(),
            staged: inner.staged.len(),
            staged_bytes: inner.staged_bytes.total(),
            commits: inner.commits,
            refusals: inner.refusals,
            ticks: self.ticks.load(Ordering::Relaxed),
        }
    }
}

impl Drop for ResidencySet {
    /// A set that goes away lets go of what it holds, so dropping it (shutdown, a model
    /// reload) never leaves locked memory behind. Members should have left already; any that
    /// remain are released in no particular order.
    fn drop(&mut self) {
        let Some(backend) = self.backend.take() else {
            return;
        };
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, r) in inner.held.drain() {
            if let Err(e) = backend.release(&r) {
                tracing::debug!("residency: releasing at drop: {e}");
            }
        }
    }
}
