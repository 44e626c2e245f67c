//! Backends: what "holding a region resident" means on one platform.
//!
//! The set decides *what* is held and when; a backend only knows how to hold and release one
//! region. [`MlockBackend`] locks host pages; [`TestBackend`] records every call and can be told
//! to fail any of them.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::bound::fmt_bytes;

/// Where a region's memory lives. Decides which bound it counts against and whether a host
/// backend locks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RegionKind {
    /// Memory the CPU maps (heap, mapped files, pinned staging): locked so it is never paged out,
    /// counted against the host bound.
    Host,
    /// Memory on a discrete device: resident by nature, so only counted, against the device
    /// bound. Host backends never lock it.
    Device,
    /// Host memory a device copies to and from (a GPU's staging buffers): host memory, counted
    /// against the host bound, locked by a host backend; a device backend page-locks it with
    /// the device instead (`cuMemHostRegister`), so transfers run straight from it. Whole pages
    /// of its own, so registering one never touches another's.
    Staging,
}

impl RegionKind {
    /// Whether the memory is the host's (counted against the host bound).
    pub fn is_host(self) -> bool {
        matches!(self, RegionKind::Host | RegionKind::Staging)
    }
}

/// A byte range `[addr, addr + len)` the set may hold.
///
/// Regions of one set must not overlap, except that two regions may share the page at their
/// ends (two heap buffers next to each other); [`MlockBackend`] counts those shared pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    /// First byte.
    pub addr: usize,
    /// Length in bytes; zero-length regions are counted as members but never touch the backend's
    /// memory calls.
    pub len: usize,
    pub kind: RegionKind,
    /// The GPU a device region is on (its ordinal; [`Region::on_gpu`]): each GPU's regions
    /// count against its own bound. 0 for host memory.
    pub gpu: u8,
}

impl Region {
    /// A host region.
    pub fn host(addr: usize, len: usize) -> Self {
        Region {
            addr,
            len,
            kind: RegionKind::Host,
            gpu: 0,
        }
    }

    /// A device region (counted, never locked).
    pub fn device(addr: usize, len: usize) -> Self {
        Region {
            addr,
            len,
            kind: RegionKind::Device,
            gpu: 0,
        }
    }

    /// This device region on GPU `ordinal` (GPU 0 unless said). Ordinals past
    /// [`crate::MAX_GPUS`] share the count of the one `MAX_GPUS` below (bounded no less).
    pub fn on_gpu(self, ordinal: usize) -> Self {
        Region {
            gpu: (ordinal % crate::MAX_GPUS) as u8,
            ..self
        }
    }

    /// A staging region (host memory a device transfers to and from).
    pub fn staging(addr: usize, len: usize) -> Self {
        Region {
            addr,
            len,
            kind: RegionKind::Staging,
            gpu: 0,
        }
    }

    /// The host region covering a slice.
    pub fn of_slice(bytes: &[u8]) -> Self {
        Region::host(bytes.as_ptr() as usize, bytes.len())
    }

    /// One past the last byte.
    pub fn end(&self) -> usize {
        self.addr.saturating_add(self.len)
    }
}

/// Which backend call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendOp {
    Prepare,
    Hold,
    Release,
}

impl fmt::Display for BackendOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendOp::Prepare => "prepare",
            BackendOp::Hold => "hold",
            BackendOp::Release => "release",
        })
    }
}

/// A backend refused. Carries what an operator needs: the call, the OS error, a hint about
/// the cause, and the advice that ends the load line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}{}; {hint}", errno.map(|e| format!(" (errno {e}: {})", errno_text(e))).unwrap_or_default())]
pub struct BackendError {
    pub op: BackendOp,
    /// The OS error number, when the refusal came from a system call.
    pub errno: Option<i32>,
    /// What was attempted, e.g. `mlock of 1.23 GiB at 0x7f..`.
    pub message: String,
    /// Why it probably failed and how to allow it, e.g.
    /// `RLIMIT_MEMLOCK is 8.00 MiB; raise it (ulimit -l) or grant CAP_IPC_LOCK`.
    pub hint: String,
    /// The load line's closing advice, e.g.
    /// `raise RLIMIT_MEMLOCK or run without --residency required`.
    pub advice: String,
}

/// `strerror` text for an errno, without std's " (os error N)" suffix.
fn errno_text(errno: i32) -> String {
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    match text.find(" (os error") {
        Some(cut) => text[..cut].to_string(),
        None => text,
    }
}

