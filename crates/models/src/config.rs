//! `config.json`, read into one normalised description of the model.
//!
//! Checkpoints in the wild spell the same thing several ways (`rope_theta` at the top or in
//! `rope_parameters`, `torch_dtype` or `dtype`, `head_dim` given or implied); they all end up
//! here as one [`ModelConfig`], so the model code never looks at JSON.

use std::path::{Path, PathBuf};

use ember_checkpoint::gguf::Value as GgufValue;
use ember_checkpoint::{CheckpointError, GgufFile, read_json};
use serde_json::{Map, Value};

use crate::error::Result;

/// The architectures ember serves. They share one model definition; these are its options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
}

impl Architecture {
    pub const SUPPORTED: &'static str =
        "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM";

    pub fn from_hf_name(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" => Some(Architecture::Llama),
            "Qwen2ForCausalLM" => Some(Architecture::Qwen2),
            "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
            "Qwen3MoeForCausalLM" => Some(Architecture::Qwen3Moe),
            _ => None,
        }
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }
}

/// Llama 3's frequency-dependent rotary scaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Renormalise the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is sparse…
    pub decoder_sparse_step: usize,
    /// …except these, which keep a dense MLP.
    pub mlp_only_layers: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// RoPE rotates adjacent pairs `(2i, 2i+1)` instead of halves `(i, i + d/2)`: GGUF Llama
    /// checkpoints store q/k permuted for it.
    pub rope_interleaved: bool,
    pub moe: Option<MoeConfig>,
    /// The dtype the checkpoint says it was saved in, if it says.
    pub dtype: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.exists() {
            return Err(CheckpointError::NotACheckpoint { path: dir.into() }.into());
        }
        let value: Value = read_json(&path)?;
        Self::from_json(&value, &path)
    }

    /// Interprets a parsed `config.json`; `path` is named in errors.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self> {
        let fields = Fields {
            map: value
                .as_object()
                .ok_or_else(|| invalid(path, "(top level)", "expected a JSON object"))?,
            path,
        };
        let arch_name = match fields.map.get("architectures") {
            Some(Value::Array(names)) => names
                .first()
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            Some(_) => return Err(invalid(path, "architectures", "expected a list of names")),
            None => return Err(missing(path, "architectures")),
        };
        let architecture = Architecture::from_hf_name(&arch_name).ok_or_else(|| {
            CheckpointError::UnsupportedArchitecture {
                path: path.into(),
                name: arch_name.clone(),
                supported: Architecture::SUPPORTED.into(),
            }
        })?;

        let hidden_size = fields.usize("hidden_size")?;
        let num_attention_heads = fields.usize("num_attention_heads")?;
        let num_key_value_heads = fields
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_attention_heads == 0
            || num_key_value_heads == 0
            || num_attention_heads % num_key_value_heads != 0
        {
            return Err(invalid(
                path,
                "num_key_value_heads",
                &format!(
                    "{num_key_value_heads} kv heads must divide {num_attention_heads} attention heads"
                ),
            ));
        }
        let head_dim = match fields.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(invalid(
                    path,
                    "head_dim",
                    "absent, and hidden_size is not a multiple of num_attention_heads",
                ));
            }
        };
        if head_dim % 2 != 0 {
            return Err(invalid(
                path,
                "head_dim",
                "must be even for rotary embeddings",
            ));
        }

        if fields.bool_or("use_sliding_window", false)? {
            return Err(invalid(
                path,
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }

        // transformers 5 moved rope settings into `rope_parameters`; older files keep
        // `rope_theta` and `rope_scaling` at the top.
        let rope_parameters = fields.map.get("rope_parameters").and_then(Value::as_object);
        let rope_theta = match fields.opt_f64("rope_theta")? {
            Some(theta) => theta,
            None => match rope_parameters.and_then(|p| p.get("rope_theta")) {
                Some(v) => v.as_f64().ok_or_else(|| {
                    invalid(path, "rope_parameters.rope_theta", "expected a number")
                })?,
                None => 10_000.0,
            },
        };
        let scaling_source = match fields.map.get("rope_scaling") {
            Some(Value::Object(m)) => Some(("rope_scaling", m)),
            Some(Value::Null) | None => rope_parameters.map(|m| ("rope_parameters", m)),
            Some(_) => return Err(invalid(path, "rope_scaling", "expected an object or null")),
        };
        let rope_scaling = match scaling_source {
            Some((field, map)) => parse_rope_scaling(map, path, field)?,
            None => None,
        };

        let moe = if architecture == Architecture::Qwen3Moe {
            let moe = MoeConfig {
                // Qwen3-MoE files say `num_experts`; transformers 5 writes `num_local_experts`.
                num_experts: match fields.opt_usize("num_experts")? {
                    Some(n) => n,
                    None => fields.usize("num_local_experts")?,
                },
                num_experts_per_tok: fields.usize("num_experts_per_tok")?,
                moe_intermediate_size: fields.usize("moe_intermediate_size")?,
                norm_topk_prob: fields.bool_or("norm_topk_prob", false)?,
                decoder_sparse_step: fields.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1),
                mlp_only_layers: match fields.map.get("mlp_only_layers") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(|v| {
                            v.as_u64().map(|x| x as usize).ok_or_else(|| {
                                invalid(path, "mlp_only_layers", "expected layer indices")
                            })
                        })
                        .collect::<Result<_>>()?,
                    Some(_) => {
                        return Err(invalid(
                            path,
                            "mlp_only_layers",
                            "expected a list of layer indices",
                        ));
                    }
                },
            };
            if moe.num_experts_per_tok == 0 || moe.num_experts_per_tok > moe.num_experts {
                return Err(invalid(
                    path,
                    "num_experts_per_tok",
                    "must be between 1 and num_experts",
                ));
            }
            Some(moe)
        } else {
            None
        };

        let attention_bias = fields.bool_or("attention_bias", false)?;
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Qwen2 => (true, false),
            _ => (attention_bias, attention_bias),
        };
        let intermediate_size = match &moe {
            // A MoE model with no dense layer may leave intermediate_size out.
            Some(_) => fields.opt_usize("intermediate_size")?.unwrap_or(0),
            None => fields.usize("intermediate_size")?,
        };

        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size,
            num_hidden_layers: fields.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: fields.usize("vocab_size")?,
            rms_norm_eps: fields.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            max_position_embeddings: fields.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: fields.bool_or("tie_word_embeddings", false)?,
            qkv_bias,
            o_bias,
            mlp_bias: fields.bool_or("mlp_bias", false)?,
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Qwen3Moe),
            rope_interleaved: false,
            moe,
            dtype: fields
                .opt_str("torch_dtype")
                .or_else(|| fields.opt_str("dtype")),
            bos_token_id: fields
                .opt_usize("bos_token_id")
                .ok()
                .flatten()
                .map(|v| v as u32),
            eos_token_ids: token_ids(fields.map.get("eos_token_id")),
        })
    }

    /// Reads the hyperparameters of a GGUF file (`{arch}.embedding_length` and friends).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let path = file.path();
        let arch = file.architecture().unwrap_or("").to_owned();
        let architecture = match arch.as_str() {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "qwen3moe" => Architecture::Qwen3Moe,
            _ => {
                return Err(CheckpointError::UnsupportedArchitecture {
                    path: path.into(),
                    name: format!("{arch} (general.architecture)"),
                    supported: "llama, qwen2, qwen3, qwen3moe".into(),
                }
                .into());
            }
        };
        let key = |name: &str| format!("{arch}.{name}");
        let opt_usize = |name: &str| {
            file.metadata(&key(name))
                .and_then(GgufValue::as_u64)
                .map(|v| v as usize)
        };
        let usize_field = |name: &str| opt_usize(name).ok_or_else(|| missing(path, &key(name)));
        let hidden_size = usize_field("embedding_length")?;
        let num_attention_heads = usize_field("attention.head_count")?;
        let num_key_value_heads =
            opt_usize("attention.head_count_kv").unwrap_or(num_attention_heads);
        if num_attention_heads == 0
            || num_key_value_heads == 0
            || num_attention_heads % num_key_value_heads != 0
        {
            return Err(invalid(
                path,
                &key("attention.head_count_kv"),
                "must divide attention.head_count",
            ));
        }
        let head_dim =
            opt_usize("attention.key_length").unwrap_or(hidden_size / num_attention_heads);
        let vocab_size = match opt_usize("vocab_size") {
            Some(v) => v,
            None => file
                .metadata("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(<[_]>::len)
                .ok_or_else(|| missing(path, &key("vocab_size")))?,
        };
        if file.contains_gguf("rope_freqs.weight") {
            return Err(invalid(
                path,
                "rope_freqs.weight",
                "per-frequency rope factors (Llama 3.1 scaling in GGUF) are not supported yet",
            ));
        }
        let moe = if architecture == Architecture::Qwen3Moe {
            Some(MoeConfig {
                num_experts: usize_field("expert_count")?,
                num_experts_per_tok: usize_field("expert_used_count")?,
                moe_intermediate_size: usize_field("expert_feed_forward_length")?,
                norm_topk_prob: file
                    .metadata(&key("expert_weights_norm"))
                    .and_then(GgufValue::as_bool)
                    .unwrap_or(true),
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
            })
        } else {
            None
        };
        let token_id = |name: &str| {
            file.metadata(name)
                .and_then(GgufValue::as_u64)
                .map(|v| v as u32)
        };
        let eos_token_ids = [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ]
        .iter()
        .filter_map(|name| token_id(name))
        .fold(Vec::new(), |mut ids, id| {
            if !ids.contains(&id) {
                ids.push(id);
            }
            ids
        });
        let has_bias = |name: &str| file.contains_gguf(&format!("blk.0.{name}.bias"));
        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: opt_usize("feed_forward_length").unwrap_or(0),
            num_hidden_layers: usize_field("block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: file
                .metadata(&key("attention.layer_norm_rms_epsilon"))
                .and_then(GgufValue::as_f64)
                .unwrap_or(1e-6) as f32,
            rope_theta: file
                .metadata(&key("rope.freq_base"))
                .and_then(GgufValue::as_f64)
                .unwrap_or(10_000.0),
            rope_scaling: None,
            max_position_embeddings: opt_usize("context_length").unwrap_or(4096),
            tie_word_embeddings: !file.contains_gguf("output.weight"),
            qkv_bias: has_bias("attn_q"),
            o_bias: has_bias("attn_output"),
            mlp_bias: has_bias("ffn_up"),
            qk_norm: file.contains_gguf("blk.0.attn_q_norm.weight"),
            rope_interleaved: architecture == Architecture::Llama,
            moe,
            dtype: None,
            bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
            eos_token_ids,
        })
    }

    /// Whether layer `index` has a mixture-of-experts MLP.
    pub fn is_sparse_layer(&self, index: usize) -> bool {
        match &self.moe {
            Some(moe) => {
                !moe.mlp_only_layers.contains(&index)
                    && (index + 1).is_multiple_of(moe.decoder_sparse_step)
            }
            None => false,
        }
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    pub fn attention_shape(&self) -> ember_tensor::cpu::AttentionShape {
        ember_tensor::cpu::AttentionShape {
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
        }
    }

    /// The widest MLP: the dense one's or an expert's intermediate size.
    pub fn ffn_width(&self) -> usize {
        self.intermediate_size
            .max(self.moe.as_ref().map_or(0, |m| m.moe_intermediate_size))
    }
}

