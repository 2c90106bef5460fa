//! Hand-written matchers for the split regexes that byte-level BPE models use (GPT-2's,
//! which ByteLevel applies, and the Llama 3 / Qwen 2 Split regexes). Each is the regex's
//! backtracking semantics written out: at every position the first alternative that
//! matches wins, as Oniguruma (`tokenizers`) and fancy-regex run it. They give the same
//! matches as the compiled regex (tests/test_edge_tokenizer.py holds the whole pipeline
//! to `tokenizers`) at a few ns a char instead of fancy-regex's ~1 µs a word (its
//! backtracking VM runs the whole alternation because of the `\s+(?!\S)` lookahead).
//!
//! Every position starts a match (the alternatives cover every char), so a split is a
//! walk: match at 0, then at its end, and so on.

use std::sync::OnceLock;

use super::pretok::BYTE_LEVEL_REGEX;
use super::unicode_classes::{LETTERS, NUMBERS, SPACES};

/// Llama 3's split (tokenizer.ggml.pre "llama-bpe" and its tokenizer.json).
pub const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's: Llama 3's with single digits.
pub const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastSplit {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// LLAMA3_REGEX with `\p{N}{1,max_digits}`.
    Llama3 { max_digits: usize },
}

impl FastSplit {
    /// The matcher for `pattern`, if it is one of the known regexes (its char tables
    /// are built now, not on the first request).
    pub fn for_regex(pattern: &str) -> Option<FastSplit> {
        let fast = match pattern {
            BYTE_LEVEL_REGEX => FastSplit::Gpt2,
            LLAMA3_REGEX => FastSplit::Llama3 { max_digits: 3 },
            QWEN2_REGEX => FastSplit::Llama3 { max_digits: 1 },
            _ => return None,
        };
        classes();
        Some(fast)
    }

    /// Calls `piece` with each match of `text` in order (they cover all of it).
    pub fn split<'a>(self, text: &'a str, piece: &mut dyn FnMut(&'a str)) {
        let classes = classes();
        let mut p = 0;
        while p < text.len() {
            let end = match self {
                FastSplit::Gpt2 => gpt2_match(classes, text, p),
                FastSplit::Llama3 { max_digits } => llama3_match(classes, text, p, max_digits),
            };
            // every alternative consumes at least one char; guard the walk regardless
            let end = if end > p { end } else { p + char_len(text, p) };
            piece(&text[p..end]);
            p = end;
        }
    }
}

const LETTER: u8 = 1;
const NUMBER: u8 = 2;
const SPACE: u8 = 4;

/// \p{L}, \p{N} and \s of the regex engine's Unicode tables, per code point.
struct Classes {
    /// Code points below 0x10000.
    bmp: Vec<u8>,
    /// (first, last, class) runs above the BMP, sorted.
    astral: Vec<(u32, u32, u8)>,
}

impl Classes {
    #[inline]
    fn of(&self, c: char) -> u8 {
        let cp = u32::from(c);
        if cp < 0x10000 {
            return self.bmp[cp as usize];
        }
        match self.astral.binary_search_by(|&(lo, hi, _)| {
            if hi < cp {
                std::cmp::Ordering::Less
            } else if lo > cp {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        }) {
            Ok(i) => self.astral[i].2,
            Err(_) => 0,
        }
    }
}

/// Built once per process (a 64 KiB table) from unicode_classes.rs.
fn classes() -> &'static Classes {
    static CLASSES: OnceLock<Classes> = OnceLock::new();
    CLASSES.get_or_init(build_classes)
}

fn build_classes() -> Classes {
    let mut bmp = vec![0u8; 0x10000];
    let mut astral: Vec<(u32, u32, u8)> = Vec::new();
    let tables = [(LETTERS, LETTER), (NUMBERS, NUMBER), (SPACES, SPACE)];
    for (ranges, flag) in tables {
        for &(first, last) in ranges {
            for cp in first..=last.min(0xFFFF) {
                bmp[cp as usize] |= flag;
            }
            if last >= 0x10000 {
                astral.push((first.max(0x10000), last, flag));
            }
        }
    }
    // the classes are disjoint, so the runs do not overlap
    astral.sort_unstable();
    Classes { bmp, astral }
}

