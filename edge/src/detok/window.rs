//! Streamed text by decoding windows of tokens (modelinfo/detokenizer.py's
//! IncrementalDetokenizer without a table), used where the prompt's last tokens end
//! inside a character: the prompt's bytes must not be emitted, so the router compares
//! decodes of a sliding window, by characters:
//!
//!     tokens [ ... | prefix_offset ... read_offset ... end ]
//!     emit decode(prefix..end)[len(decode(prefix..read))..] once it grew and does not
//!     end in U+FFFD; then prefix = read, read = end

use std::sync::Arc;

use super::stream::token_text_bytes;
use crate::tokenizer::Tokenizer;

pub struct WindowDecoder {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl WindowDecoder {
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        context: &[u32],
        skip_special_tokens: bool,
    ) -> WindowDecoder {
        WindowDecoder {
            tokenizer,
            skip_special_tokens,
            tokens: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
        }
    }

    pub fn append(&mut self, id: u32) -> String {
        self.tokens.push(id);
        let (prefix_text, new_text) = self.decode_window();
        let prefix_chars = prefix_text.chars().count();
        if new_text.chars().count() <= prefix_chars || new_text.ends_with('\u{FFFD}') {
            return String::new();
        }
        self.slide();
        skip_chars(&new_text, prefix_chars)
    }

    pub fn flush(&mut self) -> String {
        if self.read_offset == self.tokens.len() {
            return String::new();
        }
        let (prefix_text, new_text) = self.decode_window();
        self.slide();
        skip_chars(&new_text, prefix_text.chars().count())
    }

    fn slide(&mut self) {
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
    }

    fn decode_window(&self) -> (String, String) {
        let decode = |ids: &[u32]| {
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&id| {
                    token_text_bytes(&self.tokenizer, id, self.skip_special_tokens)
                        .iter()
                        .copied()
                })
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        (
            decode(&self.tokens[self.prefix_offset..self.read_offset]),
            decode(&self.tokens[self.prefix_offset..]),
        )
    }
}

/// `text` without its first `n` chars (Python's text[n:]).
fn skip_chars(text: &str, n: usize) -> String {
    match text.char_indices().nth(n) {
        Some((i, _)) => text[i..].to_string(),
        None => String::new(),
    }
}
