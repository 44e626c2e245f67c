//! Incremental detokenization for streamed output.
//!
//! Decoding tokens one at a time is wrong for two reasons: a byte-level token
//! may end in the middle of a UTF-8 character, and SentencePiece-style decoders
//! treat the first token of a decode call specially (they strip the leading
//! `▁` space). So, like TGI and vLLM (prefix offset / read offset), we decode
//! the previously emitted chunk's tokens together with the new ones and emit
//! only the text beyond that prefix's own decoding.

use std::sync::Arc;

use crate::tokenizer::Tokenizer;

/// Turns a stream of token ids into text chunks. Owns an `Arc<Tokenizer>` so a
/// request's decoder can move between tasks independently of the tokenizer's owner.
///
/// Special tokens (added tokens marked `special`) are skipped. The concatenation
/// of everything returned by [`push`](Self::push) and [`flush`](Self::flush)
/// equals `tokenizer.decode(all_ids, true)`.
#[derive(Debug)]
pub struct StreamDecoder {
    tokenizer: Arc<Tokenizer>,
    /// The window: already-emitted context tokens (`..read_offset`), then
    /// tokens whose text is still held back. Older tokens are dropped.
    ids: Vec<u32>,
    /// End of the emitted part of `ids`.
    read_offset: usize,
    /// Decoding of `ids[..read_offset]`, cached between pushes.
    prefix_text: String,
}

impl StreamDecoder {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            read_offset: 0,
            prefix_text: String::new(),
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Adds one token; returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Option<String> {
        // decode(.., true) would drop it anyway; skipping it here saves a decode
        // and keeps it out of the context window.
        if self.tokenizer.is_special(id) {
            return None;
        }
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, true);
        // A trailing U+FFFD means the last character's bytes are not all here yet.
        if text.len() <= self.prefix_text.len() || text.ends_with('\u{FFFD}') {
            return None;
        }
        // `get` guards against a decoder that rewrote the prefix (not a char boundary).
        let delta = text.get(self.prefix_text.len()..)?.to_owned();
        self.advance();
        Some(delta)
    }

    /// Returns whatever text is still held back (e.g. an incomplete character at
    /// the very end, rendered as U+FFFD as a full decode would).
    pub fn flush(&mut self) -> Option<String> {
        if self.read_offset >= self.ids.len() {
            return None;
        }
        let text = self.tokenizer.decode(&self.ids, true);
        let delta = text
            .get(self.prefix_text.len()..)
            .unwrap_or_default()
            .to_owned();
        self.advance();
        (!delta.is_empty()).then_some(delta)
    }

    /// Moves the window after emitting: the tokens just read become the
    /// context for the next ones, and older tokens are dropped, so memory is
    /// bounded by the window rather than the generation length.
    fn advance(&mut self) {
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        self.prefix_text = self.tokenizer.decode(&self.ids, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_support::{byte_level, byte_level_str, sentencepiece};

    fn stream(tok: &Arc<Tokenizer>, ids: &[u32]) -> (Vec<String>, String) {
        let mut dec = StreamDecoder::new(Arc::clone(tok));
        let mut chunks: Vec<String> = ids.iter().filter_map(|&id| dec.push(id)).collect();
        chunks.extend(dec.flush());
        let joined = chunks.concat();
        (chunks, joined)
    }

    #[test]
    fn byte_level_multibyte_split_across_tokens() {
        let tok = Arc::new(byte_level());
        for text in ["é", "日本語", "🙂", "hello é 日本語 🙂 world", "a🙂🙂b日"] {
            let ids = tok.encode(text, false).unwrap();
            let (chunks, joined) = stream(&tok, &ids);
            assert_eq!(joined, tok.decode(&ids, true), "{text}");
            assert_eq!(joined, text);
            for chunk in &chunks {
                assert!(
                    !chunk.contains('\u{FFFD}'),
                    "{text}: broken chunk {chunk:?}"
                );
            }
        }
        // Each byte as its own token: "🙂" must arrive whole, once.
        let ids: Vec<u32> = "x🙂".bytes().map(u32::from).collect();
        let (chunks, _) = stream(&tok, &ids);
        assert_eq!(chunks, ["x", "🙂"]);
    }

    #[test]
    fn byte_level_property_over_arbitrary_sequences() {
        let tok = Arc::new(byte_level());
        // Deterministic pseudo-random id sequences over the whole vocabulary,
        // including merge tokens that straddle character boundaries and specials.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let vocab = tok.vocab_size() as u64;
        let pieces: Vec<u32> = "é日本語🙂 hello"
            .bytes()
            .map(u32::from)
            .chain(tok.encode("日本語🙂é", false).unwrap())
            .collect();
        for _ in 0..300 {
            let len = (next() % 24) as usize;
            let ids: Vec<u32> = (0..len)
                .map(|_| match next() % 4 {
                    0 => (next() % vocab) as u32,
                    _ => pieces[(next() % pieces.len() as u64) as usize],
                })
                .collect();
            let (_, joined) = stream(&tok, &ids);
            assert_eq!(joined, tok.decode(&ids, true), "ids {ids:?}");
        }
    }

    #[test]
    fn skips_special_tokens_and_unknown_ids() {
        let tok = Arc::new(byte_level());
        let end = tok.token_to_id("<|im_end|>").unwrap();
        let mut ids = tok.encode("hi 🙂", false).unwrap();
        ids.insert(1, end);
        ids.push(end);
        ids.push(u32::MAX);
        let (chunks, joined) = stream(&tok, &ids);
        assert_eq!(joined, "hi 🙂");
        assert!(chunks.iter().all(|c| !c.contains("<|im_end|>")));
        // A non-special added token is text.
        let think = tok.token_to_id("<think>").unwrap();
        assert_eq!(stream(&tok, &[think]).1, "<think>");
    }

    #[test]
    fn incomplete_character_is_flushed_like_a_full_decode() {
        let tok = Arc::new(byte_level());
        let ids: Vec<u32> = b"ok\xE6\x97".iter().map(|&b| u32::from(b)).collect();
        let mut dec = StreamDecoder::new(Arc::clone(&tok));
        let pushed: Vec<_> = ids.iter().filter_map(|&id| dec.push(id)).collect();
        assert_eq!(pushed, ["o", "k"]);
        assert_eq!(dec.flush().as_deref(), Some("\u{FFFD}"));
        assert_eq!(dec.flush(), None);
        assert_eq!(tok.decode(&ids, true), "ok\u{FFFD}");
        assert_eq!(byte_level_str(b"o"), "o");
    }

    #[test]
    fn sentencepiece_spaces_and_byte_fallback() {
        let tok = Arc::new(sentencepiece(
            r#"{"bos_token": "<s>", "eos_token": "</s>"}"#,
        ));
        let ids = tok.encode("Hello world é 日本 🙂 Hello", true).unwrap();
        assert_eq!(ids[0], 1, "BOS is added and then skipped when streaming");
        let (chunks, joined) = stream(&tok, &ids);
        assert_eq!(joined, tok.decode(&ids, true));
        assert_eq!(joined, "Hello world é 日本 🙂 Hello");
        // Spaces are carried by the token after them, not lost at chunk joins.
        assert!(chunks.contains(&" world".to_owned()), "{chunks:?}");
        assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')), "{chunks:?}");
    }
}
