//! HTTP serving for clients that may misbehave: the accept loop and connection handling
//! shared by the controller's admission webhook (HTTPS), its metrics and health-probe
//! endpoints, and the node agent's healthz, metrics and health-check node ports (plain HTTP).
//!
//! What a client cannot do here, and what it gets instead:
//! - hold a connection open without finishing the TLS handshake: closed after
//!   [`Limits::read_timeout`];
//! - send request headers slowly (slow loris): HTTP/1.1 connections are closed when a
//!   request's headers take longer than `read_timeout` (hyper's header read timeout, which
//!   also closes a keep-alive connection idle that long); an HTTP/2 connection without a
//!   request in flight is closed (GOAWAY) after `read_timeout` before its first request
//!   and after [`Limits::idle_timeout`] later;
//! - send a body slowly: the handler bounds its own body read (the webhook answers 408);
//! - hold many connections: a source address may run at most
//!   [`Limits::max_unauthenticated_per_source`] TLS handshakes at once, further connections
//!   wait for a turn (closed when none came within `read_timeout`), and on a plain-HTTP
//!   server it may hold at most that many connections, further ones closed at once; at
//!   [`Limits::max_connections`] an idle connection (no request
//!   in flight; unauthenticated first, from the source holding the most) is closed to make
//!   room for the newcomer ([`book`]), and only when every connection has a request in
//!   flight do new ones wait in the kernel's backlog. So idle or half-open connections,
//!   however many, never keep the kubelet's probe or the kube-apiserver out;
//! - send many requests at once: HTTP/2 streams per connection are capped at
//!   [`Limits::max_streams`], header blocks at [`Limits::max_header_bytes`];
//! - make accept() fail (EMFILE, ENFILE, ENOBUFS): the error is logged and the loop backs
//!   off (10 ms doubling to 1 s) instead of spinning.
//!
//! Stopping: once the `stop` channel turns true the listener is closed (new connections are
//! refused), every connection is asked to finish (HTTP/1.1: after the request in flight;
//! HTTP/2: GOAWAY, open streams complete), and [`serve`] returns when all are done or
//! `drain_timeout` has passed, whichever is first; what is left is dropped.

mod book;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};
use book::{Admission, Book, Slot};

/// `m.lock()`, through a poisoned lock (every state behind these locks is consistent between
/// statements, so the next holder goes on with it).
fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What one client may hold and for how long.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The TLS handshake, a request's headers, a request's body (read by the handler), and
    /// the wait for a connection's first request: each must finish within this.
    pub read_timeout: Duration,
    /// A connection with no request in flight for this long (after its first request) is
    /// closed.
    pub idle_timeout: Duration,
    /// Connections served at once; at the cap an idle one is closed for a newcomer (module
    /// docs), and only when none is idle do newcomers wait in the kernel's accept queue.
    pub max_connections: usize,
    /// TLS handshakes one source address may run at once (more connections wait for a turn,
    /// at most `read_timeout`); on a plain-HTTP server, the connections it may hold (more are
    /// closed at once).
    pub max_unauthenticated_per_source: usize,
    /// HTTP/2 streams (requests) in flight on one connection.
    pub max_streams: u32,
    /// Largest request header block (HTTP/1.1 read buffer, HTTP/2 header list).
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            read_timeout: Duration::from_secs(10),
            // Longer than the kube-apiserver's idle connection timeout (90 s), so the client
            // normally closes first.
            idle_timeout: Duration::from_secs(120),
            max_connections: 1024,
            max_unauthenticated_per_source: 64,
            max_streams: 250,
            max_header_bytes: 64 * 1024,
        }
    }
}

/// What to do with each request: an answer, never an error (the handler turns every
/// failure into a response).
pub trait Handler: Clone + Send + Sync + 'static {
    fn call(self, req: Request<Incoming>) -> impl Future<Output = Response<Full<Bytes>>> + Send + 'static;
}

impl<F, Fut> Handler for F
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    fn call(self, req: Request<Incoming>) -> impl Future<Output = Response<Full<Bytes>>> + Send + 'static {
        self(req)
    }
}

