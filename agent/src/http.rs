//! The agent's plain-HTTP endpoints — `/healthz` and `/livez` (10256), `/metrics`, and the
//! per-Service health-check node ports that external load balancers probe — served by
//! [`clusterip_serve`], the controller's server: hyper, with the same limits on what one
//! client may hold (per-source and total connection caps, idle connections closed to make
//! room, header and idle timeouts, accept back-off; [`limits`]).
//!
//! A handler answers a path (GET and HEAD only) from memory; it never waits.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clusterip_serve::{Limits, Server};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, StatusCode};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// An HTTP response.
#[derive(Debug, Clone)]
pub struct Response {
    pub code: u16,
    pub content_type: &'static str,
    pub body: String,
    /// Extra response headers.
    pub headers: Vec<(&'static str, String)>,
}

impl Response {
    pub fn new(code: u16, content_type: &'static str, body: impl Into<String>) -> Self {
        Response { code, content_type, body: body.into(), headers: vec![] }
    }
}

/// Handler: request path → response.
pub type Handler = Arc<dyn Fn(&str) -> Response + Send + Sync>;

/// What one client may hold on the agent's ports: load balancers and probes open few
/// connections (one per check), so a source holding more than a few is not one of them.
pub fn limits() -> Limits {
    Limits {
        read_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        max_connections: 256,
        max_unauthenticated_per_source: 16,
        ..Limits::default()
    }
}

/// The hyper response for `req`, from `handler`.
fn answer(handler: &Handler, req: &Request<Incoming>) -> hyper::Response<Full<Bytes>> {
    let head = req.method() == Method::HEAD;
    let resp = if req.method() == Method::GET || head {
        handler(req.uri().path())
    } else {
        Response::new(405, "text/plain", "method not allowed\n")
    };
    let mut builder = hyper::Response::builder()
        .status(StatusCode::from_u16(resp.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(hyper::header::CONTENT_TYPE, resp.content_type)
        .header("X-Content-Type-Options", "nosniff");
    for (k, v) in &resp.headers {
        builder = builder.header(*k, v.as_str());
    }
    // (HEAD: hyper sends the length of the body it would have sent, and no body.)
    let body = if head { Bytes::new() } else { Bytes::from(resp.body) };
    builder.body(Full::new(body)).unwrap_or_else(|_| {
        let mut r = hyper::Response::new(Full::new(Bytes::from_static(b"bad response header\n")));
        *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        r
    })
}

/// Bind `addr` and serve in the background for as long as the process runs; returns the
/// bound address.
pub async fn serve(name: &'static str, addr: &str, handler: Handler) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let (keep, stop) = watch::channel(false);
    tokio::spawn(async move {
        serve_listener(name, listener, handler, stop).await;
        drop(keep);
    });
    Ok(local)
}

/// Serve on an already bound listener (made in another network namespace, say) until `stop`
/// turns true or its sender is dropped; then the listener closes and open connections end
/// after the request in flight.
pub async fn serve_listener(name: &'static str, listener: TcpListener, handler: Handler, stop: watch::Receiver<bool>) {
    let handler = move |req: Request<Incoming>| {
        let r = answer(&handler, &req);
        async move { r }
    };
    let server = Server { name, tls: None, limits: limits(), handler, on_refusal: None };
    clusterip_serve::serve(listener, server, stop, Duration::ZERO).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn raw(addr: SocketAddr, request: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(request.as_bytes()).await.expect("write");
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn answers_get_and_head_refuses_other_methods_and_sends_extra_headers() {
        let handler: Handler = Arc::new(|path| {
            let mut r = Response::new(if path == "/ok" { 200 } else { 404 }, "application/json", "{\"a\":1}");
            r.headers.push(("X-Load-Balancing-Endpoint-Weight", "3".into()));
            r
        });
        let addr = serve("test", "127.0.0.1:0", handler).await.expect("bind");
        let get = raw(addr, "GET /ok?x=1 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await;
        assert!(get.starts_with("HTTP/1.1 200 OK"), "{get}");
        assert!(get.contains("content-type: application/json") && get.contains("x-load-balancing-endpoint-weight: 3"), "{get}");
        assert!(get.ends_with("{\"a\":1}"), "{get}");
        let head = raw(addr, "HEAD /ok HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await;
        assert!(head.starts_with("HTTP/1.1 200 OK") && !head.contains("{\"a\":1}"), "{head}");
        let post = raw(addr, "POST /ok HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let missing = raw(addr, "GET /nope HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    }

    #[tokio::test]
    async fn a_stopped_server_closes_its_listener() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = watch::channel(false);
        let handler: Handler = Arc::new(|_| Response::new(200, "text/plain", "ok"));
        let task = tokio::spawn(serve_listener("test", listener, handler, rx));
        assert!(raw(addr, "GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await.starts_with("HTTP/1.1 200"));
        drop(tx);
        tokio::time::timeout(Duration::from_secs(10), task).await.expect("serve returned").expect("no panic");
        assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "the port still accepts after stop");
    }
}
