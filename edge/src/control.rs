//! The control plane's client: the Python router (router/edge_control.py) decides, the
//! edge moves the bytes. One Unix socket, framed messages, many requests at once.
//!
//! A run calls, in relay.py's order: `open` (registers the request), `admit_decode`,
//! `pick` (prefill or unified), and reports what happened (`unreachable`, `bind`,
//! `prefilled`, `broken`), then `end` exactly once. The asks are answered; `open` and the
//! reports are one-way. `lost` delivers the ids of requests whose decode process the
//! control plane learned is gone (a 503 `decode_instance_lost` for the client:
//! `lost_error`).
//!
//! Wire (router/edge_control.py's docstring has every message): frames of a 4-byte
//! little-endian length and one JSON object. The router's first frame is a hello with the
//! topology; an ask carries a `seq` its answer echoes; the router pushes `{"lost": id}`.
//!
//!     callers ──frames──▶ mpsc ──▶ writer task ──▶ socket ──▶ router
//!     callers ◀─oneshot── pending[seq] ◀── reader task ◀── socket ◀── router
//!                          lost ids ──▶ broadcast
//!
//! When the socket breaks, every pending ask and every later one fails with a 503 (the
//! router restarts the edge: docs/edge.md).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::protocol::PromptUsage;

/// router/edge_control.py WIRE_VERSION.
pub const WIRE_VERSION: u32 = 1;
/// The largest frame the router may send (its answers and pushes are small).
const MAX_FRAME_BYTES: usize = 1 << 20;
/// Lost ids a slow subscriber may fall behind by before it sees `Lagged` (then it asks
/// `is_lost`).
const LOST_CAPACITY: usize = 1024;
/// Pushed errors kept for their runs. An entry leaves at its request's `end`; one whose
/// push crossed that `end` on the wire stays, so past this many the map is cleared (a run
/// whose entry went falls back to a generic decode-lost error: same status and code).
const LOST_KEEP: usize = 4096;

/// One worker instance as the control plane names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Unified => "unified",
        }
    }
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

impl ApiError {
    /// The control plane cannot be asked (its socket broke): nothing was sent to a worker
    /// for the request, so the client may retry once the router restarted the edge.
    fn unavailable(why: &str) -> ApiError {
        ApiError {
            status: 503,
            message: format!("the router's control plane is unreachable ({why}); retry shortly"),
            error_type: "server_error".to_string(),
            code: Some("control_plane_unavailable".to_string()),
            headers: vec![("retry-after".to_string(), "1".to_string())],
        }
    }

    /// decode_bindings.py's DecodeLost, for a lost id whose pushed error was not kept.
    fn decode_lost(request_id: &str) -> ApiError {
        ApiError {
            status: 503,
            message: format!(
                "request {request_id}: the decode instance where it was reserved went down \
                 before prefill finished it; nothing was generated: retry the request"
            ),
            error_type: "server_error".to_string(),
            code: Some("decode_instance_lost".to_string()),
            headers: vec![("retry-after".to_string(), "1".to_string())],
        }
    }
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

/// An ask's answer: an instance (admit, pick), nothing (ping), or the error.
type Answer = Result<Option<Instance>, ApiError>;

/// What the reader task and the callers share.
struct Shared {
    pending: Mutex<Pending>,
    lost_tx: broadcast::Sender<String>,
    /// The pushed error of each lost request, until its `end` (or `lost_error`).
    lost_errors: Mutex<HashMap<String, ApiError>>,
}

struct Pending {
    /// Why the connection is gone (then no ask is sent or waits any more).
    closed: Option<String>,
    waiting: HashMap<u64, oneshot::Sender<Answer>>,
}

impl Shared {
    fn close(&self, why: &str) {
        let waiting = {
            let mut p = lock(&self.pending);
            if p.closed.is_none() {
                p.closed = Some(why.to_string());
            }
            std::mem::take(&mut p.waiting)
        };
        for (_, tx) in waiting {
            let _ = tx.send(Err(ApiError::unavailable(why)));
        }
    }

