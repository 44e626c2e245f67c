//! A checkpoint seen as one rank's share of each tensor it splits.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use ember_checkpoint::{TensorRef, TensorSource};
use ember_tensor::{Buffer, BufferKind, BufferOwner, DType};

use super::Shard;
use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// One rank's share of a tensor: a run of its rows (a view into the checkpoint's mapping), or
/// of its columns (a copy the rank's buffer owner lists).
struct Part {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    buffer: Arc<Buffer>,
    offset: usize,
    len: usize,
    path: PathBuf,
}

/// How a tensor is cut: rows (outputs: heads, MLP columns, vocabulary) or columns (inputs
/// of the products whose outputs the ranks add up).
enum Cut {
    Rows(Range<usize>),
    Cols(Range<usize>),
}

/// `inner` as `shard` holds it: every tensor the split cuts (q/k/v by heads, gate/up by
/// rows, o and down by columns, the embedding and head by vocabulary) is its share, under its
/// own name and with its share's shape; every other tensor (norms, biases added once) is
/// `inner`'s. The shares are worked out at construction, columns copied then.
pub struct ShardSource<'a> {
    inner: &'a dyn TensorSource,
    parts: HashMap<String, Part>,
}

impl<'a> ShardSource<'a> {
    /// `config` is the whole model's.
    pub fn new(
        inner: &'a dyn TensorSource,
        config: &ModelConfig,
        shard: Shard,
        owner: &BufferOwner,
    ) -> Result<ShardSource<'a>> {
        let mut source = ShardSource {
            inner,
            parts: HashMap::new(),
        };
        if shard.is_whole() {
            return Ok(source);
        }
        let c = config;
        let d = c.head_dim;
        let q = shard.even_part("attention heads", c.num_attention_heads, d)?;
        let kv = shard.even_part("key-value heads", c.num_key_value_heads, d)?;
        let width = shard.even_part("MLP columns", c.intermediate_size, 1)?;
        let vocab = shard.part(c.vocab_size);
        let mut cuts = vec![
            (
                "model.embed_tokens.weight".to_string(),
                Cut::Rows(vocab.clone()),
            ),
            ("lm_head.weight".to_string(), Cut::Rows(vocab)),
        ];
        for i in 0..c.num_hidden_layers {
            let attn = |name: &str| format!("model.layers.{i}.self_attn.{name}");
            let mlp = |name: &str| format!("model.layers.{i}.mlp.{name}");
            for (name, rows) in [("q_proj", &q), ("k_proj", &kv), ("v_proj", &kv)] {
                cuts.push((attn(&format!("{name}.weight")), Cut::Rows(rows.clone())));
                cuts.push((attn(&format!("{name}.bias")), Cut::Rows(rows.clone())));
            }
            cuts.push((attn("o_proj.weight"), Cut::Cols(q.clone())));
            for name in ["gate_proj", "up_proj"] {
                cuts.push((mlp(&format!("{name}.weight")), Cut::Rows(width.clone())));
                cuts.push((mlp(&format!("{name}.bias")), Cut::Rows(width.clone())));
            }
            cuts.push((mlp("down_proj.weight"), Cut::Cols(width.clone())));
        }
        for (name, cut) in cuts {
            if !inner.contains(&name) {
                continue;
            }
            let t = inner.get(&name)?;
            let part = match cut {
                Cut::Rows(rows) => row_part(&t, rows)?,
                Cut::Cols(cols) => col_part(&t, cols, shard, owner)?,
            };
            source.parts.insert(name, part);
        }
        Ok(source)
    }
}

/// Rows `rows` of a matrix, or elements `rows` of a vector: a view.
fn row_part(t: &TensorRef<'_>, rows: Range<usize>) -> Result<Part> {
    let (first, cols) = match t.shape {
        [len] => (*len, 1),
        [first, cols] => (*first, *cols),
        _ => return Err(shape_error(t, "a matrix or a vector")),
    };
    if rows.end > first {
        return Err(shape_error(t, &format!("at least {} rows", rows.end)));
    }
    // A vector's elements are a matrix's rows of one: whole blocks only.
    let unit = if cols == 1 { t.dtype.block_size() } else { 1 };
    if !rows.start.is_multiple_of(unit) || !rows.len().is_multiple_of(unit) {
        return Err(shape_error(
            t,
            &format!("a cut on whole {unit}-value blocks"),
        ));
    }
    let stride = if cols == 1 { 1 } else { cols };
    let row_bytes = |n: usize| t.dtype.row_bytes(n * stride);
    let mut shape = t.shape.to_vec();
    shape[0] = rows.len();
    Ok(Part {
        name: t.name.to_string(),
        dtype: t.dtype,
        shape,
        buffer: Arc::clone(t.buffer),
        offset: t.offset + row_bytes(rows.start),
        len: row_bytes(rows.len()),
        path: t.path.to_path_buf(),
    })
}

/// Columns `cols` of a matrix: each row's run copied into a buffer of the rank's.
fn col_part(
    t: &TensorRef<'_>,
    cols: Range<usize>,
    shard: Shard,
    owner: &BufferOwner,
) -> Result<Part> {
    let [rows, width] = *t.shape else {
        return Err(shape_error(t, "a matrix"));
    };
    let block = t.dtype.block_size();
    if cols.end > width || !cols.start.is_multiple_of(block) || !cols.len().is_multiple_of(block) {
        return Err(shape_error(
            t,
            &format!("columns {cols:?} on whole {block}-value blocks"),
        ));
    }
    let (row_bytes, skip, keep) = (
        t.dtype.row_bytes(width),
        t.dtype.row_bytes(cols.start),
        t.dtype.row_bytes(cols.len()),
    );
    let label = format!("{} (rank {} of {})", t.name, shard.rank, shard.ranks);
    let mut copy = owner.alloc(BufferKind::Repacked, label, rows * keep)?;
    for (r, out) in copy.bytes_mut().chunks_exact_mut(keep).enumerate() {
        let at = r * row_bytes + skip;
        out.copy_from_slice(&t.bytes[at..at + keep]);
    }
    Ok(Part {
        name: t.name.to_string(),
        dtype: t.dtype,
        shape: vec![rows, cols.len()],
        buffer: Arc::new(copy),
        offset: 0,
        len: rows * keep,
        path: t.path.to_path_buf(),
    })
}

fn shape_error(t: &TensorRef<'_>, expected: &str) -> Error {
    Error::Unsupported {
        what: format!(
            "splitting {} of shape {:?} ({}) across ranks: it needs {expected}",
            t.name, t.shape, t.dtype
        ),
        backend: "any",
    }
}

impl TensorSource for ShardSource<'_> {
    fn get(&self, name: &str) -> ember_checkpoint::Result<TensorRef<'_>> {
        let Some(p) = self.parts.get(name) else {
            return self.inner.get(name);
        };
        Ok(TensorRef {
            name: &p.name,
            dtype: p.dtype,
            shape: &p.shape,
            bytes: &p.buffer.bytes()[p.offset..p.offset + p.len],
            path: &p.path,
            buffer: &p.buffer,
            offset: p.offset,
        })
    }

    fn contains(&self, name: &str) -> bool {
        self.parts.contains_key(name) || self.inner.contains(name)
    }
}
