//! A fixed set of compute threads that run one parallel region at a time.
//!
//! A decode step runs a few hundred small parallel regions (one per matrix product, norm,
//! attention), so handing work out must cost far less than a microsecond. Workers spin on an
//! epoch counter for a short while after each region and only then sleep on a condition
//! variable; the caller wakes sleepers only when there are any.
//!
//! Two kinds of region. [`ThreadPool::broadcast`] runs a closure once on every thread (work
//! split statically by thread index) and waits for all. [`ThreadPool::share`] cuts the work
//! into pieces that threads claim in turn, and does not wait for a thread that has not joined
//! by the time every piece is claimed: when another process takes a core (a busy machine),
//! a descheduled worker would otherwise hold every region up for a scheduler time slice, and
//! two threads ran slower than one. A worker pushed off its core in the middle of a piece still
//! holds its region up, so a caller kept waiting too long runs shared regions alone for a
//! while ([`Pace`]). Which thread computes a piece depends on timing; the pieces do not, so a
//! kernel whose pieces write disjoint outputs gives the same bits.

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
    /// Workers still running the current region (a broadcast).
    pending: AtomicUsize,
    /// What the region of an epoch is, published by the caller just after it moves the epoch:
    /// `epoch << 1`, plus 1 for a [`ThreadPool::share`] (which workers join only while it is
    /// open, the caller waiting only for those that joined). A worker acts on a region only
    /// once it reads its own epoch here, never on a neighbour's kind.
    region_kind: AtomicU64,
    /// The epoch of the shared region open to joining, 0 for none.
    open: AtomicU64,
    /// Workers inside the open shared region.
    joined: AtomicUsize,
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

impl Shared {
    /// Wakes the workers asleep on the condition variable, if any.
    fn wake_sleepers(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.wake.notify_all();
        }
    }

    /// Ends the caller's region: the job cleared, and the caller's own panic (`own`) or a
    /// worker's passed on.
    ///
    /// # Safety
    /// No worker runs the job any more, nor can start it.
    unsafe fn end_region(&self, own: std::thread::Result<()>) {
        // SAFETY: the caller's promise.
        unsafe { *self.job.get() = None };
        if let Err(payload) = own {
            resume_unwind(payload);
        }
        if let Some(payload) = self.panic.lock().unwrap_or_else(|p| p.into_inner()).take() {
            resume_unwind(payload);
        }
    }
}

