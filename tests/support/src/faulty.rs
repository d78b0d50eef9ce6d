//! A TCP proxy whose path breaks the ways a network does, for one client of the
//! kube-apiserver (a controller replica's kubeconfig names the proxy; TLS passes through):
//!
//! - [`Path::Pass`]: bytes flow both ways as they come;
//! - [`Path::BlackHole`]: nothing flows either way and nothing is closed — no RST, no FIN,
//!   as behind a dropped route or a dead NAT entry: connections open before stay open with
//!   their bytes held, new ones are accepted and hear nothing. When the path is healed the
//!   held bytes flow on, in order (as TCP's retransmissions would deliver them);
//! - [`Path::Delay`]: every byte arrives that much later than it was sent, both ways (a
//!   watch stream then lags by it, and so does every answer).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What the proxy does with the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Pass,
    BlackHole,
    Delay(Duration),
}

/// The proxy; its connections end when it is dropped.
pub struct FaultyProxy {
    addr: SocketAddr,
    path: watch::Sender<Path>,
    _tasks: JoinSet<()>,
}

/// Chunks in flight per direction before the reader waits (a held path holds this much).
const QUEUE: usize = 1024;

impl FaultyProxy {
    /// A proxy on 127.0.0.1 (a port of its own) to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultyProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (path, watched) = watch::channel(Path::Pass);
        let mut tasks = JoinSet::new();
        tasks.spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let watched = watched.clone();
                conns.spawn(async move {
                    let Ok(outbound) = TcpStream::connect(upstream).await else { return };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::join!(pump(ri, wo, watched.clone()), pump(ro, wi, watched));
                });
            }
        });
        Ok(FaultyProxy { addr, path, _tasks: tasks })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Break or heal the path, for every connection at once.
    pub fn set(&self, path: Path) {
        self.path.send_replace(path);
    }
}

/// One direction: read as it comes (stamped), write as the path allows.
async fn pump(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, path: watch::Receiver<Path>) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(QUEUE);
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send((Instant::now(), buf[..n].to_vec())).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        let mut path = path;
        while let Some((sent, chunk)) = rx.recv().await {
            loop {
                let now = *path.borrow_and_update();
                match now {
                    Path::Pass => break,
                    Path::Delay(d) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(sent + d) => break,
                            r = path.changed() => if r.is_err() { return },
                        }
                    }
                    Path::BlackHole => {
                        if path.changed().await.is_err() {
                            return;
                        }
                    }
                }
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        // The sender closed its side (FIN): pass it on once everything before it went.
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that answers each read with the same bytes.
    async fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream, text: &[u8], within: Duration) -> Option<Vec<u8>> {
        s.write_all(text).await.ok()?;
        let mut got = vec![0u8; text.len()];
        tokio::time::timeout(within, s.read_exact(&mut got)).await.ok()?.ok()?;
        Some(got)
    }

    #[tokio::test]
    async fn passes_holds_without_closing_then_delivers_in_order_and_delays() {
        let proxy = FaultyProxy::start(echo().await).await.expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(round_trip(&mut s, b"one", Duration::from_secs(5)).await.as_deref(), Some(&b"one"[..]));
        proxy.set(Path::BlackHole);
        assert_eq!(round_trip(&mut s, b"two", Duration::from_millis(300)).await, None, "an answer through a black hole");
        let mut fresh = TcpStream::connect(proxy.addr()).await.expect("a new connection is accepted");
        assert_eq!(round_trip(&mut fresh, b"new", Duration::from_millis(300)).await, None);
        proxy.set(Path::Pass);
        let mut got = [0u8; 3];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got)).await.expect("the held bytes arrive once healed").expect("read");
        assert_eq!(&got, b"two");
        proxy.set(Path::Delay(Duration::from_millis(200)));
        let started = Instant::now();
        assert_eq!(round_trip(&mut s, b"late", Duration::from_secs(5)).await.as_deref(), Some(&b"late"[..]));
        assert!(started.elapsed() >= Duration::from_millis(400), "delayed both ways: {:?}", started.elapsed());
    }
}
