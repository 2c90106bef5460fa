//! Calls to the workers: /decode, /prefill and /generate NDJSON streams, /abort
//! (router/worker_client.py's serving calls).
//!
//! One hyper client for every worker: hyper keeps a pool of keep-alive connections per
//! instance (scheme, host and port), so a request's calls reuse warm connections and no
//! call pays a TCP handshake. Connections are made with TCP_NODELAY: an event line is
//! small and must not wait for Nagle.

use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use hyper::body::HttpBody;
use hyper::client::HttpConnector;
use hyper::{Body, Client, Request, StatusCode};

use crate::control::Instance;
use crate::protocol::{self, WorkerEvent};

pub const DECODE_PATH: &str = "/decode";
pub const PREFILL_PATH: &str = "/prefill";
pub const LANDING_PATH: &str = "/landing";
pub const GENERATE_PATH: &str = "/generate";
pub const ABORT_PATH: &str = "/abort";

/// How long connecting to a worker may take (router/worker_client.py's connect_timeout_s).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an abort may take; it is sent in the background and never awaited.
const ABORT_TIMEOUT: Duration = Duration::from_secs(1);
/// An event line longer than this is a broken worker, not a reason to buffer without end.
const MAX_LINE_BYTES: usize = 64 * 1024 * 1024;

/// Why a worker call failed.
#[derive(Debug)]
pub enum CallError {
    /// Connecting failed: the instance never saw the request (safe to send it elsewhere).
    Unreachable(String),
    /// The worker answered with an error (its ErrorEvent): status and message reach the
    /// client as they are.
    Answered(u16, String),
    /// The worker broke the call: dropped the connection, crashed, or sent what the
    /// protocol does not allow (a 502 for the client).
    Failed(String),
}

/// The pooled HTTP client every worker call goes through.
pub struct Workers {
    client: Client<HttpConnector, Body>,
    /// `Bearer <cluster secret>`, or None when the cluster has none.
    authorization: Option<hyper::header::HeaderValue>,
}

impl Workers {
    pub fn new(cluster_secret: Option<&str>) -> Result<Workers, String> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.enforce_http(true);
        let client = Client::builder()
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(usize::MAX)
            .build(connector);
        let authorization = match cluster_secret {
            Some(secret) => Some(
                hyper::header::HeaderValue::from_str(&format!("Bearer {secret}"))
                    .map_err(|_| "KVSERVE_CLUSTER_SECRET is not a valid header value".to_string())?,
            ),
            None => None,
        };
        Ok(Workers { client, authorization })
    }

    fn post(&self, url: &str, body: impl Into<Body>) -> Result<Request<Body>, String> {
        let mut builder = Request::post(url).header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some(auth) = &self.authorization {
            builder = builder.header(hyper::header::AUTHORIZATION, auth.clone());
        }
        builder.body(body.into()).map_err(|e| format!("bad worker URL {url}: {e}"))
    }

    /// POST `body` to `inst`'s `path` and return its NDJSON event stream once the worker
    /// answered 200. A non-200 answer is read and becomes `Answered` (its ErrorEvent) or
    /// `Failed`.
    pub async fn stream(
        &self,
        inst: &Instance,
        role: &str,
        path: &'static str,
        body: Bytes,
    ) -> Result<EventStream, CallError> {
        let body = self.answered(inst, role, path, body).await?;
        Ok(EventStream {
            body,
            buf: BytesMut::new(),
            ended: false,
            pending: None,
            what: Describe { role: role.to_string(), inst: inst.clone(), path },
        })
    }

    /// POST `body` (a LandingGrant) to prefill instance `inst`'s /landing and read its
    /// answer: Ok on 200; `Unreachable`, `Answered` (its ErrorEvent) or `Failed` else.
    pub async fn grant(&self, inst: &Instance, body: Bytes) -> Result<(), CallError> {
        let body = self.answered(inst, "prefill", LANDING_PATH, body).await?;
        hyper::body::to_bytes(body)
            .await
            .map(|_| ())
            .map_err(|e| CallError::Failed(failed("prefill", inst, LANDING_PATH, &e)))
    }

    /// POST `body` to `inst`'s `path`: the body of a 200 answer (unread), else the call's
    /// error (a non-200 answer read: `Answered` with its ErrorEvent, or `Failed`).
    async fn answered(
        &self,
        inst: &Instance,
        role: &str,
        path: &'static str,
        body: Bytes,
    ) -> Result<Body, CallError> {
        let url = format!("{}{}", inst.url, path);
        let req = self.post(&url, body).map_err(CallError::Failed)?;
        let resp = match self.client.request(req).await {
            Ok(resp) => resp,
            Err(e) if e.is_connect() => {
                return Err(CallError::Unreachable(format!(
                    "{} is unreachable: {}",
                    describe(role, inst),
                    error_chain(&e)
                )))
            }
            Err(e) => return Err(CallError::Failed(failed(role, inst, path, &e))),
        };
        let status = resp.status();
        let body = resp.into_body();
        if status != StatusCode::OK {
            return Err(refused(role, inst, path, status, body).await);
        }
        Ok(body)
    }

    /// Tell `inst` to free `request_id`, in the background (never awaited; bounded by
    /// one second; failures are only logged). Must run inside the runtime.
    pub fn abort_soon(&self, inst: &Instance, request_id: &str, reason: &str, prefill_contacted: bool) {
        let url = format!("{}{}", inst.url, ABORT_PATH);
        let body = protocol::abort_json(request_id, reason, prefill_contacted);
        let req = match self.post(&url, body) {
            Ok(req) => req,
            Err(e) => {
                eprintln!("kvserve-edge: abort of {request_id}: {e}");
                return;
            }
        };
        let call = self.client.request(req);
        let request_id = request_id.to_string();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return; // the runtime is shutting down: the workers' own timeouts free it
        };
        handle.spawn(async move {
            match tokio::time::timeout(ABORT_TIMEOUT, async {
                let resp = call.await?;
                hyper::body::to_bytes(resp.into_body()).await.map(|_| ())
            })
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("kvserve-edge: abort of {request_id} on {url} failed: {e}"),
                Err(_) => eprintln!("kvserve-edge: abort of {request_id} on {url} timed out"),
            }
        });
    }
}

