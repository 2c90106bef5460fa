//! `parse` and `finalize`: which requests the edge serves natively, read and checked as
//! router/api_types.py, router/preprocess.py and SamplingParams.validate do.

use serde_json::value::RawValue;

use super::{ChatMessage, Endpoint, GenRequest, Prompt};
use crate::protocol::json::{
    is_null, known, members, opt, read_bool, read_float, read_int, read_list, read_string,
    read_u32, read_u32s, Field,
};
use crate::protocol::SamplingParams;

/// protocol/sampling.py MAX_STOP_CHARS.
const MAX_STOP_CHARS: usize = 1024;
/// protocol/sampling.py MIN_REPETITION_PENALTY.
const MIN_REPETITION_PENALTY: f64 = 1e-4;
/// router/preprocess.py MAX_MESSAGES.
const MAX_MESSAGES: usize = 10_000;
/// router/preprocess.py _SEED_RANGE.
const SEED_MIN: i128 = -(1i128 << 63);
const SEED_MAX: i128 = (1i128 << 64) - 1;

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

/// Whether the router reads a body with this Content-Type (router/request_body.py
/// read_json_body; pass the request's first content-type header, None when it has none):
/// false, the router answers 415, so the request is proxied. Only ASCII values are judged
/// (Python strips and lowers Latin-1 too); others are false.
pub fn is_json_content_type(content_type: Option<&[u8]>) -> bool {
    let Some(value) = content_type else {
        return true; // no Content-Type is taken as JSON
    };
    if !value.is_ascii() {
        return false;
    }
    let media = value.split(|b| *b == b';').next().unwrap_or_default();
    let media = py_strip(media);
    media.eq_ignore_ascii_case(b"application/json")
        || (media.len() >= 5 && media[media.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// Python's str.strip() on ASCII: \t \n \v \f \r, \x1c-\x1f and space.
fn py_strip(mut s: &[u8]) -> &[u8] {
    let space = |b: u8| matches!(b, b'\t'..=b'\r' | 0x1c..=0x1f | b' ');
    while let [first, rest @ ..] = s {
        if !space(*first) {
            break;
        }
        s = rest;
    }
    while let [rest @ .., last] = s {
        if !space(*last) {
            break;
        }
        s = rest;
    }
    s
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
    let messages = raw
        .into_iter()
        .map(chat_message)
        .collect::<Option<Vec<_>>>()?;
    Some((Prompt::Messages(messages), max_tokens))
}

/// One message (router/api_types.py ChatMessage, unknown keys ignored; preprocess.py
/// _message_dict): a known role, content a string or text parts, no tool fields.
fn chat_message(v: &RawValue) -> Option<ChatMessage> {
    let entries = members(v.get().as_bytes())?;
    let slots = known(
        &entries,
        &[
            "role",
            "content",
            "name",
            "tool_calls",
            "tool_call_id",
            "reasoning_content",
        ],
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
        let texts = parts
            .into_iter()
            .map(text_part)
            .collect::<Option<Vec<_>>>()?;
        texts.join("\n")
    } else {
        read_string(content)?
    };
    Some(ChatMessage {
        role: role.to_string(),
        content,
    })
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
    if !opt(b.get("suffix"), read_string)
        .ok()?
        .unwrap_or_default()
        .is_empty()
    {
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
    let ids = items
        .into_iter()
        .map(read_u32)
        .collect::<Option<Vec<u32>>>()?;
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
            None => read_list(v)?
                .into_iter()
                .map(read_string)
                .collect::<Option<Vec<_>>>()?,
        },
    };
    let stop_ok = |s: &String| !s.is_empty() && s.chars().count() <= MAX_STOP_CHARS;
    if stop.len() > 4 || !stop.iter().all(stop_ok) {
        return None;
    }
    let stop_token_ids = opt(b.get("stop_token_ids"), read_u32s)
        .ok()?
        .unwrap_or_default();
    // `value or 0.0`: a given -0.0 is 0.0 too
    let penalty = |name: &str| -> Option<f64> {
        let p = opt(b.get(name), read_float).ok()?.unwrap_or(0.0);
        let p = if p == 0.0 { 0.0 } else { p };
        (-2.0..=2.0).contains(&p).then_some(p)
    };
    let presence_penalty = penalty("presence_penalty")?;
    let frequency_penalty = penalty("frequency_penalty")?;
    let repetition_penalty = opt(b.get("repetition_penalty"), read_float)
        .ok()?
        .unwrap_or(1.0);
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

/// `finalize_with` knowing only the context length (the unit tests' shorthand).
#[cfg(test)]
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
    let max_input = limits
        .max_input_tokens
        .filter(|m| *m > 0)
        .unwrap_or(context)
        .min(context);
    if prompt_len == 0 || prompt_len > max_input || prompt_len >= context {
        return false;
    }
    let out_limit = limits.max_output_tokens;
    let max_tokens = match req.max_tokens {
        Some(m) => {
            if out_limit.is_some_and(|o| m > o)
                || (prompt_len as u64).saturating_add(m) > context as u64
            {
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
            ChatMessage {
                role: "system".into(),
                content: "a\nb".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "q".into(),
            },
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
            assert!(
                parse(Endpoint::Completion, body, &served()).is_none(),
                "{:?}",
                std::str::from_utf8(body)
            );
        }
    }

    #[test]
    fn finalize_defaults_and_limits() {
        let mut req =
            parse(Endpoint::Completion, br#"{"prompt":"hi"}"#, &served()).expect("native");
        assert!(finalize(&mut req, 10, 100));
        assert_eq!(req.params.max_tokens, 90);
        let mut req = parse(
            Endpoint::Completion,
            br#"{"prompt":"hi","max_tokens":91}"#,
            &served(),
        )
        .expect("native");
        assert!(!finalize(&mut req, 10, 100));
        let mut req =
            parse(Endpoint::Completion, br#"{"prompt":[1,2]}"#, &served()).expect("native");
        assert!(
            !finalize(&mut req, 2, 100),
            "no vocabulary to check the ids against"
        );
    }
}
