//! Device memory: [`DeviceBuffer`]s made and listed by the [`BufferOwner`], and the typed
//! views of them that ops take.
//!
//! A view ([`DevSlice`], [`DevSliceMut`]) borrows its buffer, so the borrow checker keeps a
//! buffer alive and unaliased while an op is *enqueued*. Ops run asynchronously on the
//! device's one stream, in order; a buffer waits for that stream to drain before it is freed,
//! so nothing in flight ever touches released memory.
//!
//! [`BufferOwner`]: crate::BufferOwner

use std::marker::PhantomData;
use std::ops::Range;

use crate::buffer::{BufferId, BufferKind, Listing};
use crate::dtype::DType;

use super::device::CudaDevice;
use super::error::{CudaError, ensure};
use super::kernels::Float;

/// A plain value type that can live in device memory.
pub trait DeviceElem: bytemuck::Pod + Send + Sync + 'static {}

impl DeviceElem for u8 {}
impl DeviceElem for u32 {}
impl DeviceElem for i32 {}
impl DeviceElem for u64 {}
impl DeviceElem for f32 {}
impl DeviceElem for half::bf16 {}
impl DeviceElem for half::f16 {}

/// A float type kernels compute with.
pub trait FloatElem: DeviceElem {
    const FLOAT: Float;
}

impl FloatElem for f32 {
    const FLOAT: Float = Float::F32;
}
impl FloatElem for half::bf16 {
    const FLOAT: Float = Float::Bf16;
}
impl FloatElem for half::f16 {
    const FLOAT: Float = Float::F16;
}

/// A device allocation; frees itself once the device's stream has drained.
pub(crate) struct DeviceMemory {
    ptr: u64,
    bytes: usize,
    device: CudaDevice,
}

impl DeviceMemory {
    pub(crate) fn new(ptr: u64, bytes: usize, device: CudaDevice) -> Self {
        DeviceMemory { ptr, bytes, device }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.device.free(self.ptr);
        }
    }
}

/// Memory on a CUDA device, made by [`crate::BufferOwner::alloc_device`] and listed there
/// until dropped.
pub struct DeviceBuffer {
    // Field order is drop order: off the list and out of the residency set first, then freed.
    listing: Listing,
    memory: DeviceMemory,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("id", &self.id())
            .field("kind", &self.kind())
            .field("bytes", &self.len())
            .finish()
    }
}

impl DeviceBuffer {
    pub(crate) fn new(listing: Listing, memory: DeviceMemory) -> Self {
        DeviceBuffer { listing, memory }
    }

    pub fn id(&self) -> BufferId {
        self.listing.id()
    }

    pub fn kind(&self) -> BufferKind {
        self.listing.kind()
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.memory.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.memory.ptr
    }

    /// The whole buffer as elements of `T`.
    ///
    /// # Panics
    /// When the length is not a whole number of `T`.
    pub fn as_slice<T: DeviceElem>(&self) -> DevSlice<'_, T> {
        let (ptr, len) = self.typed::<T>();
        DevSlice::new(ptr, len)
    }

    /// As [`Self::as_slice`], writable.
    pub fn as_mut_slice<T: DeviceElem>(&mut self) -> DevSliceMut<'_, T> {
        let (ptr, len) = self.typed::<T>();
        DevSliceMut::new(ptr, len)
    }

    fn typed<T>(&self) -> (u64, usize) {
        let size = size_of::<T>();
        assert!(
            self.len().is_multiple_of(size),
            "device buffer of {} bytes is not a whole number of {size}-byte elements",
            self.len()
        );
        (self.memory.ptr, self.len() / size)
    }

    /// Copies `data` to the start of the buffer (waits until it is there).
    pub fn upload<T: DeviceElem>(&mut self, data: &[T]) -> Result<(), CudaError> {
        let device = self.memory.device.clone();
        let mut dst = self.as_mut_slice::<u8>();
        ensure!(
            size_of_val(data) <= dst.len(),
            "upload",
            "{} bytes into a buffer of {}",
            size_of_val(data),
            dst.len()
        );
        device.upload(
            &mut dst.slice_mut(0..size_of_val(data)),
            bytemuck::cast_slice(data),
        )
    }

    /// Copies the start of the buffer into `out` (waits until it is there).
    pub fn download<T: DeviceElem>(&self, out: &mut [T]) -> Result<(), CudaError> {
        let src = self.as_slice::<u8>();
        ensure!(
            size_of_val(out) <= src.len(),
            "download",
            "{} bytes from a buffer of {}",
            size_of_val(out),
            src.len()
        );
        self.memory.device.download(
            src.slice(0..size_of_val(out)),
            bytemuck::cast_slice_mut(out),
        )
    }
}

/// `len` elements of `T` in device memory, read-only, borrowed from a [`DeviceBuffer`].
#[derive(Debug)]
pub struct DevSlice<'a, T> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for DevSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevSlice<'_, T> {}

