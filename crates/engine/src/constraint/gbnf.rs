//! llama.cpp's GBNF grammars, rewritten as the Lark grammars llguidance compiles.
//!
//! GBNF (llama.cpp's `grammars/README.md`): rules `name ::= alternatives`; strings `"…"`,
//! character classes `[a-z]` and `[^…]`, `.` for any character, rule references, groups
//! `( … )`, the postfix operators `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`, and `#` comments. A
//! rule's body may start on the line after `::=` and continue on new lines after a `|` or
//! inside parentheses; elsewhere a line break ends it. `root` is the start.
//!
//! The rewrite is structural: each rule becomes a Lark rule under a name Lark accepts (lower
//! case, `_` for `-`), strings become JSON string literals, classes and `.` become regular
//! expressions over `\x{…}` escapes, so no character of the input needs Lark's own quoting.

use std::collections::HashMap;
use std::fmt::Write;

/// GBNF text as a Lark grammar whose `start` is the GBNF `root`; errors name the place.
pub fn to_lark(gbnf: &str) -> Result<String, String> {
    let rules = Parser::new(gbnf).grammar()?;
    if !rules.iter().any(|r| r.name == "root") {
        return Err("the grammar has no `root` rule".into());
    }
    let mut names: HashMap<&str, String> = HashMap::new();
    for rule in &rules {
        if names.contains_key(rule.name.as_str()) {
            continue;
        }
        let base = format!("r_{}", rule.name.to_lowercase().replace('-', "_"));
        let mut name = base.clone();
        let mut n = 1;
        while names.values().any(|v| *v == name) {
            n += 1;
            name = format!("{base}_{n}");
        }
        names.insert(&rule.name, name);
    }
    let mut out = format!("start: {}\n", names["root"]);
    // A rule defined twice takes both bodies as alternatives.
    let mut bodies: Vec<(&str, Vec<&Expr>)> = Vec::new();
    for rule in &rules {
        match bodies.iter_mut().find(|(n, _)| *n == rule.name) {
            Some((_, list)) => list.push(&rule.body),
            None => bodies.push((&rule.name, vec![&rule.body])),
        }
    }
    for (name, list) in bodies {
        let mut body = String::new();
        for (i, expr) in list.iter().enumerate() {
            if i > 0 {
                body.push_str(" | ");
            }
            emit(expr, &names, &mut body)?;
        }
        writeln!(out, "{}: {body}", names[name]).expect("writing to a String");
    }
    Ok(out)
}

#[derive(Debug, Clone, PartialEq)]
enum Expr {
    /// Alternatives.
    Choice(Vec<Expr>),
    /// A sequence (possibly empty).
    Seq(Vec<Expr>),
    Literal(String),
    /// Ranges of characters, or their complement.
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
    Ref(String),
    Repeat {
        inner: Box<Expr>,
        min: u32,
        max: Option<u32>,
    },
}

struct Rule {
    name: String,
    body: Expr,
}

fn emit(expr: &Expr, names: &HashMap<&str, String>, out: &mut String) -> Result<(), String> {
    match expr {
        Expr::Choice(alts) => {
            out.push('(');
            for (i, a) in alts.iter().enumerate() {
                if i > 0 {
                    out.push_str(" | ");
                }
                emit(a, names, out)?;
            }
            out.push(')');
        }
        Expr::Seq(items) if items.is_empty() => out.push_str("\"\""),
        Expr::Seq(items) => {
            out.push('(');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(' ');
                }
                emit(item, names, out)?;
            }
            out.push(')');
        }
        Expr::Literal(s) => {
            out.push_str(&serde_json::to_string(s).expect("a string serialises"));
        }
        Expr::Class { negated, ranges } => {
            out.push_str(if *negated { "/[^" } else { "/[" });
            for &(lo, hi) in ranges {
                write!(out, "\\x{{{:x}}}", lo as u32).expect("writing to a String");
                if hi != lo {
                    write!(out, "-\\x{{{:x}}}", hi as u32).expect("writing to a String");
                }
            }
            out.push_str("]/");
        }
        Expr::Any => out.push_str("/(?s:.)/"),
        Expr::Ref(name) => match names.get(name.as_str()) {
            Some(n) => out.push_str(n),
            None => return Err(format!("rule `{name}` is used but never defined")),
        },
        Expr::Repeat { inner, min, max } => {
            emit(inner, names, out)?;
            match (min, max) {
                (0, None) => out.push('*'),
                (1, None) => out.push('+'),
                (0, Some(1)) => out.push('?'),
                (m, None) => write!(out, "{{{m},}}").expect("writing to a String"),
                (m, Some(n)) if m == n => write!(out, "{{{m}}}").expect("writing to a String"),
                (m, Some(n)) => write!(out, "{{{m},{n}}}").expect("writing to a String"),
            }
        }
    }
    Ok(())
}

