//! The book of a server's open connections: who holds them, what each may still hold, and
//! which one goes when the server is full.
//!
//! A budget that any client can fill is a denial of service waiting to happen: the kubelet's
//! probes and the kube-apiserver's admission calls share their server with whoever else can
//! reach the port. So the book
//! - caps what a source address may hold while *unauthenticated*. On a plain-HTTP server
//!   (every connection unauthenticated) the next connection from a source at its cap is
//!   closed at once ([`Admission::SourceFull`]). On a TLS server the cap is on handshakes in
//!   progress: the next connection waits for one of its source's handshakes to end
//!   ([`Slot::handshake_turn`], in arrival order), as the kube-apiserver dials dozens of
//!   connections at once in a burst of admissions (a 500-Service burst here: 16–43 at once
//!   per replica), and a connection closed in its handshake fails an admission with "EOF";
//! - at the server's total cap, closes an open connection to make room instead of letting
//!   newcomers wait ([`victim`]): never one with a request in flight, unauthenticated before
//!   authenticated, from the source holding the most, idle the longest. Only when every open
//!   connection has a request in flight does a newcomer wait ([`Admission::Full`]), and
//!   requests are bounded in time by the server's limits.
//!
//! So a client holding many idle or half-open connections costs the others nothing: the
//! kubelet's next probe, or the apiserver's next connection, takes the slot of the
//! heaviest idle holder.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::lock;

/// Requests in flight on one connection, and since when it has had none.
pub(super) struct Activity {
    in_flight: AtomicUsize,
    since: Mutex<(Instant, bool)>, // (last change, any request seen)
    /// Told when a request ends (the connection may now be closed to make room).
    on_idle: Arc<Notify>,
}

impl Activity {
    pub(super) fn new(on_idle: Arc<Notify>) -> Self {
        Self { in_flight: AtomicUsize::new(0), since: Mutex::new((Instant::now(), false)), on_idle }
    }

    pub(super) fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let mut s = lock(&self.since);
        *s = (Instant::now(), true);
        InFlight(self.clone())
    }

    pub(super) fn busy(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) > 0
    }

    /// Requests in flight now.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Since when the connection has had no request in flight; None while one is.
    fn idle_since(&self) -> Option<Instant> {
        if self.busy() {
            return None;
        }
        Some(lock(&self.since).0)
    }

    /// When the connection counts as idle, if no request starts before then: `first` after
    /// it opened, `later` after its last request. None while a request is in flight.
    pub(super) fn idle_at(&self, first: Duration, later: Duration) -> Option<Instant> {
        if self.busy() {
            return None;
        }
        let (since, seen) = *lock(&self.since);
        Some(since + if seen { later } else { first })
    }
}

/// A request in flight; its end marks the connection active now.
pub(super) struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = lock(&self.0.since);
        *s = (Instant::now(), true);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        drop(s);
        self.0.on_idle.notify_one();
    }
}

/// What a connection in the book looks like to [`victim`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Candidate {
    pub id: u64,
    pub source: IpAddr,
    pub authenticated: bool,
    /// None while a request is in flight (never a victim).
    pub idle_since: Option<Instant>,
}

/// Which open connection to close to make room for a new one, if any may be: one without a
/// request in flight; unauthenticated before authenticated; among those, from the source
/// holding the most connections; then the one idle the longest.
pub(super) fn victim(open: &[Candidate]) -> Option<u64> {
    let mut per_source: HashMap<IpAddr, usize> = HashMap::new();
    for c in open {
        *per_source.entry(c.source).or_default() += 1;
    }
    open.iter()
        .filter_map(|c| c.idle_since.map(|since| (c, since)))
        .max_by(|(a, a_since), (b, b_since)| {
            (!a.authenticated)
                .cmp(&!b.authenticated)
                .then(per_source[&a.source].cmp(&per_source[&b.source]))
                .then(b_since.cmp(a_since))
                .then(b.id.cmp(&a.id))
        })
        .map(|(c, _)| c.id)
}

/// Connections from one address count as one source (an IPv4 client seen through an IPv6
/// listener as `::ffff:a.b.c.d` included).
fn source_of(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

struct Open {
    source: IpAddr,
    authenticated: bool,
    activity: Arc<Activity>,
    evict: Arc<Notify>,
}

#[derive(Default)]
struct Entries {
    next: u64,
    open: HashMap<u64, Open>,
    /// Unauthenticated connections per source.
    unauthenticated: HashMap<IpAddr, usize>,
}

impl Entries {
    fn forget_unauthenticated(&mut self, source: IpAddr) {
        if let Some(n) = self.unauthenticated.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.unauthenticated.remove(&source);
            }
        }
    }
}