/// How error messages name an instance: "decode instance d0 (http://127.0.0.1:8201)",
/// as router/instances.py Instance.describe.
pub fn describe(role: &str, inst: &Instance) -> String {
    format!("{role} instance {} ({})", inst.name, inst.url)
}

#[derive(Debug)]
struct Describe {
    role: String,
    inst: Instance,
    path: &'static str,
}

/// A worker's NDJSON event stream. TokenBatches of one request that arrived together
/// (already in the buffer when the first is taken) come out as one batch, as
/// router/worker_client.py merge_batches does: the client gets one write for them.
pub struct EventStream {
    body: Body,
    buf: BytesMut,
    ended: bool,
    /// An event parsed while looking for batches to merge, not yet returned.
    pending: Option<WorkerEvent>,
    what: Describe,
}

impl EventStream {
    /// The instance this stream is from.
    pub fn instance(&self) -> &Instance {
        &self.what.inst
    }

    /// "prefill instance p0 (http://...)".
    pub fn describe(&self) -> String {
        describe(&self.what.role, &self.what.inst)
    }

    /// The next event; None at the stream's end. Not cancel-safe across a partial line
    /// only in the sense that the bytes stay buffered: dropping the future loses nothing.
    pub async fn next(&mut self) -> Result<Option<WorkerEvent>, CallError> {
        let event = match self.pending.take() {
            Some(event) => event,
            None => match self.next_line().await? {
                Some(line) => self.parse(&line)?,
                None => return Ok(None),
            },
        };
        match event {
            WorkerEvent::Tokens(mut batch) if batch.finish_reason.is_none() => {
                // Join the batches already here; stop at anything else (kept for later).
                while let Some(line) = self.buffered_line() {
                    match self.parse(&line)? {
                        WorkerEvent::Tokens(more) if more.request_id == batch.request_id => {
                            batch.token_ids.extend_from_slice(&more.token_ids);
                            batch.finish_reason = more.finish_reason;
                            batch.num_output_tokens = more.num_output_tokens;
                            if batch.finish_reason.is_some() {
                                break;
                            }
                        }
                        other => {
                            self.pending = Some(other);
                            break;
                        }
                    }
                }
                Ok(Some(WorkerEvent::Tokens(batch)))
            }
            other => Ok(Some(other)),
        }
    }

    fn parse(&self, line: &[u8]) -> Result<WorkerEvent, CallError> {
        protocol::parse_event(line).map_err(|e| {
            let shown = String::from_utf8_lossy(&line[..line.len().min(200)]).into_owned();
            CallError::Failed(format!(
                "{} sent an invalid event ({e}): {shown:?}",
                describe(&self.what.role, &self.what.inst)
            ))
        })
    }

    /// A complete non-blank line already in the buffer (no read).
    fn buffered_line(&mut self) -> Option<Bytes> {
        loop {
            let at = self.buf.iter().position(|&b| b == b'\n')?;
            let line = self.buf.split_to(at + 1).freeze();
            let line = line.slice(..at);
            if !is_blank(&line) {
                return Some(line);
            }
        }
    }

    /// The next non-blank line, reading as needed; None at the end of the body.
    async fn next_line(&mut self) -> Result<Option<Bytes>, CallError> {
        loop {
            if let Some(line) = self.buffered_line() {
                return Ok(Some(line));
            }
            if self.ended {
                // A last line without its newline still counts (worker_client.py's `pending`).
                if is_blank(&self.buf) {
                    return Ok(None);
                }
                return Ok(Some(self.buf.split().freeze()));
            }
            match self.body.data().await {
                Some(Ok(chunk)) => {
                    if self.buf.len() + chunk.len() > MAX_LINE_BYTES {
                        return Err(CallError::Failed(format!(
                            "{} sent an event line over {MAX_LINE_BYTES} bytes",
                            describe(&self.what.role, &self.what.inst)
                        )));
                    }
                    self.buf.extend_from_slice(chunk.chunk());
                }
                Some(Err(e)) => {
                    return Err(CallError::Failed(failed(
                        &self.what.role,
                        &self.what.inst,
                        self.what.path,
                        &e,
                    )))
                }
                None => self.ended = true,
            }
        }
    }
}

