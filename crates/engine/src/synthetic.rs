//! Checkpoints with random weights at real models' shapes, for benchmarks.
//!
//! Speed depends on shapes, not on trained values, so a random checkpoint in the Hugging Face
//! layout measures what the real model would. Each gets a byte-level tokenizer (every UTF-8
//! text encodes; ids outside its 256 byte tokens decode to nothing) and a ChatML template.

use std::borrow::Cow;
use std::path::Path;

use safetensors::{Dtype, View};
use serde_json::{Value, json};

use crate::error::{Error, Result};

/// The real models whose shapes can be generated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Qwen3_0_6b,
    Qwen3_1_7b,
    Qwen3_8b,
    Qwen3_30bA3b,
}

impl Shape {
    pub const NAMES: &'static [&'static str] =
        &["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "qwen3-30b-a3b"];

    pub fn from_name(name: &str) -> Option<Shape> {
        match name {
            "qwen3-0.6b" => Some(Shape::Qwen3_0_6b),
            "qwen3-1.7b" => Some(Shape::Qwen3_1_7b),
            "qwen3-8b" => Some(Shape::Qwen3_8b),
            "qwen3-30b-a3b" => Some(Shape::Qwen3_30bA3b),
            _ => None,
        }
    }

    /// The model's `config.json`, as published (dtype aside).
    pub fn config(self, dtype: SyntheticDtype) -> Value {
        let (hidden, inter, layers, heads, kv, tied) = match self {
            Shape::Qwen3_0_6b => (1024, 3072, 28, 16, 8, true),
            Shape::Qwen3_1_7b => (2048, 6144, 28, 16, 8, true),
            Shape::Qwen3_8b => (4096, 12288, 36, 32, 8, false),
            Shape::Qwen3_30bA3b => (2048, 6144, 48, 32, 4, false),
        };
        let mut config = json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": tied,
            "attention_bias": false,
            "hidden_act": "silu",
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "torch_dtype": dtype.hf_name(),
        });
        if self == Shape::Qwen3_30bA3b {
            let m = config.as_object_mut().expect("an object");
            m.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
            m.insert("model_type".into(), json!("qwen3_moe"));
            m.insert("num_experts".into(), json!(128));
            m.insert("num_experts_per_tok".into(), json!(8));
            m.insert("moe_intermediate_size".into(), json!(768));
            m.insert("norm_topk_prob".into(), json!(true));
            m.insert("decoder_sparse_step".into(), json!(1));
            m.insert("mlp_only_layers".into(), json!([]));
        }
        config
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyntheticDtype {
    F32,
    Bf16,
    F16,
}

impl SyntheticDtype {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "f32" | "float32" => Some(SyntheticDtype::F32),
            "bf16" | "bfloat16" => Some(SyntheticDtype::Bf16),
            "f16" | "float16" => Some(SyntheticDtype::F16),
            _ => None,
        }
    }

    fn hf_name(self) -> &'static str {
        match self {
            SyntheticDtype::F32 => "float32",
            SyntheticDtype::Bf16 => "bfloat16",
            SyntheticDtype::F16 => "float16",
        }
    }

    fn size(self) -> usize {
        if self == SyntheticDtype::F32 { 4 } else { 2 }
    }
}

/// A tensor whose bytes are generated when the writer asks for them, so a 16 GB checkpoint
/// never sits in memory whole.
struct RandomTensor {
    shape: Vec<usize>,
    dtype: SyntheticDtype,
    /// Uniform in ±amplitude around `center`.
    center: f32,
    amplitude: f32,
    seed: u64,
}

