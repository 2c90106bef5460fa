//! Pre-tokenization as Hugging Face `tokenizers` runs it for byte-level BPE: added tokens
//! are cut out of the raw text first (whole, leftmost-longest), then each remaining piece
//! goes through the Split steps and ByteLevel's own regex; what comes out are the words
//! the BPE model merges.

use fancy_regex::Regex;

use super::fast_split::FastSplit;

/// Backtracking steps one regex search may take. The byte-level split regexes match at
/// every position after a few steps (their last alternative is `\s+` and the others
/// cover every other char), so this is never reached on real text; it only bounds a
/// pathological tokenizer.json regex.
const BACKTRACK_LIMIT: usize = 10_000_000;

/// GPT-2's split, what `ByteLevel { use_regex: true }` applies.
pub const BYTE_LEVEL_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// A split regex: a hand-written matcher when it is a known one, else compiled.
pub enum Splitter {
    Fast(FastSplit),
    Regex(Regex),
}

impl Splitter {
    pub fn new(pattern: &str) -> Result<Splitter, String> {
        Ok(match FastSplit::for_regex(pattern) {
            Some(fast) => Splitter::Fast(fast),
            None => Splitter::Regex(compile(pattern)?),
        })
    }

    /// Calls `found` with the (start, end) of each match, in order.
    fn matches(&self, text: &str, found: &mut dyn FnMut(usize, usize)) -> Result<(), String> {
        match self {
            Splitter::Fast(fast) => {
                let base = text.as_ptr() as usize;
                fast.split(text, &mut |m| {
                    let start = m.as_ptr() as usize - base;
                    found(start, start + m.len());
                });
            }
            Splitter::Regex(re) => {
                for m in re.find_iter(text) {
                    let m = m.map_err(|e| format!("split regex failed: {e}"))?;
                    found(m.start(), m.end());
                }
            }
        }
        Ok(())
    }
}

pub fn compile(pattern: &str) -> Result<Regex, String> {
    fancy_regex::RegexBuilder::new(pattern)
        .backtrack_limit(BACKTRACK_LIMIT)
        .build()
        .map_err(|e| format!("regex {pattern:?} is not supported: {e}"))
}

/// A piece of the text after the added tokens are cut out.
#[derive(Debug, PartialEq, Eq)]
pub enum Segment<'a> {
    Token(u32),
    Text(&'a str),
}

/// Added tokens of one kind (matched on the raw or on the normalized text).
pub struct AddedTokenMatcher {
    /// Index: a token's first byte; tokens with that first byte, longest first.
    by_first_byte: Vec<Vec<(Box<[u8]>, u32)>>,
    empty: bool,
}

impl AddedTokenMatcher {
    pub fn new(tokens: &[(String, u32)]) -> AddedTokenMatcher {
        let mut by_first_byte: Vec<Vec<(Box<[u8]>, u32)>> = vec![Vec::new(); 256];
        for (content, id) in tokens {
            if let Some(&first) = content.as_bytes().first() {
                by_first_byte[usize::from(first)].push((content.as_bytes().into(), *id));
            }
        }
        for list in &mut by_first_byte {
            // longest first; the first listed wins among equal contents
            list.sort_by(|a, b| b.0.len().cmp(&a.0.len()));
        }
        let empty = by_first_byte.iter().all(Vec::is_empty);
        AddedTokenMatcher {
            by_first_byte,
            empty,
        }
    }

    /// Splits `text` at the tokens, leftmost-longest and non-overlapping (aho-corasick's
    /// LeftmostLongest, as `tokenizers` matches them). Empty text pieces are left out.
    pub fn split<'a>(&self, text: &'a str, out: &mut Vec<Segment<'a>>) {
        if self.empty {
            if !text.is_empty() {
                out.push(Segment::Text(text));
            }
            return;
        }
        let bytes = text.as_bytes();
        let mut done = 0;
        let mut i = 0;
        while i < bytes.len() {
            let found = self.by_first_byte[usize::from(bytes[i])]
                .iter()
                .find(|(content, _)| bytes[i..].starts_with(content));
            match found {
                Some((content, id)) => {
                    if i > done {
                        out.push(Segment::Text(&text[done..i]));
                    }
                    out.push(Segment::Token(*id));
                    i += content.len();
                    done = i;
                }
                None => i += 1,
            }
        }
        if done < bytes.len() {
            out.push(Segment::Text(&text[done..]));
        }
    }
}

/// What a Split pre-tokenizer does with the pieces its pattern matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behavior {
    Removed,
    Isolated,
    MergedWithPrevious,
    MergedWithNext,
    Contiguous,
}

impl Behavior {
    pub fn parse(name: &str) -> Option<Behavior> {
        Some(match name {
            "Removed" => Behavior::Removed,
            "Isolated" => Behavior::Isolated,
            "MergedWithPrevious" => Behavior::MergedWithPrevious,
            "MergedWithNext" => Behavior::MergedWithNext,
            "Contiguous" => Behavior::Contiguous,
            _ => return None,
        })
    }
}

pub enum Pattern {
    Regex(Splitter),
    Literal(String),
}

/// One `{"type": "Split", "pattern": ..., "behavior": ..., "invert": ...}` step.
pub struct SplitStep {
    pub pattern: Pattern,
    pub behavior: Behavior,
    pub invert: bool,
}

