//! Hugging Face tokenizer loading: `tokenizer.json` through the `tokenizers`
//! crate, plus the parts of `tokenizer_config.json` (special tokens, BOS policy,
//! chat template) that transformers layers on top of it.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

/// Errors from loading or using a [`Tokenizer`]; each names the file or field at fault.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("invalid JSON in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot build a tokenizer from {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path}: field `{field}` {message}")]
    Field {
        path: PathBuf,
        field: &'static str,
        message: String,
    },
    #[error("tokenizer failed to encode the input: {0}")]
    Encode(String),
}

/// A loaded tokenizer with the special-token settings of its model directory.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    add_bos_token: Option<bool>,
    chat_template: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    /// Ids of added tokens flagged `special`; cached because the library only
    /// exposes them through a map clone.
    special_ids: HashSet<u32>,
    vocab_size: usize,
    /// The longest token's text in bytes, as the vocabulary writes it (at least the bytes of
    /// input one token stands for): bounds a text's token count from below.
    max_token_bytes: usize,
}

/// What we read from `tokenizer_config.json` (all optional), or from GGUF metadata.
#[derive(Debug, Default)]
pub struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub add_bos_token: Option<bool>,
    pub chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` (required) and `tokenizer_config.json` /
    /// `chat_template.jinja` (optional) from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tokenizer_path = dir.join("tokenizer.json");
        let bytes = fs::read(&tokenizer_path).map_err(|source| TokenizerError::Io {
            path: tokenizer_path.clone(),
            source,
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|err| load_error(&tokenizer_path, err))?;

        let config_path = dir.join("tokenizer_config.json");
        let mut config = match read_optional(&config_path)? {
            Some(text) => TokenizerConfig::parse(&config_path, &text)?,
            None => TokenizerConfig::default(),
        };
        // transformers lets a standalone chat_template.jinja clobber the config's template.
        let template_path = dir.join("chat_template.jinja");
        if let Some(text) = read_optional(&template_path)? {
            config.chat_template = Some(text);
        }
        Self::from_parts(inner, config, &tokenizer_path)
    }

    /// Builds from `tokenizer.json` text made elsewhere (from GGUF metadata); `origin` names
    /// where it came from in errors.
    pub fn from_json(
        json: &str,
        config: TokenizerConfig,
        origin: &Path,
    ) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(json.as_bytes())
            .map_err(|err| load_error(origin, err))?;
        Self::from_parts(inner, config, origin)
    }

    /// Builds from an already-parsed `tokenizers::Tokenizer` and the config pieces.
    fn from_parts(
        mut inner: tokenizers::Tokenizer,
        config: TokenizerConfig,
        tokenizer_path: &Path,
    ) -> Result<Self, TokenizerError> {
        // transformers disables any truncation/padding stored in tokenizer.json
        // unless the caller asks for it; a stored max_length would silently cut prompts.
        inner
            .with_truncation(None)
            .map_err(|err| TokenizerError::Load {
                path: tokenizer_path.to_path_buf(),
                message: err.to_string(),
            })?;
        inner.with_padding(None);

        let added = inner.get_added_tokens_decoder();
        let special_ids: HashSet<u32> = added
            .iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| *id)
            .collect();
        // Ids are not guaranteed contiguous: size the vocab by the largest id.
        let max_added = added.keys().map(|&id| id as usize + 1).max().unwrap_or(0);
        let vocab_size = inner.get_vocab_size(false).max(max_added);
        // Token by token: a copy of the whole vocabulary (`get_vocab`) would leave its tens of
        // megabytes with the allocator, resident and in no buffer list.
        let max_token_bytes = (0..vocab_size as u32)
            .filter_map(|id| inner.id_to_token(id).map(|t| t.len()))
            .max()
            .unwrap_or(1)
            .max(1);

        let bos_token_id = config
            .bos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t));
        let eos_token_id = config
            .eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t));
        if let (Some(eos), None) = (&config.eos_token, eos_token_id) {
            tracing::warn!(eos_token = %eos, "eos_token is not in the tokenizer vocabulary");
        }

        Ok(Self {
            inner,
            bos_token: config.bos_token,
            eos_token: config.eos_token,
            pad_token: config.pad_token,
            add_bos_token: config.add_bos_token,
            chat_template: config.chat_template,
            bos_token_id,
            eos_token_id,
            special_ids,
            vocab_size,
            max_token_bytes,
        })
    }

    /// Encodes text. HF semantics: raw prompts use `add_special_tokens = true`
    /// (post-processor adds BOS etc.), an already-rendered chat template uses `false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|err| TokenizerError::Encode(err.to_string()))?;
        let mut ids = encoding.get_ids().to_vec();
        if add_special_tokens {
            self.apply_add_bos_token(&mut ids, encoding.get_special_tokens_mask());
        }
        Ok(ids)
    }

    /// transformers rebuilds the post-processor of Llama/Gemma-style tokenizers
    /// from `add_bos_token`, so an explicit setting in tokenizer_config.json wins
    /// over what tokenizer.json's post-processor does.
    fn apply_add_bos_token(&self, ids: &mut Vec<u32>, special_mask: &[u32]) {
        let (Some(add_bos), Some(bos_id)) = (self.add_bos_token, self.bos_token_id) else {
            return;
        };
        // Mask 1 marks tokens the post-processor added, as opposed to a literal
        // BOS string in the text.
        let processor_bos = ids.first() == Some(&bos_id) && special_mask.first() == Some(&1);
        if add_bos && !processor_bos {
            ids.insert(0, bos_id);
        } else if !add_bos && processor_bos {
            ids.remove(0);
        }
    }

    /// Decodes ids to text. Ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        match self.inner.decode(ids, skip_special_tokens) {
            Ok(text) => text,
            Err(err) => {
                // Only a malformed decoder config can fail here; losing text
                // beats aborting a generation stream.
                tracing::warn!(error = %err, "tokenizer decode failed");
                String::new()
            }
        }
    }

    /// Fewer tokens than any text of `bytes` bytes certainly makes, found without encoding it:
    /// its bytes over the longest token's, with room for normalisers that shorten text
    /// (NFKC's ligatures) — so a prompt far past the context is refused before it is encoded.
    /// (A vocabulary whose unknown token swallows runs of text would break the bound; the
    /// byte-level and byte-fallback vocabularies of the models served have none.)
    pub fn min_tokens_of_bytes(&self, bytes: usize) -> usize {
        bytes / (4 * self.max_token_bytes)
    }

    /// One past the largest token id (base vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// True for added tokens marked `special` (the ones `skip_special_tokens` drops).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn pad_token(&self) -> Option<&str> {
        self.pad_token.as_deref()
    }

    /// `add_bos_token` from tokenizer_config.json, when present.
    pub fn add_bos_token(&self) -> Option<bool> {
        self.add_bos_token
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// The wrapped `tokenizers` tokenizer, for anything not covered here.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// tokenizers boxes its errors; recover serde's (bad JSON, unknown model
/// type …) so the message reads as a JSON problem in that file.
fn load_error(path: &Path, err: tokenizers::Error) -> TokenizerError {
    match err.downcast::<serde_json::Error>() {
        Ok(source) => TokenizerError::Json {
            path: path.to_path_buf(),
            source: *source,
        },
        Err(err) => TokenizerError::Load {
            path: path.to_path_buf(),
            message: err.to_string(),
        },
    }
}

/// Reads a file that may legitimately be absent.
fn read_optional(path: &Path) -> Result<Option<String>, TokenizerError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

impl TokenizerConfig {
    fn parse(path: &Path, text: &str) -> Result<Self, TokenizerError> {
        let json: Json = serde_json::from_str(text).map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Json::Object(map) = json else {
            return Err(TokenizerError::Field {
                path: path.to_path_buf(),
                field: "(root)",
                message: "must be a JSON object".into(),
            });
        };
        let field_err = |field: &'static str, message: &str| TokenizerError::Field {
            path: path.to_path_buf(),
            field,
            message: message.to_owned(),
        };
        let token = |field: &'static str| -> Result<Option<String>, TokenizerError> {
            match map.get(field) {
                None | Some(Json::Null) => Ok(None),
                Some(Json::String(s)) => Ok(Some(s.clone())),
                // Older configs serialise AddedToken objects: {"__type": "AddedToken", "content": ...}.
                Some(Json::Object(obj)) => match obj.get("content") {
                    Some(Json::String(s)) => Ok(Some(s.clone())),
                    _ => Err(field_err(field, "is an object without a string `content`")),
                },
                Some(_) => Err(field_err(
                    field,
                    "must be a string, an AddedToken object or null",
                )),
            }
        };
        let add_bos_token = match map.get("add_bos_token") {
            None | Some(Json::Null) => None,
            Some(Json::Bool(b)) => Some(*b),
            Some(_) => return Err(field_err("add_bos_token", "must be a boolean")),
        };
        let chat_template = match map.get("chat_template") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Array(list)) => {
                pick_named_template(list).map_err(|message| field_err("chat_template", &message))?
            }
            Some(_) => {
                return Err(field_err(
                    "chat_template",
                    "must be a string or a list of {name, template} objects",
                ));
            }
        };
        Ok(Self {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            pad_token: token("pad_token")?,
            add_bos_token,
            chat_template,
        })
    }
}