    fn deliver(&self, msg: Incoming) {
        if let Some(id) = msg.lost {
            let error = match msg.error {
                Some(e) => e.into_api(),
                None => ApiError::decode_lost(&id),
            };
            {
                let mut kept = lock(&self.lost_errors);
                if kept.len() >= LOST_KEEP {
                    kept.clear();
                }
                kept.insert(id.clone(), error);
            }
            let _ = self.lost_tx.send(id); // no subscriber: nobody waits on prefill now
            return;
        }
        let Some(seq) = msg.seq else { return };
        let tx = lock(&self.pending).waiting.remove(&seq);
        if let Some(tx) = tx {
            let answer = match msg.error {
                Some(e) => Err(e.into_api()),
                None => Ok(msg.instance),
            };
            let _ = tx.send(answer); // the asker may have gone (its client left)
        }
    }
}

/// A poisoned lock only means another task panicked mid-update (the release build
/// aborts on panic): the maps stay usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct Control {
    topology: Topology,
    out: mpsc::UnboundedSender<Vec<u8>>,
    shared: Arc<Shared>,
    seq: AtomicU64,
}

impl Control {
    /// Connect to the router's control socket and read its hello.
    pub async fn connect(path: &Path) -> std::io::Result<Arc<Control>> {
        let stream = UnixStream::connect(path).await?;
        let (rd, wr) = stream.into_split();
        let mut rd = BufReader::with_capacity(64 * 1024, rd);
        let mut buf = Vec::new();
        read_frame(&mut rd, &mut buf).await?;
        let topology = parse_hello(&buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let (out, rx) = mpsc::unbounded_channel();
        let (lost_tx, _) = broadcast::channel(LOST_CAPACITY);
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending {
                closed: None,
                waiting: HashMap::new(),
            }),
            lost_tx,
            lost_errors: Mutex::new(HashMap::new()),
        });
        tokio::spawn(read_loop(rd, buf, shared.clone()));
        tokio::spawn(write_loop(
            BufWriter::with_capacity(64 * 1024, wr),
            rx,
            shared.clone(),
        ));
        Ok(Arc::new(Control {
            topology,
            out,
            shared,
            seq: AtomicU64::new(1),
        }))
    }

    /// The cluster's topology (asked once at start).
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// Registers the request. One-way (the router applies messages in order: the asks
    /// that follow see it), so it returns at once; Err only while the socket is down.
    pub async fn open(&self, req: Open<'_>) -> Result<(), ApiError> {
        if let Some(why) = &lock(&self.shared.pending).closed {
            return Err(ApiError::unavailable(why));
        }
        let msg = Out::Open {
            id: req.request_id,
            prompt: req.prompt_token_ids,
            max_tokens: req.max_tokens,
            endpoint: req.endpoint,
            user: req.user,
            session: req.session,
        };
        self.report(frame(&msg, req.prompt_token_ids.len() * 7));
        Ok(())
    }

    /// A decode instance with room for the request (through the admission gate: may wait
    /// up to `deadline_s` from now). `tried`: instances this run could not reach.
    pub async fn admit_decode(
        &self,
        request_id: &str,
        tried: &[String],
        deadline_s: f64,
    ) -> Result<Instance, ApiError> {
        let seq = self.next_seq();
        let msg = Out::Admit {
            seq,
            id: request_id,
            deadline_s,
            tried,
        };
        self.ask_instance(seq, frame(&msg, 0)).await
    }

    /// A prefill (or unified) instance; the control plane counts the prompt as its queued
    /// work from now on.
    pub async fn pick(
        &self,
        request_id: &str,
        role: Role,
        tried: &[String],
    ) -> Result<Instance, ApiError> {
        let seq = self.next_seq();
        let msg = Out::Pick {
            seq,
            id: request_id,
            role: role.as_str(),
            tried,
        };
        self.ask_instance(seq, frame(&msg, 0)).await
    }

    /// Answered once the router applied every report sent before it (tests; a health
    /// check of the control plane).
    pub async fn ping(&self) -> Result<(), ApiError> {
        let seq = self.next_seq();
        self.ask(seq, frame(&Out::Ping { seq }, 0))
            .await
            .map(|_| ())
    }

    /// `instance` refused the connection: it never got the request (marked unhealthy;
    /// a decode's reservation is released, a prefill's queued work forgotten).
    pub fn unreachable(&self, request_id: &str, instance: &Instance, message: &str) {
        let msg = Out::Unreachable {
            id: request_id,
            instance: &instance.name,
            message,
        };
        self.report(frame(&msg, message.len()));
    }

    /// Decode answered DecodeReady from process `incarnation`: the request is bound to it
    /// until its prefill's first event (router/decode_bindings.py).
    pub fn bind(&self, request_id: &str, decode: &Instance, incarnation: &str) {
        let msg = Out::Bind {
            id: request_id,
            instance: &decode.name,
            incarnation,
        };
        self.report(frame(&msg, 0));
    }

    /// Prefill (or unified) answered with its FirstToken: the prompt's blocks are cached
    /// there now; the binding ends.
    pub fn prefilled(&self, request_id: &str, instance: &Instance, usage: &PromptUsage) {
        let msg = Out::Prefilled {
            id: request_id,
            instance: &instance.name,
            usage: WireUsage::of(usage),
        };
        self.report(frame(&msg, 64));
    }

    /// `instance`'s stream broke mid-request; `incarnation`: decode's, when known.
    pub fn broken(&self, request_id: &str, instance: &Instance, message: &str, incarnation: &str) {
        let msg = Out::Broken {
            id: request_id,
            instance: &instance.name,
            message,
            incarnation,
        };
        self.report(frame(&msg, message.len()));
    }

    /// The run is over (exactly once per `open`): the reservation is released, the
    /// request's metrics recorded, its state dropped.
    pub fn end(&self, request_id: &str, end: End) {
        let msg = Out::End {
            id: request_id,
            status: end.status,
            prompt_tokens: end.prompt_tokens,
            completion_tokens: end.completion_tokens,
            usage: end.usage.as_ref().map(WireUsage::of),
            first_token_s: end.first_token_s,
            last_token_s: end.last_token_s,
            token_gaps_s: &end.token_gaps_s,
        };
        self.report(frame(&msg, 64 + end.token_gaps_s.len() * 24));
        lock(&self.shared.lost_errors).remove(request_id);
    }

    /// Ids of requests whose decode process is gone while they waited for prefill.
    pub fn lost(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.shared.lost_tx.subscribe()
    }

    /// Whether `request_id` was reported lost (for a subscriber that lagged).
    pub fn is_lost(&self, request_id: &str) -> bool {
        lock(&self.shared.lost_errors).contains_key(request_id)
    }

    /// The client's error for a lost request: the router's own message, code and
    /// headers (decode_bindings.py DecodeLost).
    pub fn lost_error(&self, request_id: &str) -> ApiError {
        lock(&self.shared.lost_errors)
            .get(request_id)
            .cloned()
            .unwrap_or_else(|| ApiError::decode_lost(request_id))
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn report(&self, frame: Vec<u8>) {
        let _ = self.out.send(frame); // a closed socket: the router ends the request itself
    }

    async fn ask(&self, seq: u64, frame: Vec<u8>) -> Answer {
        let (tx, rx) = oneshot::channel();
        {
            let mut p = lock(&self.shared.pending);
            if let Some(why) = &p.closed {
                return Err(ApiError::unavailable(why));
            }
            p.waiting.insert(seq, tx);
        }
        if self.out.send(frame).is_err() {
            lock(&self.shared.pending).waiting.remove(&seq);
            return Err(ApiError::unavailable("its writer stopped"));
        }
        match rx.await {
            Ok(answer) => answer,
            Err(_) => Err(ApiError::unavailable("the connection closed")),
        }
    }

    async fn ask_instance(&self, seq: u64, frame: Vec<u8>) -> Result<Instance, ApiError> {
        match self.ask(seq, frame).await? {
            Some(inst) => Ok(inst),
            None => Err(ApiError {
                status: 500,
                message: "internal router error: the control plane answered without an instance"
                    .to_string(),
                error_type: "server_error".to_string(),
                code: None,
                headers: Vec::new(),
            }),
        }
    }
}

