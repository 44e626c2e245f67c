//! ember-residency: keeps the engine's memory resident between requests.
//!
//! An idle process's memory goes cold: the OS pages out its mapped weights and anonymous
//! buffers (Linux), or unwires its GPU memory (macOS), and the next request's first token pays
//! for bringing it back. This crate holds memory regions resident through a [`Backend`], and
//! knows nothing of models, tensors or HTTP. Its rules (see `shared/design/residency.md`):
//!
//! 1. **All or none.** [`ResidencySet::establish`] holds every region in one step, or none: a
//!    partial set measured worse than no set.
//! 2. **Bounded.** The whole set stays inside [`Bound`]: 70% of RAM (or the load limit) less a
//!    2 GiB margin, and each GPU's regions inside its device bound. Over it, nothing is held
//!    and the [`LoadReport`] line says why.
//! 3. **Staged.** Buffers made later [`join`](ResidencySet::join) as staged changes, committed
//!    by the [`Keepalive`]'s idle tick and at request start, never one by one mid-request.
//! 4. **Leave before free.** [`leave`](ResidencySet::leave) releases a held buffer at once.
//! 5. **Join refuses whole.** A join that cannot get its bookkeeping or would pass the bound
//!    changes nothing.
//! 6. **Ticks do real work**, only while idle, and stop never waits.
//! 7. **Falls back, never aborts.** A refused set is *inactive*: joins, leaves and commits are
//!    no-ops, so the engine's code is the same either way.
//!
//! [`executable_regions`] lists the program's own code so it can be held too.

mod backend;
mod bound;
mod keepalive;
mod maps;
mod report;
mod set;
#[cfg(test)]
mod tests;

pub use backend::{
    Backend, BackendError, BackendOp, Logged, MlockBackend, Region, RegionKind, TestBackend,
    TestOp, vm_locked,
};
pub use bound::{Bound, DEFAULT_PERCENT, GIB, MARGIN_BYTES, fmt_bytes, fmt_gib};
pub use keepalive::{DEFAULT_KEEP_WARM, Keepalive, MAX_INTERVAL, RequestGuard};
pub use maps::{CODE_ID_BASE, executable_regions};
pub use set::{
    CommitReport, JoinError, Left, LoadReport, MAX_GPUS, Membership, NoSet, ResidencySet,
    ResidencyState, Stats,
};
