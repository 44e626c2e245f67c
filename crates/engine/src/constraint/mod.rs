//! Constrained decoding: a request's output held to a JSON schema or a grammar, by masking,
//! before each token is sampled, every token that would leave the language (llguidance, the
//! library vLLM, SGLang and llama.cpp use).
//!
//! A [`ConstraintCompiler`] is made once per model from its tokenizer (the token trie and
//! llguidance's slices are built on the first constrained request, not at load: a server that
//! never sees one never pays for them). It turns a request's [`Grammar`] into a
//! [`Constraint`], the per-request matcher, before the request is queued, so a bad schema is
//! a clear error and never a failed stream. Each step the engine asks the constraint for its
//! mask (computed ahead, beside the forward pass, by [`Constraint::prepare`]), samples from the
//! masked logits, and hands it the token.
//!
//! Without a constraint nothing here runs: unconstrained greedy output is unchanged.

mod gbnf;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{
    InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv,
};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (OpenAI's `json_schema` response format, llama.cpp's `json_schema`).
    JsonSchema(Value),
    /// llguidance's Lark syntax (llama.cpp's `grammar` when it starts with `%llguidance`).
    Lark(String),
    /// llama.cpp's GBNF (its `grammar` field), rewritten as Lark.
    Gbnf(String),
}

impl Grammar {
    /// llama.cpp's `grammar` field: Lark after a `%llguidance` line, else GBNF.
    pub fn from_llama_grammar(text: &str) -> Grammar {
        if text.trim_start().starts_with("%llguidance") {
            Grammar::Lark(text.to_owned())
        } else {
            Grammar::Gbnf(text.to_owned())
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// The request's schema or grammar cannot be used; the message says where.
    #[error("{0}")]
    Grammar(String),
    /// The model's tokenizer cannot be described to the matcher.
    #[error("structured output is unavailable for this model's tokenizer: {0}")]
    Tokenizer(String),
    /// The matcher failed while generating (a bug, or a grammar too complex to follow).
    #[error("the output constraint failed: {0}")]
    Matcher(String),
}

/// Makes [`Constraint`]s for one model's tokenizer. Cheap to make; shared by every request.
pub struct ConstraintCompiler {
    tokenizer: Arc<Tokenizer>,
    /// Rows of the model's logits (at least the tokenizer's vocabulary).
    vocab: usize,
    /// The tokens that end a sequence: allowed wherever the grammar may end.
    eos: Arc<[u32]>,
    factory: OnceLock<Result<ParserFactory, ConstraintError>>,
}

impl std::fmt::Debug for ConstraintCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintCompiler")
            .field("vocab", &self.vocab)
            .field("ready", &self.factory.get().is_some())
            .finish()
    }
}

impl ConstraintCompiler {
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, eos: &[u32]) -> Self {
        ConstraintCompiler {
            tokenizer,
            vocab,
            eos: eos.into(),
            factory: OnceLock::new(),
        }
    }

    /// The matcher for `grammar`, at its first token. The first call also builds the token
    /// trie (a fraction of a second for a 150k vocabulary): call it off the async runtime.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, ConstraintError> {
        let eos = *self.eos.first().ok_or_else(|| {
            ConstraintError::Tokenizer("the model names no end-of-sequence token".into())
        })?;
        let factory = self
            .factory
            .get_or_init(|| self.factory(eos))
            .as_ref()
            .map_err(Clone::clone)?;
        let top = match grammar {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(bounded_whitespace(serde_json::json!({
                    "type": "object"
                })))
            }
            Grammar::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(bounded_whitespace(schema.clone()))
            }
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            Grammar::Gbnf(text) => {
                TopLevelGrammar::from_lark(gbnf::to_lark(text).map_err(ConstraintError::Grammar)?)
            }
        };
        let parser = factory
            .create_parser(top)
            .map_err(|e| ConstraintError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Grammar(e));
        }
        Ok(Constraint {
            matcher,
            eos: Arc::clone(&self.eos),
            trie_eos: eos,
            mask: None,
            mask_time: Duration::ZERO,
        })
    }

    fn factory(&self, eos: u32) -> Result<ParserFactory, ConstraintError> {
        let started = Instant::now();
        let unavailable = |e: &dyn std::fmt::Display| ConstraintError::Tokenizer(e.to_string());
        let json: Value = serde_json::from_str(
            &self
                .tokenizer
                .inner()
                .to_string(false)
                .map_err(|e| unavailable(&e))?,
        )
        .map_err(|e| unavailable(&e))?;
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| unavailable(&e))?;
        drop(json);
        // Rows past the tokenizer's vocabulary (padding of the embedding) are never allowed.
        let vocab = self.vocab.max(words.len());
        words.resize(vocab, Vec::new());
        let info = TokRxInfo::new(vocab as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(TrieEnv {
            trie,
            tokenizer: Arc::clone(&self.tokenizer),
        });
        let caps = InferenceCapabilities {
            ff_tokens: false,
            conditional_ff_tokens: false,
            backtrack: false,
            fork: false,
        };
        let mut factory = ParserFactory::new(&env, caps, &SlicedBiasComputer::general_slices())
            .map_err(|e| unavailable(&e))?;
        factory.quiet();
        drop(words);
        give_back_freed_heap();
        tracing::info!(
            "structured output ready: a trie of {vocab} tokens in {:.0} ms",
            started.elapsed().as_secs_f64() * 1e3
        );
        Ok(factory)
    }
}

