//! The KV pool in device memory and its host tier in page-locked host memory, and attention
//! over the pass's sequence's blocks, whose table the pass inputs carry
//! ([`super::pass`]).

use std::ops::Range;

use ember_tensor::cpu::{AttentionShape, RopeLayout};
use ember_tensor::cuda::{
    self, AttentionPrecision, CudaDevice, DevSlice, DevSliceMut, DeviceBuffer, FloatElem,
    PagedCacheMut, Position, RopeNorm,
};
use ember_tensor::{Buffer, BufferKind, BufferOwner};
use half::{bf16, f16};

use super::CudaBackend;
use super::weights::{CudaRope, CudaVector};
use crate::backend::{AttentionParams, KvStore, RopeStyle, Slot};
use crate::error::Result;
use crate::kv_cache::{KvDtype, KvLayout};

/// Every sequence's keys and values in one device buffer of blocks ([`crate::kv_cache`]'s
/// layout), and the host tier: slots of pinned host memory that blocks evicted from the pool
/// are copied to, and copied back from when their prefix returns.
pub struct CudaKvPool {
    device: CudaDevice,
    layout: KvLayout,
    blocks: usize,
    pool: DeviceBuffer,
    host: Buffer,
    host_blocks: usize,
    /// Whether a copy to or from `host` may still be in flight (Drop waits for it).
    copies_enqueued: bool,
}

impl CudaKvPool {
    pub fn new(
        device: &CudaDevice,
        owner: &BufferOwner,
        layout: KvLayout,
        blocks: usize,
        host_blocks: usize,
    ) -> Result<Self> {
        let bytes = layout.block_bytes();
        Ok(CudaKvPool {
            device: device.clone(),
            layout,
            blocks,
            pool: owner.alloc_device(BufferKind::KvCache, "kv pool", device, blocks * bytes)?,
            // Page-locked while the residency set holds it, so the copies run asynchronously.
            host: owner.alloc_staging(BufferKind::KvCache, "kv host tier", host_blocks * bytes)?,
            host_blocks,
            copies_enqueued: false,
        })
    }

    pub fn dtype(&self) -> KvDtype {
        self.layout.dtype
    }

    pub(super) fn pool_id(&self) -> ember_tensor::BufferId {
        self.pool.id()
    }

    /// Bytes of pool block `block` and host slot `slot`, checked.
    fn ranges(&self, block: u32, slot: u32) -> Result<(Range<usize>, Range<usize>)> {
        self.layout
            .transfer_ranges(block, slot, self.blocks, self.host_blocks, "CUDA")
    }

    /// One layer's keys and values of the sequence whose blocks `table` lists, to be written.
    fn layer<'a, T: FloatElem>(
        &'a mut self,
        layer: usize,
        table: DevSlice<'a, i32>,
    ) -> PagedCacheMut<'a, T> {
        let l = self.layout;
        PagedCacheMut {
            pool: self.pool.as_mut_slice::<T>(),
            keys_offset: l.keys_offset(layer),
            values_offset: l.values_offset(layer),
            table,
            block_size: l.block_size,
            block_stride: l.block_elems(),
        }
    }
}

impl KvStore for CudaKvPool {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn blocks(&self) -> usize {
        self.blocks
    }

    fn host_blocks(&self) -> usize {
        self.host_blocks
    }

    fn save_to_host(&mut self, block: u32, slot: u32) -> Result<()> {
        let (src, dst) = self.ranges(block, slot)?;
        let src = self.pool.as_slice::<u8>().slice(src);
        // SAFETY: the host never reads or writes the tier's slots: only these copies do, in
        // stream order; Drop waits for the stream before the buffer is freed.
        unsafe {
            self.device
                .download_async(src, &mut self.host.as_mut_slice::<u8>()[dst])?;
        }
        self.copies_enqueued = true;
        Ok(())
    }

    fn load_from_host(&mut self, slot: u32, block: u32) -> Result<()> {
        let (dst, src) = self.ranges(block, slot)?;
        let mut pool = self.pool.as_mut_slice::<u8>();
        // SAFETY: as in `save_to_host`: the slot is written only by stream-ordered copies.
        unsafe {
            self.device
                .upload_async(&mut pool.slice_mut(dst), &self.host.as_slice::<u8>()[src])?;
        }
        self.copies_enqueued = true;
        Ok(())
    }
}

impl Drop for CudaKvPool {
    fn drop(&mut self) {
        if self.copies_enqueued
            && let Err(e) = self.device.synchronize()
        {
            tracing::warn!("waiting for the kv host tier's copies before freeing it failed: {e}");
        }
    }
}

pub(super) fn attention_shape(p: &AttentionParams) -> AttentionShape {
    AttentionShape {
        n_heads: p.n_heads,
        n_kv_heads: p.n_kv_heads,
        head_dim: p.head_dim,
    }
}

/// A layer's attention inputs and output for `rows` tokens, in their slots.
struct AttentionIo<'a> {
    q: DevSlice<'a, f32>,
    k: DevSlice<'a, f32>,
    v: DevSlice<'a, f32>,
    out: DevSliceMut<'a, f32>,
}

