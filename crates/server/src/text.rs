//! Post-processing of streamed text deltas: cutting at stop strings ([`StopMatcher`]) and
//! splitting `<think>` reasoning from the answer ([`ReasoningParser`]).
//!
//! Both are incremental: they take deltas as the detokenizer yields them, return what is safe
//! to send now, and hold back only a suffix that may still turn into a stop string or a tag.
//! For any split of a text into deltas, the concatenated outputs equal those for the whole text
//! in one delta.

/// What [`StopMatcher::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text safe to send now.
    pub emit: String,
    /// A stop string completed: `emit` ends just before it and generation should end.
    pub stopped: bool,
}

/// Cuts streamed text at the first stop string, never sending any part of it.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Longest stop string, in bytes.
    max_len: usize,
    /// Text held back because it may be the start of a stop string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty strings are dropped (they would match before any text).
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            max_len,
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has been seen; later pushes return nothing.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped {
            return StopOutput {
                emit: String::new(),
                stopped: true,
            };
        }
        if self.stops.is_empty() {
            return StopOutput {
                emit: delta.to_owned(),
                stopped: false,
            };
        }
        self.held.push_str(delta);
        // The earliest match wins. Held text alone never contains a whole stop string (it
        // would have matched on an earlier push), so searching all of it repeats no work that
        // matters: it is shorter than the longest stop string.
        let first = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()))
            .min();
        if let Some(at) = first {
            self.held.truncate(at);
            self.stopped = true;
            return StopOutput {
                emit: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let keep = self.partial_suffix_len();
        let tail = self.held.split_off(self.held.len() - keep);
        StopOutput {
            emit: std::mem::replace(&mut self.held, tail),
            stopped: false,
        }
    }

    /// The text still held back, at the end of generation (which did not stop on a string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    /// It starts on a char boundary (a stop string's first byte never continues a char).
    fn partial_suffix_len(&self) -> usize {
        let text = self.held.as_bytes();
        let from = text.len().saturating_sub(self.max_len.saturating_sub(1));
        (from..text.len())
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| {
                let suffix = &text[i..];
                self.stops
                    .iter()
                    .any(|stop| stop.len() > suffix.len() && stop.as_bytes().starts_with(suffix))
            })
            .map_or(0, |i| text.len() - i)
    }
}

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";
/// In reasoning, a `\n` just before `</think>` is held too, so it can be trimmed.
const NEWLINE_THINK_END: &str = "\n</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Reasoning,
    Content,
}

/// Splits streamed text into reasoning (inside `<think>...</think>`) and content.
///
/// Whitespace: Qwen3 writes `<think>\n{reasoning}\n</think>\n\n{content}`. The parser trims
/// exactly that framing: one `\n` right after `<think>` (and at the very start when the
/// prompt already opened `<think>`), one `\n` right before `</think>`, and up to two `\n` right
/// after `</think>`. This is what Qwen3's own chat template strips when it renders a past
/// assistant turn (`reasoning_content.strip('\n')`, `content.lstrip('\n')`), so reasoning and
/// content sent back in a later request render as the model wrote them; vLLM's Qwen3 parser
/// leaves the newlines in, which clients then strip. Nothing else is trimmed.
///
/// Tags: `<think>` switches to reasoning and `</think>` to content, wherever they appear;
/// a tag that does not change the section (a stray `</think>` in content) is dropped too.
/// Tags are never emitted.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    section: Section,
    /// Text held back because it may be the start of a tag (or of `\n</think>`).
    held: String,
    /// How many more leading `\n` to drop from the current section's text; reset to 0 once
    /// anything else is emitted.
    trim_newlines: usize,
}

impl ReasoningParser {
    /// `starts_in_reasoning`: the prompt already opened `<think>`.
    pub fn new(starts_in_reasoning: bool) -> Self {
        let (section, trim_newlines) = if starts_in_reasoning {
            (Section::Reasoning, 1)
        } else {
            (Section::Content, 0)
        };
        Self {
            section,
            held: String::new(),
            trim_newlines,
        }
    }

    /// Whether text now goes to reasoning.
    pub fn in_reasoning(&self) -> bool {
        self.section == Section::Reasoning
    }

    /// Returns `(reasoning, content)` safe to send now; either may be empty.
    pub fn push(&mut self, delta: &str) -> (String, String) {
        let mut out = (String::new(), String::new());
        let mut text = std::mem::take(&mut self.held);
        text.push_str(delta);
        let mut rest: &str = &text;
        loop {
            let start = rest.find(THINK_START).map(|at| (at, THINK_START));
            let end = rest.find(THINK_END).map(|at| (at, THINK_END));
            let tag = match (start, end) {
                (Some(a), Some(b)) => Some(if a.0 < b.0 { a } else { b }),
                (a, b) => a.or(b),
            };
            let Some((at, tag)) = tag else { break };
            let mut before = &rest[..at];
            if tag == THINK_END && self.section == Section::Reasoning {
                before = before.strip_suffix('\n').unwrap_or(before);
            }
            self.emit(before, &mut out);
            rest = &rest[at + tag.len()..];
            if tag == THINK_START {
                self.section = Section::Reasoning;
                self.trim_newlines = 1;
            } else {
                self.section = Section::Content;
                self.trim_newlines = 2;
            }
        }
        let keep = self.partial_suffix_len(rest);
        let (now, later) = rest.split_at(rest.len() - keep);
        self.emit(now, &mut out);
        self.held = later.to_owned();
        out
    }

    /// Releases held text at the end of generation, as `(reasoning, content)`.
    pub fn finish(&mut self) -> (String, String) {
        let mut out = (String::new(), String::new());
        let held = std::mem::take(&mut self.held);
        self.emit(&held, &mut out);
        out
    }

    fn emit(&mut self, mut text: &str, out: &mut (String, String)) {
        while self.trim_newlines > 0
            && let Some(stripped) = text.strip_prefix('\n')
        {
            text = stripped;
            self.trim_newlines -= 1;
        }
        if text.is_empty() {
            return;
        }
        self.trim_newlines = 0;
        match self.section {
            Section::Reasoning => out.0.push_str(text),
            Section::Content => out.1.push_str(text),
        }
    }

    /// Length of the longest suffix of `text` that may grow into a tag (all tags are ASCII,
    /// so such a suffix starts on a char boundary).
    fn partial_suffix_len(&self, text: &str) -> usize {
        let patterns: &[&str] = match self.section {
            Section::Reasoning => &[THINK_START, THINK_END, NEWLINE_THINK_END],
            Section::Content => &[THINK_START, THINK_END],
        };
        let bytes = text.as_bytes();
        let longest = NEWLINE_THINK_END.len() - 1;
        (bytes.len().saturating_sub(longest)..bytes.len())
            .find(|&i| {
                let suffix = &bytes[i..];
                patterns
                    .iter()
                    .any(|p| p.len() > suffix.len() && p.as_bytes().starts_with(suffix))
            })
            .map_or(0, |i| bytes.len() - i)
    }
}