impl SplitStep {
    /// Appends the pieces of `piece` to `out` (never empty ones).
    pub fn split<'a>(&self, piece: &'a str, out: &mut Vec<&'a str>) -> Result<(), String> {
        let mut spans = Vec::new();
        let mut prev = 0;
        let mut mark = |start: usize, end: usize| {
            if prev != start {
                spans.push((prev, start, false));
            }
            spans.push((start, end, true));
            prev = end;
        };
        match &self.pattern {
            Pattern::Regex(splitter) => splitter.matches(piece, &mut mark)?,
            Pattern::Literal(s) if !s.is_empty() => {
                for (start, found) in piece.match_indices(s.as_str()) {
                    mark(start, start + found.len());
                }
            }
            Pattern::Literal(_) => {}
        }
        if prev != piece.len() {
            spans.push((prev, piece.len(), false));
        }
        if self.invert {
            for span in &mut spans {
                span.2 = !span.2;
            }
        }
        for (start, end) in apply_behavior(self.behavior, &spans) {
            if end > start {
                out.push(&piece[start..end]);
            }
        }
        Ok(())
    }
}

/// `tokenizers`' SplitDelimiterBehavior over (start, end, is_match) spans in order.
fn apply_behavior(behavior: Behavior, spans: &[(usize, usize, bool)]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    match behavior {
        Behavior::Isolated => out.extend(spans.iter().map(|&(s, e, _)| (s, e))),
        Behavior::Removed => out.extend(spans.iter().filter(|sp| !sp.2).map(|&(s, e, _)| (s, e))),
        Behavior::MergedWithPrevious => {
            let mut previous_match = false;
            for &(s, e, is_match) in spans {
                match out.last_mut() {
                    Some(last) if is_match && !previous_match => last.1 = e,
                    _ => out.push((s, e)),
                }
                previous_match = is_match;
            }
        }
        Behavior::MergedWithNext => {
            let mut previous_match = false;
            for &(s, e, is_match) in spans.iter().rev() {
                match out.last_mut() {
                    Some(last) if is_match && !previous_match => last.0 = s,
                    _ => out.push((s, e)),
                }
                previous_match = is_match;
            }
            out.reverse();
        }
        Behavior::Contiguous => {
            let mut previous_match = false;
            for &(s, e, is_match) in spans {
                match out.last_mut() {
                    Some(last) if is_match == previous_match => last.1 = e,
                    _ => out.push((s, e)),
                }
                previous_match = is_match;
            }
        }
    }
    out
}

/// The ByteLevel pre-tokenizer: an optional space before each piece, GPT-2's split when
/// `use_regex` (the byte alphabet itself is applied by the BPE model, which works on
/// bytes).
pub struct ByteLevelStep {
    pub add_prefix_space: bool,
    pub regex: Option<Splitter>,
}

impl ByteLevelStep {
    /// Calls `word` with each word of `piece`.
    pub fn words(&self, piece: &str, word: &mut dyn FnMut(&str)) -> Result<(), String> {
        let spaced;
        let piece = if self.add_prefix_space && !piece.starts_with(' ') {
            spaced = format!(" {piece}");
            spaced.as_str()
        } else {
            piece
        };
        let Some(re) = &self.regex else {
            word(piece);
            return Ok(());
        };
        // Isolated: matches and the gaps between them are all words.
        let mut prev = 0;
        re.matches(piece, &mut |start, end| {
            if start > prev {
                word(&piece[prev..start]);
            }
            if end > start {
                word(&piece[start..end]);
            }
            prev = end;
        })?;
        if prev < piece.len() {
            word(&piece[prev..]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn added_tokens_leftmost_longest() {
        let m = AddedTokenMatcher::new(&[("<a>".into(), 7), ("<a><b>".into(), 8), ("b".into(), 9)]);
        let mut out = Vec::new();
        m.split("x<a><b>yb<a>", &mut out);
        use Segment::*;
        assert_eq!(
            out,
            vec![Text("x"), Token(8), Text("y"), Token(9), Token(7)]
        );
    }

    #[test]
    fn gpt2_split_keeps_one_space_for_the_next_word() {
        let step = ByteLevelStep {
            add_prefix_space: false,
            regex: Some(Splitter::new(BYTE_LEVEL_REGEX).unwrap()),
        };
        let mut words = Vec::new();
        step.words("Hi   there's 42!\n", &mut |w| words.push(w.to_string()))
            .unwrap();
        assert_eq!(words, vec!["Hi", "  ", " there", "'s", " 42", "!", "\n"]);
    }

    #[test]
    fn split_behaviors() {
        let spans = [(0, 1, false), (1, 2, true), (2, 3, true), (3, 4, false)];
        assert_eq!(
            apply_behavior(Behavior::MergedWithPrevious, &spans),
            vec![(0, 2), (2, 3), (3, 4)]
        );
        assert_eq!(
            apply_behavior(Behavior::MergedWithNext, &spans),
            vec![(0, 1), (1, 2), (2, 4)]
        );
        assert_eq!(
            apply_behavior(Behavior::Contiguous, &spans),
            vec![(0, 1), (1, 3), (3, 4)]
        );
        assert_eq!(
            apply_behavior(Behavior::Removed, &spans),
            vec![(0, 1), (3, 4)]
        );
    }
}
