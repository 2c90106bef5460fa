//! One request's run over its workers (router/relay.py's RequestRun and unified.py's
//! UnifiedRun), with the control plane deciding where it goes, and its output
//! (router/output.py's OutputStream: tokens -> text deltas with the stop rules).
//!
//!     P/D (protocol 5, max_tokens > 1):
//!               admit decode + pick prefill      (two control asks, back to back)
//!               ──/decode──▶ and ──/prefill (await_landing)──▶ at once
//!               DecodeReady ──/landing (LandingGrant)──▶ prefill; bind
//!               prefill's FirstToken (read once the grant was accepted) ─▶ prefilled
//!               decode's TokenBatches ... until one carries a finish
//!     P/D, max_tokens == 1: pick prefill ──/prefill (no landing)──▶ FirstToken
//!     unified:  pick unified ──/generate──▶ FirstToken, TokenBatch ... until a finish
//!
//! An instance that refuses the connection never saw the request: the control plane is
//! told (`unreachable`) and another one is tried (a prefill retried after DecodeReady
//! gets the landing inline, no grant). A grant answered 410 yields to prefill's own
//! answer (an error, or a first token that finished the request). Anything later is
//! the client's error.
//!
//! Aborts (sent in the background, never awaited), as relay.py's:
//! - the run fails (worker error, timeout, the client gone: `Run` dropped unfinished):
//!   every instance that was sent the request, decode told whether a prefill was given
//!   its landing (a grant, or inline);
//! - the router finishes first (a stop string the worker has not matched yet): the
//!   instances still working on it, reason "finished";
//! - prefill finishes at its first token: decode, reason "finished".

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Sleep;

use crate::control::{ApiError, Control, End, Instance, Role, Topology};
use crate::detok::OutputText;
use crate::protocol::{self, DecodeReady, EncodedRequest, PromptUsage, SamplingParams, WorkerEvent};
use crate::worker::{self, CallError, EventStream, Workers};

/// What every run shares.
pub struct Services {
    pub control: Arc<Control>,
    pub workers: Workers,
    pub topology: Topology,
    pub request_timeout_s: f64,
}

/// Tokens as a worker reported them; `finish_reason` is the worker's view.
pub struct Tokens {
    pub token_ids: Vec<u32>,
    pub finish_reason: Option<String>,
}

/// Where a run is.
enum Stage {
    /// Nothing sent yet.
    Start,
    /// P/D: prefill's FirstToken was returned; its stream is read to its end next, then
    /// decode's (None: max_tokens == 1, prefill must have finished).
    PrefillTail(EventStream),
    /// P/D: decode's token batches.
    Decode,
    /// Unified: the instance's events after its FirstToken.
    Unified(EventStream, Instance),
    /// A worker reported the finish (or the run failed).
    Done,
}

/// One instance the run sent the request to.
struct Sent {
    inst: Instance,
    /// Still working on it (abort target of an early finish).
    open: bool,
}

/// Owns one request's worker-side state. Dropped before it completed (the client left,
/// or the caller gave up on an error), it aborts every instance that was sent it.
pub struct Run {
    s: Arc<Services>,
    request_id: String,
    prompt: Vec<u32>,
    params: SamplingParams,
    deadline: tokio::time::Instant,
    /// The run's one timer, registered once (a `timeout_at` per step would register and
    /// cancel one in tokio's timer wheel for every token batch). None while a step runs.
    timer: Option<Pin<Box<Sleep>>>,
    stage: Stage,
    sent: Vec<Sent>,
    decode: Option<(Instance, EventStream, String)>,
    /// A prefill was given decode's landing (a grant, or inline): it may write there.
    landing_sent: bool,
    /// The prompt's usage as prefill (or unified) reported it.
    pub usage: Option<PromptUsage>,
    completed: bool,
    closed: bool,
}

