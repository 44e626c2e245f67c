//! NCCL, loaded at run time: the collectives of a tensor-parallel group whose ranks are GPUs of
//! one host. Only what the group uses: communicators made together ([`NcclGroup::new`]), an
//! all-gather, and an abort that frees every rank waiting in one.
//!
//! The library is looked for as `EMBER_NCCL_LIBRARY` (a path), then `libnccl.so.2` and
//! `libnccl.so` on the loader's path (NCCL's soname is `libnccl.so.2`, which cudarc's own
//! loader does not try). A machine without it gets [`CudaError::Unavailable`] saying so.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use libloading::Library;

use super::error::{CudaError, ensure};
use super::{CudaDevice, DevSlice, DevSliceMut};

type Comm = *mut c_void;
/// `ncclResult_t`: 0 is success.
type Status = c_int;
/// `ncclFloat32` of `ncclDataType_t`.
const FLOAT32: c_int = 7;

/// The entry points ember calls, looked up once.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> Status,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Status,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> Status,
    comm_abort: unsafe extern "C" fn(Comm) -> Status,
    comm_destroy: unsafe extern "C" fn(Comm) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    /// Kept loaded for as long as the function pointers above are used: the process's life.
    _library: Library,
}

/// The library's file names, in the order they are tried.
fn candidates() -> Vec<String> {
    let mut names: Vec<String> = std::env::var("EMBER_NCCL_LIBRARY")
        .ok()
        .filter(|p| !p.is_empty())
        .into_iter()
        .collect();
    names.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
    names
}

fn api() -> Result<&'static Api, CudaError> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load)
        .as_ref()
        .map_err(|missing| CudaError::Unavailable {
            missing: missing.clone(),
        })
}

fn load() -> Result<Api, String> {
    let names = candidates();
    // SAFETY: loading NCCL runs its initialisers, which only set up its own state.
    let library = names
        .iter()
        .find_map(|name| unsafe { Library::new(name) }.ok())
        .ok_or_else(|| {
            format!(
                "NCCL ({}; put its folder on LD_LIBRARY_PATH or set EMBER_NCCL_LIBRARY to the \
                 file, e.g. from `pip install nvidia-nccl-cu13`)",
                names.join(", ")
            )
        })?;
    macro_rules! symbol {
        ($name:literal) => {
            // SAFETY: the type is the one NCCL's header declares for this name.
            *unsafe { library.get($name) }
                .map_err(|e| format!("NCCL's {}: {e}", String::from_utf8_lossy($name)))?
        };
    }
    Ok(Api {
        get_version: symbol!(b"ncclGetVersion"),
        comm_init_all: symbol!(b"ncclCommInitAll"),
        all_gather: symbol!(b"ncclAllGather"),
        comm_abort: symbol!(b"ncclCommAbort"),
        comm_destroy: symbol!(b"ncclCommDestroy"),
        error_string: symbol!(b"ncclGetErrorString"),
        _library: library,
    })
}

/// Fails with the call's name and NCCL's words for `status`.
fn check(api: &Api, op: &'static str, status: Status) -> Result<(), CudaError> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for every status.
    let why = unsafe { CStr::from_ptr((api.error_string)(status)) }.to_string_lossy();
    Err(CudaError::invalid(
        op,
        format!("NCCL error {status}: {why}"),
    ))
}

/// NCCL's version as `major.minor.patch`, or why it cannot be loaded.
pub fn nccl_version() -> Result<String, CudaError> {
    let api = api()?;
    let mut code = 0;
    // SAFETY: a valid out-pointer.
    check(api, "ncclGetVersion", unsafe {
        (api.get_version)(&mut code)
    })?;
    // Since NCCL 2.9: major * 10000 + minor * 100 + patch.
    Ok(format!(
        "{}.{}.{}",
        code / 10000,
        code / 100 % 100,
        code % 100
    ))
}

/// One communicator for each GPU of a group, rank `r` on the `r`-th device. Each rank's
/// thread calls the collectives for its own rank; [`NcclGroup::abort`] (any thread) stops
/// them all, so that no rank waits forever on one that is gone.
pub struct NcclGroup {
    api: &'static Api,
    /// Each rank's communicator.
    comms: Vec<RankComm>,
}

/// A communicator and whether it is live (an abort frees it). Its lock is held while a call
/// enqueues (a rank's first call also connects to the other ranks, waiting for them): one
/// lock each, so ranks never wait on each other's locks.
struct RankComm {
    comm: Comm,
    live: Mutex<bool>,
}

// SAFETY: a communicator may be used from any thread, one call at a time; each one's mutex
// serialises its calls (each only enqueues work on a stream, or connects on the first).
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

/// How long [`NcclGroup::abort`] waits for a rank's call to return before aborting its
/// communicator under it: a call holding it that long waits inside NCCL for a rank that is
/// gone, which is what an abort from another thread is for.
const ABORT_WAIT: Duration = Duration::from_secs(2);

