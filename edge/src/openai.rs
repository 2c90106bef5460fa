//! The OpenAI bodies: which requests the edge serves natively (`parse`, `finalize`), and
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
//! needs the prompt's length or the vocabulary, `finalize` decides after tokenizing.
//!
//! # A request's sequence
//! 1. `parse(endpoint, body, served_model_names)` -> GenRequest, or None: proxy.
//! 2. Tokenize (`Prompt::Text`: as the router's PromptEncoder; `Prompt::Messages`: the
//!    chat template with `add_generation_prompt`, then `encode(text, false)`).
//! 3. `finalize_with(&mut req, prompt_len, &limits)` (or `finalize` with the context
//!    length only): false: proxy. It sets `req.params.max_tokens`.
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::protocol::{write_str, write_u64, PromptUsage, SamplingParams};

/// protocol/sampling.py MAX_STOP_CHARS.
const MAX_STOP_CHARS: usize = 1024;
/// protocol/sampling.py MIN_REPETITION_PENALTY.
const MIN_REPETITION_PENALTY: f64 = 1e-4;
/// router/preprocess.py MAX_MESSAGES.
const MAX_MESSAGES: usize = 10_000;
/// router/preprocess.py _SEED_RANGE.
const SEED_MIN: i128 = -(1i128 << 63);
const SEED_MAX: i128 = (1i128 << 64) - 1;

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

// -- reading JSON as msgspec does -----------------------------------------------------------

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

fn members(text: &[u8]) -> Option<Vec<(String, &RawValue)>> {
    let Members(out) = serde_json::from_slice(text).ok()?;
    Some(out)
}

/// Known keys of one object: each raw value by name, or None when a known key repeats.
fn known<'a>(
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

fn is_null(v: &RawValue) -> bool {
    v.get() == "null"
}

/// A typed optional field: Ok(None) for absent or null, Err(()) for a wrong type.
type Field<T> = Result<Option<T>, ()>;

fn opt<T>(v: Option<&RawValue>, read: impl Fn(&RawValue) -> Option<T>) -> Field<T> {
    match v {
        None => Ok(None),
        Some(v) if is_null(v) => Ok(None),
        Some(v) => read(v).map(Some).ok_or(()),
    }
}

fn read_bool(v: &RawValue) -> Option<bool> {
    match v.get() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

fn is_number(text: &str) -> bool {
    text.starts_with(|c: char| c == '-' || c.is_ascii_digit())
}

fn is_integer(text: &str) -> bool {
    is_number(text) && !text.contains(['.', 'e', 'E'])
}

/// A JSON integer (msgspec's `int` takes no float, not even 1.0); None beyond i128.
fn read_int(v: &RawValue) -> Option<i128> {
    let text = v.get();
    if !is_integer(text) {
        return None;
    }
    text.parse::<i128>().ok()
}

/// A JSON number as Python's float of it: correctly rounded (Rust's parser is; serde's
/// default one is not always), an integer's -0 as 0.0.
fn read_float(v: &RawValue) -> Option<f64> {
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

fn read_string(v: &RawValue) -> Option<String> {
    if !v.get().starts_with('"') {
        return None;
    }
    serde_json::from_str::<String>(v.get()).ok()
}

fn read_list(v: &RawValue) -> Option<Vec<&RawValue>> {
    if !v.get().starts_with('[') {
        return None;
    }
    serde_json::from_str::<Vec<&RawValue>>(v.get()).ok()
}

fn read_u32(v: &RawValue) -> Option<u32> {
    read_int(v).and_then(|x| u32::try_from(x).ok())
}

fn read_u32s(v: &RawValue) -> Option<Vec<u32>> {
    read_list(v)?.into_iter().map(read_u32).collect()
}

// -- parse ------------------------------------------------------------------------------------

const COMMON: [&str; 20] = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "stream",
    "stream_options",
    "user",
    "skip_special_tokens",
];
const CHAT_ONLY: [&str; 7] = [
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];
const COMPLETION_ONLY: [&str; 5] = ["prompt", "logprobs", "echo", "suffix", "best_of"];

/// The body's fields by name (router/api_types.py's structs); None: not a JSON object, an
/// unknown field (the router answers 400), or a field twice.
struct Body<'a> {
    names: Vec<&'static str>,
    slots: Vec<Option<&'a RawValue>>,
}

impl<'a> Body<'a> {
    fn read(endpoint: Endpoint, body: &'a [u8]) -> Option<Body<'a>> {
        let entries = members(body)?;
        let only: &[&'static str] = match endpoint {
            Endpoint::Chat => &CHAT_ONLY,
            Endpoint::Completion => &COMPLETION_ONLY,
        };
        let names: Vec<&'static str> = COMMON.iter().chain(only).copied().collect();
        if entries.iter().any(|(k, _)| !names.contains(&k.as_str())) {
            return None;
        }
        let slots = known(&entries, &names)?;
        Some(Body { names, slots })
    }

    fn get(&self, name: &str) -> Option<&'a RawValue> {
        let i = self.names.iter().position(|n| *n == name)?;
        self.slots[i]
    }

