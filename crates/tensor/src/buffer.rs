//! The one owner of engine memory.
//!
//! Every buffer the engine makes (mapped weights, repacked weights, KV cache, activations,
//! per-request scratch) is made by a [`BufferOwner`] and listed there with its kind, size and
//! address range. A [`Buffer`] frees itself through its owner: on drop it is taken off the list
//! *first* and only then unmapped or deallocated, so the list never names released memory. The
//! residency layer holds exactly this list resident, which is why nothing may allocate behind it.
//!
//! Device memory is listed the same way: [`BufferOwner::alloc_device`] makes a
//! [`DeviceBuffer`], listed with [`Location::Device`] and counted (not locked) by the
//! residency set.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ember_residency::{Membership, Region, ResidencySet};
use memmap2::Mmap;

use crate::cuda::{CudaDevice, CudaError, DeviceBuffer};
use crate::error::{Error, Result};

/// Alignment of every heap buffer: a cache line, and enough for any SIMD load.
pub const BUFFER_ALIGN: usize = 64;

/// What a buffer is for; the residency layer reports bytes by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BufferKind {
    /// A checkpoint file mapped read-only; weights are views into it.
    Weights,
    /// Weights copied out of a mapping (misaligned tensors, converted layouts).
    Repacked,
    /// Keys and values of a sequence.
    KvCache,
    /// Per-forward activations and kernel scratch, sized once for the largest batch.
    Activations,
    /// Buffers that live for one request (sampling state, logits).
    Request,
    /// Anything else the engine needs to keep warm (probes, keepalive scratch).
    Scratch,
}

impl BufferKind {
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Weights => "weights",
            BufferKind::Repacked => "repacked",
            BufferKind::KvCache => "kv-cache",
            BufferKind::Activations => "activations",
            BufferKind::Request => "request",
            BufferKind::Scratch => "scratch",
        }
    }
}

impl fmt::Display for BufferKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Identifies a buffer for as long as its owner lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(u64);

impl BufferId {
    /// The number behind the id, for sets keyed by integers (the residency set).
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// Where a buffer's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host memory: heap, or a mapped file.
    Host,
    /// Memory of the CUDA device with this ordinal; `addr` is a device address.
    Device { ordinal: usize },
    /// Host memory a device copies to and from (whole pages of its own), which a device's
    /// residency backend page-locks with the driver.
    Staging,
}

/// One entry of the owner's list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferInfo {
    pub id: BufferId,
    pub kind: BufferKind,
    pub label: String,
    pub location: Location,
    /// First byte of the region.
    pub addr: usize,
    pub bytes: usize,
}

impl BufferInfo {
    /// The address range `[addr, addr + bytes)`.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.addr..self.addr + self.bytes
    }

    /// The region a residency set holds for this buffer: locked on the host, counted on a
    /// device.
    pub fn region(&self) -> Region {
        match self.location {
            Location::Host => Region::host(self.addr, self.bytes),
            Location::Device { ordinal } => Region::device(self.addr, self.bytes).on_gpu(ordinal),
            Location::Staging => Region::staging(self.addr, self.bytes),
        }
    }
}

#[derive(Default)]
struct Registry {
    next_id: AtomicU64,
    live: Mutex<BTreeMap<BufferId, BufferInfo>>,
    /// The set that holds this owner's buffers resident, once one is attached: buffers made
    /// later join it (staged), and every buffer leaves it before it is freed.
    residency: Mutex<Option<Arc<ResidencySet>>>,
}

impl Registry {
    fn residency(&self) -> Option<Arc<ResidencySet>> {
        self.residency
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn live(&self) -> MutexGuard<'_, BTreeMap<BufferId, BufferInfo>> {
        // A panic while holding this lock cannot leave the map half-updated (each update is one
        // insert or remove), so a poisoned lock is still consistent.
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lists a region (joining the residency set, staged, when one is attached).
    fn list(
        &self,
        kind: BufferKind,
        label: String,
        location: Location,
        addr: usize,
        bytes: usize,
    ) -> BufferId {
        let id = BufferId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let info = BufferInfo {
            id,
            kind,
            label,
            location,
            addr,
            bytes,
        };
        if let (Some(set), true) = (self.residency(), bytes > 0) {
            // Staged, committed between requests; a refusal is counted by the set and the
            // buffer simply lives unheld.
            if let Err(e) = set.join(id.0, info.region()) {
                tracing::debug!("buffer {} not joined to the residency set: {e}", info.label);
            }
        }
        self.live().insert(id, info);
        id
    }

    /// Takes a buffer off the list, and out of the residency set (committed at once), before
    /// its memory goes: the set must never hold a released region.
    fn unlist(&self, id: BufferId) {
        self.live().remove(&id);
        if let Some(set) = self.residency()
            && set.membership(id.0) != Membership::None
            && let Err(e) = set.leave(id.0)
        {
            tracing::warn!("releasing buffer {id:?} from the residency set failed: {e}");
        }
    }
}

/// A listed region that is not a host [`Buffer`] (device memory): dropping it takes the region
/// off the list and out of the residency set. Its holder frees the memory after that.
pub(crate) struct Listing {
    registry: Arc<Registry>,
    id: BufferId,
    kind: BufferKind,
}

impl Listing {
    pub(crate) fn id(&self) -> BufferId {
        self.id
    }

