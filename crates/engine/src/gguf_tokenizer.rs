//! The tokenizer embedded in a GGUF file, rebuilt as a Hugging Face `tokenizer.json`.
//!
//! GGUF stores a byte-level BPE as its token strings, token types and merges, plus a name for
//! the pre-tokenizer (`tokenizer.ggml.pre`). These are exactly the parts of a `tokenizer.json`,
//! so ember writes one in memory and loads it with the `tokenizers` library: one tokenizer
//! implementation for both formats.

use ember_checkpoint::GgufFile;
use ember_checkpoint::gguf::Value;
use serde_json::{Map, json};

use crate::tokenizer::{Tokenizer, TokenizerConfig, TokenizerError};

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// The pre-tokenizer splits of Qwen2 and Llama 3 vocabularies, as their tokenizer.json files
/// write them.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub fn tokenizer_from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
    let path = file.path();
    let field = |field: &'static str, message: String| TokenizerError::Field {
        path: path.to_path_buf(),
        field,
        message,
    };
    let model = file
        .metadata("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .unwrap_or("");
    if model != "gpt2" {
        return Err(field(
            "tokenizer.ggml.model",
            format!("tokenizer type `{model}` is not supported (ember reads gpt2-style BPE)"),
        ));
    }
    let tokens = file
        .metadata("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| field("tokenizer.ggml.tokens", "missing".into()))?;
    let types = file
        .metadata("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .unwrap_or(&[]);
    let merges = file
        .metadata("tokenizer.ggml.merges")
        .and_then(Value::as_array)
        .unwrap_or(&[]);
    let token = |id: usize| tokens.get(id).and_then(Value::as_str);
    let id_key = |key: &str| {
        file.metadata(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
    };

    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, value) in tokens.iter().enumerate() {
        let text = value.as_str().ok_or_else(|| {
            field(
                "tokenizer.ggml.tokens",
                format!("token {id} is not a string"),
            )
        })?;
        vocab.insert(text.to_owned(), json!(id));
        let kind = types.get(id).and_then(Value::as_u64).unwrap_or(1);
        if kind == TOKEN_TYPE_CONTROL || kind == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": kind == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let merges: Vec<&str> = merges.iter().filter_map(Value::as_str).collect();

    let pre = file
        .metadata("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let (normalizer, pre_tokenizer) = match pre {
        "default" | "gpt-2" | "gpt2" => (json!(null), byte_level(true)),
        "smollm" => (
            json!(null),
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        ),
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
        ),
        "llama-bpe" | "llama3" => (
            json!(null),
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
        ),
        other => {
            return Err(field(
                "tokenizer.ggml.pre",
                format!(
                    "pre-tokenizer `{other}` is not supported (ember knows default, smollm, qwen2, llama-bpe)"
                ),
            ));
        }
    };

    let bos_id = id_key("tokenizer.ggml.bos_token_id");
    let add_bos = file
        .metadata("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let post_processor = match (add_bos, bos_id.and_then(token)) {
        (true, Some(bos)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }),
        _ => json!(null),
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let config = TokenizerConfig {
        bos_token: bos_id.and_then(token).map(str::to_owned),
        eos_token: id_key("tokenizer.ggml.eos_token_id")
            .and_then(token)
            .map(str::to_owned),
        pad_token: id_key("tokenizer.ggml.padding_token_id")
            .and_then(token)
            .map(str::to_owned),
        add_bos_token: Some(add_bos),
        chat_template: file
            .metadata("tokenizer.chat_template")
            .and_then(Value::as_str)
            .map(str::to_owned),
    };
    Tokenizer::from_json(&tokenizer_json.to_string(), config, path)
}