/// Holds and releases regions on one platform.
///
/// The set calls `prepare` once before the first hold, then `hold` for every member (host and
/// device alike: the backend decides what holding a device region means) and `release` for every
/// member that leaves, always before the member's owner frees it. Calls are serialised by the
/// set, so a backend needs no ordering of its own, only `Send + Sync` to live behind an `Arc`.
///
/// How the platforms map:
/// - **mlock** ([`MlockBackend`]): `prepare` raises `RLIMIT_MEMLOCK`; `hold` = `mlock` of the
///   pages covering a host region; `release` = `munlock`. Device regions are no-ops.
/// - **CUDA** (`ember_tensor::cuda::CudaResidency`): staging regions (host memory the GPU
///   copies to and from) are page-locked with `cuMemHostRegister` in `hold` and
///   `cuMemHostUnregister` in `release`; other host regions are locked by mlock as above;
///   device regions stay resident on their own, so `hold`/`release` only count them.
/// - **Metal** (later, `MTLResidencySet`): `prepare` creates the set with an initial capacity;
///   `hold` = `addAllocation` of the region's `MTLBuffer`; `release` = `removeAllocation`.
///   Metal applies additions and removals only on `commit`, so that backend commits in each
///   `hold`/`release` — the set already batches holds to between requests (staged joins) and
///   makes every removal its own commit before the free, exactly what Metal needs.
pub trait Backend: Send + Sync {
    /// Short name for the load line (`mlock`, `cuda`, `metal`, `test`).
    fn name(&self) -> &'static str;

    /// Makes room before the first hold. `host_bytes` is the most host memory the set may come
    /// to hold (its bound), so joins made later find room too. Best effort where the platform
    /// decides at `hold` time anyway.
    fn prepare(&self, host_bytes: usize) -> Result<(), BackendError>;

    /// Holds one region resident.
    fn hold(&self, region: &Region) -> Result<(), BackendError>;

    /// Stops holding one region. Called before the region's owner frees it.
    fn release(&self, region: &Region) -> Result<(), BackendError>;

    /// Touches a held region the way a request will, so what holding cannot keep (the CPU's
    /// cached page-table entries and lines) is warm again; the keepalive calls it between
    /// requests. Starts at the region's `skip`-th page (counting the page of its first byte as
    /// 0), checks `stop` every few pages and returns early when it says so, and returns the
    /// pages touched. Default: nothing to do (a GPU keeps its own memory warm).
    fn warm(&self, region: &Region, skip: usize, stop: &dyn Fn() -> bool) -> usize {
        let _ = (region, skip, stop);
        0
    }
}

/// Locks host memory with `mlock`/`munlock` (Linux, macOS).
///
/// `mlock` works on whole pages and does not nest: one `munlock` unlocks a page however many
/// regions covered it. Two regions that share a page at their ends (adjacent heap buffers) would
/// otherwise lose that page's lock when the first one leaves, so the backend counts how many held
/// regions touch each *end* page and unlocks an end page only when its count drops to zero.
/// Interior pages belong to one region alone (regions do not overlap).
pub struct MlockBackend {
    page: usize,
    /// Held regions touching each end page, by page address.
    ends: Mutex<HashMap<usize, u32>>,
}

impl fmt::Debug for MlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MlockBackend")
            .field("page", &self.page)
            .finish()
    }
}

impl Default for MlockBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// Pages `warm` touches between looks at its stop flag: a few microseconds of work.
const WARM_CHECK_EVERY: usize = 256;

/// The load line's advice when mlock refuses.
const MLOCK_ADVICE: &str = "raise RLIMIT_MEMLOCK or run without --residency required";

impl MlockBackend {
    pub fn new() -> Self {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        MlockBackend {
            page: if page > 0 { page as usize } else { 4096 },
            ends: Mutex::new(HashMap::new()),
        }
    }

    /// The page size the backend rounds to.
    pub fn page_size(&self) -> usize {
        self.page
    }

    fn ends(&self) -> MutexGuard<'_, HashMap<usize, u32>> {
        // Each update is a single insert or decrement: a poisoned map is still consistent.
        self.ends.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// First and last page of a non-empty region.
    fn end_pages(&self, r: &Region) -> (usize, usize) {
        let first = r.addr & !(self.page - 1);
        let last = (r.end() - 1) & !(self.page - 1);
        (first, last)
    }