impl Run {
    pub fn new(s: Arc<Services>, request_id: String, prompt: Vec<u32>, params: SamplingParams) -> Run {
        let timeout = std::time::Duration::from_secs_f64(s.request_timeout_s.max(0.0));
        let deadline = tokio::time::Instant::now() + timeout;
        Run {
            s,
            request_id,
            prompt,
            params,
            deadline,
            timer: Some(Box::pin(tokio::time::sleep_until(deadline))),
            stage: Stage::Start,
            sent: Vec::with_capacity(2),
            decode: None,
            landing_sent: false,
            usage: None,
            completed: false,
            closed: false,
        }
    }

    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The next tokens: the first token, then token batches until one carries a finish
    /// (the caller stops there). An error ends the run: its instances are aborted.
    pub async fn next(&mut self) -> Result<Tokens, ApiError> {
        let mut timer = match self.timer.take() {
            Some(timer) => timer,
            None => Box::pin(tokio::time::sleep_until(self.deadline)), // a step was cancelled
        };
        let stepped = tokio::select! {
            biased;
            result = self.step() => Some(result),
            () = timer.as_mut() => None,
        };
        self.timer = Some(timer);
        let result = match stepped {
            Some(result) => result,
            None => {
                self.close("timeout");
                Err(api_error(
                    504,
                    format!(
                        "request {} did not finish within {} s (router.request_timeout_s)",
                        self.request_id,
                        fmt_g(self.s.request_timeout_s)
                    ),
                    "timeout",
                ))
            }
        };
        if result.is_err() {
            self.stage = Stage::Done;
            self.close("error");
        }
        result
    }

    /// The router has its finish before the workers: stop those still working.
    pub fn finish_early(&mut self) {
        if !self.closed {
            self.closed = true;
            for sent in self.sent.iter().filter(|s| s.open) {
                self.s.workers.abort_soon(&sent.inst, &self.request_id, "finished", true);
            }
        }
        self.stage = Stage::Done;
    }

    /// The run failed: abort every instance that was sent it. Idempotent.
    fn close(&mut self, reason: &str) {
        if self.closed || self.completed {
            return;
        }
        self.closed = true;
        for sent in &self.sent {
            self.s.workers.abort_soon(&sent.inst, &self.request_id, reason, self.landing_sent);
        }
    }