    fn is_given(&self, name: &str) -> bool {
        self.get(name).is_some_and(|v| !is_null(v))
    }
}

/// None: not for the native path (anything unsupported or invalid): proxy it unchanged.
pub fn parse(endpoint: Endpoint, body: &[u8], served_model_names: &[String]) -> Option<GenRequest> {
    let answered_name = served_model_names.first()?;
    let b = Body::read(endpoint, body)?;
    // model (router: check_model; absent or null is the served model)
    if let Some(name) = opt(b.get("model"), read_string).ok()? {
        if !served_model_names.contains(&name) {
            return None;
        }
    }
    // What the edge does not do, or only in its neutral form.
    for name in ["response_format", "tools", "tool_choice"] {
        if b.is_given(name) {
            return None;
        }
    }
    if !matches!(opt(b.get("n"), read_int), Ok(None) | Ok(Some(1))) {
        return None;
    }
    if let Some(v) = b.get("logit_bias").filter(|v| !is_null(v)) {
        if !members(v.get().as_bytes())?.is_empty() {
            return None;
        }
    }
    let (prompt, max_tokens) = match endpoint {
        Endpoint::Chat => chat_fields(&b)?,
        Endpoint::Completion => completion_fields(&b)?,
    };
    let params = sampling_params(&b, max_tokens)?;
    let stream = opt(b.get("stream"), read_bool).ok()?.unwrap_or(false);
    let include_usage = match b.get("stream_options").filter(|v| !is_null(v)) {
        None => false,
        Some(v) => {
            let entries = members(v.get().as_bytes())?;
            let slots = known(&entries, &["include_usage"])?;
            opt(slots[0], read_bool).ok()?.unwrap_or(false)
        }
    };
    Some(GenRequest {
        endpoint,
        model: answered_name.clone(),
        prompt,
        params,
        stream,
        include_usage: stream && include_usage,
        user: opt(b.get("user"), read_string).ok()?,
        skip_special_tokens: opt(b.get("skip_special_tokens"), read_bool).ok()? != Some(false),
        add_generation_prompt: true,
        max_tokens,
    })
}

/// The asked max_tokens: >= 1 when given (router: _prepare), and a u64.
fn asked_max_tokens(v: Option<&RawValue>) -> Field<u64> {
    match opt(v, read_int)? {
        None => Ok(None),
        Some(m) if m >= 1 => u64::try_from(m).map(Some).map_err(|_| ()),
        Some(_) => Err(()),
    }
}

fn chat_fields(b: &Body) -> Option<(Prompt, Option<u64>)> {
    if opt(b.get("logprobs"), read_bool).ok()?.unwrap_or(false) {
        return None;
    }
    if opt(b.get("top_logprobs"), read_int).ok()?.unwrap_or(0) != 0 {
        return None;
    }
    opt(b.get("parallel_tool_calls"), read_bool).ok()?;
    // max_completion_tokens wins; max_tokens is then only type-checked.
    let max_tokens = match opt(b.get("max_completion_tokens"), read_int).ok()? {
        Some(_) => {
            opt(b.get("max_tokens"), read_int).ok()?;
            asked_max_tokens(b.get("max_completion_tokens")).ok()?
        }
        None => asked_max_tokens(b.get("max_tokens")).ok()?,
    };
    let raw = read_list(b.get("messages")?)?;
    if raw.is_empty() || raw.len() > MAX_MESSAGES {
        return None;
    }
    let messages = raw.into_iter().map(chat_message).collect::<Option<Vec<_>>>()?;
    Some((Prompt::Messages(messages), max_tokens))
}

/// One message (router/api_types.py ChatMessage, unknown keys ignored; preprocess.py
/// _message_dict): a known role, content a string or text parts, no tool fields.
fn chat_message(v: &RawValue) -> Option<ChatMessage> {
    let entries = members(v.get().as_bytes())?;
    let slots = known(
        &entries,
        &["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"],
    )?;
    if slots[2..].iter().any(|s| s.is_some_and(|v| !is_null(v))) {
        return None;
    }
    let role = match read_string(slots[0]?)?.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        _ => return None,
    };
    let content = slots[1]?;
    let content = if content.get().starts_with('[') {
        let parts = read_list(content)?;
        let texts = parts.into_iter().map(text_part).collect::<Option<Vec<_>>>()?;
        texts.join("\n")
    } else {
        read_string(content)?
    };
    Some(ChatMessage { role: role.to_string(), content })
}