    /// Unlocks the region's pages, keeping end pages another held region still touches.
    /// `ends` must already exclude this region.
    fn unlock(&self, r: &Region, ends: &HashMap<usize, u32>) -> std::io::Result<()> {
        let (first, last) = self.end_pages(r);
        let shared = |p: usize| ends.get(&p).is_some_and(|&n| n > 0);
        let lo = if shared(first) {
            first + self.page
        } else {
            first
        };
        let hi = if shared(last) { last } else { last + self.page };
        if hi <= lo {
            return Ok(());
        }
        // SAFETY: munlock only changes page attributes of the calling process; an address range
        // that is not mapped is reported as an error, never dereferenced.
        let rc = unsafe { libc::munlock(lo as *const libc::c_void, hi - lo) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    fn refused(&self, op: BackendOp, call: &str, r: &Region, err: std::io::Error) -> BackendError {
        let errno = err.raw_os_error();
        let hint = match errno {
            Some(libc::ENOMEM) | Some(libc::EPERM) => {
                let locked = vm_locked()
                    .map(|b| format!(", {} already locked", fmt_bytes(b)))
                    .unwrap_or_default();
                format!(
                    "RLIMIT_MEMLOCK is {}{locked}; raise it (ulimit -l) or grant CAP_IPC_LOCK",
                    memlock_limit_text()
                )
            }
            Some(libc::EAGAIN) => {
                "the kernel could not lock every page of the range (memory pressure?)".into()
            }
            _ => "the range is not fully mapped, or the kernel refused it".into(),
        };
        BackendError {
            op,
            errno,
            message: format!("{call} of {} at {:#x}", fmt_bytes(r.len as u64), r.addr),
            hint,
            advice: MLOCK_ADVICE.into(),
        }
    }
}

impl Backend for MlockBackend {
    fn name(&self) -> &'static str {
        "mlock"
    }

    fn warm(&self, r: &Region, skip: usize, stop: &dyn Fn() -> bool) -> usize {
        if !r.kind.is_host() || r.len == 0 {
            return 0;
        }
        let mut touched = 0;
        let mut addr = match skip {
            0 => r.addr,
            _ => (r.addr & !(self.page - 1)).saturating_add(skip.saturating_mul(self.page)),
        };
        while addr < r.end() {
            if touched % WARM_CHECK_EVERY == 0 && stop() {
                break;
            }
            // SAFETY: the set calls this only for a region it holds, under its lock; a held
            // region is mapped and readable until it leaves, and leaving takes the same lock.
            // One byte read per page, never written.
            unsafe { std::ptr::read_volatile(addr as *const u8) };
            touched += 1;
            addr = (addr & !(self.page - 1)) + self.page;
        }
        touched
    }

    fn prepare(&self, host_bytes: usize) -> Result<(), BackendError> {
        let mut rl = getrlimit_memlock().map_err(|err| BackendError {
            op: BackendOp::Prepare,
            errno: err.raw_os_error(),
            message: "getrlimit(RLIMIT_MEMLOCK)".into(),
            hint: "the limit on locked memory could not be read".into(),
            advice: MLOCK_ADVICE.into(),
        })?;
        // Soft up to hard: always allowed, and leaves room for later joins.
        if rl.rlim_cur != libc::RLIM_INFINITY && rl.rlim_cur < rl.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: rl.rlim_max,
                rlim_max: rl.rlim_max,
            };
            if setrlimit_memlock(&raised).is_ok() {
                rl = raised;
            }
        }
        // Hard and soft up to what the bound needs: allowed with CAP_SYS_RESOURCE. Without it
        // the holds decide (CAP_IPC_LOCK alone lets mlock pass the limit), so a refusal here
        // is not an error.
        let needed =
            (host_bytes as u64).saturating_add(self.page as u64 - 1) & !(self.page as u64 - 1);
        let needed = libc::rlim_t::try_from(needed).unwrap_or(libc::RLIM_INFINITY);
        if rl.rlim_cur != libc::RLIM_INFINITY && rl.rlim_cur < needed {
            let raised = libc::rlimit {
                rlim_cur: needed,
                rlim_max: needed.max(rl.rlim_max),
            };
            match setrlimit_memlock(&raised) {
                Ok(()) => tracing::debug!("RLIMIT_MEMLOCK raised to {}", fmt_bytes(needed)),
                Err(err) => tracing::debug!(
                    "RLIMIT_MEMLOCK stays at {} ({err}); holds decide",
                    fmt_bytes(rl.rlim_cur)
                ),
            }
        }
        Ok(())
    }

    fn hold(&self, r: &Region) -> Result<(), BackendError> {
        if !r.kind.is_host() || r.len == 0 {
            return Ok(());
        }
        let (first, last) = self.end_pages(r);
        let len = last + self.page - first;
        let mut ends = self.ends();
        // SAFETY: mlock only changes page attributes of the calling process (and faults the
        // pages in); an unmapped range is reported as ENOMEM, never dereferenced.
        let rc = unsafe { libc::mlock(first as *const libc::c_void, len) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            // mlock may have locked part of the range before failing (EAGAIN): undo that part,
            // keeping end pages other regions hold.
            let _ = self.unlock(r, &ends);
            return Err(self.refused(BackendOp::Hold, "mlock", r, err));
        }
        *ends.entry(first).or_insert(0) += 1;
        if last != first {
            *ends.entry(last).or_insert(0) += 1;
        }
        Ok(())
    }

    fn release(&self, r: &Region) -> Result<(), BackendError> {
        if !r.kind.is_host() || r.len == 0 {
            return Ok(());
        }
        let (first, last) = self.end_pages(r);
        let mut ends = self.ends();
        for page in [first, last]
            .into_iter()
            .take(if last == first { 1 } else { 2 })
        {
            if let Some(n) = ends.get_mut(&page) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    ends.remove(&page);
                }
            }
        }
        self.unlock(r, &ends)
            .map_err(|err| self.refused(BackendOp::Release, "munlock", r, err))
    }
}