/// Whitespace a JSON reply may put between two of its tokens: a space or two, or a line break
/// or two and an indent of up to 20 (llama.cpp's JSON grammars allow the same). Unbounded,
/// a model can stall in whitespace until `max_tokens` (a small one did, in the tests).
const JSON_WHITESPACE: &str = r"[\x20\x09]{1,2}|(?:\x0D?\x0A){1,2}[\x20\x09]{0,20}";

/// `schema` with llguidance's options for it (`x-guidance`): [`JSON_WHITESPACE`], unless the
/// schema sets its own.
fn bounded_whitespace(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut() {
        object
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    schema
}

/// Returns the heap the trie's construction freed (the tokenizer's JSON, about 125 MiB for a
/// 150k vocabulary) to the system: glibc keeps it otherwise, resident for the process's life.
/// Measured on Qwen2.5's 152k vocabulary: +133 MiB resident after the first constrained
/// request without this, +64 MiB with it (the trie and llguidance's token slices), and no
/// more after further requests.
fn give_back_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The tokenizer as llguidance sees it: every token's bytes (special tokens behind the 0xff
/// marker, so no text can spell them) and the model's own tokenization of forced text.
struct TrieEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// One request's matcher: the tokens it may take next, and where its grammar stands.
pub struct Constraint {
    matcher: Matcher,
    eos: Arc<[u32]>,
    /// The end-of-sequence token the trie knows (the first of `eos`).
    trie_eos: u32,
    /// The next token's mask, when [`Self::prepare`] computed it ahead.
    mask: Option<Result<SimpleVob, ConstraintError>>,
    mask_time: Duration,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("complete", &self.is_complete())
            .finish()
    }
}

impl Constraint {
    /// Computes the next token's mask now (on whichever thread calls: the engine calls it
    /// beside the forward pass whose logits it will mask).
    pub fn prepare(&mut self) {
        if self.mask.is_none() {
            let started = Instant::now();
            let mask = self
                .matcher
                .compute_mask()
                .map_err(|e| ConstraintError::Matcher(e.to_string()));
            self.mask_time += started.elapsed();
            self.mask = Some(mask);
        }
    }

    /// Sets every logit the grammar does not allow next to −∞. The end-of-sequence tokens are
    /// allowed exactly where the grammar may end.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        self.prepare();
        let mask = self
            .mask
            .as_ref()
            .expect("prepared")
            .as_ref()
            .map_err(Clone::clone)?;
        let may_end = mask.is_allowed(self.trie_eos);
        // The end tokens follow `may_end`, not the mask (the trie knows only the first).
        let ends: Vec<(usize, f32)> = self
            .eos
            .iter()
            .filter_map(|&e| logits.get(e as usize).map(|&l| (e as usize, l)))
            .collect();
        let mut allowed = mask.num_set();
        mask.iter_unset_entries(|id| {
            if let Some(logit) = logits.get_mut(id) {
                *logit = f32::NEG_INFINITY;
            }
        });
        for (e, logit) in ends {
            allowed -= usize::from(mask.is_allowed(e as u32));
            logits[e] = if may_end { logit } else { f32::NEG_INFINITY };
            allowed += usize::from(may_end);
        }
        if allowed == 0 {
            return Err(ConstraintError::Matcher(
                "no token can continue the output".into(),
            ));
        }
        Ok(())
    }

    /// Advances past the sampled `token` (an end-of-sequence token ends the request instead).
    pub fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.mask = None;
        if self.eos.contains(&token) {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError::Matcher(e.to_string()))
    }

    /// How many of `tokens`, taken in turn from where the output stands, the grammar allows
    /// (a draft's verifiable part); the matcher does not move. Stops at an end-of-sequence
    /// token: a draft never ends the output.
    pub fn allowed_prefix(&mut self, tokens: &[u32]) -> usize {
        let before_end = tokens
            .iter()
            .position(|t| self.eos.contains(t))
            .unwrap_or(tokens.len());
        self.matcher
            .validate_tokens(&tokens[..before_end])
            .unwrap_or(0)
    }

    /// Whether the grammar is done: no token may follow, so the request ends here.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Time spent computing masks so far.
    pub fn mask_time(&self) -> Duration {
        self.mask_time
    }
}

#[cfg(test)]
mod tests;