    pub(crate) fn kind(&self) -> BufferKind {
        self.kind
    }
}

impl Drop for Listing {
    fn drop(&mut self) {
        self.registry.unlist(self.id);
    }
}

/// Makes, lists and frees the engine's buffers. Cheap to clone; clones share one list.
#[derive(Clone, Default)]
pub struct BufferOwner {
    registry: Arc<Registry>,
}

impl fmt::Debug for BufferOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferOwner")
            .field("buffers", &self.registry.live().len())
            .field("bytes", &self.total_bytes())
            .finish()
    }
}

impl BufferOwner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Allocates `bytes` of zeroed, 64-byte aligned host memory, resident from the start.
    pub fn alloc(
        &self,
        kind: BufferKind,
        label: impl Into<String>,
        bytes: usize,
    ) -> Result<Buffer> {
        let label = label.into();
        let storage = Storage::heap(&label, bytes, BUFFER_ALIGN)?;
        Ok(self.register(kind, label, storage, Location::Host))
    }

    /// Allocates zeroed host memory that a device copies to and from (a GPU's step inputs and
    /// logits): whole pages of its own, listed as [`Location::Staging`], so a device's
    /// residency backend can page-lock it with the driver and transfers run straight from it.
    pub fn alloc_staging(
        &self,
        kind: BufferKind,
        label: impl Into<String>,
        bytes: usize,
    ) -> Result<Buffer> {
        let label = label.into();
        let page = page_size();
        let storage = Storage::heap(&label, bytes.next_multiple_of(page), page)?;
        Ok(self.register(kind, label, storage, Location::Staging))
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn alloc_copy(
        &self,
        kind: BufferKind,
        label: impl Into<String>,
        data: &[u8],
    ) -> Result<Buffer> {
        let mut buf = self.alloc(kind, label, data.len())?;
        buf.bytes_mut().copy_from_slice(data);
        Ok(buf)
    }

    /// Maps a file read-only. The mapping is the buffer; tensors are read in place.
    pub fn map_file(&self, kind: BufferKind, path: &Path) -> Result<Buffer> {
        let io_err = |source| Error::Io {
            path: PathBuf::from(path),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let storage = if len == 0 {
            Storage::Empty
        } else {
            // SAFETY: the file is opened read-only and mapped private; a checkpoint changed
            // underneath a running server is outside what any inference engine can defend.
            let map = unsafe { Mmap::map(&file) }.map_err(io_err)?;
            Storage::Mapped(map)
        };
        Ok(self.register(kind, path.display().to_string(), storage, Location::Host))
    }

    /// Allocates `bytes` of memory on a CUDA device, listed here beside the host buffers
    /// (with [`Location::Device`]) and counted by the residency set once one is attached.
    /// The contents start undefined.
    pub fn alloc_device(
        &self,
        kind: BufferKind,
        label: impl Into<String>,
        device: &CudaDevice,
        bytes: usize,
    ) -> std::result::Result<DeviceBuffer, CudaError> {
        let label = label.into();
        let memory = device.malloc(&label, bytes)?;
        let location = Location::Device {
            ordinal: device.ordinal(),
        };
        let id = self
            .registry
            .list(kind, label, location, memory.addr() as usize, bytes);
        let listing = Listing {
            registry: Arc::clone(&self.registry),
            id,
            kind,
        };
        Ok(DeviceBuffer::new(listing, memory))
    }

    fn register(
        &self,
        kind: BufferKind,
        label: String,
        storage: Storage,
        location: Location,
    ) -> Buffer {
        let (addr, bytes) = storage.region();
        let id = self.registry.list(kind, label, location, addr, bytes);
        Buffer {
            registry: Arc::clone(&self.registry),
            id,
            kind,
            storage,
        }
    }

    /// Attaches the residency set that holds this owner's buffers: from now on every buffer
    /// made joins it (staged) and every buffer freed leaves it first. The buffers already
    /// listed are expected to be in the set (it was established from [`Self::list`]).
    pub fn attach_residency(&self, set: Arc<ResidencySet>) {
        *self
            .registry
            .residency
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(set);
    }

    /// Frees a buffer. Same as dropping it; spelled out where the intent matters.
    pub fn free(&self, buffer: Buffer) {
        drop(buffer);
    }

    /// A snapshot of every live buffer, in the order they were made.
    pub fn list(&self) -> Vec<BufferInfo> {
        self.registry.live().values().cloned().collect()
    }

    /// Bytes held by all live buffers.
    pub fn total_bytes(&self) -> usize {
        self.registry.live().values().map(|b| b.bytes).sum()
    }

    /// Bytes held by live buffers of one kind.
    pub fn bytes_of(&self, kind: BufferKind) -> usize {
        self.registry
            .live()
            .values()
            .filter(|b| b.kind == kind)
            .map(|b| b.bytes)
            .sum()
    }
}

enum Storage {
    Empty,
    Heap { ptr: NonNull<u8>, layout: Layout },
    Mapped(Mmap),
}

impl Storage {
    /// `bytes` of zeroed heap memory aligned to `align`. The pages are written here, so the
    /// buffer is resident from the start: the memory the list names is the memory the process
    /// really holds.
    fn heap(label: &str, bytes: usize, align: usize) -> Result<Storage> {
        if bytes == 0 {
            return Ok(Storage::Empty);
        }
        let failed = || Error::AllocFailed {
            label: label.to_string(),
            bytes,
        };
        let layout = Layout::from_size_align(bytes, align).map_err(|_| failed())?;
        // SAFETY: layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) }).ok_or_else(failed)?;
        // SAFETY: ptr points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        Ok(Storage::Heap { ptr, layout })
    }

    fn region(&self) -> (usize, usize) {
        match self {
            Storage::Empty => (0, 0),
            Storage::Heap { ptr, layout } => (ptr.as_ptr() as usize, layout.size()),
            Storage::Mapped(map) => (map.as_ptr() as usize, map.len()),
        }
    }
}

/// The host's page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).unwrap_or(4096).max(1)
}