fn getrlimit_memlock() -> std::io::Result<libc::rlimit> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: rl is a valid rlimit to write into.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } == 0 {
        Ok(rl)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn setrlimit_memlock(rl: &libc::rlimit) -> std::io::Result<()> {
    // SAFETY: rl is a valid rlimit to read from.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, rl) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The soft RLIMIT_MEMLOCK, as the hint shows it.
fn memlock_limit_text() -> String {
    match getrlimit_memlock() {
        Ok(rl) if rl.rlim_cur == libc::RLIM_INFINITY => "unlimited".into(),
        Ok(rl) => fmt_bytes(rl.rlim_cur),
        Err(_) => "unknown".into(),
    }
}

/// Bytes the process has locked (`VmLck`), where /proc tells.
pub fn vm_locked() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmLck:"))?;
    let kb: u64 = line["VmLck:".len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// One call a [`TestBackend`] received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestOp {
    Prepare(usize),
    Hold(Region),
    Release(Region),
}

/// A call and whether the backend let it succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Logged {
    pub op: TestOp,
    pub ok: bool,
}

#[derive(Default)]
struct TestState {
    log: Vec<Logged>,
    /// Regions held now, in the order they were held.
    holding: Vec<Region>,
    /// Calls that break the set's contract (releasing what is not held, holding twice).
    misuse: Vec<String>,
    /// Regions warmed, in order (kept apart from `log`, which lists holds and releases).
    warmed: Vec<Region>,
    /// How long warming one (4 KiB) page takes, to test a pass that is stopped midway.
    warm_page_time: Duration,
    /// Countdown to the call that fails: `Some(1)` fails the next one.
    fail_prepare: Option<usize>,
    fail_hold: Option<usize>,
    fail_release: Option<usize>,
}

/// Records every call, can be told to fail the n-th prepare / hold / release, and reports
/// contract breaches. Clones share one log, so a test keeps a clone to inspect what the set did.
#[derive(Clone, Default)]
pub struct TestBackend {
    state: Arc<Mutex<TestState>>,
}

impl fmt::Debug for TestBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("TestBackend")
            .field("calls", &s.log.len())
            .field("holding", &s.holding.len())
            .finish()
    }
}

impl TestBackend {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, TestState> {
        // A test that panicked mid-call must not hide the log from the next assertion.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The `n`-th `prepare` from now fails (1 = the next one). Once.
    pub fn fail_prepare(&self, n: usize) {
        self.lock().fail_prepare = Some(n.max(1));
    }