/// The answer to a new connection.
pub(super) enum Admission {
    /// Serve it (another connection may have been told to close to make room).
    Admitted { slot: Slot, evicted: bool },
    /// Its source already holds as many unauthenticated connections as it may: close it.
    SourceFull,
    /// Every open connection has a request in flight: wait for [`Book::changed`].
    Full,
}

/// Open connections of one server (module docs).
pub(super) struct Book {
    max: usize,
    per_source: usize,
    /// A TLS server's: a source at its cap waits for a handshake turn instead of being
    /// closed ([`Slot::handshake_turn`]).
    turns: bool,
    entries: Mutex<Entries>,
    /// Handshakes each source may start now (TLS servers), removed once nobody of the source
    /// holds or waits for one.
    handshakes: Mutex<HashMap<IpAddr, Arc<Semaphore>>>,
    /// Told when a connection closes or a request ends.
    changed: Arc<Notify>,
}

impl Book {
    /// A book of at most `max` connections. `per_source`: the unauthenticated connections a
    /// source may hold (plain HTTP), or with `turns` the TLS handshakes it may run at once.
    pub(super) fn new(max: usize, per_source: usize, turns: bool) -> Arc<Self> {
        Arc::new(Self { max: max.max(1), per_source: per_source.max(1), turns, entries: Mutex::default(), handshakes: Mutex::default(), changed: Arc::new(Notify::new()) })
    }

    /// Take a slot for a connection from `peer`, closing another to make room if the server
    /// is full (module docs).
    pub(super) fn admit(self: &Arc<Self>, peer: IpAddr) -> Admission {
        let source = source_of(peer);
        let mut e = lock(&self.entries);
        if !self.turns && e.unauthenticated.get(&source).copied().unwrap_or(0) >= self.per_source {
            return Admission::SourceFull;
        }
        let mut evicted = false;
        if e.open.len() >= self.max {
            let open: Vec<Candidate> = e
                .open
                .iter()
                .map(|(&id, o)| Candidate { id, source: o.source, authenticated: o.authenticated, idle_since: o.activity.idle_since() })
                .collect();
            let Some(id) = victim(&open) else { return Admission::Full };
            // Out of the book now (its slot is the newcomer's); its task closes it.
            if let Some(gone) = e.open.remove(&id) {
                if !gone.authenticated {
                    e.forget_unauthenticated(gone.source);
                }
                gone.evict.notify_one();
            }
            evicted = true;
        }
        let id = e.next;
        e.next += 1;
        let activity = Arc::new(Activity::new(self.changed.clone()));
        let evict = Arc::new(Notify::new());
        e.open.insert(id, Open { source, authenticated: false, activity: activity.clone(), evict: evict.clone() });
        *e.unauthenticated.entry(source).or_default() += 1;
        Admission::Admitted { slot: Slot { book: self.clone(), id, source, activity, evict }, evicted }
    }

    /// The source's handshake semaphore, a reference to it counted until dropped.
    fn handshakes_of(self: &Arc<Self>, source: IpAddr) -> SourceHandshakes {
        let sem = lock(&self.handshakes).entry(source).or_insert_with(|| Arc::new(Semaphore::new(self.per_source))).clone();
        SourceHandshakes { book: self.clone(), source, sem }
    }

    /// Resolves after a connection closes or a request ends (or at once if one did since
    /// the last call).
    pub(super) async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Connections open now.
    pub(super) fn open(&self) -> usize {
        lock(&self.entries).open.len()
    }
}

/// A reference to a source's handshake semaphore; the last one dropped while no handshake
/// of the source runs removes the semaphore.
struct SourceHandshakes {
    book: Arc<Book>,
    source: IpAddr,
    sem: Arc<Semaphore>,
}

impl Drop for SourceHandshakes {
    fn drop(&mut self) {
        let mut all = lock(&self.book.handshakes);
        // (Held by the book and this reference alone: nobody of the source holds or waits.)
        if all.get(&self.source).is_some_and(|s| Arc::ptr_eq(s, &self.sem) && Arc::strong_count(s) == 2 && s.available_permits() == self.book.per_source) {
            all.remove(&self.source);
        }
    }
}

