//! Addresses written in tests, and a plain HTTP GET for the endpoints tests read
//! (`/metrics`, `/readyz`) without another dependency.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// An address written in a test.
pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap_or_else(|e| panic!("test address {s:?}: {e}"))
}

/// `ip:port` socket address.
pub fn sa(ip_text: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip(ip_text), port)
}

/// GET `path` from `host` (`address:port`) over plain HTTP/1.1: (status code, body), the
/// code 0 when the answer has none. None when nothing accepts the connection. The answer
/// is read for 30 s at most (what came by then is returned).
pub async fn http_get(host: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(host).await.ok()?;
    let _ = s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes()).await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((code, body))
}

/// GET `path` on a local port (`127.0.0.1:<port>`): see [`http_get`].
pub async fn local_get(port: u16, path: &str) -> Option<(u16, String)> {
    http_get(&format!("127.0.0.1:{port}"), path).await
}