/// The caller's wait for the workers still in its region (`count` of them) to leave.
fn spin_until_zero(count: &AtomicUsize) {
    let mut spins = 0u32;
    while count.load(Ordering::SeqCst) != 0 {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Compute threads; the calling thread takes part as thread 0.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held for a region; what the caller has seen of its workers lately.
    region: Mutex<Pace>,
}

/// How long the caller has waited for workers lately, and whether it is working alone for a
/// while because of it ([`ThreadPool::share`]).
///
/// A worker that another process's thread pushes off its core in the middle of a piece holds
/// its region up until the scheduler gives it a turn again (milliseconds, against the
/// microseconds a region takes); with a busy loop on one of two cores, two threads decoded at
/// 0.75× the speed of one. So the caller measures its waits: when they pass
/// [`STRAGGLE_LIMIT`] of a [`PACE_WINDOW`], it runs shared regions alone for a spell (the
/// workers fall asleep and give their cores back), then tries its workers again.
///
/// A spell starts at [`FIRST_SPELL`] and doubles, up to [`LONGEST_SPELL`], each time the
/// window right after one straggles too; a window without straggling starts over. A busy
/// competitor keeps the spells long, while a lone preemption (a virtual machine's host taking
/// a core for a few milliseconds) costs a short one: with a fixed 500 ms spell, a 2-core VM
/// decoding Qwen2.5-Coder-1.5B went alone eight times in 35 s of an otherwise idle machine,
/// 11% of the time at about half speed.
struct Pace {
    window_start: Instant,
    waited: Duration,
    solo_until: Option<Instant>,
    /// The next spell's length.
    spell: Duration,
    /// Whether the window in hand is the first after a spell.
    after_spell: bool,
}

/// See [`Pace`].
const PACE_WINDOW: Duration = Duration::from_millis(50);
/// See [`Pace`].
const STRAGGLE_LIMIT: f64 = 0.25;
/// See [`Pace`].
const FIRST_SPELL: Duration = Duration::from_millis(50);
/// See [`Pace`].
const LONGEST_SPELL: Duration = Duration::from_millis(800);

impl Pace {
    fn new() -> Pace {
        Pace {
            window_start: Instant::now(),
            waited: Duration::ZERO,
            solo_until: None,
            spell: FIRST_SPELL,
            after_spell: false,
        }
    }

    /// Whether the next shared region runs on the caller alone; closes a window that has run
    /// its time.
    fn solo(&mut self) -> bool {
        self.solo_at(Instant::now())
    }

    fn solo_at(&mut self, now: Instant) -> bool {
        if let Some(until) = self.solo_until {
            if now < until {
                return true;
            }
            self.solo_until = None;
            self.after_spell = true;
            self.start_window(now);
        }
        let elapsed = now - self.window_start;
        if elapsed >= PACE_WINDOW {
            if self.waited.as_secs_f64() > STRAGGLE_LIMIT * elapsed.as_secs_f64() {
                if self.after_spell {
                    self.spell = (2 * self.spell).min(LONGEST_SPELL);
                } else {
                    self.spell = FIRST_SPELL;
                }
                tracing::debug!(
                    "compute threads kept the caller waiting {:.1} of the last {:.1} ms: \
                     running alone for {} ms",
                    self.waited.as_secs_f64() * 1e3,
                    elapsed.as_secs_f64() * 1e3,
                    self.spell.as_millis()
                );
                self.solo_until = Some(now + self.spell);
                return true;
            }
            self.after_spell = false;
            self.start_window(now);
        }
        false
    }

    fn start_window(&mut self, now: Instant) {
        self.window_start = now;
        self.waited = Duration::ZERO;
    }
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all, the caller included (so `n_threads - 1` are spawned).
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            epoch: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            region_kind: AtomicU64::new(0),
            open: AtomicU64::new(0),
            joined: AtomicUsize::new(0),
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
            region: Mutex::new(Pace::new()),
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
        let epoch = shared.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        shared.region_kind.store(epoch << 1, Ordering::SeqCst);
        shared.wake_sleepers();
        let own = catch_unwind(AssertUnwindSafe(|| f(0)));
        spin_until_zero(&shared.pending);
        // SAFETY: every worker has finished with the job.
        unsafe { shared.end_region(own) };
    }

    /// Runs `f(thread, piece)` over `0..n` cut into pieces of `piece` items (the last may be
    /// shorter), each piece once, claimed by whichever thread is free; `thread` indexes
    /// per-thread scratch. Returns when every piece is done. A worker that has not joined when
    /// the pieces run out is not waited for (see the module's docs).
    pub fn share(&self, n: usize, piece: usize, f: &(dyn Fn(usize, Range<usize>) + Sync)) {
        let piece = piece.max(1);
        let pieces = n.div_ceil(piece);
        let next = AtomicUsize::new(0);
        let run = |thread: usize| {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= pieces {
                    break;
                }
                f(thread, i * piece..((i + 1) * piece).min(n));
            }
        };
        if self.workers.is_empty() || pieces <= 1 {
            run(0);
            return;
        }
        let mut pace = self.region.lock().unwrap_or_else(|p| p.into_inner());
        if pace.solo() {
            run(0);
            return;
        }
        let shared = &*self.shared;
        let job_ref: &(dyn Fn(usize) + Sync) = &run;
        // SAFETY: see `Shared`; the caller waits below for every worker that joined, and a
        // worker touches the job only after joining while the region is open.
        unsafe {
            let job: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job_ref);
            *shared.job.get() = Some(job);
        }
        let epoch = shared.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        shared.open.store(epoch, Ordering::SeqCst);
        shared.region_kind.store(epoch << 1 | 1, Ordering::SeqCst);
        shared.wake_sleepers();
        let own = catch_unwind(AssertUnwindSafe(|| run(0)));
        // Every piece is claimed: close the region, then wait for the workers inside it.
        shared.open.store(0, Ordering::SeqCst);
        if shared.joined.load(Ordering::SeqCst) != 0 {
            let waiting = Instant::now();
            spin_until_zero(&shared.joined);
            pace.waited += waiting.elapsed();
        }
        // SAFETY: no worker is inside the region, and none can join a closed one.
        unsafe { shared.end_region(own) };
    }

    /// Splits `0..n` into contiguous ranges, about four a thread, and runs `f` on each, on
    /// whichever thread is free ([`Self::share`]). The ranges depend only on `n` and the thread
    /// count.
    pub fn for_each_range(&self, n: usize, f: impl Fn(Range<usize>) + Sync) {
        if self.n_threads() == 1 || n <= 1 {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        let piece = n.div_ceil(self.n_threads() * 4);
        self.share(n, piece, &|_, range| f(range));
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
        let kind = shared.region_kind.load(Ordering::SeqCst);
        if kind >> 1 != seen {
            // Not yet published (the caller moves the epoch first), or a later region has
            // begun (a late worker): look at the epoch again.
            std::hint::spin_loop();
            seen = seen.wrapping_sub(1);
            continue;
        }
        if kind & 1 == 0 {
            // A broadcast: it cannot end before this worker has run it.
            run_job(shared, index);
            shared.pending.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        // A shared region: join it only while it is still open (a late worker may find every
        // piece taken and the caller gone).
        shared.joined.fetch_add(1, Ordering::SeqCst);
        if shared.open.load(Ordering::SeqCst) == seen {
            run_job(shared, index);
        }
        shared.joined.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs the current region's job as thread `index`, a panic kept for the caller.
fn run_job(shared: &Shared, index: usize) {
    // SAFETY: the caller stored the job before the epoch moved and keeps it valid until this
    // worker is done (it waits on `pending`, or on `joined` for a shared region).
    let job = unsafe { (*shared.job.get()).expect("a region's job is set before its epoch") };
    let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(index) }));
    if let Err(payload) = result {
        *shared.panic.lock().unwrap_or_else(|p| p.into_inner()) = Some(payload);
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
    fn shared_regions_run_every_piece_once_between_broadcasts() {
        let pool = ThreadPool::new(4);
        let mut seed = 7u64;
        for round in 0..1000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let n = (seed >> 33) as usize % 200;
            let piece = 1 + (seed >> 50) as usize % 9;
            let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.share(n, piece, &|thread, range| {
                assert!(thread < 4);
                assert!(range.len() <= piece && range.start % piece == 0);
                // Uneven pieces, so workers join late or not at all.
                if (range.start / piece + round).is_multiple_of(7) {
                    std::thread::yield_now();
                }
                for i in range {
                    seen[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
            // A broadcast right after: every thread exactly once, late workers included.
            if round % 3 == 0 {
                let hits: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
                pool.broadcast(&|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "round {round}"
                );
            }
        }
    }

    #[test]
    fn a_caller_kept_waiting_by_its_workers_runs_alone_for_a_while() {
        let pool = ThreadPool::new(2);
        let deadline = Instant::now() + Duration::from_secs(20);
        // Worker pieces that stall (as a worker pushed off its core does) keep the caller
        // waiting, until it stops opening regions to them.
        while pool.region.lock().unwrap().solo_until.is_none() {
            assert!(Instant::now() < deadline, "the caller never went on alone");
            pool.share(8, 1, &|thread, _| {
                if thread != 0 {
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
        }
        let on_workers = AtomicUsize::new(0);
        pool.share(64, 1, &|thread, _| {
            if thread != 0 {
                on_workers.fetch_add(1, Ordering::Relaxed);
            }
        });
        assert_eq!(on_workers.load(Ordering::Relaxed), 0);
        // The spell ends: the workers get their turn again.
        pool.region.lock().unwrap().solo_until = Some(Instant::now());
        assert!(!pool.region.lock().unwrap().solo());
    }

    #[test]
    fn spells_alone_grow_while_the_workers_keep_straggling_and_start_over_after() {
        let mut pace = Pace::new();
        let mut now = pace.window_start;
        // One window: the caller waits `waited` of it, then asks.
        let mut window = |pace: &mut Pace, waited_ms: u64| {
            pace.waited = Duration::from_millis(waited_ms);
            now += PACE_WINDOW;
            let solo = pace.solo_at(now);
            let spell = pace.solo_until.map(|until| until - now);
            if let Some(spell) = spell {
                // The first region after the spell ends it and opens a window.
                now += spell;
                assert!(!pace.solo_at(now));
            }
            (solo, spell)
        };
        // A lone straggle: a short spell.
        assert_eq!(window(&mut pace, 20), (true, Some(FIRST_SPELL)));
        // The window right after straggles too: twice as long, and so on up to the longest.
        let mut want = FIRST_SPELL;
        for _ in 0..8 {
            want = (2 * want).min(LONGEST_SPELL);
            assert_eq!(window(&mut pace, 20), (true, Some(want)));
        }
        assert_eq!(want, LONGEST_SPELL);
        // A clean window, then a straggle: back to the first spell.
        assert_eq!(window(&mut pace, 0), (false, None));
        assert_eq!(window(&mut pace, 20), (true, Some(FIRST_SPELL)));
        // Waits under the limit never start one.
        assert_eq!(window(&mut pace, 0), (false, None));
        assert_eq!(window(&mut pace, 12), (false, None));
    }

    #[test]
    fn a_shared_region_does_not_wait_for_a_worker_that_never_joins() {
        // Workers asleep (past their spin) join late or not at all; the caller finishes alone.
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN_BEFORE_SLEEP * 3);
        let count = AtomicUsize::new(0);
        pool.share(1000, 10, &|_, range| {
            count.fetch_add(range.len(), Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 1000);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            pool.share(10, 1, &|_, range| {
                if range.start == 5 {
                    panic!("a piece failed");
                }
            })
        }));
        assert!(caught.is_err());
        pool.share(4, 1, &|_, _| {});
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
