//! Prompt lookup: a sequence's last few tokens, found earlier in its prompt or reply, are
//! guessed to go on as they did there. It costs no model and shines where replies copy: code
//! edits, quotes, documents asked back, structured text that repeats its keys.

use super::DraftSource;
use crate::scheduler::SeqId;

/// Drafts the continuation of the latest earlier occurrence of the sequence's last `n` tokens,
/// for the longest `n` from `max_n` down to `min_n` that has one.
#[derive(Clone, Copy, Debug)]
pub struct NgramDrafter {
    pub min_n: usize,
    pub max_n: usize,
}

impl Default for NgramDrafter {
    /// Matches of 2 to 4 tokens: one token alone matches too often to predict much (vLLM's
    /// prompt lookup and llama.cpp's lookup decoding look for a few tokens too).
    fn default() -> Self {
        NgramDrafter { min_n: 2, max_n: 4 }
    }
}

impl DraftSource for NgramDrafter {
    fn propose(&mut self, _id: SeqId, tokens: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        let len = tokens.len();
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let key = &tokens[len - n..];
            // The latest match wins: a reply that repeats itself repeats what it did last.
            let found = (0..len - n).rev().find(|&at| &tokens[at..at + n] == key);
            if let Some(at) = found {
                let from = at + n;
                out.extend_from_slice(&tokens[from..(from + max).min(len)]);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(tokens: &[u32], max: usize) -> Vec<u32> {
        let mut out = vec![99];
        NgramDrafter::default().propose(0, tokens, max, &mut out);
        out
    }

    #[test]
    fn the_latest_longest_match_gives_its_continuation() {
        // The last two tokens, "2 3", appear twice before; the later goes on with 7 8 9.
        let tokens = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 2, 3];
        assert_eq!(propose(&tokens, 3), vec![7, 8, 9]);
        assert_eq!(propose(&tokens, 1), vec![7]);
        // A longer match beats a later shorter one: "5 1 2 3" → 7, over "9 2 3"'s nothing.
        let tokens = [5, 1, 2, 3, 7, 0, 2, 3, 6, 5, 1, 2, 3];
        assert_eq!(propose(&tokens, 2), vec![7, 0]);
    }

    #[test]
    fn a_continuation_stops_at_the_end_and_nothing_matches_gives_nothing() {
        // The match right before the key continues into the key itself.
        assert_eq!(propose(&[4, 4, 4, 4], 8), vec![4]);
        assert_eq!(propose(&[1, 2, 3, 4, 5], 4), Vec::<u32>::new());
        assert_eq!(propose(&[1], 4), Vec::<u32>::new());
    }
}