struct Parser {
    chars: Vec<char>,
    at: usize,
}

impl Parser {
    fn new(text: &str) -> Self {
        Parser {
            chars: text.chars().collect(),
            at: 0,
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn error(&self, what: &str) -> String {
        let before: String = self.chars[..self.at.min(self.chars.len())].iter().collect();
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        format!("GBNF grammar, line {line}, column {column}: {what}")
    }

    /// Spaces and comments; line breaks too when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.at += 1,
                '\r' | '\n' if newlines => self.at += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.at += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.at;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            self.at += 1;
        }
        (self.at > start).then(|| self.chars[start..self.at].iter().collect())
    }

    fn grammar(&mut self) -> Result<Vec<Rule>, String> {
        let mut rules = Vec::new();
        loop {
            self.space(true);
            if self.peek().is_none() {
                return Ok(rules);
            }
            let name = self
                .name()
                .ok_or_else(|| self.error("expected a rule name"))?;
            self.space(false);
            if !self.eat("::=") {
                return Err(self.error(&format!("expected `::=` after `{name}`")));
            }
            self.space(true);
            let body = self.alternatives(false)?;
            match self.peek() {
                None | Some('\n' | '\r') => {}
                Some(c) => return Err(self.error(&format!("unexpected `{c}`"))),
            }
            rules.push(Rule { name, body });
        }
    }

    fn eat(&mut self, s: &str) -> bool {
        let n = s.chars().count();
        if self.chars.len() >= self.at + n
            && self.chars[self.at..self.at + n]
                .iter()
                .copied()
                .eq(s.chars())
        {
            self.at += n;
            true
        } else {
            false
        }
    }

