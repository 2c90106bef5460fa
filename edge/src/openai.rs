//! The OpenAI bodies: which requests the edge serves natively (`parse`, `finalize_with`), and
//! the responses, byte for byte what router/openai_format.py and router/choices.py write
//! for the same values.
//!
//! # What is native
//! `parse` accepts a body only when the Python router would accept it (router/api_types.py
//! decoding, router/preprocess.py checks, SamplingParams.validate) and serve it with
//! nothing the edge lacks: one choice, no logprobs, no tools, no response_format, no
//! logit_bias, text (or token-id) prompts, chat messages of role system / developer / user
//! / assistant whose content is a string or a list of text parts. Anything else, valid or
//! not, is None: the request goes to the Python router unchanged and it answers (its 4xx
//! included), so the edge never needs an error message for bad input. Where acceptance
//! needs the prompt's length or the vocabulary, `finalize_with` decides after tokenizing.
//!
//! # A request's sequence
//! 0. `is_json_content_type(first content-type header)`: false: proxy (the router's 415).
//! 1. `parse(endpoint, body, served_model_names)` -> GenRequest, or None: proxy.
//! 2. Tokenize (`Prompt::Text`: `encode(text, true)`, as the router's PromptEncoder;
//!    `Prompt::Messages`: the chat template with `add_generation_prompt`, then
//!    `encode(text, false)`).
//! 3. `finalize_with(&mut req, prompt_len, &limits)`: false: proxy. It sets
//!    `req.params.max_tokens`.
//! 4. `new_request_id(endpoint)` and `created = created_now()`: the response's `created`
//!    is Unix time in whole seconds taken here, once the request is prepared (the
//!    router's PreparedRequest.created, `int(time.time())`), the same in every chunk.
//! 5. `Formatter::new(endpoint, &id, created, &req.model, req.include_usage)`.
//!
//! A stream (`req.stream`), as router/choices.py `_one_choice_body`: await the first
//! delta before answering (a failure before it is a real HTTP status: `error_body`); then
//! status 200 and, per delta of text, `chunk(text, finish_reason)`: write it unless empty
//! (a chat stream's first call also returns the role chunk in front, as the router's
//! `stream_start() + stream_delta(first)`). After the chunk that carries the finish
//! reason: `stream_end(&usage)` (the usage chunk when include_usage, then DONE); the
//! router writes that last chunk, the usage and DONE as one write. A failure after the
//! status went out: `error_event(message, type, code)` (it ends with DONE itself).
//!
//! A whole body (`!req.stream`): collect every delta's text; at the finish,
//! `full(text, finish_reason, &usage)`, status 200, content-type application/json.
//!
//! `Usage`: prompt_tokens = the prompt's token count, completion_tokens = the output
//! tokens counted by the detokenizer, details = the first token's PromptUsage (None if no
//! token came).

mod driver;
mod format;
mod parse;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::protocol::SamplingParams;

pub use driver::cli;
// The serving path's API (serve.rs, relay.rs), whichever parts it calls.
#[allow(unused_imports)]
pub use format::{error_body, error_event, Formatter, Usage, DONE};
#[allow(unused_imports)]
#[cfg(test)]
pub use parse::finalize;
pub use parse::{finalize_with, is_json_content_type, parse, Limits};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    /// serve_generation's endpoint name ("chat" / "completion": metrics, control plane).
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completion",
        }
    }
}

/// One chat message as the template reads it ("developer" already renamed "system", a
/// list of text parts already joined with "\n", as router/preprocess.py _message_dict).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
    Messages(Vec<ChatMessage>),
}

/// A request the edge serves natively.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    /// The name answered with (the first served name), as PreparedRequest.model.
    pub model: String,
    pub prompt: Prompt,
    /// `max_tokens` is the asked one (or the default 16) until `finalize` sets it.
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    pub user: Option<String>,
    pub skip_special_tokens: bool,
    /// Always true: the router renders chat prompts with the generation prompt.
    pub add_generation_prompt: bool,
    /// max_tokens (chat: max_completion_tokens when given) as asked; None: the default.
    pub max_tokens: Option<u64>,
}

/// "chatcmpl-" / "cmpl-" and 128 bits as 32 hex digits, as the router makes them: a keyed
/// hash (xxh3-128, key from the OS once) of a process-wide counter, so ids never repeat
/// within a process and are not guessable across processes.
pub fn new_request_id(endpoint: Endpoint) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let (key, seed) = *id_key();
    let mut input = [0u8; 24];
    input[..16].copy_from_slice(&key.to_le_bytes());
    input[16..].copy_from_slice(&n.to_le_bytes());
    let bits = xxhash_rust::xxh3::xxh3_128_with_seed(&input, seed);
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    format!("{prefix}-{bits:032x}")
}

/// 192 random bits for request ids: /dev/urandom, else the time and process id.
fn id_key() -> &'static (u128, u64) {
    static KEY: OnceLock<(u128, u64)> = OnceLock::new();
    KEY.get_or_init(|| {
        use std::io::Read;
        let mut buf = [0u8; 24];
        let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf));
        if read.is_err() {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            buf[..16].copy_from_slice(&now.to_le_bytes());
            buf[16..20].copy_from_slice(&std::process::id().to_le_bytes());
        }
        let mut key = [0u8; 16];
        key.copy_from_slice(&buf[..16]);
        let mut seed = [0u8; 8];
        seed.copy_from_slice(&buf[16..]);
        (u128::from_le_bytes(key), u64::from_le_bytes(seed))
    })
}

/// A response's `created`: Unix time in whole seconds (the router's `int(time.time())`).
pub fn created_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