fn is_blank(line: &[u8]) -> bool {
    line.iter().all(|b| b.is_ascii_whitespace())
}

/// The error a non-200 answer stands for (router/worker_client.py `_error_answer`).
async fn refused(role: &str, inst: &Instance, path: &str, status: StatusCode, body: Body) -> CallError {
    let code = status.as_u16();
    if code == 401 {
        return CallError::Failed(format!(
            "{} refused the router's call to {path} (401): the router and the worker do not \
             share the cluster secret; restart the cluster with kvserve up",
            describe(role, inst)
        ));
    }
    let body = match hyper::body::to_bytes(body).await {
        Ok(body) => body,
        Err(e) => return CallError::Failed(failed(role, inst, path, &e)),
    };
    if let Ok(WorkerEvent::Error(event)) = protocol::parse_event(&body) {
        return CallError::Answered(event.status, event.message);
    }
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(&body) {
        if let Some(serde_json::Value::String(message)) = map.get("message") {
            return CallError::Answered(code, message.clone());
        }
    }
    let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
    CallError::Failed(format!("{} answered POST {path} with HTTP {code}: {text}", describe(role, inst)))
}

fn failed(role: &str, inst: &Instance, path: &str, e: &hyper::Error) -> String {
    format!(
        "{} failed during POST {path} (the worker crashed or dropped the connection): {}",
        describe(role, inst),
        error_chain(e)
    )
}

/// An error with its causes ("connection error: Connection reset by peer").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(ids: &str, finish: &str, n: u32) -> String {
        format!(
            "{{\"type\":\"tokens\",\"request_id\":\"r\",\"token_ids\":[{ids}],\"logprobs\":[],\
             \"finish_reason\":{finish},\"num_output_tokens\":{n},\"top_logprobs\":null}}\n"
        )
    }

    fn stream_of(chunks: Vec<String>) -> EventStream {
        let items: Vec<Result<Bytes, std::io::Error>> = chunks.into_iter().map(|c| Ok(Bytes::from(c))).collect();
        EventStream {
            body: Body::wrap_stream(futures_util::stream::iter(items)),
            buf: BytesMut::new(),
            ended: false,
            pending: None,
            what: Describe {
                role: "decode".into(),
                inst: Instance { name: "d0".into(), url: "http://127.0.0.1:1".into() },
                path: DECODE_PATH,
            },
        }
    }

    fn ids(event: Option<WorkerEvent>) -> (Vec<u32>, Option<String>) {
        match event {
            Some(WorkerEvent::Tokens(b)) => (b.token_ids, b.finish_reason),
            _ => panic!("not a token batch"),
        }
    }

    #[tokio::test]
    async fn batches_already_read_are_joined_up_to_a_finish() {
        let first = format!("{}\n{}", batch("1", "null", 1), batch("2,3", "null", 3));
        let tail = batch("4", "\"stop\"", 4);
        // A line split across reads, a blank line, then a batch after the finish.
        let split = tail.len() / 2;
        let mut s = stream_of(vec![
            first,
            tail[..split].to_string(),
            format!("{}{}", &tail[split..], batch("5", "null", 5)),
        ]);
        assert_eq!(ids(s.next().await.unwrap()), (vec![1, 2, 3], None));
        assert_eq!(ids(s.next().await.unwrap()), (vec![4], Some("stop".into())));
        assert_eq!(ids(s.next().await.unwrap()), (vec![5], None));
        assert!(s.next().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn an_error_after_batches_is_kept_for_the_next_call() {
        let error = "{\"type\":\"error\",\"request_id\":\"r\",\"status\":400,\"message\":\"m\"}";
        // The last line has no newline: it still counts at the body's end.
        let mut s = stream_of(vec![format!("{}{}", batch("1", "null", 1), error)]);
        assert_eq!(ids(s.next().await.unwrap()), (vec![1], None));
        match s.next().await.unwrap() {
            Some(WorkerEvent::Error(e)) => assert_eq!((e.status, e.message.as_str()), (400, "m")),
            _ => panic!("not the error"),
        }
    }

    #[tokio::test]
    async fn an_invalid_line_is_a_failure_naming_the_instance() {
        let mut s = stream_of(vec!["{\"type\":\"nonsense\"}\n".to_string()]);
        match s.next().await {
            Err(CallError::Failed(m)) => assert!(m.starts_with("decode instance d0 (http://127.0.0.1:1) sent an invalid event")),
            _ => panic!("not a failure"),
        }
    }
}
