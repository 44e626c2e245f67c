//! A checkpoint seen as one rank's share of each tensor it splits.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use ember_checkpoint::{TensorRef, TensorSource};
use ember_tensor::{Buffer, BufferKind, BufferOwner, DType};

use super::{ExpertSplit, Shard};
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
/// of the products whose outputs the ranks add up; of a stack of matrices, each one's).
enum Cut {
    /// One run of rows: a view.
    Rows(Range<usize>),
    /// Several runs of a stack's rows (counting through its matrices), copied end to end:
    /// each expert's share of a stacked `[experts, rows, cols]` tensor, which becomes
    /// `[experts, share, cols]`.
    RowRuns(Vec<Range<usize>>),
    Cols(Range<usize>),
    /// Matrices `experts` of a stacked `[experts, rows, cols]` tensor, whole: a view.
    Stack(Range<usize>),
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
        let kv = shard.kv_part(c.num_key_value_heads, d)?;
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
            if let Some(moe) = c.moe.as_ref().filter(|_| c.is_sparse_layer(i)) {
                cuts.extend(match shard.experts {
                    ExpertSplit::Columns => {
                        expert_cuts(i, moe.num_experts, moe.moe_intermediate_size, shard)?
                    }
                    // A tensor per expert is read whole, for the experts held only.
                    ExpertSplit::Experts => stack_cuts(i, shard.held_experts(moe.num_experts)),
                });
            }
        }
        for (name, cut) in cuts {
            if !inner.contains(&name) {
                continue;
            }
            let t = inner.get(&name)?;
            let part = match cut {
                Cut::Rows(rows) => row_part(&t, rows)?,
                Cut::RowRuns(runs) => row_runs_part(&t, &runs, shard, owner)?,
                Cut::Cols(cols) => col_part(&t, cols, shard, owner)?,
                Cut::Stack(experts) => stack_part(&t, experts)?,
            };
            source.parts.insert(name, part);
        }
        Ok(source)
    }
}

/// Layer `layer`'s experts, each cut like a dense MLP (its share of the columns: gate and up
/// by rows, down by columns), in the three forms `load_moe` reads: a tensor per expert,
/// stacked with gate and up fused, and stacked apart (GGUF's names mapped).
fn expert_cuts(
    layer: usize,
    experts: usize,
    width: usize,
    shard: Shard,
) -> Result<Vec<(String, Cut)>> {
    let part = shard.even_part("expert MLP columns", width, 1)?;
    let name = |n: &str| format!("model.layers.{layer}.mlp.experts.{n}");
    let mut cuts = Vec::new();
    for e in 0..experts {
        for n in ["gate_proj", "up_proj"] {
            cuts.push((name(&format!("{e}.{n}.weight")), Cut::Rows(part.clone())));
        }
        cuts.push((
            name(&format!("{e}.down_proj.weight")),
            Cut::Cols(part.clone()),
        ));
    }
    let shifted = |base: usize| part.start + base..part.end + base;
    let fused = (0..experts)
        .flat_map(|e| [shifted(2 * e * width), shifted(2 * e * width + width)])
        .collect();
    cuts.push((name("gate_up_proj"), Cut::RowRuns(fused)));
    cuts.push((name("down_proj"), Cut::Cols(part.clone())));
    for n in ["gate_proj", "up_proj"] {
        let runs = (0..experts).map(|e| shifted(e * width)).collect();
        cuts.push((name(&format!("{n}.weight")), Cut::RowRuns(runs)));
    }
    cuts.push((name("down_proj.weight"), Cut::Cols(part)));
    Ok(cuts)
}

/// Layer `layer`'s stacked experts (fused or apart, GGUF's names mapped) cut to the
/// experts `held`, each whole.
fn stack_cuts(layer: usize, held: Range<usize>) -> Vec<(String, Cut)> {
    let name = |n: &str| format!("model.layers.{layer}.mlp.experts.{n}");
    ["gate_up_proj", "down_proj"]
        .map(name)
        .into_iter()
        .chain(["gate_proj", "up_proj", "down_proj"].map(|n| name(&format!("{n}.weight"))))
        .map(|n| (n, Cut::Stack(held.clone())))
        .collect()
}