    async fn step(&mut self) -> Result<Tokens, ApiError> {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Start => match self.s.topology {
                Topology::PrefillDecode => self.pd_first().await,
                Topology::Unified => self.unified_first().await,
            },
            Stage::PrefillTail(prefill) => {
                self.drain_prefill(prefill).await?;
                self.stage = Stage::Decode;
                self.decode_next().await
            }
            Stage::Decode => self.decode_next().await,
            Stage::Unified(events, inst) => self.unified_next(events, inst).await,
            Stage::Done => Err(api_error(
                502,
                "the workers ended the stream without a finish reason".to_string(),
                "server_error",
            )),
        }
    }

    // -- P/D ------------------------------------------------------------------------------

    async fn pd_first(&mut self) -> Result<Tokens, ApiError> {
        // The prompt and params written once for both bodies.
        let encoded = EncodedRequest::new(&self.request_id, &self.prompt, &self.params);
        let (ready, prefill, mut events, refused) = if self.params.max_tokens > 1 {
            let (ready, prefill, events, refused) = self.open_both(&encoded).await?;
            (Some(ready), prefill, events, refused)
        } else {
            let (prefill, events) = self.open_prefill(&encoded, None, Vec::new()).await?;
            (None, prefill, events, None)
        };
        drop(encoded);
        let mut lost = None;
        if let (Some(ready), Some((decode, _, _))) = (&ready, &self.decode) {
            // Subscribed before the binding exists: no `lost` can slip between the two.
            lost = Some(self.s.control.lost());
            self.s.control.bind(&self.request_id, decode, &ready.incarnation);
        }
        let event = match lost {
            Some(mut lost) => {
                let request_id = self.request_id.as_str();
                let control = &self.s.control;
                let watched = async {
                    loop {
                        match lost.recv().await {
                            Ok(id) if id == request_id => return,
                            Err(RecvError::Lagged(_)) if control.is_lost(request_id) => return,
                            Ok(_) | Err(RecvError::Lagged(_)) => continue,
                            Err(RecvError::Closed) => std::future::pending::<()>().await,
                        }
                    }
                };
                tokio::select! {
                    biased;
                    event = events.next() => event,
                    // The control plane's own message, code and retry-after.
                    () = watched => return Err(self.s.control.lost_error(&self.request_id)),
                }
            }
            None => events.next().await,
        };
        let first = match event {
            Ok(Some(WorkerEvent::First(first))) => first,
            Ok(Some(WorkerEvent::Error(e))) => return Err(worker_error(e.status, e.message)),
            Ok(Some(_)) => {
                return Err(failed(format!("{} sent tokens before its FirstToken", describe_p(&prefill))))
            }
            Ok(None) => {
                self.done(&prefill);
                return Err(failed(format!("{} ended its stream without a FirstToken", describe_p(&prefill))));
            }
            Err(e) => return Err(self.stream_failed(&prefill, e, "")),
        };
        if let (Some((status, message)), None) = (&refused, &first.finish_reason) {
            return Err(landing_refused(&prefill, *status, message));
        }
        self.s.control.prefilled(&self.request_id, &prefill, &first.usage);
        self.usage = Some(first.usage);
        self.done(&prefill);
        if first.finish_reason.is_some() {
            self.release_decode(); // its pages and landing are not needed
            self.completed = true;
            drain_soon(events);
        } else {
            self.stage = Stage::PrefillTail(events);
        }
        Ok(Tokens { token_ids: vec![first.token_id], finish_reason: first.finish_reason })
    }

    /// Protocol 5: both choices first (the control plane's two asks back to back), then
    /// decode's call and prefill's (await_landing) at once; decode's DecodeReady goes to
    /// prefill as a LandingGrant. Returns DecodeReady, the prefill instance and its
    /// stream, and a 410 answer to the grant (prefill's first event decides then).
    async fn open_both(
        &mut self,
        encoded: &EncodedRequest,
    ) -> Result<(DecodeReady, Instance, EventStream, Option<(u16, String)>), ApiError> {
        let left = self.deadline.saturating_duration_since(tokio::time::Instant::now());
        let control = Arc::clone(&self.s.control);
        let (decode_inst, prefill_inst) = tokio::join!(
            control.admit_decode(&self.request_id, &[], left.as_secs_f64()),
            control.pick(&self.request_id, Role::Prefill, &[]),
        );
        let (decode_inst, prefill_inst) = (decode_inst?, prefill_inst?);
        self.start(&decode_inst);
        self.start(&prefill_inst);
        let (s, target) = (Arc::clone(&self.s), decode_inst.clone());
        let decode_call = async move {
            let body: Bytes = encoded.decode().into();
            let mut events = s.workers.stream(&target, "decode", worker::DECODE_PATH, body).await?;
            let first = events.next().await;
            Ok::<_, CallError>((events, first))
        };
        let prefill_body: Bytes = encoded.prefill_awaiting().into();
        let (s, target) = (Arc::clone(&self.s), prefill_inst.clone());
        let prefill_call =
            async move { s.workers.stream(&target, "prefill", worker::PREFILL_PATH, prefill_body).await };
        tokio::pin!(decode_call);
        tokio::pin!(prefill_call);
        // Until DecodeReady, both calls are driven; prefill may answer (its headers) only
        // with its first token, so the grant must not wait for that answer.
        let mut prefilled = None;
        let decoded = loop {
            tokio::select! {
                decoded = &mut decode_call => break decoded,
                answered = &mut prefill_call, if prefilled.is_none() => prefilled = Some(answered),
            }
        };
        let mut tried_decode: Vec<String> = Vec::new();
        let ready = match self.took_ready(decode_inst, decoded, &mut tried_decode)? {
            Some(ready) => ready,
            None if prefilled.is_none() => {
                let (ready, answered) = tokio::join!(self.open_decode(encoded, tried_decode), &mut prefill_call);
                prefilled = Some(answered);
                ready?
            }
            None => self.open_decode(encoded, tried_decode).await?,
        };
        let mut tried_prefill: Vec<String> = Vec::new();
        if let Some(Err(CallError::Unreachable(message))) = &prefilled {
            // the first prefill never got the request: another one, with the landing inline
            self.forget(&prefill_inst, message, &mut tried_prefill);
            let (inst, events) = self.open_prefill(encoded, Some(&ready), tried_prefill).await?;
            return Ok((ready, inst, events, None));
        }
        self.landing_sent = true;
        let grant_body: Bytes = protocol::landing_grant_json(&ready).into();
        let s = Arc::clone(&self.s);
        let grant_call = s.workers.grant(&prefill_inst, grant_body);
        let (granted, answered) = match prefilled {
            Some(answered) => (grant_call.await, answered),
            None => tokio::join!(grant_call, &mut prefill_call),
        };
        let events = match answered {
            Ok(events) => events,
            Err(CallError::Unreachable(message)) => {
                self.forget(&prefill_inst, &message, &mut tried_prefill);
                let (inst, events) = self.open_prefill(encoded, Some(&ready), tried_prefill).await?;
                return Ok((ready, inst, events, None));
            }
            Err(e) => return Err(self.call_failed(&prefill_inst, "prefill", e)),
        };
        let refused = match granted {
            // unreachable now: it died after taking the request; its stream tells
            Ok(()) | Err(CallError::Unreachable(_)) => None,
            Err(CallError::Answered(410, message)) => Some((410, message)),
            // the worker's own state (an engine stalled, an instance lost), as its errors
            Err(CallError::Answered(status, message)) if status >= 500 => {
                return Err(worker_error(status, message))
            }
            Err(CallError::Answered(status, message)) => {
                return Err(landing_refused(&prefill_inst, status, &message))
            }
            Err(CallError::Failed(message)) => return Err(failed(message)),
        };
        Ok((ready, prefill_inst, events, refused))
    }

    /// Admit decode instances (another while one cannot be connected to), open the
    /// stream and read its DecodeReady (the request then waits there).
    async fn open_decode(
        &mut self,
        encoded: &EncodedRequest,
        mut tried: Vec<String>,
    ) -> Result<DecodeReady, ApiError> {
        let body: Bytes = encoded.decode().into();
        loop {
            let left = self.deadline.saturating_duration_since(tokio::time::Instant::now());
            let inst = self.s.control.admit_decode(&self.request_id, &tried, left.as_secs_f64()).await?;
            self.start(&inst);
            let called = async {
                let mut events =
                    self.s.workers.stream(&inst, "decode", worker::DECODE_PATH, body.clone()).await?;
                let first = events.next().await;
                Ok::<_, CallError>((events, first))
            }
            .await;
            if let Some(ready) = self.took_ready(inst, called, &mut tried)? {
                return Ok(ready);
            }
        }
    }

    /// Decode's answer to the call: its DecodeReady (the stream kept in `self.decode`),
    /// None when it could not be connected to (told, and added to `tried`), or the error.
    fn took_ready(
        &mut self,
        inst: Instance,
        called: Result<(EventStream, Result<Option<WorkerEvent>, CallError>), CallError>,
        tried: &mut Vec<String>,
    ) -> Result<Option<DecodeReady>, ApiError> {
        let (events, first) = match called {
            Ok(called) => called,
            Err(CallError::Unreachable(message)) => {
                self.forget(&inst, &message, tried);
                return Ok(None);
            }
            Err(e) => return Err(self.call_failed(&inst, "decode", e)),
        };
        match first {
            Ok(Some(WorkerEvent::Ready(ready))) => {
                self.decode = Some((inst, events, ready.incarnation.clone()));
                Ok(Some(ready))
            }
            Ok(Some(WorkerEvent::Error(e))) => Err(worker_error(e.status, e.message)),
            Ok(Some(_)) => {
                Err(failed(format!("{} sent tokens before DecodeReady", worker::describe("decode", &inst))))
            }
            Ok(None) => {
                let message = format!("{} ended its stream before DecodeReady", worker::describe("decode", &inst));
                self.s.control.broken(&self.request_id, &inst, &message, "");
                Err(failed(message))
            }
            Err(e) => Err(self.call_failed(&inst, "decode", e)),
        }
    }

    /// Send prefill the request (another instance while one cannot be connected to),
    /// with decode's landing inline when `ready` is known (none: max_tokens == 1).
    async fn open_prefill(
        &mut self,
        encoded: &EncodedRequest,
        ready: Option<&DecodeReady>,
        mut tried: Vec<String>,
    ) -> Result<(Instance, EventStream), ApiError> {
        let body: Bytes = encoded.prefill(ready).into();
        loop {
            let inst = self.s.control.pick(&self.request_id, Role::Prefill, &tried).await?;
            self.start(&inst);
            self.landing_sent |= ready.is_some();
            match self.s.workers.stream(&inst, "prefill", worker::PREFILL_PATH, body.clone()).await {
                Ok(events) => return Ok((inst, events)),
                Err(CallError::Unreachable(message)) => self.forget(&inst, &message, &mut tried),
                Err(e) => return Err(self.call_failed(&inst, "prefill", e)),
            }
        }
    }

    /// Prefill's stream after its FirstToken, read to its end (which returns its
    /// connection to the pool); an ErrorEvent there is the client's error.
    async fn drain_prefill(&mut self, mut events: EventStream) -> Result<(), ApiError> {
        loop {
            match events.next().await {
                Ok(None) => break,
                Ok(Some(WorkerEvent::Error(e))) => return Err(worker_error(e.status, e.message)),
                Ok(Some(_)) => {
                    return Err(failed(format!("{} sent more than its FirstToken", events.describe())))
                }
                Err(e) => {
                    let inst = events.instance().clone();
                    return Err(self.stream_failed(&inst, e, ""));
                }
            }
        }
        if self.decode.is_none() {
            return Err(failed(format!(
                "{} did not finish a max_tokens=1 request",
                events.describe()
            )));
        }
        Ok(())
    }

    async fn decode_next(&mut self) -> Result<Tokens, ApiError> {
        let Some((inst, events, _)) = self.decode.as_mut() else {
            return Err(failed("no decode stream is open".to_string()));
        };
        let event = events.next().await;
        let inst = inst.clone();
        match event {
            Ok(Some(WorkerEvent::Tokens(batch))) => {
                if batch.finish_reason.is_some() {
                    self.done(&inst);
                    self.completed = true;
                } else {
                    self.stage = Stage::Decode;
                }
                Ok(Tokens { token_ids: batch.token_ids, finish_reason: batch.finish_reason })
            }
            Ok(Some(WorkerEvent::Error(e))) => Err(worker_error(e.status, e.message)),
            Ok(Some(_)) => Err(failed(format!(
                "{} sent a second DecodeReady",
                worker::describe("decode", &inst)
            ))),
            Ok(None) => Err(failed(format!(
                "{} ended its stream without a finish_reason",
                worker::describe("decode", &inst)
            ))),
            Err(e) => {
                let incarnation = self.decode.as_ref().map(|d| d.2.clone()).unwrap_or_default();
                Err(self.stream_failed(&inst, e, &incarnation))
            }
        }
    }

    fn release_decode(&mut self) {
        if let Some((inst, _, _)) = self.decode.take() {
            if let Some(at) = self.sent.iter().position(|s| s.open && s.inst.name == inst.name) {
                self.sent.remove(at);
                self.s.workers.abort_soon(&inst, &self.request_id, "finished", true);
            }
        }
    }

    // -- unified ----------------------------------------------------------------------------

    async fn unified_first(&mut self) -> Result<Tokens, ApiError> {
        let body: Bytes =
            protocol::generate_request_json(&self.request_id, &self.prompt, &self.params).into();
        let mut tried: Vec<String> = Vec::new();
        loop {
            let inst = self.s.control.pick(&self.request_id, Role::Unified, &tried).await?;
            self.start(&inst);
            let mut events =
                match self.s.workers.stream(&inst, "unified", worker::GENERATE_PATH, body.clone()).await {
                    Ok(events) => events,
                    Err(CallError::Unreachable(message)) => {
                        self.forget(&inst, &message, &mut tried);
                        continue;
                    }
                    Err(e) => return Err(self.call_failed(&inst, "unified", e)),
                };
            let first = match events.next().await {
                Ok(Some(WorkerEvent::First(first))) => first,
                Ok(Some(WorkerEvent::Error(e))) => return Err(worker_error(e.status, e.message)),
                Ok(Some(_)) => {
                    return Err(failed(format!(
                        "{} sent tokens before FirstToken",
                        worker::describe("unified", &inst)
                    )))
                }
                Ok(None) => {
                    return Err(failed(format!(
                        "{} ended its stream without a finish_reason",
                        worker::describe("unified", &inst)
                    )))
                }
                Err(e) => return Err(self.stream_failed(&inst, e, "")),
            };
            self.s.control.prefilled(&self.request_id, &inst, &first.usage);
            self.usage = Some(first.usage);
            if first.finish_reason.is_some() {
                self.done(&inst);
                self.completed = true;
                drain_soon(events);
            } else {
                self.stage = Stage::Unified(events, inst);
            }
            return Ok(Tokens { token_ids: vec![first.token_id], finish_reason: first.finish_reason });
        }
    }

    async fn unified_next(&mut self, mut events: EventStream, inst: Instance) -> Result<Tokens, ApiError> {
        match events.next().await {
            Ok(Some(WorkerEvent::Tokens(batch))) => {
                if batch.finish_reason.is_some() {
                    self.done(&inst);
                    self.completed = true;
                    drain_soon(events);
                } else {
                    self.stage = Stage::Unified(events, inst);
                }
                Ok(Tokens { token_ids: batch.token_ids, finish_reason: batch.finish_reason })
            }
            Ok(Some(WorkerEvent::Error(e))) => Err(worker_error(e.status, e.message)),
            Ok(Some(WorkerEvent::First(_))) => Err(failed(format!(
                "{} sent a second FirstToken",
                worker::describe("unified", &inst)
            ))),
            Ok(Some(WorkerEvent::Ready(_))) => Err(failed(format!(
                "{} sent a DecodeReady",
                worker::describe("unified", &inst)
            ))),
            Ok(None) => Err(failed(format!(
                "{} ended its stream without a finish_reason",
                worker::describe("unified", &inst)
            ))),
            Err(e) => Err(self.stream_failed(&inst, e, "")),
        }
    }

    // -- bookkeeping --------------------------------------------------------------------------

    fn start(&mut self, inst: &Instance) {
        self.sent.push(Sent { inst: inst.clone(), open: true });
    }

    fn done(&mut self, inst: &Instance) {
        if let Some(sent) = self.sent.iter_mut().find(|s| s.open && s.inst.name == inst.name) {
            sent.open = false;
        }
    }

    /// `inst` refused the connection: it never got the request. The control plane marks
    /// it (and forgets what it counted for it); another one is tried.
    fn forget(&mut self, inst: &Instance, message: &str, tried: &mut Vec<String>) {
        self.s.control.unreachable(&self.request_id, inst, message);
        tried.push(inst.name.clone());
        if let Some(at) = self.sent.iter().rposition(|s| s.inst.name == inst.name) {
            self.sent.remove(at);
        }
    }

    /// A call that failed after connecting (its answer, or its stream).
    fn call_failed(&mut self, inst: &Instance, role: &str, e: CallError) -> ApiError {
        match e {
            CallError::Answered(status, message) => worker_error(status, message),
            CallError::Unreachable(message) | CallError::Failed(message) => {
                let _ = role;
                self.s.control.broken(&self.request_id, inst, &message, "");
                failed(message)
            }
        }
    }

    /// `inst`'s stream broke mid-request (`incarnation`: decode's, when known).
    fn stream_failed(&mut self, inst: &Instance, e: CallError, incarnation: &str) -> ApiError {
        match e {
            CallError::Answered(status, message) => worker_error(status, message),
            CallError::Unreachable(message) | CallError::Failed(message) => {
                self.s.control.broken(&self.request_id, inst, &message, incarnation);
                failed(message)
            }
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // Dropped unfinished: the client left (an error already closed the run).
        self.close("client_disconnected");
    }
}