impl<'a, T: DeviceElem> DevSlice<'a, T> {
    fn new(ptr: u64, len: usize) -> Self {
        DevSlice {
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Elements `range` of this slice.
    ///
    /// # Panics
    /// When the range is out of bounds, as slice indexing does.
    pub fn slice(self, range: Range<usize>) -> DevSlice<'a, T> {
        let (ptr, len) = sub(self.ptr, self.len, size_of::<T>(), range);
        DevSlice::new(ptr, len)
    }

    /// The same bytes as elements of `U` (weights stored as bytes, read as bf16).
    ///
    /// # Panics
    /// When the bytes are not a whole number of `U`s or not aligned to `U`.
    pub fn cast<U: DeviceElem>(self) -> DevSlice<'a, U> {
        let bytes = self.len * size_of::<T>();
        assert!(
            bytes.is_multiple_of(size_of::<U>()) && self.ptr.is_multiple_of(align_of::<U>() as u64),
            "{bytes} bytes at {:#x} are not a whole, aligned run of {}-byte elements",
            self.ptr,
            size_of::<U>()
        );
        DevSlice::new(self.ptr, bytes / size_of::<U>())
    }
}

/// `len` elements of `T` in device memory, writable, borrowed from a [`DeviceBuffer`].
#[derive(Debug)]
pub struct DevSliceMut<'a, T> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: DeviceElem> DevSliceMut<'a, T> {
    fn new(ptr: u64, len: usize) -> Self {
        DevSliceMut {
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// A read-only view of the same elements.
    pub fn as_slice(&self) -> DevSlice<'_, T> {
        DevSlice::new(self.ptr, self.len)
    }

    /// A shorter-lived writable view of the same elements.
    pub fn reborrow(&mut self) -> DevSliceMut<'_, T> {
        DevSliceMut::new(self.ptr, self.len)
    }

    /// Elements `range`, writable.
    ///
    /// # Panics
    /// When the range is out of bounds.
    pub fn slice_mut(&mut self, range: Range<usize>) -> DevSliceMut<'_, T> {
        let (ptr, len) = sub(self.ptr, self.len, size_of::<T>(), range);
        DevSliceMut::new(ptr, len)
    }

    /// Two disjoint writable halves, `[0, mid)` and `[mid, len)`.
    pub fn split_at_mut(self, mid: usize) -> (DevSliceMut<'a, T>, DevSliceMut<'a, T>) {
        assert!(mid <= self.len, "split at {mid} of {}", self.len);
        let size = size_of::<T>() as u64;
        (
            DevSliceMut::new(self.ptr, mid),
            DevSliceMut::new(self.ptr + mid as u64 * size, self.len - mid),
        )
    }
}

fn sub(ptr: u64, len: usize, size: usize, range: Range<usize>) -> (u64, usize) {
    assert!(
        range.start <= range.end && range.end <= len,
        "device slice range {range:?} out of bounds for length {len}"
    );
    (ptr + (range.start * size) as u64, range.end - range.start)
}

/// A matrix of stored weights on the device, `rows × cols` row-major (a HF Linear), in f32,
/// bf16 or f16.
#[derive(Clone, Copy, Debug)]
pub struct DevMat<'a> {
    pub dtype: Float,
    pub data: DevSlice<'a, u8>,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> DevMat<'a> {
    /// A matrix over `data`; fails for block-quantized types (not yet on the device) and when
    /// the bytes do not match the shape.
    pub fn new(
        dtype: DType,
        data: DevSlice<'a, u8>,
        rows: usize,
        cols: usize,
    ) -> Result<Self, CudaError> {
        let float = match dtype {
            DType::F32 => Float::F32,
            DType::BF16 => Float::Bf16,
            DType::F16 => Float::F16,
            other => {
                return Err(CudaError::invalid(
                    "device matrix",
                    format!("{other} weights are not supported on CUDA yet"),
                ));
            }
        };
        ensure!(
            data.len() == rows * cols * float.size_in_bytes(),
            "device matrix",
            "{} bytes for {rows}×{cols} {float}",
            data.len()
        );
        Ok(DevMat {
            dtype: float,
            data,
            rows,
            cols,
        })
    }

    /// Rows `range` as a matrix of their own (an expert of a stacked tensor).
    pub fn slice_rows(&self, range: Range<usize>) -> DevMat<'a> {
        let row_bytes = self.cols * self.dtype.size_in_bytes();
        DevMat {
            dtype: self.dtype,
            data: self
                .data
                .slice(range.start * row_bytes..range.end * row_bytes),
            rows: range.len(),
            cols: self.cols,
        }
    }

    /// A matrix over typed elements.
    pub fn from_slice<T: FloatElem>(
        data: DevSlice<'a, T>,
        rows: usize,
        cols: usize,
    ) -> Result<Self, CudaError> {
        let bytes = DevSlice::new(data.ptr, data.len * size_of::<T>());
        let dtype = match T::FLOAT {
            Float::F32 => DType::F32,
            Float::Bf16 => DType::BF16,
            Float::F16 => DType::F16,
        };
        DevMat::new(dtype, bytes, rows, cols)
    }
}