fn attention_io<'a>(
    slots: &'a mut [DeviceBuffer; Slot::COUNT],
    p: &AttentionParams,
    rows: usize,
    kv_dim: usize,
) -> AttentionIo<'a> {
    let [q, k, v, out] = slots
        .get_disjoint_mut([
            Slot::Queries.index(),
            Slot::Keys.index(),
            Slot::Values.index(),
            Slot::AttentionOut.index(),
        ])
        .expect("distinct slots");
    let q_len = rows * p.n_heads * p.head_dim;
    AttentionIo {
        q: q.as_slice::<f32>().slice(0..q_len),
        k: k.as_slice::<f32>().slice(0..rows * kv_dim),
        v: v.as_slice::<f32>().slice(0..rows * kv_dim),
        out: out.as_mut_slice::<f32>().split_at_mut(q_len).0,
    }
}

/// A per-head norm as the rope kernels take it.
pub(super) fn rope_norm(n: Option<(&CudaVector, f32)>) -> Option<RopeNorm<'_>> {
    n.map(|(w, eps)| RopeNorm {
        weight: w.slice(),
        eps,
    })
}

impl CudaBackend {
    /// [`crate::Backend::attention`]: the keys and values stored into the sequence's blocks,
    /// then flash-decoding for a step or tiled attention for a prompt chunk.
    pub(super) fn store_and_attend(
        &mut self,
        kv: &mut CudaKvPool,
        p: AttentionParams,
        rows: usize,
    ) -> Result<()> {
        let kv_dim = kv.layout.kv_dim;
        let shape = attention_shape(&p);
        let AttentionIo { q, k, v, mut out } = attention_io(&mut self.slots, &p, rows, kv_dim);
        let pos0 = self.inputs.pos0();
        let end = self.inputs.end();
        let table = self.inputs.table();
        let dev = &self.device;
        macro_rules! run {
            ($t:ty) => {{
                let mut cache = kv.layer::<$t>(p.layer, table);
                cuda::kv_store(dev, k, v, &mut cache, kv_dim, pos0)?;
                let cache = cache.as_ref();
                if rows == 1 {
                    let mut scratch = self.attention_scratch.as_mut_slice::<f32>();
                    cuda::attention_decode(
                        dev,
                        q,
                        cache,
                        end,
                        shape,
                        p.scale,
                        self.attention_precision,
                        &mut scratch,
                        &mut out,
                    )?;
                } else {
                    // Prompts are never recorded: the host's position is the step's. Chunks
                    // short enough for the matrix-vector products keep f32 activations
                    // throughout, attention included; 16-bit operands only where the GEMMs
                    // already round the activations to bf16.
                    let precision = if rows > cuda::MAX_BATCH {
                        self.attention_precision
                    } else {
                        AttentionPrecision::F32
                    };
                    let mut scratch = self.prompt_attention_scratch.as_mut_slice::<f32>();
                    cuda::attention_prefill(
                        dev,
                        q,
                        cache,
                        p.pos0,
                        rows,
                        shape,
                        p.scale,
                        precision,
                        &mut scratch,
                        &mut out,
                    )?;
                }
            }};
        }
        match kv.dtype() {
            KvDtype::F32 => run!(f32),
            KvDtype::F16 => run!(f16),
            KvDtype::Bf16 => run!(bf16),
        }
        Ok(())
    }

    /// [`crate::Backend::rope_attention`]: a decode step rotates and stores its key inside
    /// the attention kernel; prompts, and head shapes that kernel cannot rotate, take the two
    /// ops.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_store_and_attend(
        &mut self,
        kv: &mut CudaKvPool,
        tables: &CudaRope,
        style: RopeStyle,
        p: AttentionParams,
        rows: usize,
        q_norm: Option<(&CudaVector, f32)>,
        k_norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        let layout = RopeLayout::from(style);
        if rows != 1 || !cuda::attention_decode_rope_fits(p.head_dim, layout) {
            crate::Backend::rope_qk(self, tables, style, &p, rows, q_norm, k_norm)?;
            return self.store_and_attend(kv, p, rows);
        }
        let kv_dim = kv.layout.kv_dim;
        let shape = attention_shape(&p);
        let AttentionIo { q, k, v, mut out } = attention_io(&mut self.slots, &p, rows, kv_dim);
        let rope = cuda::DecodeRope {
            k_new: k,
            v_new: v,
            q_norm: rope_norm(q_norm),
            k_norm: rope_norm(k_norm),
            cos: tables.cos.as_slice(),
            sin: tables.sin.as_slice(),
            layout,
        };
        let end: Position<'_> = self.inputs.end();
        let table = self.inputs.table();
        let mut scratch = self.attention_scratch.as_mut_slice::<f32>();
        macro_rules! run {
            ($t:ty) => {
                cuda::attention_decode_rope(
                    &self.device,
                    q,
                    rope,
                    &mut kv.layer::<$t>(p.layer, table),
                    end,
                    shape,
                    p.scale,
                    self.attention_precision,
                    &mut scratch,
                    &mut out,
                )?
            };
        }
        match kv.dtype() {
            KvDtype::F32 => run!(f32),
            KvDtype::F16 => run!(f16),
            KvDtype::Bf16 => run!(bf16),
        }
        Ok(())
    }
}