/// {"type": "text", "text": "..."} (other keys ignored, as api_types.ContentPart does).
fn text_part(v: &RawValue) -> Option<String> {
    let entries = members(v.get().as_bytes())?;
    let slots = known(&entries, &["type", "text"])?;
    if read_string(slots[0]?)? != "text" {
        return None;
    }
    read_string(slots[1]?)
}

fn completion_fields(b: &Body) -> Option<(Prompt, Option<u64>)> {
    if b.is_given("logprobs") {
        return None;
    }
    if opt(b.get("echo"), read_bool).ok()?.unwrap_or(false) {
        return None;
    }
    if !opt(b.get("suffix"), read_string).ok()?.unwrap_or_default().is_empty() {
        return None;
    }
    if !matches!(opt(b.get("best_of"), read_int), Ok(None) | Ok(Some(1))) {
        return None;
    }
    let max_tokens = asked_max_tokens(b.get("max_tokens")).ok()?;
    Some((completion_prompt(b.get("prompt")?)?, max_tokens))
}

/// preprocess.py _single_prompt: a string, token ids, or a one-element list of either.
/// Token ids must be non-empty and u32 here; the vocabulary is `finalize`'s.
fn completion_prompt(v: &RawValue) -> Option<Prompt> {
    if let Some(text) = read_string(v) {
        return Some(Prompt::Text(text));
    }
    let mut items = read_list(v)?;
    if items.len() == 1 {
        if let Some(text) = read_string(items[0]) {
            return Some(Prompt::Text(text));
        }
        if items[0].get().starts_with('[') {
            items = read_list(items[0])?;
        }
    }
    let ids = items.into_iter().map(read_u32).collect::<Option<Vec<u32>>>()?;
    if ids.is_empty() {
        return None;
    }
    Some(Prompt::TokenIds(ids))
}

/// preprocess.py _sampling_params and SamplingParams.validate, but for what needs the
/// final max_tokens (`finalize`).
fn sampling_params(b: &Body, max_tokens: Option<u64>) -> Option<SamplingParams> {
    let min_tokens = opt(b.get("min_tokens"), read_int).ok()?.unwrap_or(0);
    let min_tokens = u64::try_from(min_tokens).ok()?;
    if max_tokens.is_some_and(|m| min_tokens > m) {
        return None;
    }
    let temperature = opt(b.get("temperature"), read_float).ok()?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return None;
    }
    let top_p = opt(b.get("top_p"), read_float).ok()?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return None;
    }
    let top_k = opt(b.get("top_k"), read_int).ok()?.unwrap_or(0);
    let top_k = i64::try_from(top_k).ok().filter(|k| *k >= -1)?;
    let seed = opt(b.get("seed"), read_int).ok()?;
    if seed.is_some_and(|s| !(SEED_MIN..=SEED_MAX).contains(&s)) {
        return None;
    }
    let stop = match b.get("stop").filter(|v| !is_null(v)) {
        None => Vec::new(),
        Some(v) => match read_string(v) {
            Some(s) => vec![s],
            None => read_list(v)?.into_iter().map(read_string).collect::<Option<Vec<_>>>()?,
        },
    };
    let stop_ok = |s: &String| !s.is_empty() && s.chars().count() <= MAX_STOP_CHARS;
    if stop.len() > 4 || !stop.iter().all(stop_ok) {
        return None;
    }
    let stop_token_ids = opt(b.get("stop_token_ids"), read_u32s).ok()?.unwrap_or_default();
    // `value or 0.0`: a given -0.0 is 0.0 too
    let penalty = |name: &str| -> Option<f64> {
        let p = opt(b.get(name), read_float).ok()?.unwrap_or(0.0);
        let p = if p == 0.0 { 0.0 } else { p };
        (-2.0..=2.0).contains(&p).then_some(p)
    };
    let presence_penalty = penalty("presence_penalty")?;
    let frequency_penalty = penalty("frequency_penalty")?;
    let repetition_penalty = opt(b.get("repetition_penalty"), read_float).ok()?.unwrap_or(1.0);
    if !(MIN_REPETITION_PENALTY..=2.0).contains(&repetition_penalty) {
        return None;
    }
    Some(SamplingParams {
        max_tokens: max_tokens.unwrap_or(SamplingParams::default().max_tokens),
        min_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        stop,
        stop_token_ids,
        ignore_eos: opt(b.get("ignore_eos"), read_bool).ok()?.unwrap_or(false),
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        ..SamplingParams::default()
    })
}

// -- finalize ---------------------------------------------------------------------------------

