use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_tensor::{Buffer, BufferKind, BufferOwner, DType};
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::error::{CheckpointError, Result};
use crate::json::read_json;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    file: usize,
    /// The stored dtype's name (`"BF16"`, `"F32"`, `"I8"`…), checked when the tensor is read.
    dtype: String,
    pub shape: Vec<usize>,
    /// Byte range inside the mapped file.
    start: usize,
    end: usize,
}

/// A tensor's stored bytes, borrowed from its file's mapping.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    /// The file it was read from, for error messages.
    pub path: &'a Path,
    /// The mapping the bytes live in, and where in it they start: holding the `Arc` keeps a
    /// view into the file valid without copying it.
    pub buffer: &'a Arc<Buffer>,
    pub offset: usize,
}

impl TensorRef<'_> {
    pub fn element_count(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The safetensors files of one checkpoint, mapped, with an index from tensor name to bytes.
pub struct SafetensorsSet {
    files: Vec<(PathBuf, Arc<Buffer>)>,
    tensors: HashMap<String, TensorEntry>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl SafetensorsSet {
    /// Maps `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub fn open(dir: &Path, owner: &BufferOwner) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let file_names: Vec<String> = if index_path.exists() {
            let index: ShardIndex = read_json(&index_path)?;
            let mut names: Vec<String> = index.weight_map.into_values().collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec![SINGLE_FILE.to_owned()]
        };
        let mut set = SafetensorsSet {
            files: Vec::new(),
            tensors: HashMap::new(),
        };
        for name in file_names {
            set.add_file(&dir.join(name), owner)?;
        }
        Ok(set)
    }

    fn add_file(&mut self, path: &Path, owner: &BufferOwner) -> Result<()> {
        if !path.exists() {
            return Err(CheckpointError::Io {
                path: path.into(),
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        let buffer = owner.map_file(BufferKind::Weights, path)?;
        let invalid = |message: String| CheckpointError::Safetensors {
            path: path.into(),
            message,
        };
        let (header_len, metadata) = SafeTensors::read_metadata(buffer.bytes()).map_err(|e| {
            let hint = match e {
                safetensors::SafeTensorError::MetadataIncompleteBuffer => {
                    " (the file is truncated or has trailing bytes)"
                }
                _ => "",
            };
            invalid(format!("{e}{hint}"))
        })?;
        let data_start = 8 + header_len;
        let file = self.files.len();
        for (name, info) in metadata.tensors() {
            let entry = TensorEntry {
                file,
                dtype: format!("{:?}", info.dtype),
                shape: info.shape.clone(),
                start: data_start + info.data_offsets.0,
                end: data_start + info.data_offsets.1,
            };
            self.tensors.insert(name, entry);
        }
        self.files.push((path.into(), Arc::new(buffer)));
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The path of the first file, for messages about the checkpoint as a whole.
    pub fn first_path(&self) -> &Path {
        self.files
            .first()
            .map(|(p, _)| p.as_path())
            .unwrap_or(Path::new(SINGLE_FILE))
    }

    /// Looks a tensor up, checking that its dtype is one ember computes with.
    pub fn get(&self, name: &str) -> Result<TensorRef<'_>> {
        let Some((stored_name, entry)) = self.tensors.get_key_value(name) else {
            return Err(CheckpointError::MissingTensor {
                path: self.first_path().into(),
                name: name.into(),
            });
        };
        let (path, buffer) = &self.files[entry.file];
        let dtype = match entry.dtype.as_str() {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            other => {
                return Err(CheckpointError::TensorDtype {
                    path: path.clone(),
                    name: name.into(),
                    found: other.into(),
                });
            }
        };
        Ok(TensorRef {
            name: stored_name,
            dtype,
            shape: &entry.shape,
            bytes: &buffer.bytes()[entry.start..entry.end],
            path,
            buffer,
            offset: entry.start,
        })
    }

    /// The mapped files, so callers can keep them alive as long as views into them.
    pub fn buffers(&self) -> impl Iterator<Item = &Arc<Buffer>> {
        self.files.iter().map(|(_, b)| b)
    }

    /// Stored bytes of all tensors.
    pub fn total_tensor_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.end - t.start).sum()
    }
}
