//! Worker tokens -> client text with the stop rules: modelinfo/detokenizer.py's
//! RequestOutputText (EOS, stop token ids, stop strings with the held-back text,
//! max_tokens), the same text for the same tokens, delta by delta.
//!
//! Text comes from the tokenizer's id -> bytes table (modelinfo/token_bytes.py's
//! ByteStream): the bytes of the tokens so far, decoded as UTF-8 with U+FFFD for each
//! maximal invalid part, a character only once its last byte came. A prompt whose last
//! tokens end inside a character (token-id prompts only) decodes windows of tokens
//! instead, as the router then does (detok/window.rs).
//!
//! Stop strings: the text that could still become one is held back, the text from a
//! stop string on is cut; text already sent is never taken back:
//!
//!     text so far "Hello wor" + "ld###"     stop ["###END"]
//!     sent "Hello world", held "###"; next "END": finish "stop", text "Hello world"
#![allow(dead_code)]

mod stream;
mod window;

use std::sync::Arc;

use serde_json::Value;

use crate::protocol::SamplingParams;
use crate::tokenizer::Tokenizer;
use stream::ByteStream;
use window::WindowDecoder;

/// Prompt tokens decoded before the first output token (the router's
/// _PROMPT_CONTEXT_TOKENS): where a prompt ends inside a character, the output's first
/// characters complete it and are not the output's.
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// The fields of SamplingParams the text rules read.
#[derive(Debug, Clone, PartialEq)]
pub struct StopRules {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

impl Default for StopRules {
    /// protocol/sampling.py's defaults.
    fn default() -> StopRules {
        StopRules {
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl StopRules {
    pub fn from_params(params: &SamplingParams) -> StopRules {
        StopRules {
            max_tokens: usize::try_from(params.max_tokens).unwrap_or(usize::MAX),
            min_tokens: usize::try_from(params.min_tokens).unwrap_or(usize::MAX),
            stop: params.stop.clone(),
            stop_token_ids: params.stop_token_ids.clone(),
            ignore_eos: params.ignore_eos,
        }
    }
}

/// Tokens -> text, by table or (prompt ending inside a character) by windows.
enum TextDecoder {
    Bytes(ByteStream),
    Window(WindowDecoder),
}

impl TextDecoder {
    fn new(tokenizer: Arc<Tokenizer>, prompt: &[u32], skip_special_tokens: bool) -> TextDecoder {
        let context = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        let mut bytes = ByteStream::new(tokenizer.clone(), skip_special_tokens);
        bytes.extend(context);
        if bytes.pending() {
            TextDecoder::Window(WindowDecoder::new(tokenizer, context, skip_special_tokens))
        } else {
            TextDecoder::Bytes(bytes)
        }
    }

    fn extend(&mut self, ids: &[u32]) -> String {
        match self {
            TextDecoder::Bytes(s) => s.extend(ids),
            TextDecoder::Window(w) => ids.iter().map(|&id| w.append(id)).collect(),
        }
    }

    fn flush(&mut self) -> String {
        match self {
            TextDecoder::Bytes(s) => s.flush(),
            TextDecoder::Window(w) => w.flush(),
        }
    }
}

/// One request's output: tokens in, the text safe to send and the finish reason out.
pub struct OutputText {
    rules: StopRules,
    /// EOS ids (unless ignore_eos) and stop_token_ids: they end the request as "stop"
    /// from the min_tokens-th output on and are never text.
    stop_ids: Vec<u32>,
    decoder: TextDecoder,
    num_output_tokens: usize,
    /// Sent text plus held-back text; the final text once finished.
    output_text: String,
    /// Bytes of output_text already sent.
    num_sent: usize,
    finish_reason: Option<&'static str>,
}

impl OutputText {
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        params: &SamplingParams,
        eos_token_ids: &[u32],
        prompt_token_ids: &[u32],
        skip_special_tokens: bool,
    ) -> OutputText {
        let rules = StopRules::from_params(params);
        OutputText::with_rules(
            tokenizer,
            rules,
            eos_token_ids,
            prompt_token_ids,
            skip_special_tokens,
        )
    }

    /// `new` with the rules already read.
    pub fn with_rules(
        tokenizer: Arc<Tokenizer>,
        rules: StopRules,
        eos_token_ids: &[u32],
        prompt_token_ids: &[u32],
        skip_special_tokens: bool,
    ) -> OutputText {
        let mut stop_ids = rules.stop_token_ids.clone();
        if !rules.ignore_eos {
            stop_ids.extend_from_slice(eos_token_ids);
        }
        OutputText {
            rules,
            stop_ids,
            decoder: TextDecoder::new(tokenizer, prompt_token_ids, skip_special_tokens),
            num_output_tokens: 0,
            output_text: String::new(),
            num_sent: 0,
            finish_reason: None,
        }
    }

    /// New tokens: (text to send now, the router's finish reason if these tokens end the
    /// request, how many of them count as output). Tokens after the one that finishes
    /// are not taken; once finished, nothing more is (("", None, 0)).
    pub fn extend(&mut self, token_ids: &[u32]) -> (String, Option<String>, usize) {
        if self.finish_reason.is_some() {
            return (String::new(), None, 0);
        }
        if !self.rules.stop.is_empty() {
            return self.extend_each(token_ids);
        }
        // No stop strings: nothing is held back, the run is detokenized at once.
        let before = self.num_output_tokens;
        let mut take = token_ids.len();
        let mut finish = None;
        let room = self.rules.max_tokens.saturating_sub(before).max(1);
        if room <= take {
            take = room;
            finish = Some("length");
        }
        // A stop id wins over "length" on the same token.
        if let Some(i) = token_ids[..take].iter().enumerate().position(|(i, id)| {
            self.stop_ids.contains(id) && before + i + 1 >= self.rules.min_tokens
        }) {
            take = i + 1;
            finish = Some("stop");
        }
        self.num_output_tokens += take;
        let text_ids = if finish == Some("stop") {
            &token_ids[..take - 1]
        } else {
            &token_ids[..take]
        };
        let mut text = self.decoder.extend(text_ids);
        self.output_text.push_str(&text);
        self.num_sent = self.output_text.len();
        if let Some(reason) = finish {
            let (rest, reason) = self.finish_delta(reason);
            text.push_str(&rest);
            return (text, Some(reason), take);
        }
        (text, None, take)
    }

    /// With stop strings: token by token until one finishes.
    fn extend_each(&mut self, token_ids: &[u32]) -> (String, Option<String>, usize) {
        let mut text = String::new();
        for (i, &id) in token_ids.iter().enumerate() {
            let (part, finish) = self.append(id);
            text.push_str(&part);
            if let Some(reason) = finish {
                return (text, Some(reason), i + 1);
            }
        }
        (text, None, token_ids.len())
    }

    /// RequestOutputText.append: one token.
    fn append(&mut self, token_id: u32) -> (String, Option<String>) {
        self.num_output_tokens += 1;
        let count = self.num_output_tokens;
        if self.stop_ids.contains(&token_id) && count >= self.rules.min_tokens {
            let (text, reason) = self.finish_delta("stop");
            return (text, Some(reason));
        }
        let text = self.decoder.extend(&[token_id]);
        self.output_text.push_str(&text);
        if count >= self.rules.max_tokens {
            let (text, reason) = self.finish_delta("length");
            return (text, Some(reason));
        }
        if self.cut_at_stop_string() {
            return (self.close("stop"), Some("stop".into()));
        }
        let held = held_back_len(&self.output_text, &self.rules.stop, self.num_sent);
        (self.take_text(self.output_text.len() - held), None)
    }

    /// The worker finished for `reason` before the router saw a finish: the held-back text.
    pub fn finish(&mut self, reason: &str) -> String {
        self.finish_delta(reason).0
    }

    /// `finish`, with the finish reason: `reason`, or "stop" when the flushed text
    /// completes a stop string (RequestOutputText.finish's TextDelta). Once finished:
    /// ("", the reason it finished with).
    pub fn finish_delta(&mut self, reason: &str) -> (String, String) {
        if let Some(done) = self.finish_reason {
            return (String::new(), done.into());
        }
        let rest = self.decoder.flush();
        self.output_text.push_str(&rest);
        let reason = if self.cut_at_stop_string() {
            "stop"
        } else if reason == "length" {
            "length"
        } else {
            "stop"
        };
        (self.close(reason), reason.into())
    }

    pub fn num_output_tokens(&self) -> usize {
        self.num_output_tokens
    }

    /// The text so far (sent plus held back); the final text once finished.
    pub fn output_text(&self) -> &str {
        &self.output_text
    }

    pub fn finish_reason(&self) -> Option<&'static str> {
        self.finish_reason
    }

    /// Cuts output_text before the first stop string that starts in unsent text.
    fn cut_at_stop_string(&mut self) -> bool {
        if self.rules.stop.is_empty() || self.num_output_tokens < self.rules.min_tokens {
            return false;
        }
        match find_stop(&self.output_text, &self.rules.stop, self.num_sent) {
            Some(start) => {
                self.output_text.truncate(start);
                true
            }
            None => false,
        }
    }

    fn close(&mut self, reason: &'static str) -> String {
        self.finish_reason = Some(reason);
        self.take_text(self.output_text.len())
    }

    fn take_text(&mut self, end: usize) -> String {
        let text = self
            .output_text
            .get(self.num_sent..end)
            .unwrap_or("")
            .to_string();
        self.num_sent = self.num_sent.max(end);
        text
    }
}

/// Byte offset of the earliest stop string occurrence starting at or after `start`.
fn find_stop(text: &str, stops: &[String], start: usize) -> Option<usize> {
    let tail = text.get(start..)?;
    stops
        .iter()
        .filter_map(|s| tail.find(s.as_str()))
        .min()
        .map(|i| start + i)
}

/// Bytes of the longest suffix of text[start..] that is a proper prefix of a stop
/// string (it may still become one). Byte and char lengths order suffixes alike, and a
/// prefix that ends inside a character never matches text, so this is the router's
/// char-based rule.
fn held_back_len(text: &str, stops: &[String], start: usize) -> usize {
    let pending = &text.as_bytes()[start.min(text.len())..];
    let mut held = 0;
    for stop in stops {
        let stop = stop.as_bytes();
        let longest = (stop.len().saturating_sub(1)).min(pending.len());
        for n in (held + 1..=longest).rev() {
            if pending.ends_with(&stop[..n]) {
                held = n;
                break;
            }
        }
    }
    held
}

/// `kvserve-edge detok --tokenizer FILE`: one case per JSON line:
/// {"params": {SamplingParams fields}, "eos": [...], "prompt": [...],
///  "skip_special_tokens": bool, "calls": [[ids...], ...], "finish": "stop"|"length"|null}
/// -> {"deltas": [[text, finish_reason|null, n], ...], "final": text}. Calls after a
/// finish are not made; "finish" (when not finished by then) adds [text, reason, 0].
pub fn cli(args: &[String]) -> i32 {
    let path = match args {
        [flag, path] if flag == "--tokenizer" => path,
        _ => {
            eprintln!("usage: kvserve-edge detok --tokenizer FILE");
            return 2;
        }
    };
    let tokenizer = match Tokenizer::from_file(std::path::Path::new(path)) {
        Ok(t) => Arc::new(t),
        Err(e) => {
            eprintln!("{e}");
            return 1;
        }
    };
    crate::tokenizer::json_lines(|case| run_case(&tokenizer, case))
}

fn ids_of(value: Option<&Value>) -> Vec<u32> {
    value
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|i| i.as_u64().map(|i| i as u32))
                .collect()
        })
        .unwrap_or_default()
}

