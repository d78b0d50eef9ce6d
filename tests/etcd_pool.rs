//! The etcd backend's address pool against a real etcd: pooled addresses are answered from
//! memory, read as free by everyone (not leaks, honoured for static requests through a
//! claim), never handed out twice across replicas, returned on shutdown, and left to repair
//! when a replica dies.

mod store_common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use clusterip::alloc::AllocError;
use clusterip::cidr::Family;
use clusterip::repair::{Kind, Repairer, Target};
use clusterip::store::etcd::{range_key, EtcdConfig, EtcdStore};
use clusterip::store::etcd::pool::{claim_key, decode_pool, pool_member, pool_prefix, CHUNK, LEASE_TTL};
use clusterip::store::{AllocationStore, StoreError};
use clusterip_test_support::eventually;
use store_common::{Backend, Fixture};

async fn open(fx: &Fixture, pool: usize) -> EtcdStore {
    let cfg = EtcdConfig { pool_size: pool, ..fx.etcd_config() };
    EtcdStore::open(&cfg, fx.cidrs.clone()).await.expect("open etcd store")
}

/// Every address listed under any pool key of the fixture's ranges, read from etcd.
async fn pool_keys(fx: &Fixture) -> BTreeSet<IpAddr> {
    let mut client = etcd_client::Client::connect(fx.cp.etcd_endpoints(), None).await.expect("etcd");
    let resp = client.get(fx.prefix.clone(), Some(etcd_client::GetOptions::new().with_prefix())).await.expect("get");
    resp.kvs()
        .iter()
        .filter(|kv| kv.key_str().map(|k| k.contains("/pool/")).unwrap_or(false))
        .flat_map(|kv| decode_pool(kv.value()))
        .collect()
}