/// From a list of `{"name", "template"}` entries, takes "default", else the first.
fn pick_named_template(list: &[Json]) -> Result<Option<String>, String> {
    let mut entries = Vec::with_capacity(list.len());
    for (i, entry) in list.iter().enumerate() {
        let name = entry.get("name").and_then(Json::as_str);
        let template = entry.get("template").and_then(Json::as_str);
        match (name, template) {
            (Some(name), Some(template)) => entries.push((name, template)),
            _ => return Err(format!("entry {i} lacks a string `name` or `template`")),
        }
    }
    let chosen = entries
        .iter()
        .find(|(name, _)| *name == "default")
        .or(entries.first());
    Ok(chosen.map(|(_, template)| (*template).to_owned()))
}

/// Small tokenizers built in memory, shared by the tests of several modules.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use serde_json::json;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// GPT-2 byte-to-unicode table used by byte-level BPE vocabularies.
    pub fn byte_level_char(b: u8) -> char {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(b) {
            char::from(b)
        } else {
            let n = (0..b).filter(|&x| !printable(x)).count() as u32;
            char::from_u32(256 + n).expect("valid code point")
        }
    }

    pub fn byte_level_str(bytes: &[u8]) -> String {
        bytes.iter().map(|&b| byte_level_char(b)).collect()
    }

    pub const BYTE_LEVEL_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

    /// A Qwen-like byte-level BPE: all 256 bytes, a few merges (including ones
    /// that cut multi-byte characters mid-way), and ChatML special tokens.
    pub fn byte_level_json() -> String {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(byte_level_str(&[b]), json!(b as u32));
        }
        let merges_bytes: Vec<(&[u8], &[u8])> = vec![
            (b"h", b"e"),
            (b"he", b"l"),
            (b"hel", b"l"),
            (b"hell", b"o"),
            (b" ", b"w"),
            (b" w", b"o"),
            (b"l", b"d"),
            // "é" = C3 A9; "日" = E6 97 A5; "本" = E6 9C AC; "🙂" = F0 9F 99 82
            (b"\xC3", b"\xA9"),
            (b"\xE6", b"\x97"),
            (b"\xA5", b"\xE6"),
            (b"\xF0", b"\x9F"),
            (b"\x99", b"\x82"),
        ];
        let mut merges = Vec::new();
        for (a, b) in merges_bytes {
            let (sa, sb) = (byte_level_str(a), byte_level_str(b));
            let merged = format!("{sa}{sb}");
            let next = vocab.len() as u32;
            vocab.entry(merged).or_insert(json!(next));
            merges.push(format!("{sa} {sb}"));
        }
        let base = vocab.len() as u32;
        let added: Vec<_> = BYTE_LEVEL_SPECIALS
            .iter()
            .enumerate()
            .map(|(i, content)| {
                json!({"id": base + i as u32, "content": content, "single_word": false,
                       "lstrip": false, "rstrip": false, "normalized": false, "special": true})
            })
            .chain(std::iter::once(
                json!({"id": base + 3, "content": "<think>",
                "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
                "special": false}),
            ))
            .collect();
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                                "trim_offsets": false, "use_regex": true});
        json!({
            "version": "1.0",
            "truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0},
            "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": byte_level,
            "post_processor": byte_level,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        })
        .to_string()
    }

    /// A Llama-2-like SentencePiece BPE with byte fallback, `▁` spaces, and a
    /// post-processor that prepends `<s>`.
    pub fn sentencepiece_json() -> String {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert((*t).into(), json!(i));
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
        }
        let pieces = [
            "▁", "H", "e", "l", "o", "w", "r", "d", "▁H", "▁He", "▁Hel", "▁Hell", "▁Hello", "▁w",
            "▁wo", "▁wor", "▁worl", "▁world", "é", "▁é",
        ];
        for p in pieces {
            let next = vocab.len();
            vocab.insert(p.into(), json!(next));
        }
        let merges = [
            "▁ H",
            "▁H e",
            "▁He l",
            "▁Hel l",
            "▁Hell o",
            "▁ w",
            "▁w o",
            "▁wo r",
            "▁wor l",
            "▁worl d",
            "▁ é",
        ];
        let specials: Vec<_> = ["<unk>", "<s>", "</s>"]
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": i, "content": c, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": specials,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null,
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": "<s>", "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        })
        .to_string()
    }

    /// A fresh empty directory under the system temp dir.
    pub fn temp_dir(tag: &str) -> PathBuf {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "ember-engine-test-{}-{tag}-{n}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("create temp dir");
        dir
    }

    /// Writes `files` into a fresh directory and loads it.
    pub fn load(tag: &str, files: &[(&str, &str)]) -> Result<Tokenizer, TokenizerError> {
        let dir = temp_dir(tag);
        for (name, text) in files {
            fs::write(dir.join(name), text).expect("write fixture");
        }
        let result = Tokenizer::from_dir(&dir);
        let _ = fs::remove_dir_all(&dir);
        result
    }

    pub fn byte_level() -> Tokenizer {
        load(
            "bytelevel",
            &[
                ("tokenizer.json", &byte_level_json()),
                (
                    "tokenizer_config.json",
                    r#"{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": null}"#,
                ),
            ],
        )
        .expect("byte-level fixture loads")
    }

    pub fn sentencepiece(config: &str) -> Tokenizer {
        load(
            "sp",
            &[
                ("tokenizer.json", &sentencepiece_json()),
                ("tokenizer_config.json", config),
            ],
        )
        .expect("sentencepiece fixture loads")
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;

    /// The bound that refuses long prompts unencoded never exceeds the real count.
    #[test]
    fn min_tokens_of_bytes_never_exceeds_the_count() {
        let byte_level = byte_level();
        let sp = sentencepiece(r#"{"add_bos_token": true}"#);
        for text in [
            "hello world".repeat(500),
            "x".repeat(10_000),
            " ".repeat(4_000),
            "é漢字🙂".repeat(700),
            "ﬁﬂ".repeat(900),
        ] {
            for t in [&byte_level, &sp] {
                let count = t.encode(&text, false).unwrap().len();
                let bound = t.min_tokens_of_bytes(text.len());
                assert!(bound <= count, "{bound} > {count} for {:?}", &text[..20]);
            }
        }
    }

    #[test]
    fn byte_level_round_trip_and_metadata() {
        let tok = byte_level();
        let text = "hello world é 日本語 🙂";
        let ids = tok.encode(text, true).unwrap();
        // The fixture's tokenizer.json asks for max_length 4; it must be ignored.
        assert!(ids.len() > 4);
        assert_eq!(tok.decode(&ids, true), text);
        assert_eq!(tok.token_to_id("hello"), Some(ids[0]));
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert_eq!(tok.pad_token(), Some("<|endoftext|>"));
        assert_eq!(tok.bos_token(), None);
        assert_eq!(tok.bos_token_id(), None);
        let eos = tok.eos_token_id().unwrap();
        assert_eq!(tok.id_to_token(eos).as_deref(), Some("<|im_end|>"));
        assert!(tok.is_special(eos));
        // `<think>` is an added token but not special.
        let think = tok.token_to_id("<think>").unwrap();
        assert!(!tok.is_special(think));
        assert!(!tok.is_special(ids[0]));
        assert_eq!(tok.vocab_size(), think as usize + 1);
        assert_eq!(tok.chat_template(), None);
    }

    #[test]
    fn special_tokens_in_text_and_decode_skipping() {
        let tok = byte_level();
        let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        let start = tok.token_to_id("<|im_start|>").unwrap();
        assert_eq!(ids[0], start);
        assert_eq!(tok.decode(&ids, false), "<|im_start|>user\nhi<|im_end|>");
        assert_eq!(tok.decode(&ids, true), "user\nhi");
        // Ids beyond the vocabulary are skipped, not an error.
        let mut with_junk = ids.clone();
        with_junk.push(u32::MAX);
        with_junk.insert(1, 1_000_000);
        assert_eq!(tok.decode(&with_junk, true), "user\nhi");
    }

    #[test]
    fn sentencepiece_bos_policy() {
        // No add_bos_token: the post-processor decides (it adds <s>).
        let tok = sentencepiece(r#"{"bos_token": "<s>", "eos_token": "</s>"}"#);
        let ids = tok.encode("Hello world", true).unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(tok.decode(&ids, true), "Hello world");
        assert_eq!(tok.encode("Hello world", false).unwrap(), ids[1..].to_vec());

        // add_bos_token false wins over the post-processor.
        let tok = sentencepiece(r#"{"bos_token": "<s>", "add_bos_token": false}"#);
        assert_eq!(tok.add_bos_token(), Some(false));
        assert_eq!(tok.encode("Hello world", true).unwrap(), ids[1..].to_vec());

        // add_bos_token true with a literal "<s>" gives two BOS, as in transformers.
        let tok = sentencepiece(
            r#"{"bos_token": {"__type": "AddedToken", "content": "<s>"}, "add_bos_token": true}"#,
        );
        assert_eq!(tok.bos_token(), Some("<s>"));
        let ids = tok.encode("<s>Hello", true).unwrap();
        assert_eq!(&ids[..2], &[1, 1]);
    }

    #[test]
    fn chat_template_sources() {
        let json = byte_level_json();
        let tok = load(
            "tpl-str",
            &[
                ("tokenizer.json", &json),
                ("tokenizer_config.json", r#"{"chat_template": "A"}"#),
            ],
        )
        .unwrap();
        assert_eq!(tok.chat_template(), Some("A"));

        let list = r#"{"chat_template": [{"name": "tool_use", "template": "T"},
                                         {"name": "default", "template": "D"}]}"#;
        let tok = load(
            "tpl-list",
            &[("tokenizer.json", &json), ("tokenizer_config.json", list)],
        )
        .unwrap();
        assert_eq!(tok.chat_template(), Some("D"));

        let list = r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#;
        let tok = load(
            "tpl-first",
            &[("tokenizer.json", &json), ("tokenizer_config.json", list)],
        )
        .unwrap();
        assert_eq!(tok.chat_template(), Some("R"));

        // chat_template.jinja overrides the config, and works without a config.
        let tok = load(
            "tpl-file",
            &[
                ("tokenizer.json", &json),
                ("tokenizer_config.json", r#"{"chat_template": "A"}"#),
                ("chat_template.jinja", "J"),
            ],
        )
        .unwrap();
        assert_eq!(tok.chat_template(), Some("J"));
        let tok = load(
            "tpl-only-file",
            &[("tokenizer.json", &json), ("chat_template.jinja", "J")],
        )
        .unwrap();
        assert_eq!(tok.chat_template(), Some("J"));
    }

    #[test]
    fn errors_name_the_file_and_field() {
        let json = byte_level_json();
        let err = load("missing", &[]).unwrap_err();
        assert!(matches!(err, TokenizerError::Io { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");

        let err = load("bad-tok", &[("tokenizer.json", "{not json")]).unwrap_err();
        assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        assert!(err.to_string().contains("line 1"), "{err}");

        let err = load(
            "bad-cfg",
            &[
                ("tokenizer.json", &json),
                ("tokenizer_config.json", "{\"eos_token\": "),
            ],
        )
        .unwrap_err();
        assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

        let err = load(
            "bad-field",
            &[
                ("tokenizer.json", &json),
                ("tokenizer_config.json", r#"{"eos_token": 3}"#),
            ],
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("tokenizer_config.json") && msg.contains("eos_token"),
            "{msg}"
        );

        let err = load(
            "bad-list",
            &[
                ("tokenizer.json", &json),
                (
                    "tokenizer_config.json",
                    r#"{"chat_template": [{"name": "x"}]}"#,
                ),
            ],
        )
        .unwrap_err();
        assert!(err.to_string().contains("chat_template"), "{err}");
    }
}