/// The router's limits (router/preprocess.py Preprocessor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The model's context (ModelInfo.max_context_len).
    pub context_len: usize,
    /// router.max_input_tokens (None or 0: the context).
    pub max_input_tokens: Option<usize>,
    /// router.admission.max_output_tokens (None: none).
    pub max_output_tokens: Option<u64>,
    /// The model config's vocab_size (None: unknown, so token-id prompts and
    /// stop_token_ids cannot be checked: such requests are proxied).
    pub vocab_size: Option<u32>,
}

/// After tokenizing: the router's max_tokens default and length checks; false: proxy.
/// Knows only the context length: requests with token ids to check are proxied, and a
/// router with max_input_tokens / max_output_tokens needs `finalize_with`.
pub fn finalize(req: &mut GenRequest, prompt_len: usize, max_model_len: usize) -> bool {
    let limits = Limits {
        context_len: max_model_len,
        max_input_tokens: None,
        max_output_tokens: None,
        vocab_size: None,
    };
    finalize_with(req, prompt_len, &limits)
}

/// preprocess.py _prepare's checks on the prompt's length and max_tokens, the vocabulary
/// checks, then SamplingParams.validate's min_tokens <= max_tokens. Sets
/// `req.params.max_tokens`; false: the router would answer 400 (or the edge cannot tell).
pub fn finalize_with(req: &mut GenRequest, prompt_len: usize, limits: &Limits) -> bool {
    let context = limits.context_len;
    let max_input = limits.max_input_tokens.filter(|m| *m > 0).unwrap_or(context).min(context);
    if prompt_len == 0 || prompt_len > max_input || prompt_len >= context {
        return false;
    }
    let out_limit = limits.max_output_tokens;
    let max_tokens = match req.max_tokens {
        Some(m) => {
            if out_limit.is_some_and(|o| m > o) || (prompt_len as u64).saturating_add(m) > context as u64 {
                return false;
            }
            m
        }
        None => {
            let m = (context - prompt_len) as u64;
            out_limit.map_or(m, |o| m.min(o))
        }
    };
    let in_vocab = |ids: &[u32]| match limits.vocab_size {
        Some(v) => ids.iter().all(|t| *t < v),
        None => ids.is_empty(),
    };
    if let Prompt::TokenIds(ids) = &req.prompt {
        if !in_vocab(ids) {
            return false;
        }
    }
    if !in_vocab(&req.params.stop_token_ids) {
        return false;
    }
    if max_tokens < 1 || req.params.min_tokens > max_tokens {
        return false;
    }
    req.params.max_tokens = max_tokens;
    true
}

// -- ids and time -----------------------------------------------------------------------------

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

// -- responses --------------------------------------------------------------------------------

pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// A request's token counts (router/openai_format.py usage_dict's inputs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub details: Option<PromptUsage>,
}

impl Usage {
    /// usage_dict: the counts, and the prefill's split when known.
    fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"prompt_tokens\":");
        write_u64(out, self.prompt_tokens);
        out.extend_from_slice(b",\"completion_tokens\":");
        write_u64(out, self.completion_tokens);
        out.extend_from_slice(b",\"total_tokens\":");
        write_u64(out, self.prompt_tokens.saturating_add(self.completion_tokens));
        if let Some(d) = &self.details {
            out.extend_from_slice(b",\"prompt_tokens_details\":{\"cached_tokens\":");
            write_u64(out, d.gpu_tokens.saturating_add(d.pool_tokens));
            out.extend_from_slice(b",\"gpu_tokens\":");
            write_u64(out, d.gpu_tokens);
            out.extend_from_slice(b",\"pool_tokens\":");
            write_u64(out, d.pool_tokens);
            out.extend_from_slice(b",\"computed_tokens\":");
            write_u64(out, d.computed_tokens);
            out.push(b'}');
        }
        out.push(b'}');
    }
}

/// One choice's response bodies (router/openai_format.py ChatFormatter /
/// CompletionFormatter without logprobs and tools); the call sequence is in the header.
pub struct Formatter {
    endpoint: Endpoint,
    /// `{"id":..,"object":..,"created":..,"model":..,"choices":[` of a chunk.
    chunk_head: Vec<u8>,
    /// What follows a chunk's choices: `]}` or, with include_usage, `],"usage":null}`.
    chunk_tail: &'static [u8],
    include_usage: bool,
    request_id: String,
    created: u64,
    model: String,
    /// Whether a chat stream's role chunk went out.
    started: bool,
}

impl Formatter {
    pub fn new(
        endpoint: Endpoint,
        request_id: &str,
        created: u64,
        model: &str,
        include_usage: bool,
    ) -> Formatter {
        let mut f = Formatter {
            endpoint,
            chunk_head: Vec::new(),
            chunk_tail: if include_usage { b"],\"usage\":null}\n\n" } else { b"]}\n\n" },
            include_usage,
            request_id: request_id.to_string(),
            created,
            model: model.to_string(),
            started: false,
        };
        let mut head = b"data: ".to_vec();
        f.envelope_head(&mut head, f.object_chunk());
        f.chunk_head = head;
        f
    }