/// Matrices `experts` of a stack: a view.
fn stack_part(t: &TensorRef<'_>, experts: Range<usize>) -> Result<Part> {
    let &[count, rows, cols] = t.shape else {
        return Err(shape_error(t, "a stack of matrices"));
    };
    if experts.end > count {
        return Err(shape_error(t, &format!("at least {} experts", experts.end)));
    }
    let matrix_bytes = rows * t.dtype.row_bytes(cols);
    Ok(Part {
        name: t.name.to_string(),
        dtype: t.dtype,
        shape: vec![experts.len(), rows, cols],
        buffer: Arc::clone(t.buffer),
        offset: t.offset + experts.start * matrix_bytes,
        len: experts.len() * matrix_bytes,
        path: t.path.to_path_buf(),
    })
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

/// Runs of a stack's rows (see [`Cut::RowRuns`]), copied end to end into a buffer of the
/// rank's: as many in each matrix of the stack.
fn row_runs_part(
    t: &TensorRef<'_>,
    runs: &[Range<usize>],
    shard: Shard,
    owner: &BufferOwner,
) -> Result<Part> {
    let &[count, rows, cols] = t.shape else {
        return Err(shape_error(t, "a stack of matrices"));
    };
    let kept: usize = runs.iter().map(Range::len).sum();
    if runs.iter().any(|r| r.end > count * rows) || !kept.is_multiple_of(count) {
        return Err(shape_error(t, &format!("row runs {runs:?}")));
    }
    let row_bytes = t.dtype.row_bytes(cols);
    let label = format!("{} (rank {} of {})", t.name, shard.rank, shard.ranks);
    let mut copy = owner.alloc(BufferKind::Repacked, label, kept * row_bytes)?;
    let mut at = 0;
    for run in runs {
        let bytes = &t.bytes[run.start * row_bytes..run.end * row_bytes];
        copy.bytes_mut()[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    }
    Ok(Part {
        name: t.name.to_string(),
        dtype: t.dtype,
        shape: vec![count, kept / count, cols],
        buffer: Arc::new(copy),
        offset: 0,
        len: at,
        path: t.path.to_path_buf(),
    })
}

/// Columns `cols` of a matrix (of each matrix of a stack): each row's run copied into a
/// buffer of the rank's.
fn col_part(
    t: &TensorRef<'_>,
    cols: Range<usize>,
    shard: Shard,
    owner: &BufferOwner,
) -> Result<Part> {
    let (lead, width) = match t.shape {
        [rows, width] => (vec![*rows], *width),
        [count, rows, width] => (vec![*count, *rows], *width),
        _ => return Err(shape_error(t, "a matrix or a stack of them")),
    };
    let rows: usize = lead.iter().product();
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
    let mut shape = lead;
    shape.push(cols.len());
    Ok(Part {
        name: t.name.to_string(),
        dtype: t.dtype,
        shape,
        buffer: Arc::new(copy),
        offset: 0,
        len: rows * keep,
        path: t.path.to_path_buf(),
    })
}

fn shape_error(t: &TensorRef<'_>, expected: &str) -> Error {
    Error::CannotSplit(format!(
        "{} of shape {:?} ({}) needs {expected}",
        t.name, t.shape, t.dtype
    ))
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::Path;

    use ember_checkpoint::CheckpointError;
    use ember_checkpoint::Result as CheckpointResult;

    use super::*;

    /// f32 tensors held in memory, each value its index in the tensor.
    struct Memory {
        tensors: HashMap<String, (Vec<usize>, Arc<Buffer>)>,
    }

    impl Memory {
        fn new(owner: &BufferOwner, shapes: &[(&str, &[usize])]) -> Memory {
            let tensors = shapes
                .iter()
                .map(|&(name, shape)| {
                    let len: usize = shape.iter().product();
                    let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
                    let bytes = bytemuck::cast_slice(&values);
                    let buffer = owner.alloc_copy(BufferKind::Scratch, name, bytes).unwrap();
                    (name.to_string(), (shape.to_vec(), Arc::new(buffer)))
                })
                .collect();
            Memory { tensors }
        }
    }

    impl TensorSource for Memory {
        fn get(&self, name: &str) -> CheckpointResult<TensorRef<'_>> {
            let (key, (shape, buffer)) =
                self.tensors
                    .get_key_value(name)
                    .ok_or_else(|| CheckpointError::MissingTensor {
                        path: "memory".into(),
                        name: name.into(),
                    })?;
            Ok(TensorRef {
                name: key,
                dtype: DType::F32,
                shape,
                bytes: buffer.bytes(),
                path: Path::new("memory"),
                buffer,
                offset: 0,
            })
        }

        fn contains(&self, name: &str) -> bool {
            self.tensors.contains_key(name)
        }
    }

    /// A quantized matrix cut by columns keeps each row's whole blocks of those columns; a
    /// cut inside a block is refused.
    #[test]
    fn quantized_columns_are_cut_on_whole_blocks() {
        let owner = BufferOwner::new();
        let (rows, cols) = (3, 96);
        let row_bytes = DType::Q8_0.row_bytes(cols);
        let bytes: Vec<u8> = (0..rows * row_bytes).map(|i| i as u8).collect();
        let buffer = Arc::new(owner.alloc_copy(BufferKind::Scratch, "o", &bytes).unwrap());
        let shape = [rows, cols];
        let t = TensorRef {
            name: "o",
            dtype: DType::Q8_0,
            shape: &shape,
            bytes: buffer.bytes(),
            path: Path::new("memory"),
            buffer: &buffer,
            offset: 0,
        };
        let shard = Shard::new(1, 3).unwrap();
        let part = col_part(&t, 32..64, shard, &owner).unwrap();
        assert_eq!(part.shape, [rows, 32]);
        let block = DType::Q8_0.row_bytes(32);
        let want: Vec<u8> = (0..rows)
            .flat_map(|r| bytes[r * row_bytes + block..r * row_bytes + 2 * block].to_vec())
            .collect();
        assert_eq!(&part.buffer.bytes()[..part.len], &want[..]);
        let err = col_part(&t, 16..48, shard, &owner).err().unwrap();
        assert!(err.to_string().contains("whole 32-value blocks"), "{err}");
    }

    fn values(source: &dyn TensorSource, name: &str) -> (Vec<usize>, Vec<f32>) {
        let t = source.get(name).unwrap();
        (t.shape.to_vec(), bytemuck::cast_slice(t.bytes).to_vec())
    }

    /// `memory` with `cuts` made as [`ShardSource::new`] makes them.
    fn cut_source<'a>(
        memory: &'a Memory,
        cuts: Vec<(String, Cut)>,
        shard: Shard,
        owner: &BufferOwner,
    ) -> ShardSource<'a> {
        let mut source = ShardSource {
            inner: memory,
            parts: HashMap::new(),
        };
        for (name, cut) in cuts {
            if memory.contains(&name) {
                let t = memory.get(&name).unwrap();
                let part = match cut {
                    Cut::Rows(rows) => row_part(&t, rows).unwrap(),
                    Cut::RowRuns(runs) => row_runs_part(&t, &runs, shard, owner).unwrap(),
                    Cut::Cols(cols) => col_part(&t, cols, shard, owner).unwrap(),
                    Cut::Stack(experts) => stack_part(&t, experts).unwrap(),
                };
                source.parts.insert(name, part);
            }
        }
        source
    }

    /// Split by experts, a stack (fused or apart) gives a rank its experts whole, as a view.
    #[test]
    fn stacked_experts_split_by_experts_give_each_rank_its_experts_whole() {
        let owner = BufferOwner::new();
        let (e, i, h) = (5, 4, 3);
        let gate_up = "model.layers.0.mlp.experts.gate_up_proj";
        let gate = "model.layers.0.mlp.experts.gate_proj.weight";
        let memory = Memory::new(&owner, &[(gate_up, &[e, 2 * i, h]), (gate, &[e, i, h])]);
        // Rank 1 of 2 holds experts 2..5 (five go 2 and 3).
        let shard = Shard::new(1, 2).unwrap().with_experts(ExpertSplit::Experts);
        assert_eq!(shard.held_experts(e), 2..5);
        let source = cut_source(&memory, stack_cuts(0, shard.held_experts(e)), shard, &owner);
        for (name, rows) in [(gate_up, 2 * i), (gate, i)] {
            let (shape, got) = values(&source, name);
            assert_eq!(shape, [3, rows, h], "{name}");
            let first = 2 * rows * h;
            let want: Vec<f32> = (first..first + 3 * rows * h).map(|v| v as f32).collect();
            assert_eq!(got, want, "{name}");
            // A view of the mapping, not a copy.
            assert!(source.parts[name].len < memory.get(name).unwrap().bytes.len());
        }
    }

    /// Stacked experts (gate and up fused, `[E, 2I, H]`; down `[E, H, I]`) give each rank
    /// every expert's share: its rows of gate and of up, its columns of down.
    #[test]
    fn stacked_experts_give_each_rank_every_experts_share() {
        let owner = BufferOwner::new();
        let (e, i, h) = (2, 4, 3);
        let gate_up = "model.layers.0.mlp.experts.gate_up_proj";
        let down = "model.layers.0.mlp.experts.down_proj";
        let memory = Memory::new(&owner, &[(gate_up, &[e, 2 * i, h]), (down, &[e, h, i])]);
        let shard = Shard::new(1, 2).unwrap();
        let cuts = expert_cuts(0, e, i, shard).unwrap();
        let source = cut_source(&memory, cuts, shard, &owner);
        // Rank 1 of 2: rows 2..4 of gate and of up (rows 2, 3 and 6, 7 of each expert's 8).
        let (shape, got) = values(&source, gate_up);
        assert_eq!(shape, [e, i, h]);
        let rows = [2, 3, 6, 7, 10, 11, 14, 15];
        let want: Vec<f32> = rows
            .iter()
            .flat_map(|r| (0..h).map(move |c| (r * h + c) as f32))
            .collect();
        assert_eq!(got, want);
        // Columns 2..4 of each of down's rows.
        let (shape, got) = values(&source, down);
        assert_eq!(shape, [e, h, i / 2]);
        let want: Vec<f32> = (0..e * h)
            .flat_map(|r| [(r * i + 2) as f32, (r * i + 3) as f32])
            .collect();
        assert_eq!(got, want);
    }
}