/// A TLS handshake's turn ([`Slot::handshake_turn`]); dropping it lets the next one of the
/// source start.
pub(super) struct Turn {
    // (Declared first, so released before the reference checks whether anyone is left.)
    _permit: Option<OwnedSemaphorePermit>,
    _source: SourceHandshakes,
}

/// One admitted connection's place in the book; dropping it frees the place.
pub(super) struct Slot {
    book: Arc<Book>,
    id: u64,
    source: IpAddr,
    pub(super) activity: Arc<Activity>,
    evict: Arc<Notify>,
}

impl Slot {
    /// Wait for a turn to run this connection's TLS handshake: at most the book's
    /// `per_source` handshakes of one source run at once, the others wait here in arrival
    /// order (the caller bounds the wait).
    pub(super) async fn handshake_turn(&self) -> Turn {
        let source = self.book.handshakes_of(self.source);
        // (Acquiring fails only on a closed semaphore, and these are never closed.)
        let permit = source.sem.clone().acquire_owned().await.ok();
        Turn { _permit: permit, _source: source }
    }

    /// The client proved who it is (its TLS handshake finished with a valid certificate):
    /// it no longer counts against its source's unauthenticated connections, and is closed
    /// to make room only when no unauthenticated connection can be.
    pub(super) fn authenticated(&self) {
        let mut e = lock(&self.book.entries);
        let Some(o) = e.open.get_mut(&self.id) else { return };
        if o.authenticated {
            return;
        }
        o.authenticated = true;
        let source = o.source;
        e.forget_unauthenticated(source);
    }