/// Read a finished stream's rest in the background (bounded), so that its keep-alive
/// connection goes back to the pool instead of being closed.
fn drain_soon(mut events: EventStream) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
                while let Ok(Some(_)) = events.next().await {}
            })
            .await;
        });
    }
}

fn describe_p(inst: &Instance) -> String {
    worker::describe("prefill", inst)
}

/// 502: prefill refused decode's landing (relay.py's message, word for word).
fn landing_refused(prefill: &Instance, status: u16, message: &str) -> ApiError {
    failed(format!("{} refused decode's landing for the request ({status}): {message}", describe_p(prefill)))
}

pub fn api_error(status: u16, message: String, error_type: &str) -> ApiError {
    ApiError { status, message, error_type: error_type.to_string(), code: None, headers: Vec::new() }
}

/// A worker's ErrorEvent: its status and message (router/errors.py WorkerError).
fn worker_error(status: u16, message: String) -> ApiError {
    let error_type = if status < 500 { "invalid_request_error" } else { "server_error" };
    api_error(status, message, error_type)
}

/// 502: a worker dropped the connection, crashed or broke the protocol (WorkerFailed).
fn failed(message: String) -> ApiError {
    api_error(502, message, "server_error")
}

/// Python's `format(x, "g")` for the timeout in messages: 30 -> "30", 0.5 -> "0.5".
fn fmt_g(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

// -- output ---------------------------------------------------------------------------------

/// What to send the client next.
pub struct Delta {
    pub text: String,
    pub finish_reason: Option<String>,
}

/// Monotonic timestamps of one request, for TTFT / ITL / E2E (router/output.py
/// RequestTiming).
pub struct Timing {
    pub arrival: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Inter-token gaps: a batch of k tokens after a gap g adds k entries of g / k.
    gaps: Vec<f64>,
}

impl Timing {
    pub fn new(arrival: Instant) -> Timing {
        Timing { arrival, first_token: None, last_token: None, gaps: Vec::new() }
    }

    fn on_tokens(&mut self, num_tokens: usize) {
        let now = Instant::now();
        if self.first_token.is_none() {
            // The first token starts the clock: the rest of its batch has no gap.
            self.first_token = Some(now);
        } else if let (Some(last), true) = (self.last_token, num_tokens > 0) {
            let gap = now.duration_since(last).as_secs_f64() / num_tokens as f64;
            self.gaps.extend(std::iter::repeat(gap).take(num_tokens));
        }
        self.last_token = Some(now);
    }

    fn since_arrival(&self, t: Option<Instant>) -> Option<f64> {
        t.map(|t| t.duration_since(self.arrival).as_secs_f64())
    }
}

/// A run and its text: worker tokens -> client text deltas, the request's timing, and
/// its end reported to the control plane exactly once (`end`, or 499 when dropped
/// before: the client left).
pub struct Output {
    run: Run,
    text: OutputText,
    timing: Timing,
    ended: bool,
    /// The finish reason of the last delta, once there is one.
    pub finish_reason: Option<String>,
}

impl Output {
    pub fn new(run: Run, text: OutputText, timing: Timing) -> Output {
        Output { run, text, timing, ended: false, finish_reason: None }
    }

    pub fn usage(&self) -> Option<&PromptUsage> {
        self.run.usage.as_ref()
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.run.prompt().len() as u64
    }

    pub fn completion_tokens(&self) -> u64 {
        self.text.num_output_tokens() as u64
    }

    /// The next delta; the last one carries the finish reason (call no more after it).
    pub async fn next(&mut self) -> Result<Delta, ApiError> {
        let tokens = self.run.next().await?;
        self.timing.on_tokens(tokens.token_ids.len());
        let (mut text, by_rules, _taken) = self.text.extend(&tokens.token_ids);
        let mut finish = by_rules;
        match (&finish, tokens.finish_reason) {
            (None, Some(worker)) => {
                // The worker finished for a reason the router's rules did not see (yet):
                // the held-back text is flushed.
                // The flushed text may still complete a stop string: then "stop".
                let reason = if worker == "length" { "length" } else { "stop" };
                let (rest, by_text) = self.text.finish_delta(reason);
                text.push_str(&rest);
                finish = Some(if worker == "stop" || worker == "length" { by_text } else { worker });
            }
            (Some(_), None) => self.run.finish_early(),
            _ => {}
        }
        if finish.is_some() {
            self.finish_reason = finish.clone();
        }
        Ok(Delta { text, finish_reason: finish })
    }

    /// The run is over with `status` for the client: tell the control plane (once).
    pub fn end(&mut self, status: u16) {
        if self.ended {
            return;
        }
        self.ended = true;
        let end = End {
            status,
            prompt_tokens: self.prompt_tokens(),
            completion_tokens: self.completion_tokens(),
            usage: self.run.usage.clone(),
            first_token_s: self.timing.since_arrival(self.timing.first_token),
            last_token_s: self.timing.since_arrival(self.timing.last_token),
            token_gaps_s: std::mem::take(&mut self.timing.gaps),
        };
        self.run.s.control.end(&self.run.request_id, end);
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        self.end(499);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_written_as_python_formats_them() {
        assert_eq!(fmt_g(30.0), "30");
        assert_eq!(fmt_g(0.5), "0.5");
    }

    #[test]
    fn a_batch_after_a_gap_adds_one_gap_share_per_token() {
        let mut t = Timing::new(Instant::now());
        t.on_tokens(1);
        assert!(t.gaps.is_empty());
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.on_tokens(4);
        assert_eq!(t.gaps.len(), 4);
        assert!(t.gaps.iter().all(|g| *g > 0.0 && (*g - t.gaps[0]).abs() < 1e-12));
    }
}