/// `eos_token_id` as an int or a list of ints (anything else reads as none).
pub fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_u64)
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

fn parse_rope_scaling(
    map: &Map<String, Value>,
    path: &Path,
    field: &str,
) -> Result<Option<Llama3RopeScaling>> {
    let kind = map
        .get("rope_type")
        .or_else(|| map.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let number = |key: &str| {
                map.get(key).and_then(Value::as_f64).ok_or_else(|| {
                    invalid(
                        path,
                        &format!("{field}.{key}"),
                        "expected a number for llama3 rope scaling",
                    )
                })
            };
            Ok(Some(Llama3RopeScaling {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position_embeddings: number("original_max_position_embeddings")?,
            }))
        }
        other => Err(invalid(
            path,
            &format!("{field}.rope_type"),
            &format!("rope type `{other}` is not supported (ember supports default and llama3)"),
        )),
    }
}

fn missing(path: &Path, field: &str) -> crate::Error {
    CheckpointError::MissingField {
        path: PathBuf::from(path),
        field: field.into(),
    }
    .into()
}

fn invalid(path: &Path, field: &str, message: &str) -> crate::Error {
    CheckpointError::InvalidField {
        path: PathBuf::from(path),
        field: field.into(),
        message: message.into(),
    }
    .into()
}

struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| invalid(self.path, field, "expected a non-negative integer")),
        }
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?
            .ok_or_else(|| missing(self.path, field))
    }

    fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| invalid(self.path, field, "expected a number")),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(invalid(self.path, field, "expected true or false")),
        }
    }

    fn opt_str(&self, field: &str) -> Option<String> {
        self.map
            .get(field)
            .and_then(Value::as_str)
            .map(str::to_owned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v, Path::new("config.json"))
    }

    fn base() -> Value {
        json!({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": true,
               "torch_dtype": "bfloat16", "eos_token_id": [1, 2]})
    }

    #[test]
    fn reads_the_spellings_found_in_the_wild() {
        let c = parse(base()).unwrap();
        assert_eq!(
            (c.head_dim, c.rope_theta, c.eos_token_ids.clone()),
            (32, 1e6, vec![1, 2])
        );
        assert!(c.qk_norm && c.tie_word_embeddings && !c.qkv_bias);
        let mut v = base();
        let m = v.as_object_mut().unwrap();
        m.remove("rope_theta");
        m.remove("head_dim");
        m.remove("torch_dtype");
        m.insert("dtype".into(), json!("float32"));
        m.insert("eos_token_id".into(), json!(7));
        m.insert(
            "rope_parameters".into(),
            json!({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        );
        let c = parse(v).unwrap();
        assert_eq!(
            (c.head_dim, c.rope_theta, c.eos_token_ids.clone()),
            (16, 5e5, vec![7])
        );
        assert_eq!(c.dtype.as_deref(), Some("float32"));
        assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
    }

    #[test]
    fn errors_name_the_file_and_field() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        let msg = parse(v).unwrap_err().to_string();
        assert!(
            msg.contains("config.json") && msg.contains("hidden_size"),
            "{msg}"
        );
        let mut v = base();
        v["architectures"] = json!(["MambaForCausalLM"]);
        let msg = parse(v).unwrap_err().to_string();
        assert!(
            msg.contains("MambaForCausalLM") && msg.contains("Qwen3ForCausalLM"),
            "{msg}"
        );
        let mut v = base();
        v["num_attention_heads"] = json!("four");
        assert!(
            parse(v)
                .unwrap_err()
                .to_string()
                .contains("num_attention_heads")
        );
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(parse(v).unwrap_err().to_string().contains("yarn"));
    }

    #[test]
    fn moe_layers_follow_sparse_step_and_dense_exceptions() {
        let mut v = base();
        v["architectures"] = json!(["Qwen3MoeForCausalLM"]);
        let m = v.as_object_mut().unwrap();
        m.insert("num_hidden_layers".into(), json!(4));
        m.insert("num_experts".into(), json!(8));
        m.insert("num_experts_per_tok".into(), json!(2));
        m.insert("moe_intermediate_size".into(), json!(32));
        m.insert("decoder_sparse_step".into(), json!(2));
        m.insert("mlp_only_layers".into(), json!([3]));
        let c = parse(v).unwrap();
        assert_eq!(
            (0..4).map(|i| c.is_sparse_layer(i)).collect::<Vec<_>>(),
            [false, true, false, false]
        );
    }
}
