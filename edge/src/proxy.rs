//! Requests the edge does not serve natively, passed to the Python router unchanged.
//!
//! Method, path and query, headers (less the hop-by-hop ones, which belong to each
//! connection) and the body go to the router's internal listener; its answer comes back
//! as it is sent: status, headers, and the body streamed (SSE included) with no
//! buffering. A client that leaves drops the answer's body, which closes the upstream
//! request, so the router sees its client leave as it would without the edge.

use std::time::Duration;

use hyper::client::HttpConnector;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::http::uri::PathAndQuery;
use hyper::{Body, Client, Request, Response, StatusCode, Uri};

/// Headers that describe one connection, not the message (RFC 9110 7.6.1), plus the
/// pre-standard `proxy-connection` and `keep-alive`.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// The pooled client to the Python router.
pub struct Proxy {
    client: Client<HttpConnector, Body>,
    /// scheme://host:port of the router's internal listener.
    base: String,
}

impl Proxy {
    pub fn new(python_url: &str) -> Result<Proxy, String> {
        let base = python_url.trim_end_matches('/').to_string();
        let parsed: Uri = base.parse().map_err(|e| format!("python_url {python_url:?}: {e}"))?;
        if parsed.scheme_str() != Some("http") || parsed.authority().is_none() {
            return Err(format!("python_url {python_url:?}: an http://host:port URL is needed"));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let client = Client::builder()
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(usize::MAX)
            .build(connector);
        Ok(Proxy { client, base })
    }

    /// Forward `req` (its body replaced by `body` when given: bytes the edge already read)
    /// and return the router's answer, its body streamed through.
    pub async fn forward(&self, req: Request<Body>, body: Option<Body>) -> Response<Body> {
        let (mut parts, original) = req.into_parts();
        let body = body.unwrap_or(original);
        let target = parts.uri.path_and_query().map(PathAndQuery::as_str).unwrap_or("/");
        let uri: Uri = match format!("{}{}", self.base, target).parse() {
            Ok(uri) => uri,
            Err(_) => return plain(StatusCode::BAD_REQUEST, "invalid request target"),
        };
        strip_hop_by_hop(&mut parts.headers);
        let mut upstream = Request::new(body);
        *upstream.method_mut() = parts.method;
        *upstream.uri_mut() = uri;
        *upstream.headers_mut() = parts.headers;
        match self.client.request(upstream).await {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, body)
            }
            Err(e) => {
                eprintln!("kvserve-edge: proxying to {} failed: {e}", self.base);
                bad_gateway(&format!("the router's control plane did not answer: {e}"))
            }
        }
    }
}

/// Remove the headers of one hop, and the ones the `connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

fn plain(status: StatusCode, message: &str) -> Response<Body> {
    let mut resp = Response::new(Body::from(crate::openai::error_body(
        message,
        "invalid_request_error",
        None,
        None,
    )));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The router itself could not be reached: the client gets OpenAI's error shape.
fn bad_gateway(message: &str) -> Response<Body> {
    let mut resp = Response::new(Body::from(crate::openai::error_body(
        message,
        "server_error",
        None,
        None,
    )));
    *resp.status_mut() = StatusCode::BAD_GATEWAY;
    resp.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_removed() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive, x-private"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        h.insert("x-session-id", HeaderValue::from_static("s"));
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "x-session-id"]);
    }

    #[test]
    fn python_url_must_be_http() {
        assert!(Proxy::new("http://127.0.0.1:9000/").is_ok());
        assert!(Proxy::new("unix:/tmp/x").is_err());
    }
}