/// Why a connection was closed before it carried a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The client sent no certificate, or one that does not verify against the client CA
    /// or is not for an allowed name.
    ClientCertificate,
    /// Any other TLS handshake failure (not TLS at all, no common protocol version, ...).
    Handshake,
    /// The handshake did not finish within the read timeout.
    HandshakeTimeout,
    /// Its source already held as many unauthenticated connections as it may (plain HTTP),
    /// or ran as many handshakes for all of `read_timeout` (TLS).
    SourceLimit,
    /// Closed without a request in flight to make room for a newcomer at the connection cap.
    Evicted,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::ClientCertificate => "client_certificate",
            Refusal::Handshake => "tls_handshake",
            Refusal::HandshakeTimeout => "handshake_timeout",
            Refusal::SourceLimit => "source_limit",
            Refusal::Evicted => "evicted",
        }
    }
}

/// Where closed connections are counted (metrics), called once per [`Refusal`].
pub type OnRefusal = Arc<dyn Fn(Refusal) + Send + Sync>;

/// One HTTP server: plain or TLS, and what it is called in logs.
pub struct Server<H> {
    pub name: &'static str,
    /// HTTPS with this acceptor, which must demand a client certificate: a connection whose
    /// handshake finished counts as authenticated ([`Limits::max_unauthenticated_per_source`]).
    pub tls: Option<TlsAcceptor>,
    pub limits: Limits,
    pub handler: H,
    pub on_refusal: Option<OnRefusal>,
}

/// A warning printed at most once per interval, saying how many were held back.
struct Throttled {
    last: Mutex<Option<Instant>>,
    held: AtomicU64,
    every: Duration,
}

impl Throttled {
    fn new(every: Duration) -> Self {
        Self { last: Mutex::new(None), held: AtomicU64::new(0), every }
    }

    /// Whether to log now, and how many were held back since the last time.
    fn due(&self) -> Option<u64> {
        let mut last = lock(&self.last);
        if last.is_some_and(|t| t.elapsed() < self.every) {
            self.held.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(Instant::now());
        Some(self.held.swap(0, Ordering::Relaxed))
    }
}

/// Accept-failure back-off: 10 ms, doubling, at most 1 s; reset by a successful accept.
fn next_backoff(prev: Duration) -> Duration {
    (prev * 2).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Serve until `stop` turns true, then drain for at most `drain_timeout` (module docs).
pub async fn serve<H: Handler>(listener: TcpListener, server: Server<H>, mut stop: watch::Receiver<bool>, drain_timeout: Duration) {
    let server = Arc::new(server);
    let book = Book::new(server.limits.max_connections, server.limits.max_unauthenticated_per_source, server.tls.is_some());
    let full = Throttled::new(Duration::from_secs(10));
    let refused = Arc::new(Throttled::new(Duration::from_secs(10)));
    let mut backoff = Duration::ZERO;
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, server = server.name, "serving");
    }
    'accept: loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped(&mut stop) => break,
        };
        let (tcp, peer) = match accepted {
            Ok(c) => {
                backoff = Duration::ZERO;
                c
            }
            Err(e) => {
                // EMFILE and friends fail again at once while the condition lasts: wait.
                backoff = next_backoff(backoff);
                warn!(server = server.name, error = %e, retry_in = ?backoff, "accept failed");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => continue,
                    _ = stopped(&mut stop) => break,
                }
            }
        };
        let slot = loop {
            match book.admit(peer.ip()) {
                Admission::Admitted { slot, evicted } => {
                    if evicted {
                        server.count(Refusal::Evicted);
                    }
                    break slot;
                }
                Admission::SourceFull => {
                    debug!(server = server.name, %peer, limit = server.limits.max_unauthenticated_per_source, "closed a connection: its source holds as many unauthenticated connections as it may");
                    server.count(Refusal::SourceLimit);
                    continue 'accept;
                }
                Admission::Full => {
                    // Every connection has a request in flight (each bounded in time): this
                    // one waits for the first to end, the rest in the kernel's backlog.
                    if let Some(held) = full.due() {
                        warn!(server = server.name, limit = server.limits.max_connections, held_back = held, "connection limit reached with a request in flight on every connection; new connections wait");
                    }
                    tokio::select! {
                        _ = book.changed() => {}
                        _ = stopped(&mut stop) => break 'accept,
                    }
                }
            }
        };
        let _ = tcp.set_nodelay(true);
        let (server, stop, refused) = (server.clone(), stop.clone(), refused.clone());
        tokio::spawn(async move {
            connection(&server, tcp, peer, &slot, stop, drain_timeout, &refused).await;
            drop(slot);
        });
    }
    // Stop accepting: from here new connections are refused by the kernel.
    drop(listener);
    info!(server = server.name, open = book.open(), "stopped accepting; finishing the requests in flight");
    let drained = tokio::time::timeout(drain_timeout, async {
        while book.open() > 0 {
            book.changed().await;
        }
    })
    .await
    .is_ok();
    if drained {
        info!(server = server.name, "all connections finished");
    } else {
        warn!(server = server.name, left = book.open(), ?drain_timeout, "connections still open after the drain timeout; dropping them");
    }
}