impl RandomTensor {
    /// Block `index` of the tensor's values, as bytes.
    fn fill(&self, index: u64, out: &mut [u8]) {
        // splitmix64 of (seed, block) seeds the block's xorshift64*.
        let mut z = (self.seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let mut state = (z ^ (z >> 31)) | 1;
        for value_bytes in out.chunks_exact_mut(self.dtype.size()) {
            // xorshift64*: fast, and plenty for weights nobody will read for meaning.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
            let unit = (bits >> 40) as f32 / (1u64 << 24) as f32;
            let value = self.center + (unit * 2.0 - 1.0) * self.amplitude;
            match self.dtype {
                SyntheticDtype::F32 => value_bytes.copy_from_slice(&value.to_le_bytes()),
                SyntheticDtype::Bf16 => {
                    value_bytes.copy_from_slice(&half::bf16::from_f32(value).to_le_bytes())
                }
                SyntheticDtype::F16 => {
                    value_bytes.copy_from_slice(&half::f16::from_f32(value).to_le_bytes())
                }
            }
        }
    }
}

impl View for RandomTensor {
    fn dtype(&self) -> Dtype {
        match self.dtype {
            SyntheticDtype::F32 => Dtype::F32,
            SyntheticDtype::Bf16 => Dtype::BF16,
            SyntheticDtype::F16 => Dtype::F16,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let size = self.dtype.size();
        let mut bytes = vec![0u8; self.data_len()];
        // Blocks of a fixed size, each from its own seed, filled in parallel: the bytes do not
        // depend on the thread count, and a 60 GB checkpoint writes at disk speed.
        const BLOCK: usize = 1 << 16;
        let blocks: Vec<(usize, &mut [u8])> = bytes.chunks_mut(BLOCK * size).enumerate().collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per_thread = blocks.len().div_ceil(threads).max(1);
        let mut blocks = blocks;
        std::thread::scope(|scope| {
            while !blocks.is_empty() {
                let rest = blocks.split_off(per_thread.min(blocks.len()));
                let mine = std::mem::replace(&mut blocks, rest);
                scope.spawn(move || {
                    for (index, block) in mine {
                        self.fill(index as u64, block);
                    }
                });
            }
        });
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Writes a complete checkpoint directory for `shape` into `out`.
pub fn write_checkpoint(shape: Shape, dtype: SyntheticDtype, out: &Path) -> Result<()> {
    write_checkpoint_for_config(&shape.config(dtype), dtype, out)
}

/// Writes a checkpoint with random weights for a Qwen3 or Qwen3-MoE `config.json` (which must
/// give `head_dim`, and a vocabulary of at least 151646 so Qwen's special ids exist).
pub fn write_checkpoint_for_config(
    config: &Value,
    dtype: SyntheticDtype,
    out: &Path,
) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let get = |key: &str| config[key].as_u64().unwrap_or(0) as usize;
    let (hidden, inter, layers, heads, kv, head_dim, vocab) = (
        get("hidden_size"),
        get("intermediate_size"),
        get("num_hidden_layers"),
        get("num_attention_heads"),
        get("num_key_value_heads"),
        get("head_dim"),
        get("vocab_size"),
    );
    let experts = get("num_experts");
    let mut tensors: Vec<(String, RandomTensor)> = Vec::new();
    let mut seed = 0x5eed_u64;
    let mut add = |name: String, shape: Vec<usize>, center: f32, amplitude: f32| {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        tensors.push((
            name,
            RandomTensor {
                shape,
                dtype,
                center,
                amplitude,
                seed,
            },
        ));
    };
    // Weights ~ U(±0.04): std 0.023, close to the 0.02 models are initialised with.
    let matrix = 0.04;
    add(
        "model.embed_tokens.weight".into(),
        vec![vocab, hidden],
        0.0,
        matrix,
    );
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        add(
            format!("{p}.input_layernorm.weight"),
            vec![hidden],
            1.0,
            0.05,
        );
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![hidden],
            1.0,
            0.05,
        );
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![heads * head_dim, hidden],
            0.0,
            matrix,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![kv * head_dim, hidden],
            0.0,
            matrix,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![kv * head_dim, hidden],
            0.0,
            matrix,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![hidden, heads * head_dim],
            0.0,
            matrix,
        );
        add(
            format!("{p}.self_attn.q_norm.weight"),
            vec![head_dim],
            1.0,
            0.05,
        );
        add(
            format!("{p}.self_attn.k_norm.weight"),
            vec![head_dim],
            1.0,
            0.05,
        );
        if experts > 0 {
            let width = get("moe_intermediate_size");
            add(
                format!("{p}.mlp.gate.weight"),
                vec![experts, hidden],
                0.0,
                matrix,
            );
            for e in 0..experts {
                add(
                    format!("{p}.mlp.experts.{e}.gate_proj.weight"),
                    vec![width, hidden],
                    0.0,
                    matrix,
                );
                add(
                    format!("{p}.mlp.experts.{e}.up_proj.weight"),
                    vec![width, hidden],
                    0.0,
                    matrix,
                );
                add(
                    format!("{p}.mlp.experts.{e}.down_proj.weight"),
                    vec![hidden, width],
                    0.0,
                    matrix,
                );
            }
        } else {
            add(
                format!("{p}.mlp.gate_proj.weight"),
                vec![inter, hidden],
                0.0,
                matrix,
            );
            add(
                format!("{p}.mlp.up_proj.weight"),
                vec![inter, hidden],
                0.0,
                matrix,
            );
            add(
                format!("{p}.mlp.down_proj.weight"),
                vec![hidden, inter],
                0.0,
                matrix,
            );
        }
    }
    add("model.norm.weight".into(), vec![hidden], 1.0, 0.05);
    if config["tie_word_embeddings"] == json!(false) {
        add("lm_head.weight".into(), vec![vocab, hidden], 0.0, matrix);
    }
    let weights_path = out.join("model.safetensors");
    safetensors::serialize_to_file(tensors, None, &weights_path).map_err(|e| {
        Error::Io(std::io::Error::other(format!(
            "{}: {e}",
            weights_path.display()
        )))
    })?;

