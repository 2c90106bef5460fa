//! The control socket's messages as the edge writes and reads them (the router's side:
//! protocol/edge_messages.py; the list with answers and rules: router/edge_control.py).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{ApiError, Instance, Topology, WIRE_VERSION};
use crate::protocol::PromptUsage;

/// protocol/messages.py PromptUsage as the wire carries it.
#[derive(Serialize, Deserialize)]
pub(super) struct WireUsage {
    prompt_tokens: u64,
    gpu_tokens: u64,
    pool_tokens: u64,
    computed_tokens: u64,
}

impl WireUsage {
    pub(super) fn usage(&self) -> PromptUsage {
        PromptUsage {
            prompt_tokens: self.prompt_tokens,
            gpu_tokens: self.gpu_tokens,
            pool_tokens: self.pool_tokens,
            computed_tokens: self.computed_tokens,
        }
    }
}

impl WireUsage {
    pub(super) fn of(u: &PromptUsage) -> WireUsage {
        WireUsage {
            prompt_tokens: u.prompt_tokens,
            gpu_tokens: u.gpu_tokens,
            pool_tokens: u.pool_tokens,
            computed_tokens: u.computed_tokens,
        }
    }
}

#[derive(Serialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub(super) enum Out<'a> {
    Open {
        id: &'a str,
        prompt: &'a [u32],
        max_tokens: u64,
        endpoint: &'a str,
        user: Option<&'a str>,
        session: Option<&'a str>,
    },
    Admit {
        seq: u64,
        id: &'a str,
        deadline_s: f64,
        tried: &'a [String],
    },
    Pick {
        seq: u64,
        id: &'a str,
        role: &'static str,
        tried: &'a [String],
    },
    Ping {
        seq: u64,
    },
    Unreachable {
        id: &'a str,
        instance: &'a str,
        message: &'a str,
    },
    Bind {
        id: &'a str,
        instance: &'a str,
        incarnation: &'a str,
    },
    Prefilled {
        id: &'a str,
        instance: &'a str,
        usage: WireUsage,
    },
    Broken {
        id: &'a str,
        instance: &'a str,
        message: &'a str,
        incarnation: &'a str,
    },
    End {
        id: &'a str,
        status: u16,
        prompt_tokens: u64,
        completion_tokens: u64,
        usage: Option<WireUsage>,
        first_token_s: Option<f64>,
        last_token_s: Option<f64>,
        token_gaps_s: &'a [f64],
    },
}

/// One frame: the length prefix and the JSON, in one buffer (the call's one allocation).
pub(super) fn frame(msg: &Out<'_>, size_hint: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(size_hint + 64);
    buf.extend_from_slice(&[0u8; 4]);
    // Serializing these types into a Vec cannot fail (no maps with non-string keys, no
    // I/O); a failure would leave an empty body, which the router logs as malformed.
    let _ = serde_json::to_writer(&mut buf, msg);
    let n = (buf.len() - 4) as u32;
    buf[..4].copy_from_slice(&n.to_le_bytes());
    buf
}

#[derive(Deserialize)]
pub(super) struct WireError {
    pub(super) status: u16,
    pub(super) message: String,
    #[serde(rename = "type")]
    pub(super) error_type: String,
    pub(super) code: Option<String>,
    #[serde(default)]
    pub(super) headers: HashMap<String, String>,
}

impl WireError {
    pub(super) fn into_api(self) -> ApiError {
        ApiError {
            status: self.status,
            message: self.message,
            error_type: self.error_type,
            code: self.code,
            headers: self.headers.into_iter().collect(),
        }
    }
}

#[derive(Deserialize)]
pub(super) struct Hello {
    version: u32,
    topology: String,
}

/// Any frame from the router: a hello, an answer (seq) or a push (lost).
#[derive(Deserialize)]
pub(super) struct Incoming {
    pub(super) hello: Option<Hello>,
    pub(super) seq: Option<u64>,
    pub(super) instance: Option<Instance>,
    pub(super) error: Option<WireError>,
    pub(super) lost: Option<String>,
}

pub(super) fn parse_hello(body: &[u8]) -> Result<Topology, String> {
    let msg: Incoming = serde_json::from_slice(body).map_err(|e| format!("control hello: {e}"))?;
    let hello = msg.hello.ok_or("control: the first frame is not a hello")?;
    if hello.version != WIRE_VERSION {
        return Err(format!(
            "control: wire version {} (this edge speaks {WIRE_VERSION})",
            hello.version
        ));
    }
    match hello.topology.as_str() {
        "pd" => Ok(Topology::PrefillDecode),
        "unified" => Ok(Topology::Unified),
        other => Err(format!("control: unknown topology {other:?}")),
    }
}
