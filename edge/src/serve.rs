//! The client-facing HTTP server: auth, body limit, dispatch (router/serving.py and
//! router/generation_cycle.py, compiled).
//!
//!     POST /v1/completions, /v1/chat/completions (no query), authorized, body within
//!     max_body_bytes, accepted by `openai::parse`, tokenized, `openai::finalize`d
//!         -> served here: the control plane opens it, relay.rs runs it, the answer is
//!            an SSE stream or one JSON body
//!     everything else, exactly as it came -> the Python router (proxy.rs)
//!
//! The first delta is awaited before the response's status is sent, so a failure before
//! any token is a real HTTP status; later failures are an SSE error event. A client that
//! leaves drops the response (or the handler's future): the run's Drop aborts its
//! workers and the control plane hears 499.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::stream::{self, StreamExt};
use hyper::body::HttpBody;
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::AddrIncoming;
use hyper::service::{make_service_fn, service_fn};
use hyper::{Body, Method, Request, Response, Server, StatusCode};

use crate::chat::ChatTemplate;
use crate::config::EdgeConfig;
use crate::control::{ApiError, Control, Open};
use crate::detok::OutputText;
use crate::openai::{self, Endpoint, Formatter, GenRequest, Limits, Prompt, Usage};
use crate::proxy::Proxy;
use crate::relay::{Output, Run, Services, Timing};
use crate::tokenizer::Tokenizer;
use crate::worker::Workers;

/// How long the control socket may take to appear (the Python router starts it first).
const CONTROL_CONNECT_S: f64 = 10.0;
/// A prompt this long is tokenized off the runtime's event loop (`off_the_loop`; the
/// router's _THREAD_TOKENIZE_CHARS).
const LONG_PROMPT_BYTES: usize = 16 * 1024;
/// How often the control connection is checked.
const CONTROL_PING_MS: u64 = 500;
/// After SIGTERM / SIGINT: how long in-flight requests may take to finish.
const DRAIN_S: u64 = 5;
/// The request line and headers must arrive within this (router/http_limits.py's
/// header_timeout_s default).
const HEADER_TIMEOUT_S: u64 = 10;

/// `kvserve-edge serve --config FILE`.
pub fn main(args: &[String]) -> i32 {
    let path = match args {
        [flag, path] if flag == "--config" => PathBuf::from(path),
        _ => {
            eprintln!("usage: kvserve-edge serve --config FILE");
            return 2;
        }
    };
    let config = match EdgeConfig::load(&path) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("kvserve-edge: {e}");
            return 2;
        }
    };
    let limits = match read_limits(&path, &config) {
        Ok(limits) => limits,
        Err(e) => {
            eprintln!("kvserve-edge: {e}");
            return 2;
        }
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if config.worker_threads > 0 {
        builder.worker_threads(config.worker_threads);
    }
    let runtime = match builder.build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("kvserve-edge: starting the runtime: {e}");
            return 1;
        }
    };
    let code = runtime.block_on(run(config, limits));
    // In-flight work past the drain time is dropped, not waited for.
    runtime.shutdown_timeout(Duration::from_millis(200));
    code
}

/// What every request handler shares (built once).
struct Edge {
    config: EdgeConfig,
    /// The router's length and vocabulary limits (`openai::finalize_with`).
    limits: Limits,
    /// None: the tokenizer's form is not one the edge implements; nothing is served
    /// natively.
    tokenizer: Option<Arc<Tokenizer>>,
    chat: Option<ChatTemplate>,
    services: Arc<Services>,
    proxy: Proxy,
    api_key: Option<Vec<u8>>,
    session_headers: Vec<HeaderName>,
}

/// The router's limits, from the config file's optional fields (router/edge.py writes
/// max_input_tokens and max_output_tokens; vocab_size when it knows it).
fn read_limits(path: &std::path::Path, config: &EdgeConfig) -> Result<Limits, String> {
    #[derive(serde::Deserialize)]
    struct Optional {
        #[serde(default)]
        max_input_tokens: Option<usize>,
        #[serde(default)]
        max_output_tokens: Option<u64>,
        #[serde(default)]
        vocab_size: Option<u32>,
    }
    let raw = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let o: Optional = serde_json::from_slice(&raw).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Limits {
        context_len: config.max_model_len,
        max_input_tokens: o.max_input_tokens.filter(|&n| n > 0),
        max_output_tokens: o.max_output_tokens,
        vocab_size: o.vocab_size,
    })
}

