//! A fixed set of compute threads that run one parallel region at a time.
//!
//! A decode step runs a few hundred small parallel regions (one per matrix product, norm,
//! attention), so handing work out must cost far less than a microsecond. Workers spin on an
//! epoch counter for a short while after each region and only then sleep on a condition
//! variable; the caller wakes sleepers only when there are any. Work is split statically, so
//! which thread computes what never depends on timing.

use std::any::Any;
use std::cell::UnsafeCell;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps: long enough to bridge the serial gaps of a
/// decode step (sampling, bookkeeping), short enough that an idle server burns no CPU.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_millis(2);

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// The current region's closure; written by the caller before the epoch moves.
    job: UnsafeCell<Option<Job>>,
    epoch: AtomicU64,
    /// Workers still running the current region.
    pending: AtomicUsize,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `job` is written only by the caller holding `ThreadPool::region`, before the epoch's
// release store, and read by workers only after the matching acquire load; the closure it
// points to is `Sync` and outlives the region because `broadcast` waits for every worker.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// Compute threads; the calling thread takes part as thread 0.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    region: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all, the caller included (so `n_threads - 1` are spawned).
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            epoch: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        });
        let workers = (1..n_threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("ember-compute-{index}"))
                    .spawn(move || worker_loop(&shared, index))
                    .expect("spawning a compute thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            region: Mutex::new(()),
        }
    }

    /// The threads this process may run on (its CPU affinity), at least 1.
    pub fn available_parallelism() -> usize {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }

    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(thread_index)` once on every thread and returns when all have finished.
    pub fn broadcast(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            f(0);
            return;
        }
        let _region = self.region.lock().unwrap_or_else(|p| p.into_inner());
        let shared = &*self.shared;
        // SAFETY: see `Shared`; the lifetime is erased only for the duration of this region.
        unsafe {
            let job: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f);
            *shared.job.get() = Some(job);
        }
        shared.pending.store(self.workers.len(), Ordering::Relaxed);
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = shared.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            shared.wake.notify_all();
        }
        let own = catch_unwind(AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while shared.pending.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: every worker has finished with the job.
        unsafe { *shared.job.get() = None };
        if let Err(payload) = own {
            resume_unwind(payload);
        }
        if let Some(payload) = shared
            .panic
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            resume_unwind(payload);
        }
    }

    /// Splits `0..n` into one contiguous range per thread (never more ranges than items) and
    /// runs `f` on each. The split depends only on `n` and the thread count.
    pub fn for_each_range(&self, n: usize, f: impl Fn(Range<usize>) + Sync) {
        let parts = self.n_threads().min(n);
        if parts <= 1 {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        self.broadcast(&|index| {
            if index < parts {
                f(split_range(n, parts, index));
            }
        });
    }

    /// Like [`for_each_range`](Self::for_each_range), but ranges start and end on multiples of
    /// `align` (except the last end), so SIMD tiles are not cut between threads.
    pub fn for_each_aligned_range(&self, n: usize, align: usize, f: impl Fn(Range<usize>) + Sync) {
        let align = align.max(1);
        let blocks = n.div_ceil(align);
        self.for_each_range(blocks, |r| f(r.start * align..(r.end * align).min(n)));
    }
}

/// The `index`-th of `parts` near-equal contiguous pieces of `0..n`.
pub fn split_range(n: usize, parts: usize, index: usize) -> Range<usize> {
    let base = n / parts;
    let extra = n % parts;
    let start = index * base + index.min(extra);
    let len = base + usize::from(index < extra);
    start..start + len
}

fn worker_loop(shared: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let spin_start = Instant::now();
        let mut spins = 0u32;
        loop {
            if shared.shutdown.load(Ordering::Acquire) {
                return;
            }
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch != seen {
                seen = epoch;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) || spin_start.elapsed() < SPIN_BEFORE_SLEEP {
                std::hint::spin_loop();
                continue;
            }
            shared.sleepers.fetch_add(1, Ordering::SeqCst);
            let guard = shared.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            if shared.epoch.load(Ordering::SeqCst) == seen
                && !shared.shutdown.load(Ordering::SeqCst)
            {
                drop(shared.wake.wait(guard).unwrap_or_else(|p| p.into_inner()));
            }
            shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        // SAFETY: the epoch moved, so the caller stored a job that stays valid until `pending`
        // reaches zero.
        let job = unsafe { (*shared.job.get()).expect("a region's job is set before its epoch") };
        let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(index) }));
        if let Err(payload) = result {
            *shared.panic.lock().unwrap_or_else(|p| p.into_inner()) = Some(payload);
        }
        shared.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _guard = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_each_region_once() {
        let pool = ThreadPool::new(3);
        for _ in 0..1000 {
            let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            pool.broadcast(&|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn ranges_cover_everything_once() {
        let pool = ThreadPool::new(4);
        for n in [0usize, 1, 3, 4, 17, 1000] {
            let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_each_aligned_range(n, 8, |r| {
                assert!(r.start % 8 == 0);
                for i in r {
                    seen[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1), "n={n}");
        }
    }

    #[test]
    fn sleeping_workers_wake_and_panics_reach_the_caller() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN_BEFORE_SLEEP * 3);
        let count = AtomicUsize::new(0);
        pool.broadcast(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            pool.broadcast(&|i| {
                if i == 1 {
                    panic!("worker failure");
                }
            })
        }));
        assert!(caught.is_err());
        pool.broadcast(&|_| {});
    }
}