    /// The `n`-th `hold` from now fails (1 = the next one). Once.
    pub fn fail_hold(&self, n: usize) {
        self.lock().fail_hold = Some(n.max(1));
    }

    /// The `n`-th `release` from now fails (1 = the next one). Once. The region counts as
    /// released anyway (its owner frees it next).
    pub fn fail_release(&self, n: usize) {
        self.lock().fail_release = Some(n.max(1));
    }

    /// Every call so far, in order.
    pub fn log(&self) -> Vec<Logged> {
        self.lock().log.clone()
    }

    /// How many calls so far.
    pub fn calls(&self) -> usize {
        self.lock().log.len()
    }

    /// Regions held now.
    pub fn holding(&self) -> Vec<Region> {
        self.lock().holding.clone()
    }

    /// Regions warmed so far, in order.
    pub fn warmed(&self) -> Vec<Region> {
        self.lock().warmed.clone()
    }

    /// Makes each warmed page take `time` (default zero).
    pub fn set_warm_page_time(&self, time: Duration) {
        self.lock().warm_page_time = time;
    }

    /// Bytes held now.
    pub fn holding_bytes(&self) -> u64 {
        self.lock().holding.iter().map(|r| r.len as u64).sum()
    }

    /// Contract breaches seen (a release of a region not held, a region held twice). A correct
    /// set leaves this empty.
    pub fn misuse(&self) -> Vec<String> {
        self.lock().misuse.clone()
    }

    fn refusal(op: BackendOp, what: String) -> BackendError {
        BackendError {
            op,
            errno: None,
            message: format!("test {op} of {what}"),
            hint: "the test backend was told to fail".into(),
            advice: "this is a test".into(),
        }
    }
}

/// Counts down a failure; true when this call is the one to fail.
fn trips(countdown: &mut Option<usize>) -> bool {
    match countdown {
        Some(1) => {
            *countdown = None;
            true
        }
        Some(n) => {
            *n -= 1;
            false
        }
        None => false,
    }
}

impl Backend for TestBackend {
    fn name(&self) -> &'static str {
        "test"
    }

    /// Pretends to touch each 4 KiB page from the `skip`-th, looking at `stop` before every one.
    fn warm(&self, r: &Region, skip: usize, stop: &dyn Fn() -> bool) -> usize {
        if stop() {
            return 0;
        }
        let page_time = {
            let mut s = self.lock();
            if !s.holding.contains(r) {
                s.misuse.push(format!("warm of {r:?}, not held"));
            }
            s.warmed.push(*r);
            s.warm_page_time
        };
        let mut touched = 0;
        for _ in skip.min(r.len.div_ceil(4096))..r.len.div_ceil(4096) {
            if stop() {
                break;
            }
            if !page_time.is_zero() {
                std::thread::sleep(page_time);
            }
            touched += 1;
        }
        touched
    }

    fn prepare(&self, host_bytes: usize) -> Result<(), BackendError> {
        let mut s = self.lock();
        let ok = !trips(&mut s.fail_prepare);
        s.log.push(Logged {
            op: TestOp::Prepare(host_bytes),
            ok,
        });
        if ok {
            Ok(())
        } else {
            Err(Self::refusal(
                BackendOp::Prepare,
                fmt_bytes(host_bytes as u64),
            ))
        }
    }

    fn hold(&self, r: &Region) -> Result<(), BackendError> {
        let mut s = self.lock();
        let ok = !trips(&mut s.fail_hold);
        s.log.push(Logged {
            op: TestOp::Hold(*r),
            ok,
        });
        if !ok {
            return Err(Self::refusal(BackendOp::Hold, format!("{r:?}")));
        }
        if s.holding.contains(r) {
            s.misuse.push(format!("hold of {r:?}, already held"));
        }
        s.holding.push(*r);
        Ok(())
    }

    fn release(&self, r: &Region) -> Result<(), BackendError> {
        let mut s = self.lock();
        let ok = !trips(&mut s.fail_release);
        s.log.push(Logged {
            op: TestOp::Release(*r),
            ok,
        });
        match s.holding.iter().rposition(|h| h == r) {
            Some(i) => {
                s.holding.remove(i);
            }
            None => s.misuse.push(format!("release of {r:?}, not held")),
        }
        if ok {
            Ok(())
        } else {
            Err(Self::refusal(BackendOp::Release, format!("{r:?}")))
        }
    }
}