    fn object_chunk(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        }
    }

    fn object_full(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        }
    }

    /// ResponseFormatter.envelope up to the choices' opening bracket.
    fn envelope_head(&self, out: &mut Vec<u8>, object: &str) {
        out.extend_from_slice(b"{\"id\":");
        write_str(out, &self.request_id);
        out.extend_from_slice(b",\"object\":");
        write_str(out, object);
        out.extend_from_slice(b",\"created\":");
        write_u64(out, self.created);
        out.extend_from_slice(b",\"model\":");
        write_str(out, &self.model);
        out.extend_from_slice(b",\"choices\":[");
    }

    /// One delta's SSE bytes ("data: {...}\n\n"), empty when there is nothing to send yet
    /// (no text, no finish). A chat stream's first call puts the role chunk in front.
    pub fn chunk(&mut self, text: &str, finish_reason: Option<&str>) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.chunk_head.len() + text.len() + 96);
        if self.endpoint == Endpoint::Chat && !self.started {
            self.started = true;
            out.extend_from_slice(&self.chunk_head);
            out.extend_from_slice(
                b"{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}",
            );
            out.extend_from_slice(self.chunk_tail);
        }
        if text.is_empty() && finish_reason.is_none() {
            return out;
        }
        out.extend_from_slice(&self.chunk_head);
        match self.endpoint {
            Endpoint::Chat => {
                out.extend_from_slice(b"{\"index\":0,\"delta\":{");
                if !text.is_empty() {
                    out.extend_from_slice(b"\"content\":");
                    write_str(&mut out, text);
                }
                out.push(b'}');
            }
            Endpoint::Completion => {
                out.extend_from_slice(b"{\"index\":0,\"text\":");
                write_str(&mut out, text);
            }
        }
        out.extend_from_slice(b",\"logprobs\":null,\"finish_reason\":");
        write_opt_str(&mut out, finish_reason);
        out.push(b'}');
        out.extend_from_slice(self.chunk_tail);
        out
    }

    /// The last chunk with `"choices": []` and the usage (stream_options.include_usage).
    pub fn usage_chunk(&self, usage: &Usage) -> Vec<u8> {
        let mut out = b"data: ".to_vec();
        self.envelope_head(&mut out, self.object_chunk());
        out.extend_from_slice(b"],\"usage\":");
        usage.write_json(&mut out);
        out.extend_from_slice(b"}\n\n");
        out
    }

    /// What follows the chunk that carried the finish reason: the usage chunk when the
    /// request asked for it, then DONE.
    pub fn stream_end(&self, usage: &Usage) -> Vec<u8> {
        let mut out = if self.include_usage { self.usage_chunk(usage) } else { Vec::new() };
        out.extend_from_slice(DONE);
        out
    }

    /// The whole (non-streamed) body.
    pub fn full(&self, text: &str, finish_reason: &str, usage: &Usage) -> Vec<u8> {
        let mut out = Vec::with_capacity(text.len() + 320);
        self.envelope_head(&mut out, self.object_full());
        match self.endpoint {
            Endpoint::Chat => {
                out.extend_from_slice(b"{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":");
                write_str(&mut out, text);
                out.extend_from_slice(b",\"refusal\":null}");
            }
            Endpoint::Completion => {
                out.extend_from_slice(b"{\"index\":0,\"text\":");
                write_str(&mut out, text);
            }
        }
        out.extend_from_slice(b",\"logprobs\":null,\"finish_reason\":");
        write_str(&mut out, finish_reason);
        out.extend_from_slice(b"}],\"usage\":");
        usage.write_json(&mut out);
        out.push(b'}');
        out
    }
}

fn write_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => write_str(out, s),
        None => out.extend_from_slice(b"null"),
    }
}

/// router/errors.py APIError.encode(): {"error": {"message", "type", "param", "code"}}.
pub fn error_body(message: &str, error_type: &str, param: Option<&str>, code: Option<&str>) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.len() + 96);
    out.extend_from_slice(b"{\"error\":{\"message\":");
    write_str(&mut out, message);
    out.extend_from_slice(b",\"type\":");
    write_str(&mut out, error_type);
    out.extend_from_slice(b",\"param\":");
    write_opt_str(&mut out, param);
    out.extend_from_slice(b",\"code\":");
    write_opt_str(&mut out, code);
    out.extend_from_slice(b"}}");
    out
}

/// router/choices.py error_event: a failure after a stream's status went out, as one SSE
/// event, then DONE.
pub fn error_event(message: &str, error_type: &str, code: Option<&str>) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend_from_slice(&error_body(message, error_type, None, code));
    out.extend_from_slice(b"\n\n");
    out.extend_from_slice(DONE);
    out
}

