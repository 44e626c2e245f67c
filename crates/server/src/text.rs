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

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: a tiny deterministic generator for the property tests.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        /// Up to `max_pieces - 1` random pieces.
        fn text(&mut self, pieces: &[&str], max_pieces: usize) -> String {
            let len = self.below(max_pieces);
            (0..len).map(|_| pieces[self.below(pieces.len())]).collect()
        }

        /// Splits `text` at random char boundaries (empty deltas included).
        fn split<'a>(&mut self, text: &'a str) -> Vec<&'a str> {
            let mut cuts: Vec<usize> = (0..self.below(text.len() + 2))
                .map(|_| self.below(text.len() + 1))
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            cuts.push(0);
            cuts.push(text.len());
            cuts.sort_unstable();
            cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect()
        }
    }

    /// Every char boundary a cut: the finest split a `&str` stream allows (bytewise for ASCII).
    fn char_split(text: &str) -> Vec<&str> {
        let mut bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        bounds.push(text.len());
        bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect()
    }

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// Runs deltas through a matcher: (everything emitted, stopped), checking as it goes that
    /// nothing is emitted after a stop.
    fn run_stop(stop_list: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops(stop_list));
        let mut out = String::new();
        for d in deltas {
            let was_stopped = m.stopped();
            let o = m.push(d);
            if was_stopped {
                assert!(o.stopped && o.emit.is_empty());
            }
            out.push_str(&o.emit);
        }
        if m.stopped() {
            assert_eq!(m.finish(), "");
        } else {
            out.push_str(&m.finish());
        }
        (out, m.stopped())
    }

    /// What a stop matcher must produce: the text up to the earliest stop string.
    fn expected_stop(stop_list: &[&str], text: &str) -> (String, bool) {
        match stop_list
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s))
            .min()
        {
            Some(at) => (text[..at].to_string(), true),
            None => (text.to_string(), false),
        }
    }

    #[test]
    fn stop_passes_through_without_stops() {
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(
            m.push("a<b"),
            StopOutput {
                emit: "a<b".into(),
                stopped: false
            }
        );
        assert_eq!(m.finish(), "");
        let mut m = StopMatcher::new(stops(&[""]));
        assert_eq!(m.push("x").emit, "x");
        assert!(!m.stopped());
    }

    #[test]
    fn stop_within_one_delta() {
        let mut m = StopMatcher::new(stops(&["END"]));
        assert_eq!(
            m.push("Hello END world"),
            StopOutput {
                emit: "Hello ".into(),
                stopped: true
            }
        );
        assert!(m.stopped());
        assert_eq!(
            m.push("more"),
            StopOutput {
                emit: String::new(),
                stopped: true
            }
        );
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn stop_split_across_deltas_holds_back() {
        let mut m = StopMatcher::new(stops(&["END"]));
        assert_eq!(m.push("Hel").emit, "Hel");
        assert_eq!(m.push("lo E").emit, "lo ");
        assert_eq!(m.push("N").emit, "");
        let o = m.push("D and more");
        assert_eq!((o.emit.as_str(), o.stopped), ("", true));

        // A false start is released as soon as it cannot be a stop any more.
        let mut m = StopMatcher::new(stops(&["END"]));
        assert_eq!(m.push("ab E").emit, "ab ");
        assert_eq!(m.push("N").emit, "");
        assert_eq!(m.push("x").emit, "ENx");
        assert!(!m.stopped());
        // And at the end of generation.
        assert_eq!(m.push("yE").emit, "y");
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn earliest_stop_wins() {
        assert_eq!(run_stop(&["cd", "abc"], &["xabcd"]), ("x".into(), true));
        assert_eq!(run_stop(&["bcd", "abc"], &["ab", "cd"]), ("".into(), true));
        assert_eq!(run_stop(&["abc", "ab"], &["zab"]), ("z".into(), true));
        // A long stop's partial match does not hide a short one inside it.
        assert_eq!(
            run_stop(&["abcdef", "cd"], &["ab", "c", "d"]),
            ("ab".into(), true)
        );
        assert_eq!(
            run_stop(&["aab"], &["a", "a", "a", "b"]),
            ("a".into(), true)
        );
    }

    #[test]
    fn stop_multibyte() {
        assert_eq!(
            run_stop(&["日本"], &["これは日", "本です"]),
            ("これは".into(), true)
        );
        assert_eq!(
            run_stop(&["é!"], &["caf", "é", "!", "x"]),
            ("caf".into(), true)
        );
        // A held multibyte char is released whole.
        let mut m = StopMatcher::new(stops(&["éa"]));
        assert_eq!(m.push("xé").emit, "x");
        assert_eq!(m.push("b").emit, "éb");
        // A stop that shares a lead byte but not the char does not hold.
        let mut m = StopMatcher::new(stops(&["é"]));
        assert_eq!(m.push("è").emit, "è");
        let mut m = StopMatcher::new(stops(&["🦀x"]));
        assert_eq!(m.push("a🦀").emit, "a");
        let o = m.push("x");
        assert_eq!((o.emit.as_str(), o.stopped), ("", true));
    }

    #[test]
    fn stop_never_leaks_when_split_finest() {
        for stop in ["END", "\n\n", "</s>", "é!", "日本語", "a🦀b", "x"] {
            let text = format!("hello {stop} after");
            let (out, stopped) = run_stop(&[stop], &char_split(&text));
            assert_eq!(out, "hello ", "stop {stop:?}");
            assert!(stopped);
            // Every prefix of the stop string, at the end of generation, comes out on finish.
            for (cut, _) in stop.char_indices().skip(1) {
                let text = format!("tail {}", &stop[..cut]);
                assert_eq!(run_stop(&[stop], &char_split(&text)), (text.clone(), false));
            }
        }
    }

    #[test]
    fn stop_property_random_splits() {
        let pieces = ["a", "b", "ab", "é", "日", "\n", " ", "🦀", "<", "/"];
        let stop_sets: [&[&str]; 6] = [
            &["ab"],
            &["aab", "b\n"],
            &["é日", "\n\n"],
            &["🦀🦀", "ba"],
            &["</", "aaaa"],
            &["a", "日"],
        ];
        let mut rng = Rng(7);
        for round in 0..3000 {
            let set = stop_sets[round % stop_sets.len()];
            let text = rng.text(&pieces, 24);
            let expected = expected_stop(set, &text);
            assert_eq!(run_stop(set, &[&text]), expected, "{set:?} {text:?}");
            for _ in 0..4 {
                let deltas = rng.split(&text);
                assert_eq!(run_stop(set, &deltas), expected, "{set:?} {deltas:?}");
            }
            assert_eq!(
                run_stop(set, &char_split(&text)),
                expected,
                "{set:?} {text:?}"
            );
        }
    }

    fn run_reasoning(starts_in_reasoning: bool, deltas: &[&str]) -> (String, String) {
        let mut p = ReasoningParser::new(starts_in_reasoning);
        let (mut reasoning, mut content) = (String::new(), String::new());
        for d in deltas {
            let (r, c) = p.push(d);
            reasoning.push_str(&r);
            content.push_str(&c);
        }
        let (r, c) = p.finish();
        reasoning.push_str(&r);
        content.push_str(&c);
        (reasoning, content)
    }

    fn pair(r: &str, c: &str) -> (String, String) {
        (r.to_string(), c.to_string())
    }

    #[test]
    fn reasoning_qwen3_shapes() {
        let full = "<think>\nLet me think.\n</think>\n\nThe answer.";
        assert_eq!(
            run_reasoning(false, &[full]),
            pair("Let me think.", "The answer.")
        );
        // The prompt already opened `<think>\n`.
        assert_eq!(
            run_reasoning(true, &["Let me think.\n</think>\n\nThe answer."]),
            pair("Let me think.", "The answer.")
        );
        assert_eq!(run_reasoning(true, &["\nabc</think>x"]), pair("abc", "x"));
        // Empty thinking, as with enable_thinking=false rendered by the model itself.
        assert_eq!(
            run_reasoning(false, &["<think>\n\n</think>\n\nHello"]),
            pair("", "Hello")
        );
        // No tags: content untouched, leading newlines included.
        assert_eq!(
            run_reasoning(false, &["\n\nplain a < b > c"]),
            pair("", "\n\nplain a < b > c")
        );
        // Only the framing newlines are trimmed.
        assert_eq!(
            run_reasoning(false, &["<think>\n\nx\n\n</think>\n\n\ny\n"]),
            pair("\nx\n", "\ny\n")
        );
        assert_eq!(run_reasoning(false, &["<think>x</think>y"]), pair("x", "y"));
        // Text before `<think>` is content.
        assert_eq!(
            run_reasoning(false, &["pre<think>r</think>post"]),
            pair("r", "prepost")
        );
    }

    #[test]
    fn reasoning_tags_split_across_deltas() {
        let deltas = [
            "<th", "ink>", "\n", "abc", "\n</", "think", ">", "\n", "\nx",
        ];
        assert_eq!(run_reasoning(false, &deltas), pair("abc", "x"));
        let mut p = ReasoningParser::new(false);
        assert_eq!(p.push("<"), pair("", ""));
        assert_eq!(p.push("think"), pair("", ""));
        assert!(!p.in_reasoning());
        assert_eq!(p.push(">\nreason"), pair("reason", ""));
        assert!(p.in_reasoning());
        assert_eq!(p.push("ing\n"), pair("ing", ""));
        assert_eq!(p.push("</think"), pair("", ""));
        assert_eq!(p.push(">"), pair("", ""));
        assert!(!p.in_reasoning());
        assert_eq!(p.push("\n\nHi"), pair("", "Hi"));
        assert_eq!(p.finish(), pair("", ""));
    }

    #[test]
    fn reasoning_finish_flushes() {
        // A partial tag that never completes is text.
        assert_eq!(run_reasoning(false, &["abc <thi"]), pair("", "abc <thi"));
        assert_eq!(run_reasoning(false, &["abc </"]), pair("", "abc </"));
        // Reasoning cut off (length) stays reasoning, its held "\n" included.
        assert_eq!(run_reasoning(false, &["<think>\nabc\n"]), pair("abc\n", ""));
        assert_eq!(
            run_reasoning(true, &["abc\n</thin"]),
            pair("abc\n</thin", "")
        );
        let mut p = ReasoningParser::new(true);
        assert_eq!(p.push("r"), pair("r", ""));
        assert_eq!(p.push("\n"), pair("", ""));
        assert_eq!(p.finish(), pair("\n", ""));
    }

    #[test]
    fn reasoning_stray_tags_are_dropped() {
        assert_eq!(run_reasoning(false, &["a</think>\n\nb"]), pair("", "ab"));
        assert_eq!(
            run_reasoning(true, &["a<think>\nb</think>c"]),
            pair("ab", "c")
        );
        // A second thinking block goes to reasoning too.
        assert_eq!(
            run_reasoning(false, &["<think>a</think>b<think>c</think>d"]),
            pair("ac", "bd")
        );
    }

    #[test]
    fn reasoning_multibyte() {
        assert_eq!(
            run_reasoning(true, &["思考", "中\n</", "think>\n\n答え🦀"]),
            pair("思考中", "答え🦀")
        );
        assert_eq!(run_reasoning(false, &["é<", "think>ü"]), pair("ü", "é"));
    }

    #[test]
    fn reasoning_property_random_splits() {
        let pieces = [
            "<think>",
            "</think>",
            "\n",
            "\n\n",
            "a",
            "é",
            "日本",
            "<",
            "</",
            "<thi",
            "think>",
            ">",
            " ",
            "🦀",
            "\n</think>",
        ];
        let mut rng = Rng(11);
        for round in 0..3000 {
            let starts = round % 2 == 0;
            let text = rng.text(&pieces, 20);
            let expected = run_reasoning(starts, &[&text]);
            for _ in 0..4 {
                let deltas = rng.split(&text);
                assert_eq!(
                    run_reasoning(starts, &deltas),
                    expected,
                    "{starts} {deltas:?}"
                );
            }
            assert_eq!(
                run_reasoning(starts, &char_split(&text)),
                expected,
                "{starts} {text:?}"
            );
        }
    }

    #[test]
    fn reasoning_matches_a_whole_text_reference() {
        // An independent, non-incremental statement of the rules, for texts whose tags do not
        // overlap each other.
        fn reference(starts: bool, text: &str) -> (String, String) {
            let (mut reasoning, mut content) = (String::new(), String::new());
            let mut in_reasoning = starts;
            let mut trim = usize::from(starts);
            let mut rest = text;
            loop {
                let next = ["<think>", "</think>"]
                    .iter()
                    .filter_map(|t| rest.find(t).map(|at| (at, *t)))
                    .min();
                let (mut chunk, tag) = match next {
                    Some((at, t)) => (&rest[..at], Some(t)),
                    None => (rest, None),
                };
                if tag == Some("</think>") && in_reasoning {
                    chunk = chunk.strip_suffix('\n').unwrap_or(chunk);
                }
                while trim > 0 && chunk.starts_with('\n') {
                    chunk = &chunk[1..];
                    trim -= 1;
                }
                if in_reasoning {
                    &mut reasoning
                } else {
                    &mut content
                }
                .push_str(chunk);
                match tag {
                    Some(t) => {
                        rest = &rest[rest.find(t).unwrap() + t.len()..];
                        in_reasoning = t == "<think>";
                        trim = if in_reasoning { 1 } else { 2 };
                    }
                    None => return (reasoning, content),
                }
            }
        }
        let pieces = ["<think>", "</think>", "\n", "a", "é", " ", "\n\n"];
        let mut rng = Rng(3);
        for round in 0..2000 {
            let starts = round % 2 == 1;
            let text = rng.text(&pieces, 16);
            let deltas = rng.split(&text);
            assert_eq!(
                run_reasoning(starts, &deltas),
                reference(starts, &text),
                "{text:?}"
            );
        }
    }
}