#[inline]
fn char_len(text: &str, p: usize) -> usize {
    text[p..].chars().next().map_or(1, char::len_utf8)
}

#[inline]
fn char_at(text: &str, p: usize) -> Option<char> {
    text.get(p..).and_then(|s| s.chars().next())
}

/// End of the run of chars from `p` whose class `keep` accepts.
#[inline]
fn run(classes: &Classes, text: &str, p: usize, keep: impl Fn(u8) -> bool) -> usize {
    let mut end = p;
    for c in text[p..].chars() {
        if !keep(classes.of(c)) {
            break;
        }
        end += c.len_utf8();
    }
    end
}

fn is_other(class: u8) -> bool {
    class == 0
}

/// `\s+(?!\S)|\s+` at a whitespace char: the run, less its last char when a non-space
/// follows and the run has more than one char (that char goes with the next word).
fn whitespace(classes: &Classes, text: &str, p: usize) -> usize {
    let end = run(classes, text, p, |k| k & SPACE != 0);
    if end == text.len() {
        return end;
    }
    let last = text[p..end].chars().next_back().map_or(0, char::len_utf8);
    if end - last > p {
        end - last
    } else {
        end
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d` (case-insensitive: Unicode simple case folding, where "ſ"
/// is an s) from the char after the apostrophe; the match's end.
fn contraction(text: &str, p: usize, ignore_case: bool) -> Option<usize> {
    let rest = &text[p + 1..];
    let fold = |c: char| {
        if ignore_case {
            if c == 'ſ' {
                's'
            } else {
                c.to_ascii_lowercase()
            }
        } else {
            c
        }
    };
    let mut chars = rest.chars();
    let first = chars.next().map(fold)?;
    let second = chars.next().map(fold);
    let one = |c: char| p + 1 + c.len_utf8();
    match first {
        's' | 't' | 'm' | 'd' => Some(one(rest.chars().next()?)),
        'r' | 'v' if second == Some('e') => {
            Some(p + 1 + rest.chars().take(2).map(char::len_utf8).sum::<usize>())
        }
        'l' if second == Some('l') => {
            Some(p + 1 + rest.chars().take(2).map(char::len_utf8).sum::<usize>())
        }
        _ => None,
    }
}

fn gpt2_match(classes: &Classes, text: &str, p: usize) -> usize {
    let Some(c) = char_at(text, p) else {
        return text.len();
    };
    if c == '\'' {
        if let Some(end) = contraction(text, p, false) {
            return end;
        }
    }
    let class = classes.of(c);
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: the optional space first
    if c == ' ' {
        if let Some(next) = char_at(text, p + 1) {
            let k = classes.of(next);
            if k & LETTER != 0 {
                return run(classes, text, p + 1, |k| k & LETTER != 0);
            }
            if k & NUMBER != 0 {
                return run(classes, text, p + 1, |k| k & NUMBER != 0);
            }
            if is_other(k) {
                return run(classes, text, p + 1, is_other);
            }
        }
    }
    if class & LETTER != 0 {
        return run(classes, text, p, |k| k & LETTER != 0);
    }
    if class & NUMBER != 0 {
        return run(classes, text, p, |k| k & NUMBER != 0);
    }
    if is_other(class) {
        return run(classes, text, p, is_other);
    }
    whitespace(classes, text, p)
}

fn is_newline(c: char) -> bool {
    c == '\r' || c == '\n'
}

fn llama3_match(classes: &Classes, text: &str, p: usize, max_digits: usize) -> usize {
    let Some(c) = char_at(text, p) else {
        return text.len();
    };
    if c == '\'' {
        if let Some(end) = contraction(text, p, true) {
            return end;
        }
    }
    let class = classes.of(c);
    let next = char_at(text, p + c.len_utf8());
    let next_class = next.map(|n| classes.of(n));
    // `[^\r\n\p{L}\p{N}]?\p{L}+`
    if !is_newline(c) && class & (LETTER | NUMBER) == 0 {
        if next_class.is_some_and(|k| k & LETTER != 0) {
            return run(classes, text, p + c.len_utf8(), |k| k & LETTER != 0);
        }
    }
    if class & LETTER != 0 {
        return run(classes, text, p, |k| k & LETTER != 0);
    }
    // `\p{N}{1,max_digits}`
    if class & NUMBER != 0 {
        let mut end = p;
        for d in text[p..].chars().take(max_digits) {
            if classes.of(d) & NUMBER == 0 {
                break;
            }
            end += d.len_utf8();
        }
        return end;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let other_from = if c == ' ' && next_class.is_some_and(is_other) {
        Some(p + 1)
    } else if is_other(class) {
        Some(p)
    } else {
        None
    };
    if let Some(start) = other_from {
        let end = run(classes, text, start, is_other);
        return end + text[end..].chars().take_while(|&n| is_newline(n)).count();
    }
    // `\s*[\r\n]+`: through the run's last newline
    let end = run(classes, text, p, |k| k & SPACE != 0);
    if let Some(k) = text[p..end].rfind(is_newline) {
        return p + k + 1;
    }
    whitespace(classes, text, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(kind: FastSplit, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        kind.split(text, &mut |w| out.push(w.to_string()));
        out
    }

    /// The matchers against the regexes they stand for, on texts that reach every
    /// alternative.
    #[test]
    fn same_matches_as_the_regexes() {
        let texts = [
            "Hi   there's 42!\n",
            "a  \n\n  b\r\n c \t\u{a0}d",
            "'S 'ſ 'LL 'Re don't 12345 x1y22z",
            "((x)) ...\n\n  !!\r\n\r\n",
            "日本語 🦙🦙 naïve\u{2003}end   ",
            " \n \n  x\t\tword,  \u{3000}\u{3000}",
        ];
        for (kind, pattern) in [
            (FastSplit::Gpt2, BYTE_LEVEL_REGEX),
            (FastSplit::Llama3 { max_digits: 3 }, LLAMA3_REGEX),
            (FastSplit::Llama3 { max_digits: 1 }, QWEN2_REGEX),
        ] {
            let re = fancy_regex::Regex::new(pattern).unwrap();
            for text in texts {
                let want: Vec<String> = re
                    .find_iter(text)
                    .map(|m| m.unwrap().as_str().to_string())
                    .collect();
                assert_eq!(words(kind, text), want, "{pattern} on {text:?}");
            }
        }
    }
}
#[cfg(test)]
mod generate {
    /// Prints unicode_classes.rs's ranges (`cargo test --release print_class_tables --
    /// --ignored --nocapture`).
    #[test]
    #[ignore]
    fn print_class_tables() {
        let all: String = (0..=0x10FFFFu32).filter_map(char::from_u32).collect();
        for (name, pattern) in [
            ("LETTERS", r"\p{L}+"),
            ("NUMBERS", r"\p{N}+"),
            ("SPACES", r"\s+"),
        ] {
            let re = fancy_regex::Regex::new(pattern).unwrap();
            let ranges: Vec<String> = re
                .find_iter(&all)
                .map(|m| {
                    let t = m.unwrap().as_str();
                    let first = u32::from(t.chars().next().unwrap());
                    let last = u32::from(t.chars().next_back().unwrap());
                    format!("(0x{first:X}, 0x{last:X})")
                })
                .collect();
            println!("pub const {name}: &[(u32, u32)] = &[");
            for chunk in ranges.chunks(6) {
                println!("    {},", chunk.join(", "));
            }
            println!("];");
        }
    }

    #[test]
    fn classes_match_the_regex_engine() {
        let classes = super::classes();
        let all: String = (0..=0x10FFFFu32).filter_map(char::from_u32).collect();
        let letter = fancy_regex::Regex::new(r"\p{L}").unwrap();
        let number = fancy_regex::Regex::new(r"\p{N}").unwrap();
        let space = fancy_regex::Regex::new(r"\s").unwrap();
        let mut want = vec![0u8; 0x110000];
        for (re, flag) in [
            (letter, super::LETTER),
            (number, super::NUMBER),
            (space, super::SPACE),
        ] {
            for m in re.find_iter(&all) {
                let c = m.unwrap().as_str().chars().next().unwrap();
                want[u32::from(c) as usize] |= flag;
            }
        }
        for c in all.chars() {
            assert_eq!(
                classes.of(c),
                want[u32::from(c) as usize],
                "U+{:04X}",
                u32::from(c)
            );
        }
    }
}
