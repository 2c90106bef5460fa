//! The control plane's client: the Python router (router/edge_control.py) decides, the
//! edge moves the bytes. One Unix socket, framed messages, many requests at once.
//!
//! A run calls, in relay.py's order: `open` (registers the request), `admit_decode`,
//! `pick` (prefill or unified), and reports what happened (`unreachable`, `bind`,
//! `prefilled`, `broken`), then `end` exactly once. The asks are answered; the reports
//! are one-way. `lost` delivers the ids of requests whose decode process the control
//! plane learned is gone (a 503 `decode_instance_lost` for the client).
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use crate::protocol::PromptUsage;

/// One worker instance as the control plane names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    pub name: String,
    /// Base URL, e.g. "http://127.0.0.1:8101".
    pub url: String,
}

/// Which instances serve the cluster: a prefill and a decode (two calls), or unified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    PrefillDecode,
    Unified,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Unified,
}

/// An error the client gets (router/errors.py APIError's fields).
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub error_type: String,
    pub code: Option<String>,
    /// Extra response headers, e.g. ("retry-after", "1").
    pub headers: Vec<(String, String)>,
}

/// What the control plane needs to know of a request to route it.
pub struct Open<'a> {
    pub request_id: &'a str,
    pub prompt_token_ids: &'a [u32],
    pub max_tokens: u64,
    pub user: Option<&'a str>,
    pub session: Option<&'a str>,
    /// "chat" or "completion" (metrics).
    pub endpoint: &'a str,
}

/// How the run ended, for the metrics and the request's state in the control plane.
pub struct End {
    /// The HTTP status the client got (499: it left first).
    pub status: u16,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub usage: Option<PromptUsage>,
    /// Seconds from arrival: first token, last token (None: none came).
    pub first_token_s: Option<f64>,
    pub last_token_s: Option<f64>,
    /// Inter-token gaps (router/output.py RequestTiming.token_gaps).
    pub token_gaps_s: Vec<f64>,
}

pub struct Control {}

impl Control {
    pub async fn connect(_path: &Path) -> std::io::Result<Arc<Control>> {
        todo!("control")
    }

    /// The cluster's topology (asked once at start).
    pub fn topology(&self) -> Topology {
        todo!("control")
    }

    pub async fn open(&self, _req: Open<'_>) -> Result<(), ApiError> {
        todo!("control")
    }

    /// A decode instance with room for the request (through the admission gate: may wait
    /// up to `deadline_s` from now). `tried`: instances this run could not reach.
    pub async fn admit_decode(
        &self,
        _request_id: &str,
        _tried: &[String],
        _deadline_s: f64,
    ) -> Result<Instance, ApiError> {
        todo!("control")
    }

    /// A prefill (or unified) instance; the control plane counts the prompt as its queued
    /// work from now on.
    pub async fn pick(
        &self,
        _request_id: &str,
        _role: Role,
        _tried: &[String],
    ) -> Result<Instance, ApiError> {
        todo!("control")
    }

    /// `instance` refused the connection: it never got the request (marked unhealthy;
    /// a decode's reservation is released, a prefill's queued work forgotten).
    pub fn unreachable(&self, _request_id: &str, _instance: &Instance, _message: &str) {
        todo!("control")
    }

    /// Decode answered DecodeReady from process `incarnation`: the request is bound to it
    /// until its prefill's first event (router/decode_bindings.py).
    pub fn bind(&self, _request_id: &str, _decode: &Instance, _incarnation: &str) {
        todo!("control")
    }

    /// Prefill (or unified) answered with its FirstToken: the prompt's blocks are cached
    /// there now; the binding ends.
    pub fn prefilled(&self, _request_id: &str, _instance: &Instance, _usage: &PromptUsage) {
        todo!("control")
    }

    /// `instance`'s stream broke mid-request; `incarnation`: decode's, when known.
    pub fn broken(&self, _request_id: &str, _instance: &Instance, _message: &str, _incarnation: &str) {
        todo!("control")
    }

    /// The run is over (exactly once per `open`): the reservation is released, the
    /// request's metrics recorded, its state dropped.
    pub fn end(&self, _request_id: &str, _end: End) {
        todo!("control")
    }

    /// Ids of requests whose decode process is gone while they waited for prefill.
    pub fn lost(&self) -> tokio::sync::broadcast::Receiver<String> {
        todo!("control")
    }
}

/// `kvserve-edge control --socket PATH`: test driver (JSON lines: one call each).
pub fn cli(_args: &[String]) -> i32 {
    todo!("control cli")
}
