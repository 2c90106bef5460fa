//! msgspec's JSON, both ways: writing the bytes msgspec.json.encode writes, and reading
//! values the way msgspec decodes them into a typed Struct (an `int` takes no float, a
//! `float` is correctly rounded), each member left raw until its type is known.

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

// -- writing ----------------------------------------------------------------------------------

pub fn write_bool(out: &mut Vec<u8>, value: bool) {
    out.extend_from_slice(if value { b"true" } else { b"false" });
}

/// A JSON string as msgspec writes it: `"` and `\` escaped, \b \t \n \f \r short, other
/// control characters as \u00XX (lower-case hex), everything else raw UTF-8. serde_json
/// writes exactly that.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    let mut i = 0;
    let bytes = s.as_bytes();
    out.push(b'"');
    // The common case (nothing to escape) is one copy.
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i] >= 0x20 && bytes[i] != b'"' && bytes[i] != b'\\' {
            i += 1;
        }
        out.extend_from_slice(&bytes[start..i]);
        if i == bytes.len() {
            break;
        }
        let b = bytes[i];
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x09 => out.extend_from_slice(b"\\t"),
            0x0a => out.extend_from_slice(b"\\n"),
            0x0c => out.extend_from_slice(b"\\f"),
            0x0d => out.extend_from_slice(b"\\r"),
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[(b >> 4) as usize]);
                out.push(HEX[(b & 15) as usize]);
            }
        }
        i += 1;
    }
    out.push(b'"');
}

pub fn write_u64(out: &mut Vec<u8>, mut value: u64) {
    let mut buf = [0u8; 20];
    let mut pos = buf.len();
    loop {
        pos -= 1;
        buf[pos] = b'0' + (value % 10) as u8;
        value /= 10;
        if value == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[pos..]);
}

pub fn write_i128(out: &mut Vec<u8>, value: i128) {
    if let Ok(v) = u64::try_from(value) {
        write_u64(out, v);
    } else {
        out.extend_from_slice(value.to_string().as_bytes());
    }
}

/// A JSON list of token ids.
pub fn write_ids(out: &mut Vec<u8>, ids: &[u32]) {
    // One reserve, then each id with its comma from a stack buffer: prompts run to
    // hundreds of thousands of ids, and this is on every request's path.
    out.reserve(ids.len() * 11 + 2);
    out.push(b'[');
    let mut buf = [0u8; 11];
    for (i, &id) in ids.iter().enumerate() {
        let mut pos = buf.len();
        let mut v = id;
        loop {
            pos -= 1;
            buf[pos] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        if i > 0 {
            pos -= 1;
            buf[pos] = b',';
        }
        out.extend_from_slice(&buf[pos..]);
    }
    out.push(b']');
}

/// A float as msgspec writes it: the shortest digits that read back as the same double;
/// positional with at least one fraction digit when 1e-5 <= |x| < 1e16 (`1.0`, `0.00001`,
/// `1234567890123456.8`), else `d[.ddd]e[-]x` (`1e16`, `1.5e-7`); `-0.0`; non-finite
/// values as `null`.
pub fn write_f64(out: &mut Vec<u8>, value: f64) {
    if !value.is_finite() {
        out.extend_from_slice(b"null");
        return;
    }
    if value == 0.0 {
        out.extend_from_slice(if value.is_sign_negative() {
            b"-0.0"
        } else {
            b"0.0"
        });
        return;
    }
    // The shortest digits that read back as `value`, and where the point goes: ryu's,
    // whose ties (two shortest strings as near) go to the even digit, as Python's repr
    // and msgspec (Rust's own `{:e}` rounds those up: 562949953421312.25 gave ".3").
    let (negative, digits, exp) = shortest_digits(value);
    if negative {
        out.push(b'-');
    }
    if (-5..16).contains(&exp) {
        let n = digits.len() as i32;
        if exp < 0 {
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat(b'0').take((-exp - 1) as usize));
            out.extend_from_slice(digits.as_bytes());
        } else if exp + 1 >= n {
            out.extend_from_slice(digits.as_bytes());
            out.extend(std::iter::repeat(b'0').take((exp + 1 - n) as usize));
            out.extend_from_slice(b".0");
        } else {
            let point = (exp + 1) as usize;
            out.extend_from_slice(&digits.as_bytes()[..point]);
            out.push(b'.');
            out.extend_from_slice(&digits.as_bytes()[point..]);
        }
    } else {
        out.extend_from_slice(&digits.as_bytes()[..1]);
        if digits.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits.as_bytes()[1..]);
        }
        out.push(b'e');
        out.extend_from_slice(exp.to_string().as_bytes());
    }
}

/// (negative, the shortest significant digits without leading or trailing zeros, the
/// decimal exponent of the first digit) of a finite non-zero `value`.
fn shortest_digits(value: f64) -> (bool, String, i32) {
    let mut buf = ryu::Buffer::new();
    let text = buf.format_finite(value);
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exp10) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (text, 0),
    };
    let fraction = mantissa.split_once('.').map_or(0, |(_, f)| f.len() as i32);
    let all: String = mantissa.chars().filter(|c| *c != '.').collect();
    // value = all × 10^(exp10 - fraction)
    let trimmed = all.trim_start_matches('0');
    let digits = trimmed.trim_end_matches('0');
    let scale = exp10 - fraction + (trimmed.len() - digits.len()) as i32;
    let exp = scale + digits.len() as i32 - 1;
    (negative, digits.to_string(), exp)
}

