//! What a hostile tenant does to the ports it can reach, for the tests and the benchmark of
//! docs/reliability.md "Tenants": connections held open from many source addresses, kept
//! up as the server closes them. Sources are loopback addresses (127.0.0.2, …: all of
//! 127/8 is on `lo`), so one test process is many clients.
//!
//! Everything stops when the returned [`Attack`] is dropped (its tasks are aborted and
//! their sockets closed).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;

/// `n` loopback source addresses other than 127.0.0.1, starting at 127.0.<first>.2.
pub fn sources(first: u8, n: usize) -> Vec<IpAddr> {
    (0..n).map(|i| IpAddr::V4(Ipv4Addr::new(127, first, (i / 250) as u8, (i % 250) as u8 + 2))).collect()
}

/// A TCP connection to `dst` from `src`.
pub async fn connect_from(src: IpAddr, dst: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = if src.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.bind(SocketAddr::new(src, 0))?;
    socket.connect(dst).await
}

/// Running attack tasks; dropping it stops them all.
#[derive(Default)]
pub struct Attack {
    tasks: Vec<JoinHandle<()>>,
    /// Connections the server accepted and later closed (or reset).
    pub closed_by_server: Arc<AtomicU64>,
    /// Connections made.
    pub opened: Arc<AtomicU64>,
}

impl Drop for Attack {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// How long a held connection waits before it connects again once the server closed it.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// A connection from `src` to `dst` that sends nothing, held until the server closes it;
/// counted in `opened` and then `closed`.
async fn hold_silent(src: IpAddr, dst: SocketAddr, opened: &AtomicU64, closed: &AtomicU64) {
    if let Ok(mut s) = connect_from(src, dst).await {
        opened.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; 1024];
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
        closed.fetch_add(1, Ordering::Relaxed);
    }
}

impl Attack {
    pub fn new() -> Self {
        Self::default()
    }

    /// From each source, `per_source` plain-HTTP keep-alive connections to `dst`, each
    /// sending `GET path` every `every` (so it is never idle for long) and reading the
    /// answer; a connection the server closes is made again after [`RECONNECT_AFTER`].
    pub fn keep_alive(&mut self, sources: &[IpAddr], per_source: usize, dst: SocketAddr, path: &str, every: Duration) {
        for &src in sources {
            for _ in 0..per_source {
                let (path, opened, closed) = (path.to_string(), self.opened.clone(), self.closed_by_server.clone());
                self.tasks.push(tokio::spawn(async move {
                    loop {
                        if let Ok(mut s) = connect_from(src, dst).await {
                            opened.fetch_add(1, Ordering::Relaxed);
                            let req = format!("GET {path} HTTP/1.1\r\nHost: {dst}\r\n\r\n");
                            let mut buf = vec![0u8; 64 * 1024];
                            loop {
                                if s.write_all(req.as_bytes()).await.is_err() {
                                    break;
                                }
                                // Read whatever comes within the interval; a close ends it.
                                let until = tokio::time::Instant::now() + every;
                                let mut gone = false;
                                while let Ok(r) = tokio::time::timeout_at(until, s.read(&mut buf)).await {
                                    if matches!(r, Ok(0) | Err(_)) {
                                        gone = true;
                                        break;
                                    }
                                }
                                if gone {
                                    break;
                                }
                            }
                            closed.fetch_add(1, Ordering::Relaxed);
                        }
                        // (The attack's pace, not a wait.)
                        tokio::time::sleep(RECONNECT_AFTER).await;
                    }
                }));
            }
        }
    }

    /// From each source, `per_source` connections to `dst` that never send a byte (for a
    /// TLS port: never start the handshake), each made again after [`RECONNECT_AFTER`]
    /// once the server closes it.
    pub fn silent(&mut self, sources: &[IpAddr], per_source: usize, dst: SocketAddr) {
        for &src in sources {
            for _ in 0..per_source {
                let (opened, closed) = (self.opened.clone(), self.closed_by_server.clone());
                self.tasks.push(tokio::spawn(async move {
                    loop {
                        hold_silent(src, dst, &opened, &closed).await;
                        // (The attack's pace, not a wait.)
                        tokio::time::sleep(RECONNECT_AFTER).await;
                    }
                }));
            }
        }
    }

    /// `per_second` new silent connections to `dst` every second, from `sources` in turn,
    /// each held until the server closes it (the webhook figure: a flood of half-open
    /// handshakes).
    pub fn silent_flood(&mut self, sources: &[IpAddr], per_second: u32, dst: SocketAddr) {
        let (sources, opened, closed) = (sources.to_vec(), self.opened.clone(), self.closed_by_server.clone());
        self.tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / per_second.max(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut held = tokio::task::JoinSet::new();
            for src in sources.iter().cycle() {
                tick.tick().await;
                let (src, opened, closed) = (*src, opened.clone(), closed.clone());
                held.spawn(async move { hold_silent(src, dst, &opened, &closed).await });
                while held.try_join_next().is_some() {}
            }
        }));
    }
}
