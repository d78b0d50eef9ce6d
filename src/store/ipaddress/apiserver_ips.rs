//! The addresses the cluster already records as IPAddress objects — the kube-apiserver's
//! own allocations included — kept by a watch. Admission never hands out one of them: a
//! stock kube-apiserver would refuse the Service ("provided IP is already allocated").
//!
//! The set is a *view*: it lags the apiserver by the watch's delay, so it serves as a hint
//! (which candidates to skip, when to look again) and never as the deciding read. Where a
//! decision must not be made on a stale picture, callers read the IPAddress itself from the
//! apiserver (`ApiserverIps::recorded_now`; `blocks.rs` lists them before answering from a
//! block; docs/backends.md, "Decisions on a possibly stale view").
//!
//! The view also remembers, for [`SETTLE`], when each address left it ([`Released`]): the
//! kube-apiserver's own repair controller may create a just-deleted Service's IPAddress
//! again in the moments after the delete (its Service and IPAddress informers are separate
//! watches; when the IPAddress's deletion reaches it before the Service's, the Service looks
//! unrecorded and is "repaired", Event `ClusterIPNotAllocated`). A dynamic answer of that
//! address in that moment is refused by the apiserver as "provided IP is already
//! allocated" — stock itself would just try its next candidate, which an answer we gave
//! cannot do. So dynamic picks take settled addresses first (`blocks::Book::pick`).

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::ops::Deref;
use std::net::IpAddr;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, ListParams, PartialObjectMeta};
use tokio::sync::{broadcast, watch};
use tracing::warn;

use crate::clock::{Clock, Moment};
use crate::k8s;

use crate::store::fold::{fold, Change};
use crate::store::{StoreError, Unreadable};
use crate::sync::{read, write};

/// One change the watch applied to the view, in the order the apiserver made them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpChange {
    /// An IPAddress object of this address was created (or first seen).
    Added(IpAddr),
    /// The IPAddress object of this address was deleted.
    Deleted(IpAddr),
    /// The view was listed anew: changes since the last event may have been missed.
    Relisted,
}

/// How long [`ApiserverIps::recorded_now`] waits for the kube-apiserver: below the
/// webhook's 5 s timeout (deploy/webhooks.yaml), so an admission reading a record gets an
/// answer (an error) instead of hanging on a half-open connection.
const RECORDED_NOW_TIMEOUT: Duration = Duration::from_secs(4);

/// How many changes a slow subscriber may fall behind before it misses some (it is told:
/// `broadcast::error::RecvError::Lagged`).
const CHANGES_BUFFER: usize = 4096;

/// How long an address that left the view counts as settling: a dynamic pick takes it only
/// when no settled address is free (module docs). Far above the moments the apiserver's
/// repair controller needs to create it again; costs nothing while a range has room.
pub const SETTLE: Duration = Duration::from_secs(30);

/// When addresses left the view, for [`SETTLE`] after.
#[derive(Debug, Default)]
pub struct Released {
    at: HashMap<IpAddr, Moment>,
    /// The same, oldest first, to forget them in order (an address released twice is
    /// queued twice; only its latest moment is kept in `at`).
    order: VecDeque<(Moment, IpAddr)>,
}

impl Released {
    /// `ip` left the view at `now`.
    pub fn note(&mut self, ip: IpAddr, now: Moment) {
        self.at.insert(ip, now);
        self.order.push_back((now, ip));
        while let Some(&(t, old)) = self.order.front() {
            if now.saturating_duration_since(t) < SETTLE {
                break;
            }
            self.order.pop_front();
            if self.at.get(&old) == Some(&t) {
                self.at.remove(&old);
            }
        }
    }

    /// When `ip` left the view, if less than [`SETTLE`] before `now`.
    pub fn settling_since(&self, ip: IpAddr, now: Moment) -> Option<Moment> {
        self.at.get(&ip).copied().filter(|t| now.saturating_duration_since(*t) < SETTLE)
    }

    /// Addresses remembered (settling, or settled and not yet forgotten).
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }
}

