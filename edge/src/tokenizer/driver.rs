//! `kvserve-edge tokenize`: the tokenizer's test driver (tests/test_edge_tokenizer.py)
//! and benchmark line (benchmarks/edge_tokenizer.py), and the JSON-lines loop the
//! detok driver shares.

use std::io::{BufRead, Write};
use std::path::Path;

use serde_json::Value;

use super::Tokenizer;

/// `kvserve-edge tokenize --tokenizer FILE`: one JSON line in, one out:
/// {"text", "add_special_tokens"} -> {"ids": [...]};
/// {"token_bytes": [ids]} -> {"bytes_hex": [hex or null], "special": [bool]};
/// {"bench": [texts], "repeat": n} -> {"ns_per_encode": ..., "num_tokens": ...}
/// (benchmarks/edge_tokenizer.py: each text encoded n times, add_special_tokens false).
pub fn cli(args: &[String]) -> i32 {
    let path = match args {
        [flag, path] if flag == "--tokenizer" => path,
        _ => {
            eprintln!("usage: kvserve-edge tokenize --tokenizer FILE");
            return 2;
        }
    };
    let tokenizer = match Tokenizer::from_file(Path::new(path)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return 1;
        }
    };
    json_lines(|line| cli_answer(&tokenizer, line))
}

fn cli_answer(tokenizer: &Tokenizer, line: &serde_json::Value) -> serde_json::Value {
    use serde_json::json;
    if let Some(ids) = line.get("token_bytes").and_then(|v| v.as_array()) {
        let ids: Vec<u32> = ids
            .iter()
            .map(|v| v.as_u64().unwrap_or(u64::MAX) as u32)
            .collect();
        let hex: Vec<serde_json::Value> = ids
            .iter()
            .map(|&id| match tokenizer.token_bytes(id) {
                Some(b) => json!(b.iter().map(|x| format!("{x:02x}")).collect::<String>()),
                None => serde_json::Value::Null,
            })
            .collect();
        let special: Vec<bool> = ids.iter().map(|&id| tokenizer.is_special(id)).collect();
        return json!({"bytes_hex": hex, "special": special});
    }
    if let Some(texts) = line.get("bench").and_then(|v| v.as_array()) {
        return bench(
            tokenizer,
            texts,
            line.get("repeat").and_then(|v| v.as_u64()).unwrap_or(1),
        );
    }
    let Some(text) = line.get("text").and_then(|v| v.as_str()) else {
        return json!({"error": "expected {\"text\": ...} or {\"token_bytes\": [...]}"});
    };
    let add = line
        .get("add_special_tokens")
        .and_then(|v| v.as_bool())
        .unwrap_or(true);
    match tokenizer.try_encode(text, add) {
        Ok(ids) => json!({ "ids": ids }),
        Err(e) => json!({ "error": e }),
    }
}

/// Times `try_encode` of each text, `repeat` rounds (the first warms the word cache as
/// serving does).
fn bench(tokenizer: &Tokenizer, texts: &[serde_json::Value], repeat: u64) -> serde_json::Value {
    let texts: Vec<&str> = texts.iter().filter_map(|t| t.as_str()).collect();
    let mut num_tokens = 0;
    for text in &texts {
        num_tokens += tokenizer.try_encode(text, false).map_or(0, |ids| ids.len());
    }
    let start = std::time::Instant::now();
    for _ in 0..repeat {
        for text in &texts {
            std::hint::black_box(tokenizer.try_encode(std::hint::black_box(text), false).ok());
        }
    }
    let calls = (repeat as usize * texts.len()).max(1);
    let ns = start.elapsed().as_nanos() as f64 / calls as f64;
    let start = std::time::Instant::now();
    let mut num_words = 0;
    for _ in 0..repeat {
        for text in &texts {
            num_words += tokenizer.count_words(std::hint::black_box(text));
        }
    }
    let split_ns = start.elapsed().as_nanos() as f64 / calls as f64;
    serde_json::json!({ "ns_per_encode": ns, "ns_per_split": split_ns, "num_tokens": num_tokens,
                        "num_words": num_words / repeat.max(1) as usize })
}

/// The test drivers' loop: a JSON value per stdin line, `answer`'s value per stdout
/// line (an {"error"} for a line that is not JSON). Returns the exit status.
pub fn json_lines(mut answer: impl FnMut(&Value) -> Value) -> i32 {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for line in stdin.lock().lines() {
        let Ok(line) = line else { return 1 };
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Value>(&line) {
            Ok(value) => answer(&value),
            Err(e) => serde_json::json!({ "error": format!("not JSON: {e}") }),
        };
        if writeln!(out, "{reply}").and_then(|()| out.flush()).is_err() {
            return 1;
        }
    }
    0
}