fn run_case(tokenizer: &Arc<Tokenizer>, case: &Value) -> Value {
    use serde_json::json;
    let params = case.get("params").cloned().unwrap_or(json!({}));
    let params: SamplingParams = match serde_json::from_value(params) {
        Ok(p) => p,
        Err(e) => return json!({ "error": format!("params: {e}") }),
    };
    let skip = case
        .get("skip_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let eos = ids_of(case.get("eos"));
    let prompt = ids_of(case.get("prompt"));
    let mut out = OutputText::new(tokenizer.clone(), &params, &eos, &prompt, skip);
    let mut deltas = Vec::new();
    for call in case
        .get("calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if out.finish_reason().is_some() {
            break;
        }
        let (text, finish, taken) = out.extend(&ids_of(Some(call)));
        deltas.push(json!([text, finish, taken]));
    }
    if let (None, Some(reason)) = (
        out.finish_reason(),
        case.get("finish").and_then(Value::as_str),
    ) {
        let (text, reason) = out.finish_delta(reason);
        deltas.push(json!([text, reason, 0]));
    }
    json!({"deltas": deltas, "final": out.output_text()})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn held_back_is_the_longest_proper_prefix_of_a_stop_at_the_end() {
        let s = stops(&["###END", "ab"]);
        assert_eq!(held_back_len("Hello world###", &s, 0), 3);
        assert_eq!(held_back_len("Hello world###", &s, 12), 2); // only unsent text counts
        assert_eq!(held_back_len("xa", &s, 0), 1);
        assert_eq!(held_back_len("x###END", &s, 0), 0); // whole stops are cut, not held
                                                        // "é" is two bytes: a one-byte prefix of "éx" never matches text
        assert_eq!(held_back_len("caf\u{e9}", &stops(&["\u{e9}x"]), 0), 2);
    }

    #[test]
    fn find_stop_takes_the_earliest_in_unsent_text() {
        let s = stops(&["END", "lo"]);
        assert_eq!(find_stop("Hello END", &s, 0), Some(3));
        assert_eq!(find_stop("Hello END", &s, 4), Some(6));
        assert_eq!(find_stop("Hello", &s, 5), None);
    }
}