/// What the view holds: the recorded addresses, and when others left it.
#[derive(Debug, Default)]
pub struct Recorded {
    pub addresses: HashSet<IpAddr>,
    pub released: Released,
}

impl Deref for Recorded {
    type Target = HashSet<IpAddr>;
    fn deref(&self) -> &HashSet<IpAddr> {
        &self.addresses
    }
}

/// A watch-fed set of IPAddress names.
#[derive(Clone)]
pub struct ApiserverIps {
    set: Arc<RwLock<Recorded>>,
    /// Names of IPAddress objects that are not canonical addresses: they hold nothing a
    /// Service could ask for, but are reported (log, `clusterip_allocator_unreadable_records`).
    bad: Arc<RwLock<BTreeSet<String>>>,
    /// Counts additions (a new record, or a relist); a receiver never misses one, however
    /// busy its task was when it happened.
    added: Arc<watch::Sender<u64>>,
    /// Every change, for subscribers that follow single addresses ([`Self::changes`]).
    changes: broadcast::Sender<IpChange>,
    /// For reads from storage; None for a fixed view.
    api: Option<Api<IPAddress>>,
    /// For reads of the Services holding an address; None for a fixed view.
    services: Option<Api<Service>>,
    /// When addresses leave the view: the clock of the blocks' protocol (`BlockStore`),
    /// which compares these moments with its own.
    clock: Arc<dyn Clock>,
}

impl Default for ApiserverIps {
    fn default() -> Self {
        Self { set: Arc::default(), bad: Arc::default(), added: Arc::new(watch::Sender::new(0)), changes: broadcast::Sender::new(CHANGES_BUFFER), api: None, services: None, clock: crate::clock::system() }
    }
}

impl ApiserverIps {
    /// Start the watch; `synced` turns true after the first full list.
    ///
    /// It watches metadata only: the name is the address, and an object whose spec cannot be
    /// decoded (a garbled parentRef, written behind the apiserver's validation) must neither
    /// stop the watch nor go uncounted: its address stays taken.
    pub fn start(client: kube::Client) -> (Self, watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
        let me = Self { api: Some(Api::all(client.clone())), services: Some(Api::all(client.clone())), ..Self::default() };
        let (tx, rx) = watch::channel(false);
        let (set, bad, added, changes) = (me.set.clone(), me.bad.clone(), me.added.clone(), me.changes.clone());
        let clock = me.clock.clone();
        let task = tokio::spawn(async move {
            let api: Api<PartialObjectMeta<IPAddress>> = Api::all(client);
            // The address an object's name records, or the name that records none.
            let read = |o: &PartialObjectMeta<IPAddress>| -> Result<IpAddr, String> {
                let name = o.metadata.name.clone().unwrap_or_default();
                k8s::ipaddress::address(&name).ok_or(name)
            };
            fold(api, "IPAddress", read, |change| match change {
                Change::Replace(list) => {
                    let (mut ips, mut names) = (HashSet::new(), BTreeSet::new());
                    for judged in list {
                        match judged {
                            Ok(ip) => ips.insert(ip),
                            Err(name) => names.insert(name),
                        };
                    }
                    {
                        let now = clock.now();
                        let mut view = write(&set);
                        let gone: Vec<IpAddr> = view.addresses.difference(&ips).copied().collect();
                        for ip in gone {
                            view.released.note(ip, now);
                        }
                        view.addresses = ips;
                    }
                    for name in &names {
                        warn_unreadable(name);
                    }
                    *write(&bad) = names;
                    tx.send_replace(true);
                    added.send_modify(|n| *n += 1);
                    let _ = changes.send(IpChange::Relisted);
                }
                Change::Apply(Ok(ip)) => {
                    // (An update of an object already seen is not an addition.)
                    if write(&set).addresses.insert(ip) {
                        let _ = changes.send(IpChange::Added(ip));
                    }
                    added.send_modify(|n| *n += 1);
                }
                Change::Apply(Err(name)) => {
                    warn_unreadable(&name);
                    write(&bad).insert(name);
                }
                Change::Delete(Ok(ip)) => {
                    let now = clock.now();
                    let removed = {
                        let mut view = write(&set);
                        let removed = view.addresses.remove(&ip);
                        if removed {
                            view.released.note(ip, now);
                        }
                        removed
                    };
                    if removed {
                        let _ = changes.send(IpChange::Deleted(ip));
                    }
                }
                Change::Delete(Err(name)) => {
                    write(&bad).remove(&name);
                }
            })
            .await
        });
        (me, rx, task)
    }

