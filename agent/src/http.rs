//! A minimal HTTP/1.1 server for `/healthz`, `/livez` and `/metrics` (GET only, one
//! request per connection): enough for probes and Prometheus, with no framework.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

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

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// Bind `addr` and serve in the background; returns the bound address.
pub async fn serve(addr: &str, handler: Handler) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(serve_listener(listener, handler));
    Ok(local)
}

/// Serve on an already bound listener (made in another network namespace, say), forever:
/// spawn it, and abort the task to stop.
pub async fn serve_listener(listener: TcpListener, handler: Handler) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else { continue };
        let handler = handler.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut len = 0;
            // Read the request head (bounded in size and time).
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while len < buf.len() {
                    match sock.read(&mut buf[len..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            len += n;
                            if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                                break;
                            }
                        }
                    }
                }
            })
            .await;
            if read.is_err() {
                return;
            }
            let head = String::from_utf8_lossy(&buf[..len]);
            let mut parts = head.lines().next().unwrap_or("").split_whitespace();
            let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
            let path = target.split('?').next().unwrap_or("/");
            let resp = if method == "GET" || method == "HEAD" {
                handler(path)
            } else {
                Response::new(405, "text/plain", "method not allowed\n")
            };
            let body = if method == "HEAD" { "" } else { resp.body.as_str() };
            let extra: String = resp.headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
            let out = format!(
                "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nX-Content-Type-Options: nosniff\r\n{}Content-Length: {}\r\nConnection: close\r\n\r\n{}",
                resp.code,
                reason(resp.code),
                resp.content_type,
                extra,
                resp.body.len(),
                body
            );
            let _ = sock.write_all(out.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
