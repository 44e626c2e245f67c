//! The idle keepalive: between requests, commit staged changes and do a little real work on
//! the held memory, until `--keep-warm` after the last request.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::set::{CommitReport, ResidencySet};

/// The longest interval between ticks: the OS reclaims an idle process's memory within a
/// second or two, so a tick must come well inside that.
pub const MAX_INTERVAL: Duration = Duration::from_millis(500);

/// The shortest interval: keeps a zero from turning the thread into a spin.
const MIN_INTERVAL: Duration = Duration::from_millis(1);

/// A warm pass takes at most 1/`WARM_SHARE` of the interval (25 ms of every 250 ms), so an
/// idle server spends at most 10% of one core on it (a 2 GiB set takes ~12 ms, 5%); a set too
/// big for that is warmed over several ticks, each taking up where the last stopped.
const WARM_SHARE: u32 = 10;

/// Default `--keep-warm`: 15 minutes after the last request.
pub const DEFAULT_KEEP_WARM: Duration = Duration::from_secs(900);

struct State {
    /// Requests running now; ticks wait while any does.
    active: usize,
    /// When the keep-warm window started: the last request's end, or `start`.
    idle_since: Instant,
    /// When the next tick is due.
    next_tick: Instant,
    /// A tick is running (outside the lock); `request_started` waits for it to finish.
    ticking: bool,
    /// No tick since the last request ended (or since start): the next one logs its warm pass.
    first_of_idle: bool,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the thread (request ended, stop) and waiters for a tick in flight.
    wake: Condvar,
    set: Arc<ResidencySet>,
    keep_warm: Duration,
    interval: Duration,
    /// Each tick also warms the held set ([`ResidencySet::warm`]).
    warm: bool,
    /// Requests on their way in (inside `request_started`), and stop: a warm pass in flight
    /// gives up at its next look, so neither waits for it.
    arriving: AtomicUsize,
    stopping: AtomicBool,
    warmed_pages: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Updates are single field writes; a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.wake.wait(st).unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a warm pass should give up now.
    fn interrupted(&self) -> bool {
        self.arriving.load(Ordering::SeqCst) > 0 || self.stopping.load(Ordering::SeqCst)
    }

    fn wait_for<'a>(&self, st: MutexGuard<'a, State>, d: Duration) -> MutexGuard<'a, State> {
        match self.wake.wait_timeout(st, d) {
            Ok((st, _)) => st,
            Err(p) => p.into_inner().0,
        }
    }
}

/// Ticks while the server is idle, so what the set holds stays warm on every level (the
/// device's queue, the page tables), and staged joins get committed between requests.
///
/// Each tick commits the set's staged changes, then calls the engine's `tick` (a 16-byte copy
/// inside a scratch buffer that is a member of the set, so the tick does real work on held
/// memory; an empty command would not reach a GPU), then, unless turned off, warms the set:
/// one byte read per page of every held host region ([`ResidencySet::warm`]). Locked pages
/// stay mapped, but an idle process's page-table entries and cache lines do not stay in the
/// CPU's caches: measured on a 2-vCPU VM with a 2 GiB set, the first token after a 5-10 s idle
/// gap came 6-7% later than a back-to-back request sent right after it, with no page fault at
/// all, and 1-2% later with the warm pass (which reads the 2 GiB set's pages in ~12 ms). A pass
/// takes at most 1/10 of the interval, a bigger set being covered over several ticks, and a
/// request arriving mid-pass stops it within microseconds. Ticks run only while no request
/// does and until `keep_warm` after the last one ended (from `start` before the first
/// request). Stopping wakes the thread at once, whatever it waits for; it never waits out an
/// interval.
pub struct Keepalive {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Marks one request for as long as it lives: `request_started` on creation,
/// `request_finished` on drop, so an early return or a panic cannot leave ticking paused.
pub struct RequestGuard {
    shared: Arc<Shared>,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        finish(&self.shared);
    }
}

impl Keepalive {
    /// Starts the thread, with the warm pass on. `interval` is clamped to at most
    /// [`MAX_INTERVAL`]; a zero `keep_warm` never ticks.
    pub fn start(
        set: Arc<ResidencySet>,
        keep_warm: Duration,
        interval: Duration,
        tick: Box<dyn Fn() + Send>,
    ) -> Keepalive {
        Self::start_with(set, keep_warm, interval, true, tick)
    }

