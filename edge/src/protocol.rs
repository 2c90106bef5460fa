//! The worker protocol (protocol/messages.py, protocol/sampling.py): the same JSON bytes
//! as msgspec writes for the same values, and the events the workers stream.
//!
//! Requests are written by hand rather than through serde: msgspec writes floats its own
//! way (`1.0`, `0.00001`, `1e-6`, `1e16`; see `write_f64`), and workers compare nothing
//! byte for byte, but the edge's requests must be the router's so that every log, hash
//! and test sees one protocol. DecodeReady's `landing` travels as the raw bytes decode
//! sent: its capability is an HMAC over the fields (protocol/landing_capability.py), so
//! the edge never decodes and re-encodes it.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;

use json::{write_bool, write_f64, write_i128, write_ids, write_str, write_u64};

pub mod json;

/// protocol/messages.py PROTOCOL_VERSION.
pub const PROTOCOL_VERSION: i64 = 5;

/// protocol/sampling.py GrammarSpec (the edge never sets one: such requests are proxied).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct GrammarSpec {
    pub kind: String,
    #[serde(default)]
    pub text: String,
}

/// protocol/sampling.py SamplingParams, field for field, in its order; `Default` is its
/// defaults. Deserialize (missing fields: defaults) is for test drivers; the wire form is
/// `write_json`, msgspec's bytes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub max_tokens: u64,
    pub min_tokens: u64,
    pub temperature: f64,
    pub top_p: f64,
    /// -1 or 0: no top-k filter.
    pub top_k: i64,
    /// The API accepts [-2^63, 2^64 - 1].
    pub seed: Option<i128>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub logprobs: bool,
    pub top_logprobs: u32,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub repetition_penalty: f64,
    pub logit_bias: Vec<(u32, f64)>,
    pub grammar: Option<GrammarSpec>,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            max_tokens: 16,
            min_tokens: 0,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: false,
            top_logprobs: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            grammar: None,
        }
    }
}

impl SamplingParams {
    /// msgspec.json.encode(params): every field, in declaration order.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"max_tokens\":");
        write_u64(out, self.max_tokens);
        out.extend_from_slice(b",\"min_tokens\":");
        write_u64(out, self.min_tokens);
        out.extend_from_slice(b",\"temperature\":");
        write_f64(out, self.temperature);
        out.extend_from_slice(b",\"top_p\":");
        write_f64(out, self.top_p);
        out.extend_from_slice(b",\"top_k\":");
        write_i128(out, self.top_k as i128);
        out.extend_from_slice(b",\"seed\":");
        match self.seed {
            Some(seed) => write_i128(out, seed),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"stop\":[");
        for (i, s) in self.stop.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_str(out, s);
        }
        out.extend_from_slice(b"],\"stop_token_ids\":");
        write_ids(out, &self.stop_token_ids);
        out.extend_from_slice(b",\"ignore_eos\":");
        write_bool(out, self.ignore_eos);
        out.extend_from_slice(b",\"logprobs\":");
        write_bool(out, self.logprobs);
        out.extend_from_slice(b",\"top_logprobs\":");
        write_u64(out, self.top_logprobs as u64);
        out.extend_from_slice(b",\"presence_penalty\":");
        write_f64(out, self.presence_penalty);
        out.extend_from_slice(b",\"frequency_penalty\":");
        write_f64(out, self.frequency_penalty);
        out.extend_from_slice(b",\"repetition_penalty\":");
        write_f64(out, self.repetition_penalty);
        out.extend_from_slice(b",\"logit_bias\":[");
        for (i, (token, bias)) in self.logit_bias.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.push(b'[');
            write_u64(out, *token as u64);
            out.push(b',');
            write_f64(out, *bias);
            out.push(b']');
        }
        out.extend_from_slice(b"],\"grammar\":");
        match &self.grammar {
            Some(g) => {
                out.extend_from_slice(b"{\"kind\":");
                write_str(out, &g.kind);
                out.extend_from_slice(b",\"text\":");
                write_str(out, &g.text);
                out.push(b'}');
            }
            None => out.extend_from_slice(b"null"),
        }
        out.push(b'}');
    }

    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(320);
        self.write_json(&mut out);
        out
    }
}