// -- test driver ------------------------------------------------------------------------------

/// `kvserve-edge openai`: one JSON object per stdin line, one answer per stdout line
/// (tests/test_edge_bodies.py). Ops:
///   {"op": "parse", "endpoint": "chat"|"completion", "body": TEXT, "served": [..],
///    "finalize"?: {"prompt_len", "context_len", "max_input_tokens"?, "max_output_tokens"?,
///    "vocab_size"?}} -> null, or the request with "params_json" (msgspec's bytes) and,
///    with "finalize", "finalized" and "final_params_json"
///   {"op": "stream", "endpoint", "request_id", "created", "model", "include_usage",
///    "deltas": [[text, finish|null], ..], "usage": USAGE} -> {"chunks": [..], "end": ..}
///   {"op": "full", "endpoint", "request_id", "created", "model", "text", "finish_reason",
///    "usage": USAGE} -> {"bytes"}
///   {"op": "error_body", "message", "type", "param", "code"} / {"op": "error_event",
///    "message", "type", "code"} -> {"bytes"}
///   {"op": "worker", "kind": "decode"|"prefill"|"generate"|"abort", "request_id",
///    "prompt", "params" (SamplingParams fields), "ready"? (a ready event's line),
///    "reason", "prefill_contacted"} -> {"bytes"}
///   {"op": "event", "line": TEXT} -> the event's fields, or {"error": ..}
///   {"op": "request_id", "endpoint"} -> {"id"}
/// USAGE: {"prompt_tokens", "completion_tokens", "details": PromptUsage|null}.
pub fn cli(_args: &[String]) -> i32 {
    use std::io::{BufRead, Write};
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { return 1 };
        if line.trim().is_empty() {
            continue;
        }
        let answer = match cli_op(&line) {
            Ok(v) => v,
            Err(e) => serde_json::json!({ "driver_error": e }),
        };
        if writeln!(out, "{answer}").and_then(|_| out.flush()).is_err() {
            return 1;
        }
    }
    0
}

type Json = serde_json::Value;

fn cli_op(line: &str) -> Result<Json, String> {
    let entries = members(line.as_bytes()).ok_or("not a JSON object")?;
    let raw = |name: &str| entries.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
    let value = |name: &str| -> Json {
        raw(name).and_then(|v| serde_json::from_str(v.get()).ok()).unwrap_or(Json::Null)
    };
    let string = |name: &str| value(name).as_str().map(str::to_string).unwrap_or_default();
    let endpoint = if string("endpoint") == "chat" { Endpoint::Chat } else { Endpoint::Completion };
    let bytes = |b: Vec<u8>| serde_json::json!({ "bytes": String::from_utf8_lossy(&b) });
    match string("op").as_str() {
        "parse" => {
            let served: Vec<String> = serde_json::from_value(value("served")).map_err(|e| e.to_string())?;
            let body = string("body");
            let Some(mut req) = parse(endpoint, body.as_bytes(), &served) else {
                return Ok(Json::Null);
            };
            let mut answer = request_json(&req);
            if let Some(f) = value("finalize").as_object() {
                let num = |k: &str| f.get(k).and_then(Json::as_u64);
                let limits = Limits {
                    context_len: num("context_len").unwrap_or(0) as usize,
                    max_input_tokens: num("max_input_tokens").map(|m| m as usize),
                    max_output_tokens: num("max_output_tokens"),
                    vocab_size: num("vocab_size").map(|v| v as u32),
                };
                let ok = finalize_with(&mut req, num("prompt_len").unwrap_or(0) as usize, &limits);
                answer["finalized"] = Json::Bool(ok);
                answer["final_params_json"] = Json::String(String::from_utf8_lossy(&req.params.to_json()).into_owned());
            }
            Ok(answer)
        }
        "stream" => {
            let usage = usage_from(&value("usage"));
            let mut f = Formatter::new(endpoint, &string("request_id"), value("created").as_u64().unwrap_or(0), &string("model"), value("include_usage").as_bool().unwrap_or(false));
            let deltas: Vec<(String, Option<String>)> = serde_json::from_value(value("deltas")).map_err(|e| e.to_string())?;
            let chunks: Vec<Json> = deltas
                .iter()
                .map(|(text, finish)| Json::String(String::from_utf8_lossy(&f.chunk(text, finish.as_deref())).into_owned()))
                .collect();
            Ok(serde_json::json!({ "chunks": chunks, "end": String::from_utf8_lossy(&f.stream_end(&usage)) }))
        }
        "full" => {
            let f = Formatter::new(endpoint, &string("request_id"), value("created").as_u64().unwrap_or(0), &string("model"), false);
            Ok(bytes(f.full(&string("text"), &string("finish_reason"), &usage_from(&value("usage")))))
        }
        "error_body" => {
            let (p, c) = (value("param"), value("code"));
            Ok(bytes(error_body(&string("message"), &string("type"), p.as_str(), c.as_str())))
        }
        "error_event" => {
            let c = value("code");
            Ok(bytes(error_event(&string("message"), &string("type"), c.as_str())))
        }
        "worker" => worker_op(&string("kind"), raw, &string("request_id")).map(bytes),
        "event" => Ok(event_json(string("line").as_bytes())),
        "request_id" => Ok(serde_json::json!({ "id": new_request_id(endpoint) })),
        other => Err(format!("unknown op {other:?}")),
    }
}