    fn alternatives(&mut self, nested: bool) -> Result<Expr, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.at += 1;
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().expect("one")
        } else {
            Expr::Choice(alts)
        })
    }

    fn sequence(&mut self, nested: bool) -> Result<Expr, String> {
        let mut items = Vec::new();
        loop {
            let item = match self.peek() {
                Some('"') => Expr::Literal(self.literal()?),
                Some('[') => self.class()?,
                Some('.') => {
                    self.at += 1;
                    Expr::Any
                }
                Some('(') => {
                    self.at += 1;
                    self.space(true);
                    let inner = self.alternatives(true)?;
                    if self.peek() != Some(')') {
                        return Err(self.error("expected `)`"));
                    }
                    self.at += 1;
                    inner
                }
                Some(c) if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                    Expr::Ref(self.name().expect("a name character"))
                }
                _ => break,
            };
            let item = self.postfix(item)?;
            items.push(item);
            self.space(nested);
        }
        Ok(if items.len() == 1 {
            items.pop().expect("one")
        } else {
            Expr::Seq(items)
        })
    }

    fn postfix(&mut self, mut item: Expr) -> Result<Expr, String> {
        loop {
            let (min, max) = match self.peek() {
                Some('*') => (0, None),
                Some('+') => (1, None),
                Some('?') => (0, Some(1)),
                Some('{') => {
                    self.at += 1;
                    self.space(false);
                    let min = self.number()?;
                    self.space(false);
                    let max = if self.peek() == Some(',') {
                        self.at += 1;
                        self.space(false);
                        if self.peek() == Some('}') {
                            None
                        } else {
                            Some(self.number()?)
                        }
                    } else {
                        Some(min)
                    };
                    self.space(false);
                    if self.peek() != Some('}') {
                        return Err(self.error("expected `}` closing a repetition"));
                    }
                    if max.is_some_and(|m| m < min) {
                        return Err(self.error("a repetition's maximum is below its minimum"));
                    }
                    (min, max)
                }
                _ => return Ok(item),
            };
            self.at += 1;
            item = Expr::Repeat {
                inner: Box::new(item),
                min,
                max,
            };
        }
    }

    fn number(&mut self) -> Result<u32, String> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.at += 1;
        }
        let digits: String = self.chars[start..self.at].iter().collect();
        digits
            .parse()
            .map_err(|_| self.error("expected a number in a repetition"))
    }

    /// One character of a string or class, escapes decoded.
    fn char(&mut self, end: char) -> Result<char, String> {
        let c = self
            .peek()
            .ok_or_else(|| self.error(&format!("unterminated: expected `{end}`")))?;
        self.at += 1;
        if c != '\\' {
            return Ok(c);
        }
        let e = self
            .peek()
            .ok_or_else(|| self.error("an escape at the end of the text"))?;
        self.at += 1;
        let hex = |p: &mut Self, digits: usize| -> Result<char, String> {
            let start = p.at;
            p.at = (p.at + digits).min(p.chars.len());
            let s: String = p.chars[start..p.at].iter().collect();
            u32::from_str_radix(&s, 16)
                .ok()
                .filter(|_| s.len() == digits)
                .and_then(char::from_u32)
                .ok_or_else(|| p.error(&format!("bad escape `\\{e}{s}`")))
        };
        Ok(match e {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            '0' => '\0',
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            '\\' | '"' | '[' | ']' | '-' | '^' | '/' => e,
            _ => return Err(self.error(&format!("unknown escape `\\{e}`"))),
        })
    }

    fn literal(&mut self) -> Result<String, String> {
        self.at += 1; // the opening quote
        let mut s = String::new();
        while self.peek() != Some('"') {
            if self.peek().is_none() || self.peek() == Some('\n') {
                return Err(self.error("unterminated string"));
            }
            s.push(self.char('"')?);
        }
        self.at += 1;
        Ok(s)
    }

    fn class(&mut self) -> Result<Expr, String> {
        self.at += 1; // `[`
        let negated = self.peek() == Some('^');
        if negated {
            self.at += 1;
        }
        let mut ranges = Vec::new();
        while self.peek() != Some(']') {
            if self.peek().is_none() {
                return Err(self.error("unterminated character class"));
            }
            let lo = self.char(']')?;
            let hi = if self.peek() == Some('-') && self.chars.get(self.at + 1) != Some(&']') {
                self.at += 1;
                self.char(']')?
            } else {
                lo
            };
            if hi < lo {
                return Err(self.error(&format!("the range `{lo}-{hi}` runs backwards")));
            }
            ranges.push((lo, hi));
        }
        self.at += 1;
        if ranges.is_empty() && !negated {
            return Err(self.error("an empty character class matches nothing"));
        }
        Ok(Expr::Class { negated, ranges })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_strings_classes_and_repetitions() {
        let lark = to_lark(
            "root ::= greeting (\" \" name)? \"!\"{1,3}  # a comment\n\
             greeting ::= \"hi\" | \"hello\"\n\
             name ::= [A-Z] [a-z-]* .\n",
        )
        .unwrap();
        assert_eq!(
            lark,
            "start: r_root\n\
             r_root: (r_greeting (\" \" r_name)? \"!\"{1,3})\n\
             r_greeting: (\"hi\" | \"hello\")\n\
             r_name: (/[\\x{41}-\\x{5a}]/ /[\\x{61}-\\x{7a}\\x{2d}]/* /(?s:.)/)\n"
        );
    }

    #[test]
    fn bodies_continue_after_a_bar_and_inside_parentheses() {
        let lark = to_lark(
            "root ::=\n  \"{\" ws (\n    pair\n    (\",\" ws pair)*\n  )? \"}\"\n\
             pair ::= \"a\" |\n  \"b\"\nws ::= [ \\t\\n]*\n",
        )
        .unwrap();
        assert!(
            lark.contains("r_root: (\"{\" r_ws (r_pair (\",\" r_ws r_pair)*)? \"}\")"),
            "{lark}"
        );
        assert!(lark.contains("r_pair: (\"a\" | \"b\")"), "{lark}");
        assert!(lark.contains("r_ws: /[\\x{20}\\x{9}\\x{a}]/*"), "{lark}");
    }

    #[test]
    fn escapes_and_names_lark_would_misread() {
        let lark =
            to_lark("root ::= my-Rule\nmy-Rule ::= \"say \\\"\\u00e9\\\"\\n\" [^\\]]\n").unwrap();
        assert!(
            lark.contains("start: r_my_rule\n") || lark.contains("r_root"),
            "{lark}"
        );
        assert!(
            lark.contains("r_my_rule: (\"say \\\"é\\\"\\n\" /[^\\x{5d}]/)"),
            "{lark}"
        );
    }

    #[test]
    fn mistakes_are_named_with_their_place() {
        let e = to_lark("root ::= \"a\" missing\n").unwrap_err();
        assert!(e.contains("`missing` is used but never defined"), "{e}");
        let e = to_lark("greeting ::= \"hi\"\n").unwrap_err();
        assert!(e.contains("no `root`"), "{e}");
        let e = to_lark("root ::= \"a\nb\"\n").unwrap_err();
        assert!(
            e.contains("line 1") && e.contains("unterminated string"),
            "{e}"
        );
        let e = to_lark("root ::= [z-a]\n").unwrap_err();
        assert!(e.contains("runs backwards"), "{e}");
        let e = to_lark("root = \"a\"\n").unwrap_err();
        assert!(e.contains("expected `::=`"), "{e}");
        let e = to_lark("root ::= \"a\"{3,1}\n").unwrap_err();
        assert!(e.contains("maximum is below"), "{e}");
    }
}