/// Through serde_json too, the bytes are msgspec's (`write_json`, as a raw value).
impl Serialize for SamplingParams {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text = String::from_utf8(self.to_json()).map_err(serde::ser::Error::custom)?;
        RawValue::from_string(text)
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

/// protocol/messages.py PromptUsage: where each prompt token came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptUsage {
    pub prompt_tokens: u64,
    pub gpu_tokens: u64,
    pub pool_tokens: u64,
    pub computed_tokens: u64,
}

// -- requests to the workers ----------------------------------------------------------------

/// A request's prompt and params written once for all its worker calls: a long prompt's
/// ids are most of each body, and a P/D request sends them twice (decode, prefill).
pub struct EncodedRequest {
    request_id: String,
    /// `,"prompt_token_ids":[...],"params":{...}`.
    tail: Vec<u8>,
}

impl EncodedRequest {
    pub fn new(request_id: &str, prompt: &[u32], params: &SamplingParams) -> EncodedRequest {
        let mut tail = Vec::with_capacity(360 + prompt.len() * 7);
        tail.extend_from_slice(b",\"prompt_token_ids\":");
        write_ids(&mut tail, prompt);
        tail.extend_from_slice(b",\"params\":");
        params.write_json(&mut tail);
        EncodedRequest {
            request_id: request_id.to_string(),
            tail,
        }
    }

    /// version, request_id, prompt_token_ids, params; room for `extra` more bytes.
    fn head(&self, extra: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.tail.len() + self.request_id.len() + 32 + extra);
        out.extend_from_slice(b"{\"version\":");
        write_i128(&mut out, PROTOCOL_VERSION as i128);
        out.extend_from_slice(b",\"request_id\":");
        write_str(&mut out, &self.request_id);
        out.extend_from_slice(&self.tail);
        out
    }

    /// msgspec.json.encode(DecodeRequest(...)): POST /decode's body.
    pub fn decode(&self) -> Vec<u8> {
        let mut out = self.head(1);
        out.push(b'}');
        out
    }

    /// msgspec.json.encode(GenerateRequest(...)): POST /generate's body (unified).
    pub fn generate(&self) -> Vec<u8> {
        self.decode()
    }

    /// msgspec.json.encode(PrefillRequest(...)): POST /prefill's body, with decode's
    /// landing and notify URL as relay.py passes them (`ready` None: `[]` and "", a
    /// request that ends at its first token). The landing is DecodeReady's bytes, untouched.
    pub fn prefill(&self, ready: Option<&DecodeReady>) -> Vec<u8> {
        let extra = ready.map_or(0, |r| r.landing.get().len() + r.notify_url.len());
        let mut out = self.head(64 + extra);
        out.extend_from_slice(b",\"landing\":");
        match ready {
            Some(r) => {
                out.extend_from_slice(r.landing.get().as_bytes());
                out.extend_from_slice(b",\"notify_url\":");
                write_str(&mut out, &r.notify_url);
            }
            None => out.extend_from_slice(b"[],\"notify_url\":\"\""),
        }
        out.extend_from_slice(b",\"await_landing\":false}");
        out
    }

    /// POST /prefill's body sent beside decode's (protocol 5): no landing yet, it
    /// follows in a LandingGrant (`landing_grant_json`).
    pub fn prefill_awaiting(&self) -> Vec<u8> {
        let mut out = self.head(64);
        out.extend_from_slice(b",\"landing\":[],\"notify_url\":\"\",\"await_landing\":true}");
        out
    }
}

/// msgspec.json.encode(LandingGrant(...)): POST /landing's body, decode's DecodeReady
/// forwarded to prefill (the landing is DecodeReady's bytes, untouched).
pub fn landing_grant_json(ready: &DecodeReady) -> Vec<u8> {
    let landing = ready.landing.get();
    let mut out = Vec::with_capacity(64 + ready.request_id.len() + landing.len() + ready.notify_url.len());
    out.extend_from_slice(b"{\"version\":");
    write_i128(&mut out, PROTOCOL_VERSION as i128);
    out.extend_from_slice(b",\"request_id\":");
    write_str(&mut out, &ready.request_id);
    out.extend_from_slice(b",\"landing\":");
    out.extend_from_slice(landing.as_bytes());
    out.extend_from_slice(b",\"notify_url\":");
    write_str(&mut out, &ready.notify_url);
    out.push(b'}');
    out
}