fn usage_from(v: &Json) -> Usage {
    let num = |k: &str| v.get(k).and_then(Json::as_u64).unwrap_or(0);
    Usage {
        prompt_tokens: num("prompt_tokens"),
        completion_tokens: num("completion_tokens"),
        details: v.get("details").and_then(|d| serde_json::from_value(d.clone()).ok()),
    }
}

fn worker_op<'a>(kind: &str, raw: impl Fn(&str) -> Option<&'a RawValue>, id: &str) -> Result<Vec<u8>, String> {
    if kind == "abort" {
        let reason = raw("reason").and_then(read_string).unwrap_or_default();
        let contacted = raw("prefill_contacted").and_then(read_bool).unwrap_or(true);
        return Ok(crate::protocol::abort_json(id, &reason, contacted));
    }
    let prompt = raw("prompt").and_then(read_u32s).ok_or("prompt: token ids")?;
    let params = raw("params").map_or(Some(SamplingParams::default()), params_from_raw).ok_or("params")?;
    match kind {
        "decode" => Ok(crate::protocol::decode_request_json(id, &prompt, &params)),
        "generate" => Ok(crate::protocol::generate_request_json(id, &prompt, &params)),
        "prefill" => {
            let ready = match raw("ready").and_then(read_string) {
                None => None,
                Some(line) => match crate::protocol::parse_event(line.as_bytes())? {
                    crate::protocol::WorkerEvent::Ready(r) => Some(r),
                    _ => return Err("ready: not a ready event".to_string()),
                },
            };
            Ok(crate::protocol::prefill_request_json(id, &prompt, &params, ready.as_ref()))
        }
        other => Err(format!("unknown worker kind {other:?}")),
    }
}

/// SamplingParams from a JSON object of its fields (missing: defaults), floats read
/// exactly (Rust's parser) so the test compares encodings, not parsers.
fn params_from_raw(v: &RawValue) -> Option<SamplingParams> {
    let entries = members(v.get().as_bytes())?;
    let mut p = SamplingParams::default();
    for (key, value) in &entries {
        let int = || read_int(value);
        match key.as_str() {
            "max_tokens" => p.max_tokens = u64::try_from(int()?).ok()?,
            "min_tokens" => p.min_tokens = u64::try_from(int()?).ok()?,
            "temperature" => p.temperature = read_float(value)?,
            "top_p" => p.top_p = read_float(value)?,
            "top_k" => p.top_k = i64::try_from(int()?).ok()?,
            "seed" => p.seed = if is_null(value) { None } else { Some(int()?) },
            "stop" => p.stop = read_list(value)?.into_iter().map(read_string).collect::<Option<_>>()?,
            "stop_token_ids" => p.stop_token_ids = read_u32s(value)?,
            "ignore_eos" => p.ignore_eos = read_bool(value)?,
            "logprobs" => p.logprobs = read_bool(value)?,
            "top_logprobs" => p.top_logprobs = read_u32(value)?,
            "presence_penalty" => p.presence_penalty = read_float(value)?,
            "frequency_penalty" => p.frequency_penalty = read_float(value)?,
            "repetition_penalty" => p.repetition_penalty = read_float(value)?,
            "logit_bias" => {
                p.logit_bias = read_list(value)?
                    .into_iter()
                    .map(|pair| {
                        let pair = read_list(pair)?;
                        match pair.as_slice() {
                            [t, b] => Some((read_u32(t)?, read_float(b)?)),
                            _ => None,
                        }
                    })
                    .collect::<Option<_>>()?
            }
            "grammar" => p.grammar = if is_null(value) { None } else { serde_json::from_str(value.get()).ok()? },
            _ => return None,
        }
    }
    Some(p)
}