async fn cleanup(fx: &Fixture) {
    let mut client = etcd_client::Client::connect(fx.cp.etcd_endpoints(), None).await.expect("etcd");
    let _ = client.delete(fx.prefix.clone(), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pooled_addresses_are_free_to_every_reader_and_not_leaks() {
    let fx = Fixture::new(Backend::Etcd, &["198.18.96.0/24"]).await;
    let a = open(&fx, 16).await;
    eventually("the pool is filled", Duration::from_secs(60), || async { a.pool_ready() }).await;
    let pooled = pool_keys(&fx).await;
    assert_eq!(pooled.len(), 16, "the pool key lists the whole pool");
    let reader = open(&fx, 0).await;
    assert_eq!(reader.allocated().await.expect("allocated"), Vec::<IpAddr>::new(), "pooled addresses are not records");
    for ip in &pooled {
        assert!(!reader.has(*ip).await.expect("has"), "{ip} is pooled, so free");
    }
    let usage = reader.usage().await.expect("usage");
    assert_eq!((usage[0].used, usage[0].pooled, usage[0].free), (0, 16, 254));

    // A dynamic request is answered from the pool: the address was pooled and now is a record.
    let ip = a.allocate_next(Family::IPv4, None).await.expect("allocate_next");
    assert!(pooled.contains(&ip), "{ip} came from the pool");
    let off = u32::from(match ip {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(_) => panic!("asked for IPv4"),
    }) & 0xff;
    assert!(off > 16, "{ip} is in the dynamic band of a /24 (static band: the first 16)");
    eventually("another reader sees the handed-out address as a record", Duration::from_secs(60), || async {
        reader.allocated().await.map(|v| v == vec![ip]).unwrap_or(false)
    })
    .await;
    // Each reader reports the stored map's size (`clusterip_allocator_map_bytes`): the value
    // in etcd, as its watch last delivered it.
    let key = reader.keys()[0].clone();
    let key = &key;
    let (fx_ref, reader_ref) = (&fx, &reader);
    eventually("the reader's map size is the stored value's", Duration::from_secs(60), move || async move {
        let mut client = etcd_client::Client::connect(fx_ref.cp.etcd_endpoints(), None).await.expect("etcd");
        let stored = client.get(key.as_str(), None).await.expect("get the map").kvs().first().map(|kv| kv.value().len() as u64);
        let reported = reader_ref.usage().await.ok().and_then(|u| u[0].map_bytes);
        stored.is_some_and(|s| s > 0) && reported == stored
    })
    .await;
    assert!(!pool_keys(&fx).await.contains(&ip), "the pool key no longer lists a handed-out address");

    // The repair pass over these records finds one leak (no Service holds the handed-out
    // address) and nothing about the pooled ones.
    let store: Arc<dyn AllocationStore> = Arc::new(open(&fx, 0).await);
    let mut repairer = Repairer::new(fx.cp.client().await, Target::Etcd(store));
    let pass = repairer.run_once(false, false, None).await.expect("repair pass");
    let leaks: Vec<&str> = pass.report.findings.iter().filter(|f| f.kind == Kind::Leak).map(|f| f.address.as_str()).collect();
    assert_eq!(leaks, vec![ip.to_string().as_str()], "only the handed-out address is a leak");
    assert!(pass.report.findings.iter().all(|f| f.address.parse::<IpAddr>().map(|x| !pooled.contains(&x) || x == ip).unwrap_or(true)));

    // Releasing an address another replica still pools (no Service can hold it, so this is
    // a stray release) takes it out of that pool through a claim and frees it.
    let still = *pool_keys(&fx).await.iter().next().expect("a pooled address");
    reader.release(still).await.expect("release of a pooled address");
    assert!(!reader.has(still).await.expect("has"), "{still} is free");
    eventually("its former owner sees it free too", Duration::from_secs(60), || async { !a.has(still).await.unwrap_or(true) }).await;
    eventually("the owner's pool key stops listing it", Duration::from_secs(60), || async { !pool_keys(&fx).await.contains(&still) }).await;
    assert!(!reader.allocated().await.expect("allocated").contains(&still));
    drop((a, reader));
    cleanup(&fx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_static_request_for_another_replicas_pooled_address_is_granted_once() {
    let fx = Fixture::new(Backend::Etcd, &["198.18.97.0/24"]).await;
    let owner = open(&fx, 16).await;
    eventually("the pool is filled", Duration::from_secs(60), || async { owner.pool_ready() }).await;
    let other = open(&fx, 0).await;
    let pooled = pool_keys(&fx).await;
    let wanted = *pooled.iter().next().expect("a pooled address");
    eventually("the other replica sees the pool key", Duration::from_secs(60), || async { !other.has(wanted).await.unwrap_or(true) }).await;

    other.allocate(wanted, None).await.expect("a static request for a pooled address is honoured");
    assert!(other.has(wanted).await.expect("has"), "now a record");
    match other.allocate(wanted, None).await {
        Err(StoreError::Alloc(AllocError::Allocated)) => {}
        r => panic!("a second static request for {wanted} must be refused as allocated, got {r:?}"),
    }
    // The owner never hands it out: drain its pool and more.
    let mut handed = HashSet::new();
    for _ in 0..40 {
        handed.insert(owner.allocate_next(Family::IPv4, None).await.expect("allocate_next"));
    }
    assert_eq!(handed.len(), 40, "no address twice");
    assert!(!handed.contains(&wanted), "the owner handed out an address it granted away");

    // A static request for an address the owner already handed out is refused.
    let gone = *handed.iter().next().expect("one");
    match other.allocate(gone, None).await {
        Err(StoreError::Alloc(AllocError::Allocated)) => {}
        r => panic!("{gone} is held; expected already allocated, got {r:?}"),
    }
    // Another replica releases an address the owner handed out (its Service was deleted),
    // even while the owner's pool key may still list it: the map lets it go.
    other.release(gone).await.expect("release of a handed-out address");
    eventually("the released address is free in etcd", Duration::from_secs(60), || async {
        let fresh = open(&fx, 0).await;
        !fresh.allocated().await.unwrap_or_default().contains(&gone)
    })
    .await;

    // The owner's own static request for one of its pooled addresses takes it from the pool.
    // (The pool key may still list addresses handed out a moment ago; the owner judges by
    // memory, where a pooled address reads as free.)
    eventually("the pool is refilled", Duration::from_secs(60), || async { owner.pool_ready() }).await;
    let mut mine = None;
    for ip in pool_keys(&fx).await {
        if !owner.has(ip).await.expect("has") {
            mine = Some(ip);
            break;
        }
    }
    let mine = mine.expect("an address still pooled");
    owner.allocate(mine, None).await.expect("own pooled address");
    assert!(owner.has(mine).await.expect("has"));
    drop((owner, other));
    cleanup(&fx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pooled_replicas_and_static_claims_never_share_an_address() {
    let fx = Fixture::new(Backend::Etcd, &["198.18.104.0/21"]).await;
    // Pools of 200 (a /21 allows up to 239) that 150 dynamic requests each cannot drain: most claims find their
    // address still pooled (granted), some lose to a hand-out (refused).
    let a = Arc::new(open(&fx, 200).await);
    let b = Arc::new(open(&fx, 200).await);
    eventually("both pools are filled", Duration::from_secs(60), || async { a.pool_ready() && b.pool_ready() }).await;
    // Static requests aim at whatever is pooled right now, so about half are claims on the
    // other replica's pool and half take from their own.
    let targets: Vec<IpAddr> = pool_keys(&fx).await.into_iter().step_by(3).collect();
    let mut tasks = Vec::new();
    for (i, store) in [a.clone(), b.clone()].into_iter().enumerate() {
        for ip in targets.iter().skip(i).step_by(2) {
            let (s, ip) = (store.clone(), *ip);
            tasks.push(tokio::spawn(async move { ("static", s.allocate(ip, None).await.map(|()| (ip, "static"))) }));
        }
        for _ in 0..150 {
            let s = store.clone();
            tasks.push(tokio::spawn(async move { ("dynamic", s.allocate_next(Family::IPv4, None).await.map(|ip| (ip, "dynamic"))) }));
        }
    }
    let mut got = Vec::new();
    let mut unanswered = 0;
    for t in tasks {
        match t.await.expect("task") {
            (_, Ok(x)) => got.push(x),
            ("static", Err(StoreError::Alloc(AllocError::Allocated))) => {} // a claim that lost to a hand-out
            // A claim the owner did not answer within its deadline (a busy machine): a
            // retryable answer that gave nothing away — and giving nothing twice is what
            // this test judges.
            ("static", Err(StoreError::Unavailable(_))) => unanswered += 1,
            (kind, Err(e)) => panic!("unexpected error for a {kind} request: {e}"),
        }
    }
    eprintln!("{} static requests: {} succeeded, {unanswered} unanswered claims", targets.len(), got.iter().filter(|(_, k)| *k == "static").count());
    let unique: HashSet<IpAddr> = got.iter().map(|(ip, _)| *ip).collect();
    assert_eq!(unique.len(), got.len(), "an address was handed out twice");
    assert_eq!(got.iter().filter(|(_, k)| *k == "dynamic").count(), 300, "every dynamic request succeeded");
    assert!(got.iter().any(|(_, k)| *k == "static"), "some claims were granted");
    // Every handed-out address is durable: a new reader sees each as a record.
    let reader = open(&fx, 0).await;
    eventually("every handed-out address is a record", Duration::from_secs(60), || async {
        let all: HashSet<IpAddr> = reader.allocated().await.unwrap_or_default().into_iter().collect();
        unique.iter().all(|ip| all.contains(ip))
    })
    .await;
    drop((a, b, reader));
    cleanup(&fx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_closed_pool_is_free_at_once_and_a_dead_replicas_pool_expires_into_leaks() {
    let fx = Fixture::new(Backend::Etcd, &["198.18.98.0/24", "fd00:18:98::/120"]).await;
    let reader = open(&fx, 0).await;

    // Shut down cleanly: the pool's addresses leave the map, the handed-out one stays.
    let a = open(&fx, 8).await;
    eventually("the pool is filled", Duration::from_secs(60), || async { a.pool_ready() }).await;
    let kept = a.allocate_next(Family::IPv6, None).await.expect("allocate_next");
    a.close().await.expect("close");
    assert!(pool_keys(&fx).await.is_empty(), "no pool key after close");
    eventually("only the handed-out address is used", Duration::from_secs(60), || async {
        reader.usage().await.map(|u| u.iter().map(|r| r.used + r.pooled).sum::<u64>() == 1).unwrap_or(false)
    })
    .await;
    assert_eq!(reader.allocated().await.expect("allocated"), vec![kept]);

    // Die without closing: the pool key goes with the lease, and its addresses become
    // records no Service holds — leaks for the repair pass, never silently free.
    let b = open(&fx, 8).await;
    eventually("the pool is filled", Duration::from_secs(60), || async { b.pool_ready() }).await;
    let orphaned = pool_keys(&fx).await;
    assert_eq!(orphaned.len(), 16, "8 per range");
    drop(b);
    eventually("the dead replica's pool key expires", LEASE_TTL * 2, || async { pool_keys(&fx).await.is_empty() }).await;
    eventually("the orphaned pool reads as records", Duration::from_secs(60), || async {
        let all: BTreeSet<IpAddr> = reader.allocated().await.unwrap_or_default().into_iter().collect();
        orphaned.iter().all(|ip| all.contains(ip))
    })
    .await;
    drop(reader);
    cleanup(&fx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pools_never_make_a_range_look_full_before_it_is() {
    // /25: 126 usable, static band 16, dynamic 110: a pool of at most 13.
    let fx = Fixture::new(Backend::Etcd, &["198.18.95.0/25"]).await;
    let holder = open(&fx, 64).await;
    eventually("the pool is filled", Duration::from_secs(60), || async { holder.pool_ready() }).await;
    assert_eq!(holder.pooled(), vec![13], "capped at an eighth of the dynamic band");
    let other = open(&fx, 0).await;
    // Every address of the range, the holder's pooled ones included (claimed from it).
    let mut got = HashSet::new();
    for _ in 0..126 {
        let ip = other.allocate_next(Family::IPv4, None).await.expect("an address while any is free");
        assert!(got.insert(ip), "{ip} handed out twice");
    }
    match other.allocate_next(Family::IPv4, None).await {
        Err(StoreError::Alloc(AllocError::Full)) => {}
        r => panic!("127th allocation in a /25: expected range full, got {r:?}"),
    }
    assert_eq!(holder.pooled(), vec![0], "the holder's pool was claimed empty");
    match holder.allocate_next(Family::IPv4, None).await {
        Err(StoreError::Alloc(AllocError::Full)) => {}
        r => panic!("the holder must find the range full too, got {r:?}"),
    }
    drop((holder, other));
    cleanup(&fx).await;
}

/// Static requests for every address of a range, sent as a pooled replica opens, race its
/// pool's first fill: the fill can record an address in the same transaction as (or just
/// before) the static request for it is decided. The replica's pool learns of the fill only
/// when its transaction returns, another replica's watch a moment later still. Each request
/// is granted all the same (a pooled address is free), from the pooled replica itself (even
/// rounds) or from another (odd rounds, through a claim). (The soak saw one refused
/// "provided IP is already allocated".)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn static_requests_racing_the_first_fill_are_all_granted() {
    // /26: 62 usable, static band 16, dynamic 46: a pool of 5 from the dynamic band.
    let cidr = "198.18.94.0/26";
    let all: Vec<IpAddr> = (1..63u32).map(|i| IpAddr::V4(std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(198, 18, 94, 0)) + i))).collect();
    for round in 0..12 {
        let fx = Fixture::new(Backend::Etcd, &[cidr]).await;
        let other = if round % 2 == 1 { Some(open(&fx, 0).await) } else { None };
        let pooled = open(&fx, 64).await;
        let asker = other.as_ref().unwrap_or(&pooled);
        let results = futures::future::join_all(all.iter().map(|ip| async move { (*ip, asker.allocate(*ip, None).await) })).await;
        let refused: Vec<String> = results.iter().filter_map(|(ip, r)| r.as_ref().err().map(|e| format!("{ip}: {e}"))).collect();
        assert!(refused.is_empty(), "round {round}: every free address is granted to a static request, refused: {refused:?}");
        assert_eq!(asker.allocated().await.expect("allocated"), all, "round {round}: every address is a record");
        assert_eq!(pooled.pooled(), vec![0], "round {round}: nothing is left pooled");
        drop((results, other, pooled));
        cleanup(&fx).await;
    }
}

/// The pool keys of the fixture's first range, by name below `<range key>/pool/`: (value,
/// mod revision).
async fn pool_key_revisions(fx: &Fixture) -> BTreeMap<String, (Vec<u8>, i64)> {
    let prefix = pool_prefix(&range_key(&fx.prefix, &fx.cidrs[0]));
    let mut client = etcd_client::Client::connect(fx.cp.etcd_endpoints(), None).await.expect("etcd");
    let resp = client.get(prefix.clone(), Some(etcd_client::GetOptions::new().with_prefix())).await.expect("get");
    resp.kvs()
        .iter()
        .filter_map(|kv| Some((kv.key_str().ok()?.strip_prefix(&prefix)?.to_string(), (kv.value().to_vec(), kv.mod_revision()))))
        .collect()
}

/// Each hand-out makes etcd keep one more revision of what it rewrites until the next
/// compaction: a key of at most CHUNK addresses, not a list of the whole pool (docs/reliability.md, "Soak").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hand_out_rewrites_one_small_pool_key() {
    // /20: dynamic band 3838, so the pool keeps all 200 asked for.
    let fx = Fixture::new(Backend::Etcd, &["198.18.112.0/20"]).await;
    let a = open(&fx, 200).await;
    eventually("the pool is filled", Duration::from_secs(60), || async { a.pool_ready() && a.pooled() == vec![200] }).await;
    let before = pool_key_revisions(&fx).await;
    let sizes: Vec<usize> = before.values().map(|(v, _)| decode_pool(v).len()).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 200, "the pool keys list the whole pool: {sizes:?}");
    assert!(sizes.iter().all(|n| *n <= CHUNK), "no pool key lists more than {CHUNK} addresses: {sizes:?}");
    let members: BTreeSet<&str> = before.keys().map(|k| pool_member(k)).collect();
    assert_eq!(members.len(), 1, "one replica's keys: {:?}", before.keys());

    // One hand-out: exactly one key is rewritten (or deleted), the others are untouched.
    let ip = a.allocate_next(Family::IPv4, None).await.expect("allocate_next");
    eventually("the key that listed the handed-out address is rewritten", Duration::from_secs(60), || async {
        !pool_keys(&fx).await.contains(&ip)
    })
    .await;
    let after = pool_key_revisions(&fx).await;
    let changed: Vec<&String> = before.keys().filter(|k| after.get(*k).map(|(_, rev)| *rev) != Some(before[*k].1)).collect();
    assert_eq!(changed.len(), 1, "one hand-out rewrote {changed:?}");
    let rewritten = after.get(changed[0]).map(|(v, _)| v.len()).unwrap_or(0);
    let whole: usize = before.values().map(|(v, _)| v.len()).sum();
    assert!(rewritten * 3 < whole, "the rewrite ({rewritten} bytes) is a fraction of the pool's listing ({whole} bytes)");
    drop(a);
    cleanup(&fx).await;
}

/// Replicas of the version before chunked pool keys run beside this one during a rolling
/// update: their key `<range key>/pool/<member>` is read as that member's pool, and their
/// claim addressed to one of our keys by name (`<member>/<chunk>`) is answered by us.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_keys_and_claims_of_the_version_before_chunks_are_understood() {
    let fx = Fixture::new(Backend::Etcd, &["198.18.99.0/24"]).await;
    let key = range_key(&fx.prefix, &fx.cidrs[0]);
    let mut client = etcd_client::Client::connect(fx.cp.etcd_endpoints(), None).await.expect("etcd");

    // An old replica's pool key, over two addresses recorded in the map.
    let reader = open(&fx, 0).await;
    let listed: Vec<IpAddr> = ["198.18.99.200", "198.18.99.201"].iter().map(|s| s.parse().expect("ip")).collect();
    for ip in &listed {
        reader.allocate(*ip, None).await.expect("record the address");
    }
    let old = "00000000000000ab";
    let lease = client.lease_grant(60, None).await.expect("lease").id();
    let body: String = listed.iter().map(|ip| format!("{ip}\n")).collect();
    client
        .put(format!("{}{old}", pool_prefix(&key)), body, Some(etcd_client::PutOptions::new().with_lease(lease)))
        .await
        .expect("write the old-shape pool key");
    eventually("the old-shape key's addresses read as pooled (free in reserve)", Duration::from_secs(60), || async {
        reader.usage().await.map(|u| u[0].pooled == 2 && u[0].used == 0).unwrap_or(false)
    })
    .await;
    assert!(!reader.has(listed[0]).await.expect("has"), "pooled, so not a record");
    // A static request for one is a claim addressed to that member (which is gone here, so
    // nobody answers: a retryable error naming it, nothing given).
    match reader.allocate(listed[0], None).await {
        Err(e @ StoreError::Unavailable(_)) => assert!(e.to_string().contains(old), "the claim names the old member: {e}"),
        r => panic!("a static request for an address an unanswering replica pools: expected a retryable error, got {r:?}"),
    }

    // A claim as the old version addresses it: to our pool key by its name.
    let a = open(&fx, 16).await;
    eventually("the pool is filled", Duration::from_secs(60), || async { a.pool_ready() }).await;
    let ours = pool_key_revisions(&fx).await;
    let (name, (value, _)) = ours.iter().find(|(k, _)| k.contains('/')).expect("a chunked pool key of ours");
    let wanted = *decode_pool(value).iter().next().expect("a pooled address");
    let claim = claim_key(&key, wanted);
    let claim_lease = client.lease_grant(30, None).await.expect("lease").id();
    client
        .put(claim.clone(), format!(r#"{{"owner":"{name}","claimant":"old-replica"}}"#), Some(etcd_client::PutOptions::new().with_lease(claim_lease)))
        .await
        .expect("write the claim");
    eventually("the owner answers the claim addressed by key name", Duration::from_secs(30), || {
        let (mut client, claim) = (client.clone(), claim.clone());
        async move {
            let resp = client.get(claim, None).await.expect("read the claim");
            resp.kvs().first().is_some_and(|kv| String::from_utf8_lossy(kv.value()).contains(r#""answer":"granted""#))
        }
    })
    .await;
    let mut handed = HashSet::new();
    for _ in 0..40 {
        handed.insert(a.allocate_next(Family::IPv4, None).await.expect("allocate_next"));
    }
    assert!(!handed.contains(&wanted), "the owner handed out {wanted}, which it granted to the claim");
    let _ = client.lease_revoke(lease).await;
    drop((a, reader));
    cleanup(&fx).await;
}