impl<H> Server<H> {
    fn count(&self, why: Refusal) {
        if let Some(count) = &self.on_refusal {
            count(why);
        }
    }
}

async fn connection<H: Handler>(server: &Server<H>, tcp: TcpStream, peer: SocketAddr, slot: &Slot, stop: watch::Receiver<bool>, drain_timeout: Duration, refused: &Throttled) {
    let limits = server.limits;
    let Some(acceptor) = &server.tls else {
        return http(server, tcp, false, peer, slot, stop, drain_timeout).await;
    };
    // At most max_unauthenticated_per_source handshakes of one source at once; the others
    // wait their turn here, for at most the read timeout.
    let turn = tokio::select! {
        t = tokio::time::timeout(limits.read_timeout, slot.handshake_turn()) => t,
        _ = slot.evicted() => {
            debug!(server = server.name, %peer, "closed a connection waiting for a TLS handshake turn to make room for a new one");
            return;
        }
    };
    let Ok(turn) = turn else {
        debug!(server = server.name, %peer, limit = limits.max_unauthenticated_per_source, timeout = ?limits.read_timeout, "closed a connection: its source's handshakes in progress left it no turn in time");
        server.count(Refusal::SourceLimit);
        return;
    };
    let handshake = tokio::select! {
        h = tokio::time::timeout(limits.read_timeout, acceptor.accept(tcp)) => h,
        _ = slot.evicted() => {
            debug!(server = server.name, %peer, "closed a connection in its TLS handshake to make room for a new one");
            return;
        }
    };
    drop(turn);
    let refusal = match handshake {
        Ok(Ok(tls)) => {
            // A finished handshake counts as authenticated: the caller's TLS configuration
            // demands a client certificate (the webhook's accepts only the kube-apiserver's).
            slot.authenticated();
            let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
            return http(server, tls, h2, peer, slot, stop, drain_timeout).await;
        }
        Ok(Err(e)) => {
            let rustls_error = e.get_ref().and_then(|i| i.downcast_ref::<tokio_rustls::rustls::Error>());
            let reason = match rustls_error {
                Some(tokio_rustls::rustls::Error::NoCertificatesPresented | tokio_rustls::rustls::Error::InvalidCertificate(_)) => Refusal::ClientCertificate,
                _ => Refusal::Handshake,
            };
            if reason == Refusal::ClientCertificate {
                // Someone other than the kube-apiserver, or an apiserver without its client
                // certificate (docs/operations.md): worth a line, but not one per attempt.
                if let Some(held) = refused.due() {
                    warn!(server = server.name, %peer, error = %e, held_back = held, "refused a connection: no valid client certificate");
                }
            } else {
                debug!(server = server.name, %peer, error = %e, "TLS handshake failed");
            }
            reason
        }
        Err(_) => {
            debug!(server = server.name, %peer, timeout = ?limits.read_timeout, "TLS handshake not finished in time; closed");
            Refusal::HandshakeTimeout
        }
    };
    server.count(refusal);
}

/// hyper's HTTP/1.1 and HTTP/2 server connections, driven alike.
trait Graceful: Future<Output = hyper::Result<()>> {
    fn begin_shutdown(self: Pin<&mut Self>);
}

impl<I, S, B> Graceful for hyper::server::conn::http1::Connection<I, S>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn begin_shutdown(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

impl<I, S, B, E> Graceful for hyper::server::conn::http2::Connection<I, S, E>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    fn begin_shutdown(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

async fn http<H, IO>(server: &Server<H>, io: IO, h2: bool, peer: SocketAddr, slot: &Slot, stop: watch::Receiver<bool>, drain_timeout: Duration)
where
    H: Handler,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = server.limits;
    let svc = {
        let (handler, activity) = (server.handler.clone(), slot.activity.clone());
        hyper::service::service_fn(move |req| {
            let guard = activity.begin();
            let answer = handler.clone().call(req);
            async move {
                let r = answer.await;
                drop(guard);
                Ok::<_, Infallible>(r)
            }
        })
    };
    let io = TokioIo::new(io);
    let header_bytes = u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX);
    let result = if h2 {
        let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.max_streams)
            .max_header_list_size(header_bytes)
            // A peer that stopped answering (gone without a FIN) is noticed.
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(20))
            .serve_connection(io, svc);
        drive(conn, slot, &limits, stop, drain_timeout).await
    } else {
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.read_timeout)
            .max_buf_size(limits.max_header_bytes.max(8192))
            .serve_connection(io, svc);
        drive(conn, slot, &limits, stop, drain_timeout).await
    };
    if let Err(e) = result {
        debug!(server = server.name, %peer, error = %e, "connection ended with an error");
    }
}

