//! GPT-2's byte <-> char map: byte-level BPE spells every byte as a printable char, so
//! a vocabulary token's string stands for bytes.

use std::collections::HashMap;

/// GPT-2's byte -> char map (printable bytes are themselves, the others 256, 257, ...).
pub fn byte_chars() -> [char; 256] {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut chars = ['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        chars[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    chars
}

/// The inverse of `byte_chars`: (chars < 324) -> byte.
pub fn char_bytes() -> HashMap<char, u8> {
    byte_chars()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// A token's bytes: its chars through the byte map when all are in it, else its UTF-8
/// (an added token spelled in plain text), as `tokenizers`' ByteLevel decoder reads it.
pub fn spelled_bytes(token: &str, map: &HashMap<char, u8>) -> Vec<u8> {
    token
        .chars()
        .map(|c| map.get(&c).copied())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}