/// A region of memory made by a [`BufferOwner`] and listed there until it is dropped.
pub struct Buffer {
    registry: Arc<Registry>,
    id: BufferId,
    kind: BufferKind,
    storage: Storage,
}

// SAFETY: the buffer exclusively owns its heap allocation or mapping; shared access is `&[u8]`,
// mutation needs `&mut self`.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .field("bytes", &self.len())
            .finish()
    }
}

impl Buffer {
    pub fn id(&self) -> BufferId {
        self.id
    }

    pub fn kind(&self) -> BufferKind {
        self.kind
    }

    pub fn len(&self) -> usize {
        self.storage.region().1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped(_))
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Empty => &[],
            // SAFETY: the allocation is `layout.size()` bytes, initialised at allocation.
            Storage::Heap { ptr, layout } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), layout.size())
            },
            Storage::Mapped(map) => map,
        }
    }

    /// Mutable bytes of a heap buffer. Mapped files are read-only and give an empty slice.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Empty | Storage::Mapped(_) => &mut [],
            // SAFETY: as in `bytes`, and `&mut self` makes the access exclusive.
            Storage::Heap { ptr, layout } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), layout.size())
            },
        }
    }

    /// The buffer as a slice of `T`. Heap buffers are 64-byte aligned, so this holds for any
    /// element type of a size that divides the length.
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.bytes())
    }

    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.registry.unlist(self.id);
        if let Storage::Heap { ptr, layout } = self.storage {
            // SAFETY: allocated in `BufferOwner::alloc` with this layout, freed once here.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        }
        // A mapping unmaps when `storage` drops, after this body.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freeing_one_of_two_buffers_keeps_only_the_other() {
        let owner = BufferOwner::new();
        let a = owner.alloc(BufferKind::Activations, "a", 4096).unwrap();
        let b = owner.alloc(BufferKind::KvCache, "b", 8192).unwrap();
        let b_info = owner.list().into_iter().find(|i| i.id == b.id()).unwrap();
        assert_eq!(owner.list().len(), 2);
        owner.free(a);
        let list = owner.list();
        assert_eq!(list, vec![b_info.clone()]);
        assert_eq!(owner.total_bytes(), 8192);
        assert_eq!(
            list[0].range(),
            b.bytes().as_ptr() as usize..b.bytes().as_ptr() as usize + 8192
        );
        drop(b);
        assert!(owner.list().is_empty());
        assert_eq!(owner.total_bytes(), 0);
    }

    #[test]
    fn staging_buffers_are_whole_pages_of_their_own_counted_as_host() {
        use ember_residency::RegionKind;
        let owner = BufferOwner::new();
        let page = page_size();
        let a = owner
            .alloc_staging(BufferKind::Activations, "a", 100)
            .unwrap();
        let b = owner
            .alloc_staging(BufferKind::Activations, "b", page + 1)
            .unwrap();
        for (buffer, pages) in [(&a, 1), (&b, 2)] {
            let info = owner
                .list()
                .into_iter()
                .find(|i| i.id == buffer.id())
                .unwrap();
            assert_eq!(info.location, Location::Staging);
            assert_eq!(info.addr % page, 0, "starts on a page");
            assert_eq!(info.bytes, pages * page, "whole pages");
            assert_eq!(buffer.len(), pages * page);
            assert!(buffer.bytes().iter().all(|&x| x == 0), "zeroed");
            let region = info.region();
            assert_eq!(region.kind, RegionKind::Staging);
            assert!(region.kind.is_host());
        }
    }

    #[test]
    fn later_buffers_join_staged_and_leave_before_they_are_freed() {
        use ember_residency::{Bound, TestBackend, TestOp};
        let owner = BufferOwner::new();
        let first = owner.alloc(BufferKind::Weights, "w", 4096).unwrap();
        let backend = TestBackend::new();
        let regions = owner
            .list()
            .iter()
            .map(|b| (b.id.0, Region::host(b.addr, b.bytes)))
            .collect();
        let (set, report) = ResidencySet::establish(
            Arc::new(backend.clone()),
            Bound::fixed(1 << 30, "a test bound"),
            regions,
        );
        assert!(report.held);
        owner.attach_residency(Arc::clone(&set));

        let later = owner.alloc(BufferKind::KvCache, "kv", 8192).unwrap();
        assert_eq!(
            set.membership(later.id().0),
            Membership::Staged,
            "made during a request: staged, not held"
        );
        set.commit();
        assert_eq!(set.membership(later.id().0), Membership::Held);
        let region = Region::host(later.bytes().as_ptr() as usize, 8192);
        drop(later);
        let released = backend
            .log()
            .iter()
            .any(|l| l.ok && matches!(&l.op, TestOp::Release(r) if *r == region));
        assert!(
            released,
            "freeing a held buffer releases it from the set first"
        );
        assert_eq!(set.stats().buffers, 1);

        let staged = owner.alloc(BufferKind::Request, "r", 100).unwrap();
        drop(staged);
        assert_eq!(
            set.stats().staged,
            0,
            "a staged buffer that is freed just leaves the staging list"
        );
        drop(first);
        assert_eq!(set.stats().buffers, 0);
    }

    #[test]
    fn heap_buffers_are_zeroed_aligned_and_writable() {
        let owner = BufferOwner::new();
        let mut buf = owner.alloc(BufferKind::Scratch, "s", 1000).unwrap();
        assert_eq!(buf.bytes().as_ptr() as usize % BUFFER_ALIGN, 0);
        assert!(buf.bytes().iter().all(|&b| b == 0));
        buf.as_mut_slice::<u8>()[999] = 7;
        assert_eq!(buf.bytes()[999], 7);
        let empty = owner.alloc(BufferKind::Scratch, "e", 0).unwrap();
        assert!(empty.is_empty());
        assert_eq!(owner.bytes_of(BufferKind::Scratch), 1000);
    }

    #[test]
    fn mapped_files_are_listed_and_missing_files_name_the_path() {
        let dir = std::env::temp_dir().join(format!("ember-buffer-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("weights.bin");
        std::fs::write(&path, [1u8, 2, 3, 4]).unwrap();
        let owner = BufferOwner::new();
        let map = owner.map_file(BufferKind::Weights, &path).unwrap();
        assert_eq!(map.bytes(), &[1, 2, 3, 4]);
        assert!(map.is_mapped());
        assert_eq!(owner.list()[0].kind, BufferKind::Weights);
        drop(map);
        assert!(owner.list().is_empty());
        let err = owner
            .map_file(BufferKind::Weights, &dir.join("missing.bin"))
            .unwrap_err();
        assert!(err.to_string().contains("missing.bin"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