/// msgspec.json.encode(DecodeRequest(...)): POST /decode's body.
pub fn decode_request_json(request_id: &str, prompt: &[u32], params: &SamplingParams) -> Vec<u8> {
    EncodedRequest::new(request_id, prompt, params).decode()
}

/// msgspec.json.encode(GenerateRequest(...)): POST /generate's body (unified instances).
pub fn generate_request_json(request_id: &str, prompt: &[u32], params: &SamplingParams) -> Vec<u8> {
    EncodedRequest::new(request_id, prompt, params).generate()
}

/// msgspec.json.encode(PrefillRequest(...)): `EncodedRequest::prefill` in one call.
pub fn prefill_request_json(
    request_id: &str,
    prompt: &[u32],
    params: &SamplingParams,
    ready: Option<&DecodeReady>,
) -> Vec<u8> {
    EncodedRequest::new(request_id, prompt, params).prefill(ready)
}

/// msgspec.json.encode(AbortRequest(...)): POST /abort's body. `reason` is one of
/// "client_disconnected", "error", "timeout", "finished".
pub fn abort_json(request_id: &str, reason: &str, prefill_contacted: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(96 + request_id.len());
    out.extend_from_slice(b"{\"request_id\":");
    write_str(&mut out, request_id);
    out.extend_from_slice(b",\"reason\":");
    write_str(&mut out, reason);
    out.extend_from_slice(b",\"prefill_contacted\":");
    write_bool(&mut out, prefill_contacted);
    out.push(b'}');
    out
}

// -- events from the workers ----------------------------------------------------------------

/// Decode's first line: where prefill writes, and where it posts its notices.
#[derive(Debug)]
pub struct DecodeReady {
    pub request_id: String,
    /// The JSON array of LandingInfo exactly as decode sent it.
    pub landing: Box<RawValue>,
    pub notify_url: String,
    pub incarnation: String,
}

/// Prefill's (or a unified instance's) first token with the prompt's usage.
#[derive(Debug, Clone, PartialEq)]
pub struct FirstToken {
    pub request_id: String,
    pub token_id: u32,
    pub usage: PromptUsage,
    /// Set when the request already ended at this token.
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenBatch {
    pub request_id: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: Option<String>,
    pub num_output_tokens: u64,
}

/// A worker's error: the HTTP status the client gets, and the message.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorEvent {
    pub request_id: String,
    pub status: u16,
    pub message: String,
}

/// One line of a worker's NDJSON stream (msgspec's tagged union on "type").
#[derive(Debug)]
pub enum WorkerEvent {
    Ready(DecodeReady),
    First(FirstToken),
    Tokens(TokenBatch),
    Error(ErrorEvent),
}

/// Every field any event has, read in one pass whatever their order (msgspec puts the
/// tag first but a decoder must not rely on it). Logprobs are not read: requests that
/// ask for them are proxied. Unknown fields are skipped, as msgspec does.
#[derive(Deserialize)]
struct AnyEvent {
    #[serde(rename = "type")]
    tag: Option<String>,
    request_id: Option<String>,
    landing: Option<Box<RawValue>>,
    notify_url: Option<String>,
    incarnation: Option<String>,
    token_id: Option<u32>,
    usage: Option<PromptUsage>,
    /// Outer None: absent (an error: the field is required, though it may be null).
    #[serde(default, deserialize_with = "present")]
    finish_reason: Option<Option<String>>,
    token_ids: Option<Vec<u32>>,
    num_output_tokens: Option<u64>,
    status: Option<u16>,
    message: Option<String>,
}

/// A present field, null or not (serde gives absent fields the default, None).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

fn need<T>(value: Option<T>, tag: &str, field: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("a {tag:?} event without `{field}`"))
}