/// One frame's body into `buf` (reused: no allocation once it is large enough).
async fn read_frame(rd: &mut BufReader<OwnedReadHalf>, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let mut len = [0u8; 4];
    rd.read_exact(&mut len).await?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a {n}-byte frame"),
        ));
    }
    buf.resize(n, 0);
    rd.read_exact(buf).await?;
    Ok(())
}

async fn read_loop(mut rd: BufReader<OwnedReadHalf>, mut buf: Vec<u8>, shared: Arc<Shared>) {
    let why = loop {
        match read_frame(&mut rd, &mut buf).await {
            Ok(()) => match serde_json::from_slice::<Incoming>(&buf) {
                Ok(msg) => shared.deliver(msg),
                Err(e) => break format!("a malformed frame: {e}"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break "the router closed it".to_string()
            }
            Err(e) => break e.to_string(),
        }
    };
    eprintln!("kvserve-edge: control socket: {why}");
    shared.close(&why);
}

/// Writes queued frames; those queued meanwhile go out in the same flush (one syscall
/// for many requests under load).
async fn write_loop(
    mut wr: BufWriter<OwnedWriteHalf>,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
    shared: Arc<Shared>,
) {
    let result: std::io::Result<()> = async {
        while let Some(first) = rx.recv().await {
            wr.write_all(&first).await?;
            while let Ok(more) = rx.try_recv() {
                wr.write_all(&more).await?;
            }
            wr.flush().await?;
        }
        wr.shutdown().await // every Control handle dropped: the router ends our requests
    }
    .await;
    if let Err(e) = result {
        shared.close(&format!("writing failed: {e}"));
    }
}

mod driver;
mod wire;

use wire::{frame, parse_hello, Incoming, Out, WireUsage};

/// `kvserve-edge control --socket PATH`: test driver (JSON lines: one call each;
/// src/control/driver.rs).
pub fn cli(args: &[String]) -> i32 {
    driver::cli(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_has_its_length_prefix() {
        let f = frame(&Out::Ping { seq: 7 }, 0);
        let n = u32::from_le_bytes([f[0], f[1], f[2], f[3]]) as usize;
        assert_eq!(n, f.len() - 4);
        assert_eq!(&f[4..], br#"{"op":"ping","seq":7}"#);
    }

    #[test]
    fn hello_gives_the_topology() {
        assert_eq!(
            parse_hello(br#"{"hello":{"version":1,"topology":"pd"}}"#),
            Ok(Topology::PrefillDecode)
        );
        assert_eq!(
            parse_hello(br#"{"hello":{"version":1,"topology":"unified"}}"#),
            Ok(Topology::Unified)
        );
        assert!(parse_hello(br#"{"hello":{"version":2,"topology":"pd"}}"#).is_err());
        assert!(parse_hello(br#"{"seq":1}"#).is_err());
        assert!(parse_hello(b"not json").is_err());
    }

    fn shared_with(lost_tx: broadcast::Sender<String>) -> Shared {
        Shared {
            pending: Mutex::new(Pending {
                closed: None,
                waiting: HashMap::new(),
            }),
            lost_tx,
            lost_errors: Mutex::new(HashMap::new()),
        }
    }

    #[test]
    fn a_closed_connection_fails_pending_asks_with_503() {
        let (lost_tx, _) = broadcast::channel(4);
        let shared = shared_with(lost_tx);
        let (tx, mut rx) = oneshot::channel();
        lock(&shared.pending).waiting.insert(1, tx);
        shared.close("gone");
        let answer = rx.try_recv().expect("answered");
        let err = answer.expect_err("an error");
        assert_eq!(err.status, 503);
        assert_eq!(err.code.as_deref(), Some("control_plane_unavailable"));
        assert!(lock(&shared.pending).closed.is_some());
    }

    #[test]
    fn answers_and_pushes_are_routed() {
        let (lost_tx, mut lost_rx) = broadcast::channel(4);
        let shared = shared_with(lost_tx);
        let (tx, mut rx) = oneshot::channel();
        lock(&shared.pending).waiting.insert(3, tx);
        let msg: Incoming =
            serde_json::from_slice(br#"{"seq":3,"instance":{"name":"p0","url":"http://x"}}"#)
                .unwrap();
        shared.deliver(msg);
        let inst = rx.try_recv().unwrap().unwrap().unwrap();
        assert_eq!(inst.name, "p0");
        let push: Incoming = serde_json::from_slice(
            br#"{"lost":"r1","error":{"status":503,"message":"m","type":"server_error","code":"decode_instance_lost","headers":{"retry-after":"1"}}}"#,
        )
        .unwrap();
        shared.deliver(push);
        assert_eq!(lost_rx.try_recv().unwrap(), "r1");
        let err = lock(&shared.lost_errors).get("r1").cloned().unwrap();
        assert_eq!(err.message, "m");
        assert_eq!(
            err.headers,
            vec![("retry-after".to_string(), "1".to_string())]
        );
    }
}