    /// Resolves once the book has chosen this connection to close to make room.
    pub(super) async fn evicted(&self) {
        self.evict.notified().await;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut e = lock(&self.book.entries);
        if let Some(gone) = e.open.remove(&self.id) {
            if !gone.authenticated {
                e.forget_unauthenticated(gone.source);
            }
        }
        drop(e);
        self.book.changed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(a: Admission, otherwise: &str) -> Slot {
        match a {
            Admission::Admitted { slot, .. } => slot,
            _ => panic!("{otherwise}"),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    fn c(id: u64, source: &str, authenticated: bool, idle_for_s: Option<u64>, now: Instant) -> Candidate {
        Candidate { id, source: ip(source), authenticated, idle_since: idle_for_s.map(|s| now - Duration::from_secs(s)) }
    }

    #[test]
    fn a_connection_with_a_request_in_flight_is_never_the_victim() {
        let now = Instant::now();
        assert_eq!(victim(&[c(1, "10.0.0.1", false, None, now), c(2, "10.0.0.1", true, None, now)]), None);
        assert_eq!(victim(&[c(1, "10.0.0.1", false, None, now), c(2, "10.0.0.2", true, Some(0), now)]), Some(2));
    }

    #[test]
    fn unauthenticated_goes_before_authenticated_whatever_the_counts() {
        let now = Instant::now();
        let open = [c(1, "10.0.0.1", true, Some(100), now), c(2, "10.0.0.1", true, Some(100), now), c(3, "10.0.0.9", false, Some(1), now)];
        assert_eq!(victim(&open), Some(3));
    }

    #[test]
    fn the_heaviest_source_goes_first_then_the_longest_idle() {
        let now = Instant::now();
        let open = [
            c(1, "10.0.0.1", false, Some(50), now), // the kubelet: one connection, idle longest
            c(2, "10.0.0.66", false, Some(1), now),
            c(3, "10.0.0.66", false, Some(7), now),
            c(4, "10.0.0.66", false, Some(3), now),
        ];
        assert_eq!(victim(&open), Some(3));
    }

    #[test]
    fn a_source_may_hold_only_its_share_of_unauthenticated_connections() {
        let book = Book::new(100, 2, false);
        let a = ip("198.18.0.1");
        let s1 = match book.admit(a) {
            Admission::Admitted { slot, evicted: false } => slot,
            _ => panic!("first connection refused"),
        };
        let _s2 = match book.admit(a) {
            Admission::Admitted { slot, .. } => slot,
            _ => panic!("second connection refused"),
        };
        assert!(matches!(book.admit(a), Admission::SourceFull));
        // Another source is not affected; an authenticated connection frees its share.
        assert!(matches!(book.admit(ip("198.18.0.2")), Admission::Admitted { .. }));
        s1.authenticated();
        let _s3 = match book.admit(a) {
            Admission::Admitted { slot, .. } => slot,
            _ => panic!("a share freed by authentication was not given"),
        };
        assert!(matches!(book.admit(a), Admission::SourceFull));
        // The IPv4-mapped form of the same address is the same source.
        assert!(matches!(book.admit(ip("::ffff:198.18.0.1")), Admission::SourceFull));
    }

    /// A TLS server's book admits every connection; a source runs its share of handshakes at
    /// once and the others wait their turn in order, and nothing of a source is kept once
    /// none of its connections holds or waits for a turn.
    #[tokio::test]
    async fn a_tls_source_over_its_share_waits_for_a_handshake_turn_instead_of_being_closed() {
        let book = Book::new(100, 2, true);
        let slot = |a| admitted(a, "a TLS server closed a connection at its source's share");
        let a = ip("198.18.0.1");
        let slots: Vec<Slot> = (0..4).map(|_| slot(book.admit(a))).collect();
        let first = slots[0].handshake_turn().await;
        let _second = slots[1].handshake_turn().await;
        let short = Duration::from_millis(50);
        assert!(tokio::time::timeout(short, slots[2].handshake_turn()).await.is_err(), "a third handshake of the source ran beside two");
        // Another source has turns of its own.
        let other = slot(book.admit(ip("198.18.0.2")));
        let other_turn = tokio::time::timeout(Duration::from_secs(5), other.handshake_turn()).await.expect("another source waits for nobody");
        // The waiters go in order: the third when the first turn ends, then the fourth.
        let third = tokio::spawn({
            let s = slots.into_iter().skip(2).collect::<Vec<_>>();
            async move {
                let t = s[0].handshake_turn().await;
                (t, s)
            }
        });
        tokio::task::yield_now().await;
        drop(first);
        let (third_turn, rest) = tokio::time::timeout(Duration::from_secs(5), third).await.expect("the waiter got the freed turn").expect("task");
        assert!(tokio::time::timeout(short, rest[1].handshake_turn()).await.is_err(), "two turns are held again");
        drop((third_turn, _second, other_turn));
        tokio::time::timeout(Duration::from_secs(5), rest[1].handshake_turn()).await.expect("turns free again");
        assert!(lock(&book.handshakes).is_empty(), "a source with no handshake held or awaited is forgotten");
    }

    #[test]
    fn a_connection_is_idle_after_the_first_wait_before_its_first_request_and_the_later_one_after() {
        let a = Arc::new(Activity::new(Arc::new(Notify::new())));
        let (first, later) = (Duration::from_secs(5), Duration::from_secs(60));
        assert!(a.idle_at(first, later).expect("idle") <= Instant::now() + first);
        let req = a.begin();
        assert_eq!(a.idle_at(first, later), None, "a request in flight");
        drop(req);
        assert!(a.idle_at(first, later).expect("idle again") >= Instant::now() + Duration::from_secs(50));
    }

    #[tokio::test]
    async fn a_full_book_closes_an_idle_connection_for_a_newcomer_and_waits_only_when_all_are_busy() {
        let book = Book::new(2, 10, false);
        let slot = |a| admitted(a, "not admitted");
        let first = slot(book.admit(ip("198.18.0.66")));
        let second = slot(book.admit(ip("198.18.0.66")));
        // The newcomer takes an idle one's place; the chosen one is told.
        let third = match book.admit(ip("198.18.0.1")) {
            Admission::Admitted { slot, evicted: true } => slot,
            _ => panic!("no room made"),
        };
        assert_eq!(book.open(), 2);
        tokio::time::timeout(Duration::from_secs(5), first.evicted()).await.expect("the longest idle was told to close");
        // Both left have a request in flight: the next waits, and is told when one ends.
        let (r2, r3) = (second.activity.begin(), third.activity.begin());
        assert!(matches!(book.admit(ip("198.18.0.2")), Admission::Full));
        drop(r2);
        tokio::time::timeout(Duration::from_secs(5), book.changed()).await.expect("told when a request ended");
        assert!(matches!(book.admit(ip("198.18.0.2")), Admission::Admitted { evicted: true, .. }));
        drop((first, r3));
    }
}
