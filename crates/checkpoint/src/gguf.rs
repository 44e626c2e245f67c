//! GGUF files (versions 2 and 3): metadata and tensors, memory-mapped and read in place.
//!
//! A GGUF file is a header of typed key/value metadata (hyperparameters, the tokenizer, the
//! chat template), a table of tensor descriptions, and the tensor data, aligned. Tensors are
//! looked up by their Hugging Face names through [`hf_to_gguf_name`], so the model code reads
//! GGUF and safetensors checkpoints alike.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_tensor::{Buffer, BufferKind, BufferOwner, DType};

use crate::error::{CheckpointError, Result};
use crate::safetensors_set::TensorRef;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
struct TensorInfo {
    /// Rows-major shape (the reverse of ggml's `ne`, innermost dimension last).
    shape: Vec<usize>,
    ggml_type: u32,
    start: usize,
    end: usize,
}

/// A mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    buffer: Arc<Buffer>,
    pub version: u32,
    metadata: HashMap<String, Value>,
    tensors: HashMap<String, TensorInfo>,
}

impl GgufFile {
    pub fn open(path: &Path, owner: &BufferOwner) -> Result<Self> {
        if !path.exists() {
            return Err(CheckpointError::Io {
                path: path.into(),
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        let buffer = owner.map_file(BufferKind::Weights, path)?;
        let invalid = |message: String| CheckpointError::Gguf {
            path: path.into(),
            message,
        };
        let mut reader = Reader {
            bytes: buffer.bytes(),
            pos: 0,
        };
        if reader.take(4).map_err(&invalid)? != MAGIC {
            return Err(invalid(
                "not a GGUF file (the magic bytes are not `GGUF`)".into(),
            ));
        }
        let version = reader.u32().map_err(&invalid)?;
        if !(2..=3).contains(&version) {
            return Err(invalid(format!(
                "GGUF version {version} is not supported (ember reads versions 2 and 3)"
            )));
        }
        let tensor_count = reader.u64().map_err(&invalid)?;
        let kv_count = reader.u64().map_err(&invalid)?;
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = reader.string().map_err(&invalid)?;
            let kind = reader.u32().map_err(&invalid)?;
            let value = reader
                .value(kind, 0)
                .map_err(|e| invalid(format!("metadata `{key}`: {e}")))?;
            metadata.insert(key, value);
        }
        let mut infos = Vec::new();
        for _ in 0..tensor_count {
            let name = reader.string().map_err(&invalid)?;
            let n_dims = reader.u32().map_err(&invalid)? as usize;
            if n_dims > 4 {
                return Err(invalid(format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let mut ne = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                ne.push(reader.u64().map_err(&invalid)? as usize);
            }
            let ggml_type = reader.u32().map_err(&invalid)?;
            let offset = reader.u64().map_err(&invalid)?;
            ne.reverse();
            infos.push((name, ne, ggml_type, offset));
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(DEFAULT_ALIGNMENT)
            .max(1);
        let data_start = (reader.pos as u64).div_ceil(alignment) * alignment;
        let file_len = buffer.len() as u64;
        let mut tensors = HashMap::new();
        for (name, shape, ggml_type, offset) in infos {
            let bytes = tensor_bytes(&shape, ggml_type);
            let start = data_start
                .checked_add(offset)
                .ok_or_else(|| invalid(format!("tensor `{name}`: offset overflows")))?;
            let end = start + bytes.unwrap_or(0) as u64;
            if end > file_len {
                return Err(invalid(format!(
                    "tensor `{name}` ends at byte {end}, past the end of the file ({file_len} bytes): the file is truncated"
                )));
            }
            tensors.insert(
                name,
                TensorInfo {
                    shape,
                    ggml_type,
                    start: start as usize,
                    end: end as usize,
                },
            );
        }
        Ok(GgufFile {
            path: path.into(),
            buffer: Arc::new(buffer),
            version,
            metadata,
            tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn metadata_keys(&self) -> impl Iterator<Item = &str> {
        self.metadata.keys().map(String::as_str)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata("general.architecture")
            .and_then(Value::as_str)
    }

    pub fn contains_gguf(&self, gguf_name: &str) -> bool {
        self.tensors.contains_key(gguf_name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor by its GGUF name, checking that ember computes with its type.
    pub fn get_gguf(&self, gguf_name: &str, reported_name: &str) -> Result<TensorRef<'_>> {
        let Some((stored_name, info)) = self.tensors.get_key_value(gguf_name) else {
            return Err(CheckpointError::MissingTensor {
                path: self.path.clone(),
                name: format!("{gguf_name} ({reported_name})"),
            });
        };
        let dtype =
            DType::from_ggml_type(info.ggml_type).ok_or_else(|| CheckpointError::TensorDtype {
                path: self.path.clone(),
                name: gguf_name.into(),
                found: ember_tensor::dtype::ggml_type_name(info.ggml_type),
            })?;
        Ok(TensorRef {
            name: stored_name,
            dtype,
            shape: &info.shape,
            bytes: &self.buffer.bytes()[info.start..info.end],
            path: &self.path,
            buffer: &self.buffer,
            offset: info.start,
        })
    }

    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.buffer
    }
}

/// Stored bytes of a tensor of this shape and ggml type, when the type is one ember knows.
fn tensor_bytes(shape: &[usize], ggml_type: u32) -> Option<usize> {
    let dtype = DType::from_ggml_type(ggml_type)?;
    let cols = *shape.last().unwrap_or(&1);
    let rows: usize = shape[..shape.len().saturating_sub(1)].iter().product();
    Some(rows * dtype.row_bytes(cols))
}

/// The GGUF name of a Hugging Face tensor name (`model.layers.3.self_attn.q_proj.weight` →
/// `blk.3.attn_q.weight`), for the tensors the supported architectures use.
pub fn hf_to_gguf_name(name: &str) -> Option<String> {
    match name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (stem, suffix) = rest.rsplit_once('.')?;
    let gguf_stem = match stem {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" => "ffn_gate_inp",
        // Stacked experts, `[experts, rows, cols]`.
        "mlp.experts.gate_proj" => "ffn_gate_exps",
        "mlp.experts.up_proj" => "ffn_up_exps",
        "mlp.experts.down_proj" => "ffn_down_exps",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf_stem}.{suffix}"))
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            format!("the header ends early (reading {n} bytes at offset {}): the file is truncated or not GGUF", self.pos)
        })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let len = self.u64()? as usize;
        let bytes = self.take(len)?;
        // Some converters wrote token pieces that are not valid UTF-8; keep them readable.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, kind: u32, depth: usize) -> std::result::Result<Value, String> {
        Ok(match kind {
            0 => Value::U64(self.take(1)?[0] as u64),
            1 => Value::I64(self.take(1)?[0] as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as u64),
            3 => Value::I64(i16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as i64),
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as f64),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err("arrays nested too deeply".into());
                }
                let item_kind = self.u32()?;
                let count = self.u64()? as usize;
                if count > self.bytes.len() {
                    return Err(format!(
                        "an array claims {count} items, more than the file could hold"
                    ));
                }
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    items.push(self.value(item_kind, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_le_bytes(
                self.take(8)?.try_into().expect("8 bytes"),
            )),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_hf_names_to_gguf_names() {
        assert_eq!(
            hf_to_gguf_name("model.layers.12.self_attn.q_proj.bias").as_deref(),
            Some("blk.12.attn_q.bias")
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.0.mlp.down_proj.weight").as_deref(),
            Some("blk.0.ffn_down.weight")
        );
        assert_eq!(
            hf_to_gguf_name("model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.0.mlp.experts.gate_proj.weight").as_deref(),
            Some("blk.0.ffn_gate_exps.weight")
        );
        assert_eq!(hf_to_gguf_name("vision.patch_embed"), None);
    }
}
