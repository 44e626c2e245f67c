//! Keys and values of one sequence, preallocated for the whole context.

use ember_tensor::cpu::KvSlice;
use ember_tensor::{Buffer, BufferKind, BufferOwner};

use crate::backend::{KvFill, KvStore};
use crate::config::ModelConfig;
use crate::error::Result;

/// How cached keys and values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// Exact: what the golden tests against transformers need.
    F32,
    /// Half the memory and the decode reads; what llama.cpp keeps by default.
    F16,
    /// bf16 bits: half the memory and the decode reads, the model's own type for bf16
    /// checkpoints (what transformers and vLLM keep for them).
    Bf16,
}

impl KvDtype {
    /// The name `--kv-type` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }

    pub fn size_in_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
}

/// `[layer][position][kv_heads·head_dim]` keys and values, `capacity` positions per layer.
pub struct KvCache {
    keys: Buffer,
    values: Buffer,
    dtype: KvDtype,
    layers: usize,
    kv_dim: usize,
    fill: KvFill,
}

impl KvCache {
    pub fn new(
        config: &ModelConfig,
        capacity: usize,
        dtype: KvDtype,
        owner: &BufferOwner,
    ) -> Result<Self> {
        let kv_dim = config.kv_dim();
        let bytes = config.num_hidden_layers * capacity * kv_dim * dtype.size_in_bytes();
        Ok(KvCache {
            keys: owner.alloc(BufferKind::KvCache, "kv cache keys", bytes)?,
            values: owner.alloc(BufferKind::KvCache, "kv cache values", bytes)?,
            dtype,
            layers: config.num_hidden_layers,
            kv_dim,
            fill: KvFill::empty(capacity),
        })
    }

    /// Bytes one position takes across all layers, keys and values.
    pub fn bytes_per_position(config: &ModelConfig, dtype: KvDtype) -> usize {
        2 * config.num_hidden_layers * config.kv_dim() * dtype.size_in_bytes()
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    fn layer_range(&self, layer: usize) -> std::ops::Range<usize> {
        debug_assert!(layer < self.layers);
        let per_layer = self.capacity() * self.kv_dim;
        layer * per_layer..(layer + 1) * per_layer
    }

    /// One layer's keys and values, read-only.
    pub(crate) fn layer(&self, layer: usize) -> (KvSlice<'_>, KvSlice<'_>) {
        let r = self.layer_range(layer);
        match self.dtype {
            KvDtype::F32 => (
                KvSlice::F32(&self.keys.as_slice()[r.clone()]),
                KvSlice::F32(&self.values.as_slice()[r]),
            ),
            KvDtype::F16 => (
                KvSlice::F16(&self.keys.as_slice()[r.clone()]),
                KvSlice::F16(&self.values.as_slice()[r]),
            ),
            KvDtype::Bf16 => (
                KvSlice::Bf16(&self.keys.as_slice()[r.clone()]),
                KvSlice::Bf16(&self.values.as_slice()[r]),
            ),
        }
    }

    /// Stores the keys and values of positions `start..start + n` of one layer.
    pub(crate) fn write(&mut self, layer: usize, start: usize, keys: &[f32], values: &[f32]) {
        let r = self.layer_range(layer);
        let rows = r.start + start * self.kv_dim..r.start + start * self.kv_dim + keys.len();
        match self.dtype {
            KvDtype::F32 => {
                self.keys.as_mut_slice::<f32>()[rows.clone()].copy_from_slice(keys);
                self.values.as_mut_slice::<f32>()[rows].copy_from_slice(values);
            }
            // Both round to nearest even.
            KvDtype::F16 => self.write_bits(rows, keys, values, ember_tensor::dtype::f32_to_f16),
            KvDtype::Bf16 => self.write_bits(rows, keys, values, ember_tensor::dtype::f32_to_bf16),
        }
    }

    /// Stores f32 keys and values as 16-bit elements `convert` makes.
    fn write_bits(
        &mut self,
        rows: std::ops::Range<usize>,
        keys: &[f32],
        values: &[f32],
        convert: impl Fn(f32) -> u16,
    ) {
        let store = |dst: &mut [u16], src: &[f32]| {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = convert(s);
            }
        };
        store(&mut self.keys.as_mut_slice::<u16>()[rows.clone()], keys);
        store(&mut self.values.as_mut_slice::<u16>()[rows], values);
    }
}

impl KvStore for KvCache {
    fn fill(&self) -> &KvFill {
        &self.fill
    }

    fn fill_mut(&mut self) -> &mut KvFill {
        &mut self.fill
    }
}