fn request_json(req: &GenRequest) -> Json {
    let prompt = match &req.prompt {
        Prompt::Text(t) => serde_json::json!({ "text": t }),
        Prompt::TokenIds(ids) => serde_json::json!({ "token_ids": ids }),
        Prompt::Messages(m) => {
            let list: Vec<Json> = m.iter().map(|m| serde_json::json!({ "role": m.role, "content": m.content })).collect();
            serde_json::json!({ "messages": list })
        }
    };
    serde_json::json!({
        "endpoint": req.endpoint.name(),
        "model": req.model,
        "prompt": prompt,
        "params_json": String::from_utf8_lossy(&req.params.to_json()),
        "max_tokens": req.max_tokens,
        "stream": req.stream,
        "include_usage": req.include_usage,
        "user": req.user,
        "skip_special_tokens": req.skip_special_tokens,
        "add_generation_prompt": req.add_generation_prompt,
    })
}

fn event_json(line: &[u8]) -> Json {
    use crate::protocol::WorkerEvent;
    match crate::protocol::parse_event(line) {
        Err(e) => serde_json::json!({ "error": e }),
        Ok(WorkerEvent::Ready(r)) => serde_json::json!({
            "type": "ready", "request_id": r.request_id, "landing_raw": r.landing.get(),
            "notify_url": r.notify_url, "incarnation": r.incarnation,
        }),
        Ok(WorkerEvent::First(t)) => serde_json::json!({
            "type": "first_token", "request_id": t.request_id, "token_id": t.token_id,
            "usage": t.usage, "finish_reason": t.finish_reason,
        }),
        Ok(WorkerEvent::Tokens(t)) => serde_json::json!({
            "type": "tokens", "request_id": t.request_id, "token_ids": t.token_ids,
            "finish_reason": t.finish_reason, "num_output_tokens": t.num_output_tokens,
        }),
        Ok(WorkerEvent::Error(e)) => serde_json::json!({
            "type": "error", "request_id": e.request_id, "status": e.status, "message": e.message,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served() -> Vec<String> {
        vec!["m".to_string(), "builtin:m".to_string()]
    }

    #[test]
    fn plain_requests_are_native() {
        let body = br#"{"model":"builtin:m","prompt":"hi","max_tokens":5,"temperature":0.7,"stream":true,"stream_options":{"include_usage":true}}"#;
        let req = parse(Endpoint::Completion, body, &served()).expect("native");
        assert_eq!(req.model, "m");
        assert_eq!(req.prompt, Prompt::Text("hi".to_string()));
        assert_eq!((req.params.max_tokens, req.params.temperature), (5, 0.7));
        assert!(req.stream && req.include_usage);
        let chat = br#"{"messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"user","content":"q","refusal":null}]}"#;
        let req = parse(Endpoint::Chat, chat, &served()).expect("native");
        let want = vec![
            ChatMessage { role: "system".into(), content: "a\nb".into() },
            ChatMessage { role: "user".into(), content: "q".into() },
        ];
        assert_eq!(req.prompt, Prompt::Messages(want));
    }

    #[test]
    fn anything_else_is_proxied() {
        for body in [
            &br#"{"prompt":"hi","tools":[]}"#[..],
            br#"{"prompt":"hi","max_tokens":1.0}"#,
            br#"{"prompt":"hi","prompt":"again"}"#,
            br#"{"prompt":"hi","model":"other"}"#,
            br#"{"prompt":"hi","temperature":2.5}"#,
            br#"{"prompt":"hi","n":2}"#,
            br#"{"prompt":"hi","logprobs":0}"#,
            br#"{"prompt":[]}"#,
            br#"{"prompt":"hi","unknown":1}"#,
            br#"[1]"#,
            b"",
        ] {
            assert!(parse(Endpoint::Completion, body, &served()).is_none(), "{:?}", std::str::from_utf8(body));
        }
    }

    #[test]
    fn finalize_defaults_and_limits() {
        let mut req = parse(Endpoint::Completion, br#"{"prompt":"hi"}"#, &served()).expect("native");
        assert!(finalize(&mut req, 10, 100));
        assert_eq!(req.params.max_tokens, 90);
        let mut req = parse(Endpoint::Completion, br#"{"prompt":"hi","max_tokens":91}"#, &served()).expect("native");
        assert!(!finalize(&mut req, 10, 100));
        let mut req = parse(Endpoint::Completion, br#"{"prompt":[1,2]}"#, &served()).expect("native");
        assert!(!finalize(&mut req, 2, 100), "no vocabulary to check the ids against");
    }

    #[test]
    fn chat_stream_starts_with_the_role() {
        let mut f = Formatter::new(Endpoint::Chat, "chatcmpl-1", 7, "m", false);
        let first = String::from_utf8(f.chunk("", None)).unwrap();
        assert_eq!(first, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
        assert!(f.chunk("", None).is_empty());
        assert!(new_request_id(Endpoint::Chat).starts_with("chatcmpl-"));
        assert_ne!(new_request_id(Endpoint::Completion), new_request_id(Endpoint::Completion));
    }
}