    write_json(&out.join("config.json"), config)?;
    write_json(
        &out.join("generation_config.json"),
        &json!({"eos_token_id": [151645, 151643], "bos_token_id": 151643}),
    )?;
    write_json(&out.join("tokenizer.json"), &byte_level_tokenizer(vocab))?;
    write_json(
        &out.join("tokenizer_config.json"),
        &json!({
            "bos_token": null,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
        }),
    )?;
    Ok(())
}

const CHATML_TEMPLATE: &str = "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}";

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("JSON values serialise");
    std::fs::write(path, text)?;
    Ok(())
}

/// GPT-2's byte-to-character map: printable bytes stand for themselves, the rest are moved
/// past U+0100 so every byte has a visible character.
fn byte_level_char(byte: u8) -> char {
    match byte {
        b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF => byte as char,
        _ => {
            let shifted = [0..=0x20u8, 0x7F..=0xA0, 0xAD..=0xAD]
                .iter()
                .flat_map(|r| r.clone())
                .position(|b| b == byte)
                .unwrap_or(0);
            char::from_u32(256 + shifted as u32).expect("a valid code point")
        }
    }
}

/// Qwen's special tokens, at Qwen's ids.
const SPECIAL_TOKENS: [(u32, &str); 3] = [
    (151643, "<|endoftext|>"),
    (151644, "<|im_start|>"),
    (151645, "<|im_end|>"),
];

/// A byte-level BPE with the 256 byte tokens, a visible word (" t1234") for every id up to
/// the special tokens, and those at Qwen's ids: prompts encode to bytes, and what a random
/// model generates decodes to text a client can see and time. (As in Qwen's own tokenizer, the
/// ids past the special tokens up to the embedding's padded size stay unnamed: `tokenizers`
/// renumbers added tokens that sit below a model vocabulary's last id.)
fn byte_level_tokenizer(vocab: usize) -> Value {
    let space = byte_level_char(b' ');
    let first_special = SPECIAL_TOKENS[0].0;
    let vocab: serde_json::Map<String, Value> = (0..=255u8)
        .map(|b| (byte_level_char(b).to_string(), json!(b as u32)))
        .chain(
            (256..first_special.min(vocab as u32)).map(|id| (format!("{space}t{id}"), json!(id))),
        )
        .collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": SPECIAL_TOKENS.iter().map(|&(id, content)| special(id, content)).collect::<Vec<_>>(),
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_map_is_a_bijection() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_level_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_level_char(b' '), 'Ġ');
        assert_eq!(byte_level_char(b'a'), 'a');
    }

    #[test]
    fn every_id_decodes_to_text() {
        let dir = std::env::temp_dir().join(format!("ember-synth-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_json(&dir.join("tokenizer.json"), &byte_level_tokenizer(151936)).unwrap();
        let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            tokenizer.decode(&[300, 151642], true).unwrap(),
            " t300 t151642"
        );
        assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(151645));
        assert_eq!(
            tokenizer.encode("hi t300", false).unwrap().get_ids(),
            &[104, 105, 32, 116, 51, 48, 48]
        );
    }
}
