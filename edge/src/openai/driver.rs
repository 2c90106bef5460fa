//! `kvserve-edge openai`: the bodies' test driver (tests/test_edge_bodies.py).

use serde_json::value::RawValue;

use super::{error_body, error_event};
use super::{
    finalize_with, new_request_id, parse, Endpoint, Formatter, GenRequest, Limits, Prompt, Usage,
};
use crate::protocol::json::{
    is_null, members, read_bool, read_float, read_int, read_list, read_string, read_u32, read_u32s,
};
use crate::protocol::SamplingParams;

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
///   {"op": "worker", "kind": "decode"|"prefill"|"prefill_awaiting"|"generate"|"abort"|
///    "grant", "request_id", "prompt", "params" (SamplingParams fields), "ready"? (a ready
///    event's line: prefill's landing, the grant's), "reason", "prefill_contacted"}
///    -> {"bytes"}
///   {"op": "event", "line": TEXT} -> the event's fields, or {"error": ..}
///   {"op": "request_id", "endpoint"} -> {"id"}
///   {"op": "content_type", "header": [bytes]|null} -> {"json": bool}
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
        raw(name)
            .and_then(|v| serde_json::from_str(v.get()).ok())
            .unwrap_or(Json::Null)
    };
    let string = |name: &str| value(name).as_str().map(str::to_string).unwrap_or_default();
    let endpoint = if string("endpoint") == "chat" {
        Endpoint::Chat
    } else {
        Endpoint::Completion
    };
    let bytes = |b: Vec<u8>| serde_json::json!({ "bytes": String::from_utf8_lossy(&b) });
    match string("op").as_str() {
        "parse" => {
            let served: Vec<String> =
                serde_json::from_value(value("served")).map_err(|e| e.to_string())?;
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
                answer["final_params_json"] =
                    Json::String(String::from_utf8_lossy(&req.params.to_json()).into_owned());
            }
            Ok(answer)
        }
        "stream" => {
            let usage = usage_from(&value("usage"));
            let mut f = Formatter::new(
                endpoint,
                &string("request_id"),
                value("created").as_u64().unwrap_or(0),
                &string("model"),
                value("include_usage").as_bool().unwrap_or(false),
            );
            let deltas: Vec<(String, Option<String>)> =
                serde_json::from_value(value("deltas")).map_err(|e| e.to_string())?;
            let chunks: Vec<Json> = deltas
                .iter()
                .map(|(text, finish)| {
                    Json::String(
                        String::from_utf8_lossy(&f.chunk(text, finish.as_deref())).into_owned(),
                    )
                })
                .collect();
            Ok(
                serde_json::json!({ "chunks": chunks, "end": String::from_utf8_lossy(&f.stream_end(&usage)) }),
            )
        }
        "full" => {
            let f = Formatter::new(
                endpoint,
                &string("request_id"),
                value("created").as_u64().unwrap_or(0),
                &string("model"),
                false,
            );
            Ok(bytes(f.full(
                &string("text"),
                &string("finish_reason"),
                &usage_from(&value("usage")),
            )))
        }
        "error_body" => {
            let (p, c) = (value("param"), value("code"));
            Ok(bytes(error_body(
                &string("message"),
                &string("type"),
                p.as_str(),
                c.as_str(),
            )))
        }
        "error_event" => {
            let c = value("code");
            Ok(bytes(error_event(
                &string("message"),
                &string("type"),
                c.as_str(),
            )))
        }
        "worker" => worker_op(&string("kind"), raw, &string("request_id")).map(bytes),
        "event" => Ok(event_json(string("line").as_bytes())),
        "request_id" => Ok(serde_json::json!({ "id": new_request_id(endpoint) })),
        "content_type" => {
            let header: Option<Vec<u8>> = serde_json::from_value(value("header")).ok();
            let json = super::is_json_content_type(header.as_deref());
            Ok(serde_json::json!({ "json": json }))
        }
        other => Err(format!("unknown op {other:?}")),
    }
}

fn usage_from(v: &Json) -> Usage {
    let num = |k: &str| v.get(k).and_then(Json::as_u64).unwrap_or(0);
    Usage {
        prompt_tokens: num("prompt_tokens"),
        completion_tokens: num("completion_tokens"),
        details: v
            .get("details")
            .and_then(|d| serde_json::from_value(d.clone()).ok()),
    }
}

fn worker_op<'a>(
    kind: &str,
    raw: impl Fn(&str) -> Option<&'a RawValue>,
    id: &str,
) -> Result<Vec<u8>, String> {
    if kind == "abort" {
        let reason = raw("reason").and_then(read_string).unwrap_or_default();
        let contacted = raw("prefill_contacted").and_then(read_bool).unwrap_or(true);
        return Ok(crate::protocol::abort_json(id, &reason, contacted));
    }
    let ready = match raw("ready").and_then(read_string) {
        None => None,
        Some(line) => match crate::protocol::parse_event(line.as_bytes())? {
            crate::protocol::WorkerEvent::Ready(r) => Some(r),
            _ => return Err("ready: not a ready event".to_string()),
        },
    };
    if kind == "grant" {
        let ready = ready.ok_or("grant: needs ready")?;
        return Ok(crate::protocol::landing_grant_json(&ready));
    }
    let prompt = raw("prompt")
        .and_then(read_u32s)
        .ok_or("prompt: token ids")?;
    let params = raw("params")
        .map_or(Some(SamplingParams::default()), params_from_raw)
        .ok_or("params")?;
    match kind {
        "decode" => Ok(crate::protocol::decode_request_json(id, &prompt, &params)),
        "generate" => Ok(crate::protocol::generate_request_json(id, &prompt, &params)),
        "prefill" => Ok(crate::protocol::prefill_request_json(
            id,
            &prompt,
            &params,
            ready.as_ref(),
        )),
        "prefill_awaiting" => {
            Ok(crate::protocol::EncodedRequest::new(id, &prompt, &params).prefill_awaiting())
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
            "stop" => {
                p.stop = read_list(value)?
                    .into_iter()
                    .map(read_string)
                    .collect::<Option<_>>()?
            }
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
            "grammar" => {
                p.grammar = if is_null(value) {
                    None
                } else {
                    serde_json::from_str(value.get()).ok()?
                }
            }
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
            let list: Vec<Json> = m
                .iter()
                .map(|m| serde_json::json!({ "role": m.role, "content": m.content }))
                .collect();
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