    /// IPAddress objects whose name is not a canonical address (kind `ipaddress`).
    pub fn unreadable(&self) -> Vec<Unreadable> {
        let bad = read(&self.bad);
        bad.iter().map(|name| Unreadable { kind: "ipaddress", record: name.clone(), reason: "the name is not a canonical IP address".into() }).collect()
    }

    /// A view that no watch updates: the given addresses, as of whenever they were read.
    /// For tools that judge against one picture, and for tests that hold a replica's view
    /// back to reproduce a lagging watch.
    pub fn fixed(addresses: impl IntoIterator<Item = IpAddr>) -> Self {
        Self { set: Arc::new(RwLock::new(Recorded { addresses: addresses.into_iter().collect(), released: Released::default() })), ..Self::default() }
    }

    /// A fixed view whose releases ([`Self::remove`]) are timed on `clock`.
    #[cfg(test)]
    pub fn with_clock(self, clock: Arc<dyn Clock>) -> Self {
        Self { clock, ..self }
    }

    /// The view gains `ip` as the watch's add would (for tests of a fixed view).
    #[cfg(test)]
    pub fn add(&self, ip: IpAddr) {
        write(&self.set).addresses.insert(ip);
    }

    /// The view loses `ip` as the watch's delete would (for tests of a fixed view).
    #[cfg(test)]
    pub fn remove(&self, ip: IpAddr) {
        let now = self.clock.now();
        let mut view = write(&self.set);
        if view.addresses.remove(&ip) {
            view.released.note(ip, now);
        }
    }

    /// Whether the apiserver records `ip` right now, read from storage: a GET without a
    /// resourceVersion, never served from a cache. The deciding read where the view could be
    /// stale (see the module docs). A fixed view answers from its set.
    pub async fn recorded_now(&self, ip: IpAddr) -> Result<bool, StoreError> {
        let Some(api) = &self.api else { return Ok(self.contains(ip)) };
        // (Metadata only: an object whose spec cannot be decoded still records the address.)
        match tokio::time::timeout(RECORDED_NOW_TIMEOUT, api.get_metadata_opt(&ip.to_string())).await {
            Ok(Ok(found)) => Ok(found.is_some()),
            Ok(Err(e)) => Err(StoreError::from_kube(format!("reading IPAddress {ip}"), e)),
            Err(_) => Err(StoreError::Unavailable(format!("reading IPAddress {ip}: the kube-apiserver did not answer within {RECORDED_NOW_TIMEOUT:?}").into())),
        }
    }

    /// Whether a stored Service holds `ip` right now, read from storage: the Service
    /// `parent` names (when the request named it), else any Service whose `spec.clusterIP`
    /// it is (a field selector; a generated name's secondary-family address is not found
    /// this way). An IPAddress deleted while its Service still holds the address — the
    /// kube-apiserver's repair recreating a record it judged wrong, a delete by hand — is no
    /// failed create: the address must not be given again. A fixed view: no.
    pub async fn held_by_service(&self, ip: IpAddr, parent: &crate::store::ParentRef) -> Result<bool, StoreError> {
        let Some(all) = &self.services else { return Ok(false) };
        let holds = |svc: &Service| crate::k8s::service::held_ips(svc).iter().any(|t| crate::cidr::parse_ip(t).ok() == Some(ip));
        let read = async {
            match (parent.resource.as_str(), parent.namespace.as_deref(), parent.name.is_empty()) {
                ("services", Some(ns), false) => {
                    let api: Api<Service> = Api::namespaced(all.clone().into_client(), ns);
                    api.get_opt(&parent.name).await.map(|s| s.is_some_and(|s| holds(&s)))
                }
                _ => all.list(&ListParams::default().fields(&format!("spec.clusterIP={ip}"))).await.map(|l| l.items.iter().any(holds)),
            }
        };
        match tokio::time::timeout(RECORDED_NOW_TIMEOUT, read).await {
            Ok(Ok(held)) => Ok(held),
            Ok(Err(e)) => Err(StoreError::from_kube(format!("reading the Service that holds {ip}"), e)),
            Err(_) => Err(StoreError::Unavailable(format!("reading the Service that holds {ip}: the kube-apiserver did not answer within {RECORDED_NOW_TIMEOUT:?}").into())),
        }
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        read(&self.set).contains(&ip)
    }