// -- reading ----------------------------------------------------------------------------------

/// A JSON object's members in order, values left raw. None: not an object, or a key twice
/// (msgspec keeps the last; the edge does not guess).
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, &'de RawValue>()? {
                    out.push(entry);
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

pub fn members(text: &[u8]) -> Option<Vec<(String, &RawValue)>> {
    let Members(out) = serde_json::from_slice(text).ok()?;
    Some(out)
}

/// Known keys of one object: each raw value by name, or None when a known key repeats.
pub fn known<'a>(
    entries: &[(String, &'a RawValue)],
    names: &[&str],
) -> Option<Vec<Option<&'a RawValue>>> {
    let mut slots = vec![None; names.len()];
    for (key, value) in entries {
        if let Some(i) = names.iter().position(|n| n == key) {
            if slots[i].is_some() {
                return None;
            }
            slots[i] = Some(*value);
        }
    }
    Some(slots)
}

pub fn is_null(v: &RawValue) -> bool {
    v.get() == "null"
}

/// A typed optional field: Ok(None) for absent or null, Err(()) for a wrong type.
pub type Field<T> = Result<Option<T>, ()>;

pub fn opt<T>(v: Option<&RawValue>, read: impl Fn(&RawValue) -> Option<T>) -> Field<T> {
    match v {
        None => Ok(None),
        Some(v) if is_null(v) => Ok(None),
        Some(v) => read(v).map(Some).ok_or(()),
    }
}

pub fn read_bool(v: &RawValue) -> Option<bool> {
    match v.get() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

pub fn is_number(text: &str) -> bool {
    text.starts_with(|c: char| c == '-' || c.is_ascii_digit())
}

pub fn is_integer(text: &str) -> bool {
    is_number(text) && !text.contains(['.', 'e', 'E'])
}

/// A JSON integer (msgspec's `int` takes no float, not even 1.0); None beyond i128.
pub fn read_int(v: &RawValue) -> Option<i128> {
    let text = v.get();
    if !is_integer(text) {
        return None;
    }
    text.parse::<i128>().ok()
}

/// A JSON number as Python's float of it: correctly rounded (Rust's parser is; serde's
/// default one is not always), an integer's -0 as 0.0.
pub fn read_float(v: &RawValue) -> Option<f64> {
    let text = v.get();
    if !is_number(text) {
        return None;
    }
    let x = text.parse::<f64>().ok()?;
    if is_integer(text) && x == 0.0 {
        return Some(0.0);
    }
    Some(x)
}

pub fn read_string(v: &RawValue) -> Option<String> {
    if !v.get().starts_with('"') {
        return None;
    }
    serde_json::from_str::<String>(v.get()).ok()
}

pub fn read_list(v: &RawValue) -> Option<Vec<&RawValue>> {
    if !v.get().starts_with('[') {
        return None;
    }
    serde_json::from_str::<Vec<&RawValue>>(v.get()).ok()
}

pub fn read_u32(v: &RawValue) -> Option<u32> {
    read_int(v).and_then(|x| u32::try_from(x).ok())
}

pub fn read_u32s(v: &RawValue) -> Option<Vec<u32>> {
    read_list(v)?.into_iter().map(read_u32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(x: f64) -> String {
        let mut out = Vec::new();
        write_f64(&mut out, x);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn ids_as_msgspec_writes_them() {
        let mut ids = vec![0, 7, 10, 99, 100, 101, 4_294_967_295, 1_000_000_000, 49_151];
        ids.extend((0..2000).map(|i| i * 2_147_483 + 9)); // past one block
        let mut out = Vec::new();
        write_ids(&mut out, &ids);
        let want: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("[{}]", want.join(","))
        );
        let mut out = Vec::new();
        write_ids(&mut out, &[]);
        assert_eq!(out, b"[]");
    }

    #[test]
    fn floats_as_msgspec_writes_them() {
        assert_eq!(f(1.0), "1.0");
        assert_eq!(f(0.7), "0.7");
        assert_eq!(f(1e-5), "0.00001");
        assert_eq!(f(9.9e-6), "9.9e-6");
        assert_eq!(f(1e15), "1000000000000000.0");
        assert_eq!(f(1e16), "1e16");
        assert_eq!(f(1.5e17), "1.5e17");
        assert_eq!(f(1234567890123456.8), "1234567890123456.8");
        assert_eq!(f(-0.0), "-0.0");
        assert_eq!(f(0.1 + 0.2), "0.30000000000000004");
        assert_eq!(f(-2.5), "-2.5");
        assert_eq!(f(f64::NAN), "null");
        // two shortest strings as near (2^49 + 0.25): the even digit, as msgspec
        assert_eq!(f(562949953421312.25), "562949953421312.2");
        assert_eq!(f(5e-324), "5e-324");
        assert_eq!(f(1.7976931348623157e308), "1.7976931348623157e308");
        assert_eq!(f(123e20), "1.23e22");
    }
}