/// How long a connection asked to close for idleness or to make room may go on answering
/// the requests it had accepted (each is bounded by the handler's own timeouts; this bounds
/// a handler that never ends).
pub const IN_FLIGHT_GRACE: Duration = Duration::from_secs(60);

/// Run a connection until it ends; ask it to finish when it is idle too long, the server
/// stops or the book makes room with it. A request it has accepted is still answered: when
/// it was asked to close for idleness or to make room, it is dropped once its requests are
/// answered and `read_timeout` has passed (at most [`IN_FLIGHT_GRACE`]); when the server
/// stops, after `drain_timeout` whatever is in flight.
async fn drive<C: Graceful>(conn: C, slot: &Slot, limits: &Limits, mut stop: watch::Receiver<bool>, drain_timeout: Duration) -> hyper::Result<()> {
    let activity = &slot.activity;
    tokio::pin!(conn);
    let mut closing: Option<tokio::time::Instant> = None;
    // Set when the close is the server's stop: its deadline is final.
    let mut stopping = false;
    let mut grace_until: Option<tokio::time::Instant> = None;
    loop {
        let idle_at = activity.idle_at(limits.read_timeout, limits.idle_timeout).map(tokio::time::Instant::from_std);
        // (While a request is in flight, look again after a while: it may finish.)
        let check_at = idle_at.unwrap_or_else(|| tokio::time::Instant::now() + limits.read_timeout);
        tokio::select! {
            r = conn.as_mut() => return r,
            _ = stopped(&mut stop), if !stopping => {
                if closing.is_none() {
                    conn.as_mut().begin_shutdown();
                }
                stopping = true;
                closing = Some(tokio::time::Instant::now() + drain_timeout);
            }
            _ = slot.evicted(), if closing.is_none() => {
                debug!(busy = activity.busy(), "closing a connection to make room for a new one");
                if !activity.busy() {
                    return Ok(());
                }
                conn.as_mut().begin_shutdown();
                closing = Some(tokio::time::Instant::now() + limits.read_timeout);
                grace_until = Some(tokio::time::Instant::now() + IN_FLIGHT_GRACE);
            }
            _ = tokio::time::sleep_until(check_at), if closing.is_none() => {
                if activity.idle_at(limits.read_timeout, limits.idle_timeout).is_some_and(|t| t <= Instant::now()) {
                    debug!("closing an idle connection");
                    conn.as_mut().begin_shutdown();
                    closing = Some(tokio::time::Instant::now() + limits.read_timeout);
                    grace_until = Some(tokio::time::Instant::now() + IN_FLIGHT_GRACE);
                }
            }
            _ = tokio::time::sleep_until(closing.unwrap_or_else(tokio::time::Instant::now)), if closing.is_some() => {
                let now = tokio::time::Instant::now();
                if activity.busy() && !stopping && grace_until.is_some_and(|g| now < g) {
                    // A request accepted before the close is still being answered (a slow
                    // store, a loaded machine): let it finish; look again shortly.
                    closing = Some(now + Duration::from_millis(200));
                    continue;
                }
                if activity.busy() {
                    // Its client sees the connection end under a request (an "EOF").
                    warn!(in_flight = activity.in_flight(), "closed a connection with requests still in flight: its close deadline passed");
                }
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_starts_small_doubles_and_is_capped() {
        let mut b = Duration::ZERO;
        let mut seen = Vec::new();
        for _ in 0..10 {
            b = next_backoff(b);
            seen.push(b.as_millis());
        }
        assert_eq!(seen, vec![10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
    }

    #[test]
    fn throttled_warnings_count_what_was_held_back() {
        let t = Throttled::new(Duration::from_secs(3600));
        assert_eq!(t.due(), Some(0));
        assert_eq!(t.due(), None);
        assert_eq!(t.due(), None);
        *t.last.lock().unwrap() = Some(Instant::now() - Duration::from_secs(7200));
        assert_eq!(t.due(), Some(2));
    }
}
