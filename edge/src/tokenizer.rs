//! Byte-level BPE, the same ids as the router's `modelinfo.tokenizer.Tokenizer` (Hugging
//! Face `tokenizers`) for the tokenizer.json forms it supports; `from_file` refuses the
//! others (the edge then serves nothing natively).
//!
//! The pipeline `tokenizers` runs for these files, step for step:
//!
//!     text ─▶ added tokens cut out (raw ones, then "normalized" ones; no normalizer)
//!          ─▶ each other piece: Split steps ─▶ ByteLevel (prefix space, GPT-2 regex)
//!          ─▶ each word: BPE over its bytes (cached per word)
//!          ─▶ post-processor: TemplateProcessing's BOS/EOS when add_special_tokens
//!
//! Supported: normalizer null, or NFC (Qwen 2) for texts below U+0300, which it leaves
//! as they are; pre_tokenizer ByteLevel, or a Sequence of Split steps
//! (regex or string pattern, any behavior, invert) ending in one ByteLevel; model BPE
//! without dropout, continuing_subword_prefix, end_of_word_suffix or byte_fallback
//! (ignore_merges, unk_token, fuse_unk are honoured); added tokens without
//! single_word / lstrip / rstrip; post_processor null, ByteLevel, TemplateProcessing or
//! a Sequence of those; decoder ByteLevel (token_bytes relies on it); no truncation or
//! padding.
#![allow(dead_code)]

mod bpe;
mod byte_map;
mod driver;
mod fast_split;
mod load;
mod pretok;
#[rustfmt::skip]
mod unicode_classes;

use std::path::Path;

use bpe::Bpe;
pub use driver::{cli, json_lines};
use pretok::{AddedTokenMatcher, ByteLevelStep, Segment, SplitStep};

pub struct Tokenizer {
    /// Added tokens matched on the raw text (`normalized: false`), then those matched on
    /// the normalized text (identical here: no normalizer), as two passes like
    /// `tokenizers` makes.
    added_raw: AddedTokenMatcher,
    added_normalized: AddedTokenMatcher,
    splits: Vec<SplitStep>,
    byte_level: ByteLevelStep,
    bpe: Bpe,
    /// What add_special_tokens puts around the text's ids.
    template: Vec<TemplatePiece>,
    /// id -> its bytes (None: no token has this id).
    token_bytes: Vec<Option<Box<[u8]>>>,
    /// id -> an added token marked special.
    special: Vec<bool>,
    /// `\p{Cn}` of the edge's regex tables: chars assigned after their Unicode version
    /// are letters, digits or marks to `tokenizers` (newer tables) and none to the split
    /// regexes here, so a text holding one may split differently.
    unassigned: fancy_regex::Regex,
    /// The normalizer is NFC: texts it would change are declined (there are no
    /// normalization tables here); on the others it is the identity.
    nfc: bool,
}

/// One element of a TemplateProcessing `single` template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TemplatePiece {
    Ids(Vec<u32>),
    Sequence,
}

impl Tokenizer {
    /// A Hugging Face tokenizer.json (router/edge_tokenizer.py writes the model's).
    pub fn from_file(path: &Path) -> Result<Tokenizer, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Tokenizer::from_json(&text)
    }

    /// The same as `from_file` for the file's text.
    pub fn from_json(text: &str) -> Result<Tokenizer, String> {
        load::from_json(text)
    }

    /// The same ids as `Tokenizer.encode(text, add_special_tokens=...)` in Python, except
    /// where `try_encode` refuses the text: then the ids of this tokenizer's reading of it
    /// (almost always the same), or none if a split regex failed.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        self.encode_unchecked(text, add_special_tokens)
            .unwrap_or_default()
    }

    /// The same ids as `Tokenizer.encode(text, add_special_tokens=...)` in Python, or an
    /// error where they might not be: the text holds a character unassigned in the edge's
    /// Unicode tables (assigned in a later Unicode version, which `tokenizers` may know),
    /// or one from U+0300 on under an NFC normalizer, or a pathological split regex ran
    /// past its bound. The serving path proxies then.
    pub fn try_encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        if !text.is_ascii() {
            if self.nfc && !load::nfc_stable(text) {
                return Err("NFC normalization of chars from U+0300 on is not implemented".into());
            }
            if let Ok(Some(m)) = self.unassigned.find(text) {
                let c = m.as_str().chars().next().unwrap_or_default();
                return Err(format!(
                    "U+{:04X} is unassigned in the edge's Unicode tables",
                    u32::from(c)
                ));
            }
        }
        self.encode_unchecked(text, add_special_tokens)
    }

    fn encode_unchecked(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        if add_special_tokens {
            for piece in &self.template {
                match piece {
                    TemplatePiece::Ids(special) => ids.extend_from_slice(special),
                    TemplatePiece::Sequence => self.encode_text(text, &mut ids)?,
                }
            }
        } else {
            self.encode_text(text, &mut ids)?;
        }
        Ok(ids)
    }

    fn encode_text(&self, text: &str, ids: &mut Vec<u32>) -> Result<(), String> {
        let mut raw = Vec::new();
        self.added_raw.split(text, &mut raw);
        let mut segments = Vec::with_capacity(raw.len());
        for segment in raw {
            match segment {
                Segment::Text(piece) => self.added_normalized.split(piece, &mut segments),
                token => segments.push(token),
            }
        }
        for segment in segments {
            match segment {
                Segment::Token(id) => ids.push(id),
                Segment::Text(piece) => self.encode_piece(piece, ids)?,
            }
        }
        Ok(())
    }

    /// Split steps, then ByteLevel, then BPE of each word.
    fn encode_piece(&self, piece: &str, ids: &mut Vec<u32>) -> Result<(), String> {
        let mut pieces = vec![piece];
        for step in &self.splits {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for p in pieces {
                step.split(p, &mut next)?;
            }
            pieces = next;
        }
        let bpe = &self.bpe;
        for p in pieces {
            self.byte_level
                .words(p, &mut |word| bpe.encode_word(word.as_bytes(), ids))?;
        }
        Ok(())
    }

    /// Pre-tokenization alone: how many words `text` splits into (benchmarks).
    fn count_words(&self, text: &str) -> usize {
        let mut raw = Vec::new();
        self.added_raw.split(text, &mut raw);
        let mut n = 0;
        for segment in raw {
            if let Segment::Text(piece) = segment {
                let mut pieces = vec![piece];
                for step in &self.splits {
                    let mut next = Vec::new();
                    for p in pieces {
                        let _ = step.split(p, &mut next);
                    }
                    pieces = next;
                }
                for p in pieces {
                    let _ = self.byte_level.words(p, &mut |_| n += 1);
                }
            }
        }
        n
    }

    /// The bytes a token stands for (None: not a token of the vocabulary).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).and_then(|b| b.as_deref())
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// One more than the largest token id.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }
}