    /// The recorded addresses (and when others left), read-locked until the guard drops:
    /// for a caller that asks about many addresses at once (one lock instead of one per
    /// address). Hold it briefly; the watch waits for it to apply what it receives.
    pub fn view(&self) -> RwLockReadGuard<'_, Recorded> {
        read(&self.set)
    }

    /// Every recorded address, for seeding a backend.
    pub fn snapshot(&self) -> Vec<IpAddr> {
        read(&self.set).addresses.iter().copied().collect()
    }

    /// Every change to the view from now on, one address at a time, in the apiserver's
    /// order (a subscriber more than 4096 behind is told it lagged). A fixed view never changes.
    pub fn changes(&self) -> broadcast::Receiver<IpChange> {
        self.changes.subscribe()
    }

    /// A receiver that sees every addition to the view from now on (`changed()` resolves
    /// once per batch of additions since it last looked; none is lost while its task is
    /// busy elsewhere).
    pub fn additions(&self) -> watch::Receiver<u64> {
        self.added.subscribe()
    }
}

fn warn_unreadable(name: &str) {
    warn!(ipaddress = %name, "an IPAddress object's name is not a canonical IP address; it holds no address (delete it: kubectl delete ipaddress {name})");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 32, fault 5 on the admission path: a kube-apiserver that accepts the connection
    /// and never answers (half-open) gets `recorded_now` an error within its bound, not a
    /// hang.
    #[tokio::test(start_paused = true)]
    async fn a_read_from_storage_that_never_answers_is_bounded() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("listen");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                open.push(conn);
            }
        });
        let config = kube::Config::new(url.parse().expect("url"));
        let client = kube::Client::try_from(config).expect("client");
        let ips = ApiserverIps { api: Some(Api::all(client)), ..ApiserverIps::default() };
        let r = tokio::time::timeout(Duration::from_secs(60), ips.recorded_now("198.19.0.1".parse().expect("ip"))).await;
        held.abort();
        let r = r.expect("recorded_now waited 60 s for an apiserver that never answers");
        assert!(matches!(&r, Err(StoreError::Unavailable(_))), "{r:?}");
    }

    /// A released address settles after [`SETTLE`], and what is remembered stays bounded by
    /// what was released within it.
    #[test]
    fn released_addresses_settle_and_are_forgotten() {
        let ip = |n: u8| IpAddr::from([198, 19, 0, n]);
        let mut r = Released::default();
        r.note(ip(1), Moment::ZERO);
        let later = Moment::ZERO + Duration::from_secs(10);
        r.note(ip(2), later);
        assert_eq!(r.settling_since(ip(1), later), Some(Moment::ZERO));
        assert_eq!(r.settling_since(ip(3), later), None);
        let settled = Moment::ZERO + SETTLE;
        assert_eq!(r.settling_since(ip(1), settled), None, "settled after SETTLE");
        assert_eq!(r.settling_since(ip(2), settled), Some(later));
        // Released again: the latest moment counts, and the first one is forgotten in turn.
        r.note(ip(2), settled);
        r.note(ip(4), settled + SETTLE / 2);
        assert_eq!(r.len(), 2, "ip 1 and the first release of ip 2 forgotten");
        assert_eq!(r.settling_since(ip(2), settled + SETTLE / 2), Some(settled));
    }
}
