//! Streamed text by table (modelinfo/token_bytes.py's ByteStream, byte_level kind): the
//! tokens' bytes decoded as UTF-8 as they come, an unfinished character held until its
//! last byte, each maximal invalid part one U+FFFD (what Python's "replace" handler and
//! `String::from_utf8_lossy` both do), so the pieces join to the full decode.

use std::sync::Arc;

use crate::tokenizer::Tokenizer;

pub struct ByteStream {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    /// The start of a character not complete yet.
    held: Vec<u8>,
}

impl ByteStream {
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> ByteStream {
        ByteStream {
            tokenizer,
            skip_special_tokens,
            held: Vec::new(),
        }
    }

    /// The text the ids complete (maybe "").
    pub fn extend(&mut self, ids: &[u32]) -> String {
        let mut data = std::mem::take(&mut self.held);
        for &id in ids {
            data.extend_from_slice(token_text_bytes(
                &self.tokenizer,
                id,
                self.skip_special_tokens,
            ));
        }
        let (text, consumed) = decode_utf8_partial(&data);
        self.held = data[consumed..].to_vec();
        text
    }

    /// True while the start of a character is held.
    pub fn pending(&self) -> bool {
        !self.held.is_empty()
    }

    /// At the end: the held bytes (an unfinished character shows as U+FFFD).
    pub fn flush(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.held).into_owned();
        self.held.clear();
        text
    }
}

/// What a token adds to the decoded bytes: nothing for an id outside the vocabulary or
/// a skipped special token.
pub fn token_text_bytes(tokenizer: &Tokenizer, id: u32, skip_special_tokens: bool) -> &[u8] {
    if skip_special_tokens && tokenizer.is_special(id) {
        return &[];
    }
    tokenizer.token_bytes(id).unwrap_or(&[])
}

/// UTF-8 decoding of `data` up to an unfinished character at its end: (text, bytes
/// consumed). Invalid parts become U+FFFD, one per maximal invalid subpart.
pub fn decode_utf8_partial(data: &[u8]) -> (String, usize) {
    let mut text = String::with_capacity(data.len());
    let mut rest = data;
    loop {
        match std::str::from_utf8(rest) {
            Ok(valid) => {
                text.push_str(valid);
                return (text, data.len());
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                // from_utf8 checked these bytes
                text.push_str(std::str::from_utf8(valid).unwrap_or_default());
                match e.error_len() {
                    Some(n) => {
                        text.push('\u{FFFD}');
                        rest = &after[n..];
                    }
                    None => return (text, data.len() - after.len()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_utf8_holds_an_unfinished_character_only() {
        assert_eq!(decode_utf8_partial(b"ab\xe2\x82"), ("ab".to_string(), 2));
        assert_eq!(
            decode_utf8_partial(b"a\xffb\xe2\x82\xac"),
            ("a\u{FFFD}b\u{20AC}".to_string(), 6)
        );
        assert_eq!(
            decode_utf8_partial(b"\xf0\x80x"),
            ("\u{FFFD}\u{FFFD}x".to_string(), 3)
        );
    }
}
