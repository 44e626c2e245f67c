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

/// A layer's attention inputs and output for the tokens in `rows`, in their slots.
struct AttentionIo<'a> {
    q: DevSlice<'a, f32>,
    k: DevSlice<'a, f32>,
    v: DevSlice<'a, f32>,
    out: DevSliceMut<'a, f32>,
}

fn attention_io<'a>(
    slots: &'a mut [DeviceBuffer; Slot::COUNT],
    p: &AttentionParams,
    rows: Range<usize>,
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
    let q_dim = p.n_heads * p.head_dim;
    let (q_rows, kv_rows) = (
        rows.start * q_dim..rows.end * q_dim,
        rows.start * kv_dim..rows.end * kv_dim,
    );
    let out = out.as_mut_slice::<f32>().split_at_mut(q_rows.end).0;
    AttentionIo {
        q: q.as_slice::<f32>().slice(q_rows.clone()),
        k: k.as_slice::<f32>().slice(kv_rows.clone()),
        v: v.as_slice::<f32>().slice(kv_rows),
        out: out.split_at_mut(q_rows.start).1,
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
    /// [`crate::Backend::attention`] of a pass of one sequence, or of a prompt chunk in a
    /// pass of several: the keys and values stored into the sequence's blocks, then
    /// flash-decoding for a step, and for a prompt chunk tiled attention or each row as a
    /// decode row ([`PromptAttention`]).
    pub(super) fn store_and_attend(
        &mut self,
        kv: &mut CudaKvPool,
        p: AttentionParams,
    ) -> Result<()> {
        if p.rows > 1 && self.prompt_attention == PromptAttention::AsDecodeRows {
            self.store_segment(kv, &p)?;
            // The rows the tiled kernel with decode's arithmetic takes go there; the rest (past
            // the contexts it takes, or where decode is not on the tensor cores) each as a
            // decode row, as many a launch as the decode scratch has room for.
            let tiled = self.attend_prompt_rows(kv, &p)?;
            let rows = p.row_range();
            let rows = rows.start + tiled..rows.end;
            for start in rows.clone().step_by(self.decode_scratch_rows) {
                let span = start..rows.end.min(start + self.decode_scratch_rows);
                self.attend_decode_rows(kv, &p, DecodeRowsOf::Span(span), None)?;
            }
            return Ok(());
        }
        let kv_dim = kv.layout.kv_dim;
        let shape = attention_shape(&p);
        let (pos0, table) = self.inputs.segment(p.first_row, p.segment);
        let end = self.inputs.end();
        // Prompt rows take 16-bit operands only where the pass's products already round the
        // activations to bf16 (the GEMMs); a pass short enough for the matrix-vector products
        // keeps f32 throughout.
        let precision = if self.inputs.rows() > cuda::MAX_BATCH {
            self.attention_precision
        } else {
            AttentionPrecision::F32
        };
        let AttentionIo { q, k, v, mut out } =
            attention_io(&mut self.slots, &p, p.row_range(), kv_dim);
        let dev = &self.device;
        macro_rules! run {
            ($t:ty) => {{
                let mut cache = kv.layer::<$t>(p.layer, table);
                cuda::kv_store(dev, k, v, &mut cache, kv_dim, pos0)?;
                let cache = cache.as_ref();
                if p.rows == 1 {
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
                    // Prompts are never recorded: the host's position is the pass's.
                    let mut scratch = self.prompt_attention_scratch.as_mut_slice::<f32>();
                    cuda::attention_prefill(
                        dev,
                        q,
                        cache,
                        p.pos0,
                        p.rows,
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

    /// Attends the first rows of prompt segment `p` (its keys and values stored) with the bits
    /// each gets as a decode row, tiled ([`cuda::attention_prompt_rows`]): those whose
    /// contexts that kernel takes. Returns how many.
    fn attend_prompt_rows(&mut self, kv: &mut CudaKvPool, p: &AttentionParams) -> Result<usize> {
        let kv_dim = kv.layout.kv_dim;
        let shape = attention_shape(p);
        let (_, table) = self.inputs.segment(p.first_row, p.segment);
        let (dev, precision) = (&self.device, self.attention_precision);
        macro_rules! run {
            ($t:ty) => {{
                let cache = kv.layer::<$t>(p.layer, table);
                let cache = cache.as_ref();
                let most = cuda::attention_prompt_rows_max_context(dev, &cache, shape, precision);
                let n = most.saturating_sub(p.pos0).min(p.rows);
                if n > 0 {
                    let first = p.row_range().start;
                    let AttentionIo { q, mut out, .. } =
                        attention_io(&mut self.slots, p, first..first + n, kv_dim);
                    let mut scratch = self.prompt_attention_scratch.as_mut_slice::<f32>();
                    cuda::attention_prompt_rows(
                        dev,
                        q,
                        cache,
                        p.pos0,
                        n,
                        shape,
                        p.scale,
                        &mut scratch,
                        &mut out,
                    )?;
                }
                n
            }};
        }
        Ok(match kv.dtype() {
            KvDtype::F32 => run!(f32),
            KvDtype::F16 => run!(f16),
            KvDtype::Bf16 => run!(bf16),
        })
    }

    /// Stores segment `p`'s keys and values into its blocks.
    fn store_segment(&mut self, kv: &mut CudaKvPool, p: &AttentionParams) -> Result<()> {
        let kv_dim = kv.layout.kv_dim;
        let (pos0, table) = self.inputs.segment(p.first_row, p.segment);
        let AttentionIo { k, v, .. } = attention_io(&mut self.slots, p, p.row_range(), kv_dim);
        macro_rules! run {
            ($t:ty) => {
                cuda::kv_store(
                    &self.device,
                    k,
                    v,
                    &mut kv.layer::<$t>(p.layer, table),
                    kv_dim,
                    pos0,
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

    /// [`crate::Backend::rope_attention`] of a pass of one sequence, or of a prompt chunk in
    /// a pass of several: a decode step rotates and stores its key inside the attention
    /// kernel; prompts, and head shapes that kernel cannot rotate, take the two ops.
    fn rope_store_and_attend(
        &mut self,
        kv: &mut CudaKvPool,
        tables: &CudaRope,
        style: RopeStyle,
        p: AttentionParams,
        q_norm: Option<(&CudaVector, f32)>,
        k_norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        let layout = RopeLayout::from(style);
        if p.rows != 1 || !cuda::attention_decode_rope_fits(p.head_dim, layout) {
            crate::Backend::rope_qk(self, tables, style, &p, q_norm, k_norm)?;
            return self.store_and_attend(kv, p);
        }
        let kv_dim = kv.layout.kv_dim;
        let shape = attention_shape(&p);
        let AttentionIo { q, k, v, mut out } = attention_io(&mut self.slots, &p, 0..1, kv_dim);
        let rope = decode_rope(k, v, (tables, style, q_norm, k_norm));
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

    /// [`crate::Backend::attention`]: in a pass of several sequences, a decode row is stored
    /// and attends on its own (the batched kernel over one row).
    pub(super) fn attention_of_segment(
        &mut self,
        kv: &mut CudaKvPool,
        p: AttentionParams,
    ) -> Result<()> {
        if !(self.inputs.is_batch() && p.rows == 1) {
            return self.store_and_attend(kv, p);
        }
        self.store_segment(kv, &p)?;
        self.attend_decode_rows(kv, &p, DecodeRowsOf::Span(p.row_range()), None)
    }

    /// [`crate::Backend::rope_attention_segments`]: in a pass of several sequences, each
    /// prompt chunk on its own, then every decode row in one launch, each over its own
    /// blocks ([`Self::attend_decode_rows`]); a pass of one sequence as it comes.
    pub(super) fn rope_attention_of_segments(
        &mut self,
        kv: &mut CudaKvPool,
        tables: &CudaRope,
        style: RopeStyle,
        segments: &[AttentionParams],
        q_norm: Option<(&CudaVector, f32)>,
        k_norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        // One sequence, or no decode rows to gather: each segment as it comes.
        let decode_row = segments.iter().find(|p| p.rows == 1);
        let Some(&first) = decode_row.filter(|_| self.inputs.is_batch()) else {
            for &p in segments {
                self.rope_store_and_attend(kv, tables, style, p, q_norm, k_norm)?;
            }
            return Ok(());
        };
        // The decode kernel rotates and stores its rows itself where it can.
        let fused = cuda::attention_decode_rope_fits(first.head_dim, RopeLayout::from(style));
        let mut decode_rows = 0;
        for &p in segments {
            if p.rows != 1 {
                self.rope_store_and_attend(kv, tables, style, p, q_norm, k_norm)?;
                continue;
            }
            decode_rows += 1;
            if !fused {
                crate::Backend::rope_qk(self, tables, style, &p, q_norm, k_norm)?;
                self.store_segment(kv, &p)?;
            }
        }
        let rope = fused.then_some((tables, style, q_norm, k_norm));
        if decode_rows == self.inputs.decode_row_count() {
            return self.attend_decode_rows(kv, &first, DecodeRowsOf::All, rope);
        }
        // Some of the pass's segments only: each of their rows on its own.
        for p in segments.iter().filter(|p| p.rows == 1) {
            self.attend_decode_rows(kv, p, DecodeRowsOf::Span(p.row_range()), rope)?;
        }
        Ok(())
    }

    /// The attention of decode rows of a pass (`which`), in one launch: with `rope`,
    /// rotating each row's queries and key and storing its key and value as it goes (else
    /// that was done). `p`: any of the rows' segments (the layer and the shape). Each row's
    /// bits are those of its sequence's decode step alone.
    fn attend_decode_rows(
        &mut self,
        kv: &mut CudaKvPool,
        p: &AttentionParams,
        which: DecodeRowsOf,
        rope: Option<DecodeRopeInputs<'_>>,
    ) -> Result<()> {
        let kv_dim = kv.layout.kv_dim;
        let shape = attention_shape(p);
        let rows = self.inputs.rows();
        let AttentionIo { q, k, v, mut out } = attention_io(&mut self.slots, p, 0..rows, kv_dim);
        let decode = match which {
            DecodeRowsOf::All => self.inputs.decode_rows(),
            DecodeRowsOf::Span(rows) => self.inputs.row_span(rows),
        };
        let tables = self.inputs.tables();
        let mut scratch = self.attention_scratch.as_mut_slice::<f32>();
        let (dev, precision) = (&self.device, self.attention_precision);
        macro_rules! run {
            ($t:ty) => {{
                let mut cache = kv.layer::<$t>(p.layer, tables);
                match rope {
                    Some(inputs) => cuda::attention_decode_rope(
                        dev,
                        q,
                        decode_rope(k, v, inputs),
                        &mut cache,
                        decode,
                        shape,
                        p.scale,
                        precision,
                        &mut scratch,
                        &mut out,
                    )?,
                    None => cuda::attention_decode(
                        dev,
                        q,
                        cache.as_ref(),
                        decode,
                        shape,
                        p.scale,
                        precision,
                        &mut scratch,
                        &mut out,
                    )?,
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
}

/// How the rows of a prompt chunk attend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PromptAttention {
    /// Tiled over many query rows at once, each key read once for the tile: fast, but a row's
    /// bits follow the chunk it is in (the tile's precision, a one-row chunk on the decode
    /// kernel).
    Tiled,
    /// Each row with the decode kernel's arithmetic over its own positions, so a prompt row
    /// gets the bits of the same position decoded alone, however the prompt was split and
    /// whatever shares the pass (`--batch-invariant`): tiled on the tensor cores where the
    /// decode kernel runs there and its chunks are 128 keys
    /// ([`cuda::attention_prompt_rows`]), else each row through the decode kernel itself
    /// (every row reading its whole prefix).
    AsDecodeRows,
}

/// Which decode rows of a pass a launch takes.
#[derive(Clone)]
enum DecodeRowsOf {
    /// Every sequence's that decodes one token.
    All,
    /// These rows (one decode row, or a prompt chunk's rows each as a decode row).
    Span(Range<usize>),
}

/// What the decode kernel needs to rotate its rows itself: the tables, their layout, and
/// Qwen3's q and k norms.
type DecodeRopeInputs<'a> = (
    &'a CudaRope,
    RopeStyle,
    Option<(&'a CudaVector, f32)>,
    Option<(&'a CudaVector, f32)>,
);

/// The step's keys and values as projected, with what rotates them.
fn decode_rope<'a>(
    k_new: DevSlice<'a, f32>,
    v_new: DevSlice<'a, f32>,
    (tables, style, q_norm, k_norm): DecodeRopeInputs<'a>,
) -> cuda::DecodeRope<'a> {
    cuda::DecodeRope {
        k_new,
        v_new,
        q_norm: rope_norm(q_norm),
        k_norm: rope_norm(k_norm),
        cos: tables.cos.as_slice(),
        sin: tables.sin.as_slice(),
        layout: RopeLayout::from(style),
    }
}
