//! Keys and values of one sequence, preallocated for the whole context.

use ember_tensor::{Buffer, BufferKind, BufferOwner};

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// `[layer][position][kv_heads·head_dim]` keys and values, f32, `capacity` positions per layer.
pub struct KvCache {
    keys: Buffer,
    values: Buffer,
    layers: usize,
    kv_dim: usize,
    capacity: usize,
    len: usize,
}

impl KvCache {
    pub fn new(config: &ModelConfig, capacity: usize, owner: &BufferOwner) -> Result<Self> {
        let kv_dim = config.kv_dim();
        let bytes = config.num_hidden_layers * capacity * kv_dim * 4;
        Ok(KvCache {
            keys: owner.alloc(BufferKind::KvCache, "kv cache keys", bytes)?,
            values: owner.alloc(BufferKind::KvCache, "kv cache values", bytes)?,
            layers: config.num_hidden_layers,
            kv_dim,
            capacity,
            len: 0,
        })
    }

    /// Bytes one position takes across all layers, keys and values.
    pub fn bytes_per_position(config: &ModelConfig) -> usize {
        2 * config.num_hidden_layers * config.kv_dim() * 4
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets positions from `len` on (a new prompt reuses the cache from the start).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        if self.len + n > self.capacity {
            return Err(Error::ContextFull {
                used: self.len,
                requested: n,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    fn layer_range(&self, layer: usize) -> std::ops::Range<usize> {
        debug_assert!(layer < self.layers);
        let per_layer = self.capacity * self.kv_dim;
        layer * per_layer..(layer + 1) * per_layer
    }

    /// One layer's keys and values, read-only.
    pub(crate) fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let r = self.layer_range(layer);
        (
            &self.keys.as_slice::<f32>()[r.clone()],
            &self.values.as_slice::<f32>()[r],
        )
    }

    /// Rows `start..start + n` of one layer's keys and values, for writing.
    pub(crate) fn rows_mut(
        &mut self,
        layer: usize,
        start: usize,
        n: usize,
    ) -> (&mut [f32], &mut [f32]) {
        let r = self.layer_range(layer);
        let rows = r.start + start * self.kv_dim..r.start + (start + n) * self.kv_dim;
        (
            &mut self.keys.as_mut_slice::<f32>()[rows.clone()],
            &mut self.values.as_mut_slice::<f32>()[rows],
        )
    }
}