impl NcclGroup {
    /// Communicators among `devices` (distinct GPUs: NCCL refuses two ranks on one).
    pub fn new(devices: &[CudaDevice]) -> Result<NcclGroup, CudaError> {
        const OP: &str = "ncclCommInitAll";
        let api = api()?;
        let ordinals: Vec<c_int> = devices.iter().map(|d| d.ordinal() as c_int).collect();
        for (i, o) in ordinals.iter().enumerate() {
            ensure!(
                !ordinals[..i].contains(o),
                OP,
                "two ranks on GPU {o}: NCCL gives each rank a GPU of its own"
            );
        }
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
        // NCCL's runtime shares the devices' primary contexts with the driver API's.
        if let Some(first) = devices.first() {
            first.bind()?;
        }
        // SAFETY: `comms` has room for one communicator per device in `ordinals`.
        check(api, OP, unsafe {
            (api.comm_init_all)(
                comms.as_mut_ptr(),
                ordinals.len() as c_int,
                ordinals.as_ptr(),
            )
        })?;
        Ok(NcclGroup {
            api,
            comms: comms
                .into_iter()
                .map(|comm| RankComm {
                    comm,
                    live: Mutex::new(true),
                })
                .collect(),
        })
    }

    pub fn ranks(&self) -> usize {
        self.comms.len()
    }

    /// Enqueues on `device`'s stream (rank `rank`'s GPU) every rank's `send` gathered into
    /// `recv`, rank `r`'s at `recv[r * send.len()..]`, on every rank.
    pub fn all_gather(
        &self,
        rank: usize,
        device: &CudaDevice,
        send: DevSlice<'_, f32>,
        recv: &mut DevSliceMut<'_, f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "ncclAllGather";
        ensure!(
            rank < self.ranks() && recv.len() == send.len() * self.ranks(),
            OP,
            "rank {rank} of {}: {} values from each into {}",
            self.ranks(),
            send.len(),
            recv.len()
        );
        let RankComm { comm: c, live } = &self.comms[rank];
        let live = lock(live);
        if !*live {
            return Err(CudaError::invalid(OP, "the group was stopped"));
        }
        device.bind()?;
        // SAFETY: both ranges are live device memory of the lengths checked above, on the
        // communicator's GPU; the stream is that device's; the lock keeps `c` from an abort.
        check(self.api, OP, unsafe {
            (self.api.all_gather)(
                send.device_ptr() as *const c_void,
                recv.device_ptr() as *mut c_void,
                send.len(),
                FLOAT32,
                *c,
                device.stream().cu_stream() as *mut c_void,
            )
        })
    }

    /// Enqueues `values` (rank `rank`'s, on `device`) becoming every rank's summed in rank
    /// order, `((v0 + v1) + v2) + …`, on every rank: an all-gather into `gathered` (room for
    /// `ranks ×` the values), then the sums. The same bits whatever the length, unlike NCCL's
    /// own all-reduce, whose algorithm (and so the order of its sums) follows the message's
    /// size; for two ranks it moves what that one would.
    pub fn all_reduce_in_rank_order(
        &self,
        rank: usize,
        device: &CudaDevice,
        values: &mut DevSliceMut<'_, f32>,
        gathered: &mut DevSliceMut<'_, f32>,
    ) -> Result<(), CudaError> {
        let len = values.len();
        ensure!(
            gathered.len() >= self.ranks() * len,
            "all_reduce_in_rank_order",
            "room for {} values gathered from {} ranks of {len}",
            gathered.len(),
            self.ranks()
        );
        if len == 0 {
            return Ok(());
        }
        let mut all = gathered.slice_mut(0..self.ranks() * len);
        self.all_gather(rank, device, values.as_slice(), &mut all)?;
        super::sum_parts(device, all.as_slice(), values)
    }

    /// Stops the group: collectives in flight are abandoned (the ranks waiting on their
    /// streams are freed) and later ones fail.
    pub fn abort(&self) {
        for RankComm { comm, live } in &self.comms {
            let deadline = Instant::now() + ABORT_WAIT;
            let was_live = loop {
                match live.try_lock() {
                    Ok(mut held) => break std::mem::replace(&mut *held, false),
                    Err(TryLockError::Poisoned(p)) => {
                        break std::mem::replace(&mut *p.into_inner(), false);
                    }
                    Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    // Stuck inside NCCL: aborted under the call, as NCCL allows; the call
                    // returns an error, and its rank's group has failed, so it makes no
                    // other. (Live: only an abort clears it, and aborts come one at a time.)
                    Err(TryLockError::WouldBlock) => break true,
                }
            };
            if was_live {
                // SAFETY: a live communicator, aborted once.
                let status = unsafe { (self.api.comm_abort)(*comm) };
                if status != 0 {
                    tracing::warn!("ncclCommAbort failed: NCCL error {status}");
                }
            }
        }
    }
}

fn lock(live: &Mutex<bool>) -> MutexGuard<'_, bool> {
    // A call leaves the flag as it was.
    live.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        for RankComm { comm, live } in &self.comms {
            if std::mem::replace(&mut *lock(live), false) {
                // SAFETY: a live communicator, destroyed once; its ranks' streams were
                // drained by their backends before the group goes.
                if unsafe { (self.api.comm_destroy)(*comm) } != 0 {
                    tracing::warn!("ncclCommDestroy failed");
                }
            }
        }
    }
}