/// One NDJSON line of /decode, /prefill or /generate -> its event; Err says what is wrong.
pub fn parse_event(line: &[u8]) -> Result<WorkerEvent, String> {
    let e: AnyEvent =
        serde_json::from_slice(line).map_err(|err| format!("a malformed worker event: {err}"))?;
    let tag = e.tag.ok_or("a worker event without `type`")?;
    let request_id = need(e.request_id, &tag, "request_id")?;
    match tag.as_str() {
        "ready" => {
            let landing = need(e.landing, &tag, "landing")?;
            if !landing.get().starts_with('[') {
                return Err("a \"ready\" event whose `landing` is not a list".to_string());
            }
            Ok(WorkerEvent::Ready(DecodeReady {
                request_id,
                landing,
                notify_url: need(e.notify_url, &tag, "notify_url")?,
                incarnation: e.incarnation.unwrap_or_default(),
            }))
        }
        "first_token" => Ok(WorkerEvent::First(FirstToken {
            request_id,
            token_id: need(e.token_id, &tag, "token_id")?,
            usage: need(e.usage, &tag, "usage")?,
            finish_reason: need(e.finish_reason, &tag, "finish_reason")?,
        })),
        "tokens" => Ok(WorkerEvent::Tokens(TokenBatch {
            request_id,
            token_ids: need(e.token_ids, &tag, "token_ids")?,
            finish_reason: need(e.finish_reason, &tag, "finish_reason")?,
            num_output_tokens: need(e.num_output_tokens, &tag, "num_output_tokens")?,
        })),
        "error" => Ok(WorkerEvent::Error(ErrorEvent {
            request_id,
            status: need(e.status, &tag, "status")?,
            message: need(e.message, &tag, "message")?,
        })),
        other => Err(format!("a worker event of unknown type {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_params_are_msgspecs() {
        let want = br#"{"max_tokens":16,"min_tokens":0,"temperature":1.0,"top_p":1.0,"top_k":0,"seed":null,"stop":[],"stop_token_ids":[],"ignore_eos":false,"logprobs":false,"top_logprobs":0,"presence_penalty":0.0,"frequency_penalty":0.0,"repetition_penalty":1.0,"logit_bias":[],"grammar":null}"#;
        assert_eq!(SamplingParams::default().to_json(), want.to_vec());
    }

    #[test]
    fn params_read_partially_and_serialize_as_msgspec() {
        let p: SamplingParams =
            serde_json::from_str(r#"{"seed": -5, "stop": ["a"], "logit_bias": [[3, 0.5]]}"#)
                .unwrap();
        assert_eq!(
            (p.seed, p.max_tokens, p.logit_bias.clone()),
            (Some(-5), 16, vec![(3, 0.5)])
        );
        let p = SamplingParams {
            repetition_penalty: 1e-5,
            ..p
        };
        assert_eq!(serde_json::to_vec(&p).unwrap(), p.to_json());
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(
            (v["stop"][0].as_str(), v["seed"].as_i64()),
            (Some("a"), Some(-5))
        );
    }

    #[test]
    fn events_parse_and_landing_stays_raw() {
        let line = br#"{"type":"ready","request_id":"r","landing":[ {"rank":0,"expires_at_s":1.50} ],"notify_url":"http://x"}"#;
        match parse_event(line) {
            Ok(WorkerEvent::Ready(r)) => {
                assert_eq!(r.landing.get(), r#"[ {"rank":0,"expires_at_s":1.50} ]"#);
                let body = prefill_request_json("r", &[1], &SamplingParams::default(), Some(&r));
                let text = String::from_utf8(body).unwrap();
                assert!(text.ends_with(
                    r#""landing":[ {"rank":0,"expires_at_s":1.50} ],"notify_url":"http://x","await_landing":false}"#
                ));
                let grant = String::from_utf8(landing_grant_json(&r)).unwrap();
                assert_eq!(
                    grant,
                    format!(
                        r#"{{"version":{PROTOCOL_VERSION},"request_id":"r","landing":[ {{"rank":0,"expires_at_s":1.50}} ],"notify_url":"http://x"}}"#
                    )
                );
                let encoded = EncodedRequest::new("r", &[1], &SamplingParams::default());
                let awaiting = String::from_utf8(encoded.prefill_awaiting()).unwrap();
                assert!(awaiting.ends_with(r#","landing":[],"notify_url":"","await_landing":true}"#));
            }
            other => panic!("{other:?}"),
        }
        let batch = br#"{"type":"tokens","request_id":"r","token_ids":[5,6],"logprobs":[null,null],"finish_reason":null,"num_output_tokens":3}"#;
        assert!(
            matches!(parse_event(batch), Ok(WorkerEvent::Tokens(t)) if t.token_ids == vec![5, 6] && t.finish_reason.is_none())
        );
        let missing =
            br#"{"type":"tokens","request_id":"r","token_ids":[5],"num_output_tokens":1}"#;
        assert!(parse_event(missing).is_err());
        assert!(parse_event(b"{\"type\":\"nope\",\"request_id\":\"r\"}").is_err());
        assert!(parse_event(b"not json").is_err());
    }
}