async fn run(config: EdgeConfig, limits: Limits) -> i32 {
    match start(config, limits).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvserve-edge: {e}");
            1
        }
    }
}

async fn start(config: EdgeConfig, limits: Limits) -> Result<i32, String> {
    let tokenizer = match Tokenizer::from_file(&config.tokenizer_path) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            eprintln!("kvserve-edge: the tokenizer is not served natively ({e}): every request is proxied");
            None
        }
    };
    let chat = match &config.chat_template_path {
        Some(path) => match ChatTemplate::from_file(path) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("kvserve-edge: chat requests are proxied: {e}");
                None
            }
        },
        None => None,
    };
    let control = connect_control(&config).await?;
    let workers = Workers::new(EdgeConfig::cluster_secret().as_deref())?;
    let services = Arc::new(Services {
        topology: control.topology(),
        control: control.clone(),
        workers,
        request_timeout_s: config.request_timeout_s,
    });
    let proxy = Proxy::new(&config.python_url)?;
    let session_headers = config
        .session_headers
        .iter()
        .filter_map(|name| HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).ok())
        .collect();
    let api_key = config.api_key.as_ref().map(|k| k.as_bytes().to_vec());
    let edge = Arc::new(Edge { config, limits, tokenizer, chat, services, proxy, api_key, session_headers });

    let incoming = listen(&edge.config).await?;
    let make = make_service_fn(move |_conn| {
        let edge = edge.clone();
        async move { Ok::<_, Infallible>(service_fn(move |req| handle(edge.clone(), req))) }
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = Server::builder(incoming)
        .http1_keepalive(true)
        .http1_header_read_timeout(Duration::from_secs(HEADER_TIMEOUT_S))
        .serve(make)
        .with_graceful_shutdown(async {
            let _ = stop_rx.await;
        });
    let mut server = tokio::spawn(server);
    let control_gone = control_closed(control);
    tokio::select! {
        () = shutdown_signal() => {
            let _ = stop_tx.send(());
            // Stop accepting; in-flight requests get DRAIN_S to finish.
            let _ = tokio::time::timeout(Duration::from_secs(DRAIN_S), &mut server).await;
            Ok(0)
        }
        () = control_gone => {
            eprintln!("kvserve-edge: the control socket closed: exiting");
            Ok(3)
        }
        res = &mut server => match res {
            Ok(Ok(())) => Ok(0),
            Ok(Err(e)) => Err(format!("server: {e}")),
            Err(e) => Err(format!("server task: {e}")),
        },
    }
}

/// Connect the control socket, retrying while it is not there yet.
async fn connect_control(config: &EdgeConfig) -> Result<Arc<Control>, String> {
    let started = Instant::now();
    let limit = Duration::from_secs_f64(CONTROL_CONNECT_S);
    loop {
        // Bounded as a whole: a socket that accepts but never says hello is a failure too.
        let left = limit.saturating_sub(started.elapsed());
        let error = match tokio::time::timeout(left, Control::connect(&config.control_socket)).await {
            Ok(Ok(control)) => return Ok(control),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no hello from the control plane".to_string(),
        };
        if started.elapsed() >= limit {
            return Err(format!("control socket {}: {error}", config.control_socket.display()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Resolves when the control connection is gone: a ping fails once the socket broke
/// (then every ask would fail too; the Python router restarts the edge).
async fn control_closed(control: Arc<Control>) {
    loop {
        tokio::time::sleep(Duration::from_millis(CONTROL_PING_MS)).await;
        if control.ping().await.is_err() {
            return;
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Bind listen_host:listen_port (SO_REUSEADDR, TCP_NODELAY on every connection) and say
/// so on stdout: the Python parent waits for that line.
async fn listen(config: &EdgeConfig) -> Result<AddrIncoming, String> {
    let where_ = format!("{}:{}", config.listen_host, config.listen_port);
    let addr: SocketAddr = tokio::net::lookup_host((config.listen_host.as_str(), config.listen_port))
        .await
        .map_err(|e| format!("{where_}: {e}"))?
        .next()
        .ok_or_else(|| format!("{where_}: no address"))?;
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }
        .map_err(|e| format!("{where_}: {e}"))?;
    socket.set_reuseaddr(true).map_err(|e| format!("{where_}: {e}"))?;
    socket.bind(addr).map_err(|e| format!("binding {where_}: {e}"))?;
    let listener = socket.listen(1024).map_err(|e| format!("listening on {where_}: {e}"))?;
    let mut incoming = AddrIncoming::from_listener(listener).map_err(|e| format!("{where_}: {e}"))?;
    incoming.set_nodelay(true);
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "kvserve-edge listening on {where_}");
    let _ = out.flush();
    Ok(incoming)
}

async fn handle(edge: Arc<Edge>, req: Request<Body>) -> Result<Response<Body>, Infallible> {
    if req.method() == Method::POST && req.uri().query().is_none() {
        let endpoint = match req.uri().path() {
            "/v1/completions" => Some(Endpoint::Completion),
            "/v1/chat/completions" => Some(Endpoint::Chat),
            _ => None,
        };
        if let Some(endpoint) = endpoint {
            if edge.tokenizer.is_some() {
                return Ok(edge.generation(req, endpoint).await);
            }
        }
    }
    Ok(edge.proxy.forward(req, None).await)
}

impl Edge {
    async fn generation(&self, req: Request<Body>, endpoint: Endpoint) -> Response<Body> {
        let arrival = Instant::now();
        if !self.authorized(req.headers()) {
            return self.proxy.forward(req, None).await; // the router's 401, exactly
        }
        let (parts, body) = req.into_parts();
        let body = match self.read_body(&parts.headers, body).await {
            BodyRead::Whole(body) => body,
            BodyRead::TooLarge(body) => {
                // The router answers 413 (and closes) as it does without an edge.
                return self.proxy.forward(Request::from_parts(parts, Body::empty()), Some(body)).await;
            }
            BodyRead::Gone => return empty(StatusCode::BAD_REQUEST),
        };
        let prepared = self.prepare(endpoint, &body, &parts.headers);
        let Some((gen, prompt, session)) = prepared else {
            return self.proxy.forward(Request::from_parts(parts, Body::empty()), Some(Body::from(body))).await;
        };
        self.serve(gen, prompt, session, arrival).await
    }

    /// The client's API key, compared in constant time (serving.py check_auth). A wrong
    /// or missing key is the Python router's to answer.
    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(key) = &self.api_key else { return true };
        let header = headers.get(hyper::header::AUTHORIZATION).map(HeaderValue::as_bytes).unwrap_or(b"");
        let (scheme, token) = match header.iter().position(|&b| b == b' ') {
            Some(at) => (&header[..at], &header[at + 1..]),
            None => (header, &b""[..]),
        };
        let token = trim_ascii(token);
        // Both checks run: a key must not leak through how fast a wrong guess is refused.
        // A value beyond ASCII is the router's to judge (it reads headers as latin-1).
        let scheme_ok = scheme.eq_ignore_ascii_case(b"bearer") & header.is_ascii();
        constant_time_eq(token, key) & scheme_ok
    }

    /// The body, up to max_body_bytes; a larger one (declared or sent) is passed on to
    /// the router whole, the part already read first, the rest streamed.
    async fn read_body(&self, headers: &HeaderMap, mut body: Body) -> BodyRead {
        let max = self.config.max_body_bytes;
        let declared = headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.map_or(false, |n| n > max as u64) {
            return BodyRead::TooLarge(body);
        }
        let mut buf = BytesMut::with_capacity(declared.unwrap_or(0).min(max as u64) as usize);
        while let Some(chunk) = body.data().await {
            let Ok(chunk) = chunk else { return BodyRead::Gone };
            if buf.len() + chunk.len() > max {
                let head: Result<Bytes, hyper::Error> = Ok(buf.freeze());
                let next: Result<Bytes, hyper::Error> = Ok(chunk);
                let rest = stream::iter([head, next]).chain(body);
                return BodyRead::TooLarge(Body::wrap_stream(rest));
            }
            if buf.is_empty() && body.is_end_stream() {
                return BodyRead::Whole(chunk); // one chunk: no copy
            }
            buf.extend_from_slice(&chunk);
        }
        BodyRead::Whole(buf.freeze())
    }

    /// The request as the native path serves it: parsed, its prompt tokenized, the
    /// router's length rules applied, its session named. None: not one the edge serves
    /// (the router answers it, invalid ones included).
    fn prepare(&self, endpoint: Endpoint, body: &[u8], headers: &HeaderMap) -> Option<(GenRequest, Vec<u32>, Option<String>)> {
        let tokenizer = self.tokenizer.as_ref()?;
        // The router answers 415 to a body that is not JSON by its content-type.
        let content_type = headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes);
        if !openai::is_json_content_type(content_type) {
            return None;
        }
        let mut gen = openai::parse(endpoint, body, &self.config.served_model_names)?;
        let prompt = match &gen.prompt {
            Prompt::Text(text) => off_the_loop(text.len(), || tokenizer.try_encode(text, true)).ok()?,
            Prompt::TokenIds(ids) => {
                // An id outside the vocabulary is the router's 400 to write.
                if ids.iter().any(|&id| tokenizer.token_bytes(id).is_none()) {
                    return None;
                }
                ids.clone()
            }
            Prompt::Messages(messages) => {
                let text = self.chat.as_ref()?.render(messages, gen.add_generation_prompt)?;
                off_the_loop(text.len(), || tokenizer.try_encode(&text, false)).ok()?
            }
        };
        if !openai::finalize_with(&mut gen, prompt.len(), &self.limits) {
            return None;
        }
        let session = self.session_of(headers, gen.user.as_deref());
        Some((gen, prompt, session))
    }

    /// The first of session_headers the request carries non-empty (each header's first
    /// occurrence), else `user` (serving.py session_of; values read as latin-1).
    fn session_of(&self, headers: &HeaderMap, user: Option<&str>) -> Option<String> {
        for name in &self.session_headers {
            if let Some(value) = headers.get(name) {
                if !value.is_empty() {
                    return Some(value.as_bytes().iter().map(|&b| b as char).collect());
                }
            }
        }
        user.map(str::to_string)
    }

    /// Run the request and answer it.
    async fn serve(&self, gen: GenRequest, prompt: Vec<u32>, session: Option<String>, arrival: Instant) -> Response<Body> {
        let Some(tokenizer) = self.tokenizer.clone() else {
            return empty(StatusCode::INTERNAL_SERVER_ERROR); // `prepare` served nothing
        };
        let request_id = openai::new_request_id(gen.endpoint);
        let s = &self.services;
        let opened = s
            .control
            .open(Open {
                request_id: &request_id,
                prompt_token_ids: &prompt,
                max_tokens: gen.params.max_tokens as u64,
                user: gen.user.as_deref(),
                session: session.as_deref(),
                endpoint: gen.endpoint.name(),
            })
            .await;
        if let Err(e) = opened {
            return error_response(&e); // not opened: no `end` owed
        }
        let text = OutputText::new(
            tokenizer,
            &gen.params,
            &self.config.eos_token_ids,
            &prompt,
            gen.skip_special_tokens,
        );
        let created = openai::created_now();
        let fmt = Formatter::new(gen.endpoint, &request_id, created, &gen.model, gen.include_usage);
        let run = Run::new(s.clone(), request_id, prompt, gen.params);
        let mut out = Output::new(run, text, Timing::new(arrival));
        let first = match out.next().await {
            Ok(first) => first,
            Err(e) => {
                out.end(e.status);
                return error_response(&e);
            }
        };
        if gen.stream {
            stream_response(Streaming { out, fmt, first: Some(first), done: false })
        } else {
            whole_response(out, fmt, first).await
        }
    }
}

enum BodyRead {
    Whole(Bytes),
    /// Larger than max_body_bytes: the whole body to pass on.
    TooLarge(Body),
    /// The client left (or broke the body) before its end.
    Gone,
}

/// `work` on the current thread; for a long text (`size` bytes) with the runtime told
/// first, so that the other tasks of this worker thread move to another one meanwhile
/// (router/preprocess.py tokenizes long prompts in a thread for the same reason).
fn off_the_loop<T>(size: usize, work: impl FnOnce() -> T) -> T {
    if size >= LONG_PROMPT_BYTES {
        tokio::task::block_in_place(work)
    } else {
        work()
    }
}

/// `bytes` without ASCII whitespace at either end (str.strip for the ASCII a header holds).
fn trim_ascii(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(bytes.len());
    let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(start, |i| i + 1);
    &bytes[start..end]
}

/// Equal bytes, in a time that depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() != b.len()) as u8;
    for (i, &x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(!x);
    }
    diff == 0
}

/// A non-streamed answer: every delta to the finish, then one JSON body.
async fn whole_response(mut out: Output, fmt: Formatter, first: crate::relay::Delta) -> Response<Body> {
    let mut text = first.text;
    let mut finish = first.finish_reason;
    while finish.is_none() {
        match out.next().await {
            Ok(delta) => {
                text.push_str(&delta.text);
                finish = delta.finish_reason;
            }
            Err(e) => {
                out.end(e.status);
                return error_response(&e);
            }
        }
    }
    let usage = usage_of(&out);
    let body = fmt.full(&text, finish.as_deref().unwrap_or("stop"), &usage);
    out.end(200);
    json_response(StatusCode::OK, body, &[])
}

fn usage_of(out: &Output) -> Usage {
    Usage { prompt_tokens: out.prompt_tokens(), completion_tokens: out.completion_tokens(), details: out.usage().copied() }
}

/// A streamed answer's state: the body yields one write per delta (the worker's batch).
struct Streaming {
    out: Output,
    fmt: Formatter,
    first: Option<crate::relay::Delta>,
    done: bool,
}

impl Streaming {
    /// The next write of the body; None after [DONE].
    async fn next_chunk(&mut self) -> Option<Vec<u8>> {
        if self.done {
            return None;
        }
        let delta = match self.first.take() {
            Some(first) => first,
            None => match self.out.next().await {
                Ok(delta) => delta,
                Err(e) => {
                    self.done = true;
                    self.out.end(e.status);
                    return Some(openai::error_event(&e.message, &e.error_type, e.code.as_deref()));
                }
            },
        };
        let mut chunk = self.fmt.chunk(&delta.text, delta.finish_reason.as_deref());
        if delta.finish_reason.is_some() {
            self.done = true;
            // The last chunk, the usage and DONE: one write, as the router's.
            chunk.extend_from_slice(&self.fmt.stream_end(&usage_of(&self.out)));
            self.out.end(200);
        }
        Some(chunk)
    }
}

fn stream_response(state: Streaming) -> Response<Body> {
    let body = stream::unfold(state, |mut state| async move {
        loop {
            let chunk = state.next_chunk().await?;
            if !chunk.is_empty() {
                return Some((Ok::<_, Infallible>(Bytes::from(chunk)), state));
            }
        }
    });
    let mut resp = Response::new(Body::wrap_stream(body));
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    headers.insert(hyper::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

fn json_response(status: StatusCode, body: Vec<u8>, extra: &[(String, String)]) -> Response<Body> {
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    for (name, value) in extra {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
            headers.insert(name, value);
        }
    }
    resp
}

/// An APIError before the response started: its status, OpenAI's error body, its headers.
fn error_response(e: &ApiError) -> Response<Body> {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = openai::error_body(&e.message, &e.error_type, None, e.code.as_deref());
    json_response(status, body, &e.headers)
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = status;
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_are_stripped_of_ascii_whitespace() {
        assert_eq!(trim_ascii(b"  key \t"), b"key");
        assert_eq!(trim_ascii(b"   "), b"");
        assert_eq!(trim_ascii(b""), b"");
    }

    #[test]
    fn keys_compare_equal_only_when_equal() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"k"));
        assert!(constant_time_eq(b"", b""));
    }
}
