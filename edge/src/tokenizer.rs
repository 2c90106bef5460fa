//! Byte-level BPE, the same ids as the router's `modelinfo.tokenizer.Tokenizer` (Hugging
//! Face `tokenizers`) for the tokenizer.json forms it supports; `from_file` refuses the
//! others (the edge then serves nothing natively).

use std::path::Path;

pub struct Tokenizer {}

impl Tokenizer {
    /// A Hugging Face tokenizer.json (router/edge_tokenizer.py writes the model's).
    pub fn from_file(_path: &Path) -> Result<Tokenizer, String> {
        todo!("tokenizer")
    }

    /// The same ids as `Tokenizer.encode(text, add_special_tokens=...)` in Python.
    pub fn encode(&self, _text: &str, _add_special_tokens: bool) -> Vec<u32> {
        todo!("tokenizer")
    }

    /// The bytes a token stands for (None: not a token of the vocabulary).
    pub fn token_bytes(&self, _id: u32) -> Option<&[u8]> {
        todo!("tokenizer")
    }

    pub fn is_special(&self, _id: u32) -> bool {
        todo!("tokenizer")
    }
}

/// `kvserve-edge tokenize --tokenizer FILE`: one JSON line in ({"text", "add_special_tokens"}),
/// one out ({"ids": [...]}).
pub fn cli(_args: &[String]) -> i32 {
    todo!("tokenizer cli")
}