    /// [`start`](Self::start), choosing whether each tick also warms the held set (`warm`).
    pub fn start_with(
        set: Arc<ResidencySet>,
        keep_warm: Duration,
        interval: Duration,
        warm: bool,
        tick: Box<dyn Fn() + Send>,
    ) -> Keepalive {
        let interval = interval.clamp(MIN_INTERVAL, MAX_INTERVAL);
        let now = Instant::now();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                active: 0,
                idle_since: now,
                next_tick: now + interval,
                ticking: false,
                first_of_idle: true,
                stop: false,
            }),
            wake: Condvar::new(),
            set,
            keep_warm,
            interval,
            warm,
            arriving: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            warmed_pages: AtomicU64::new(0),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("ember-keepalive".into())
                .spawn(move || run(&shared, tick))
        };
        let thread = match thread {
            Ok(handle) => Some(handle),
            Err(e) => {
                // Serving matters more than staying warm: without the thread, requests still
                // commit at their start.
                tracing::warn!("keepalive: no thread ({e}); the server will go cold when idle");
                None
            }
        };
        Keepalive {
            shared,
            thread: Mutex::new(thread),
        }
    }

    /// A request begins: ticking pauses (waiting out a tick already running, so none overlaps
    /// the request), then the set's staged changes are committed. Pair with
    /// [`request_finished`](Self::request_finished), or use [`request`](Self::request).
    pub fn request_started(&self) -> CommitReport {
        // Seen by a warm pass in flight, which then stops at once rather than finishing.
        self.shared.arriving.fetch_add(1, Ordering::SeqCst);
        {
            let mut st = self.shared.lock();
            st.active += 1;
            while st.ticking {
                st = self.shared.wait(st);
            }
        }
        self.shared.arriving.fetch_sub(1, Ordering::SeqCst);
        self.shared.set.commit_before_request()
    }

    /// A request ended: when it was the last one running, the keep-warm window restarts now.
    pub fn request_finished(&self) {
        finish(&self.shared);
    }

    /// [`request_started`](Self::request_started) now and
    /// [`request_finished`](Self::request_finished) when the guard drops.
    pub fn request(&self) -> RequestGuard {
        self.request_started();
        RequestGuard {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Ticks so far (the same figure as the set's `ticks`).
    pub fn ticks(&self) -> u64 {
        self.shared.set.stats().ticks
    }

    /// Whether ticks warm the held set.
    pub fn warms(&self) -> bool {
        self.shared.warm
    }

    /// Pages the warm passes have touched so far.
    pub fn warmed_pages(&self) -> u64 {
        self.shared.warmed_pages.load(Ordering::Relaxed)
    }

    /// Stops the thread and waits for it: at once when it is waiting, or after the tick in
    /// flight (a 16-byte copy). Idempotent; also done on drop.
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        {
            let mut st = self.shared.lock();
            st.stop = true;
        }
        self.shared.wake.notify_all();
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = handle {
            // A tick that stops its own keepalive must not join itself.
            if handle.thread().id() != std::thread::current().id() {
                let _ = handle.join();
            }
        }
    }
}

impl Drop for Keepalive {
    fn drop(&mut self) {
        self.stop();
    }
}

fn finish(shared: &Shared) {
    {
        let mut st = shared.lock();
        st.active = st.active.saturating_sub(1);
        if st.active == 0 {
            let now = Instant::now();
            st.idle_since = now;
            st.next_tick = now + shared.interval;
            st.first_of_idle = true;
        }
    }
    shared.wake.notify_all();
}

fn run(shared: &Shared, tick: Box<dyn Fn() + Send>) {
    let mut warned = false;
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        if st.active > 0 {
            st = shared.wait(st);
            continue;
        }
        let window_end = st.idle_since + shared.keep_warm;
        if st.next_tick >= window_end {
            // Past keep-warm: sleep until a request ends (or stop).
            st = shared.wait(st);
            continue;
        }
        let now = Instant::now();
        if now < st.next_tick {
            let due = st.next_tick - now;
            st = shared.wait_for(st, due);
            continue;
        }

        st.ticking = true;
        let first_of_idle = std::mem::replace(&mut st.first_of_idle, false);
        drop(st);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            shared.set.commit();
            tick();
            if shared.warm {
                let started = Instant::now();
                let budget = shared.interval / WARM_SHARE;
                let pages = shared
                    .set
                    .warm(&|| shared.interrupted() || started.elapsed() > budget);
                shared
                    .warmed_pages
                    .fetch_add(pages as u64, Ordering::Relaxed);
                if first_of_idle {
                    tracing::debug!(
                        pages,
                        ms = started.elapsed().as_secs_f64() * 1e3,
                        "keepalive: warmed the held set"
                    );
                }
            }
        }));
        match outcome {
            Ok(()) => shared.set.count_tick(),
            Err(_) if !warned => {
                warned = true;
                tracing::warn!("keepalive: a tick panicked; ticking goes on");
            }
            Err(_) => {}
        }
        st = shared.lock();
        st.ticking = false;
        st.next_tick = Instant::now() + shared.interval;
        shared.wake.notify_all();
    }
}
