//! Importing Kubernetes' legacy RangeAllocation into the etcd backend, with the real etcd of
//! the test control plane: the envelope decoder on bytes the real kube-apiserver wrote, and
//! `clusterip import-rangeallocation` from an etcd key and from a JSON file.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::process::Command;

use clusterip::cidr::ServiceCidr;
use clusterip::store::etcd::{EtcdConfig, EtcdStore};
use clusterip::store::legacy::RangeAllocation;
use clusterip::store::AllocationStore;
use clusterip_test_support::{control_plane, unique_name};

fn varint(mut n: usize, out: &mut Vec<u8>) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// A length-delimited protobuf field.
fn field(number: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![(number << 3) | 2];
    varint(bytes.len(), &mut out);
    out.extend_from_slice(bytes);
    out
}

/// The value the kube-apiserver stores for a RangeAllocation: `k8s\0` + runtime.Unknown.
fn envelope(range: &str, data: &[u8]) -> Vec<u8> {
    let type_meta = [field(1, b"v1"), field(2, b"RangeAllocation")].concat();
    let object = [field(1, &[]), field(2, range.as_bytes()), field(3, data)].concat();
    let unknown = [field(1, &type_meta), field(2, &object), field(4, b"application/vnd.kubernetes.protobuf")].concat();
    [b"k8s\0".as_slice(), &unknown].concat()
}

fn import(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_clusterip")).arg("import-rangeallocation").args(args).output().expect("run clusterip");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn decodes_the_envelope_the_real_apiserver_wrote() {
    let cp = control_plane();
    let cfg = EtcdConfig { endpoints: cp.etcd_endpoints(), ..Default::default() };
    // Since 1.33 the apiserver no longer keeps the Service IP bitmap, but it still keeps the
    // NodePort one in the same RangeAllocation format.
    let raw = EtcdStore::read_key(&cfg, "/registry/ranges/servicenodeports").await.expect("etcd").expect("the apiserver's NodePort RangeAllocation");
    let legacy = RangeAllocation::decode(&raw).expect("decode real bytes");
    assert_eq!(legacy.range, "30000-32767");
    let err = legacy.to_map().expect_err("a port range is not a service CIDR").to_string();
    assert!(err.contains("30000-32767"), "{err}");
}

#[tokio::test]
async fn imports_from_an_etcd_key_and_from_a_file_as_a_union() {
    let cp = control_plane();
    let endpoints = cp.etcd_endpoints().join(",");
    let prefix = format!("/clusterip-test/{}", unique_name("import"));
    let cidr = ServiceCidr::parse("198.18.40.0/24").expect("cidr");
    // Offsets 0, 9 and 100 → 198.18.40.1, .10, .101 (bit i of the big-endian integer).
    let mut data = vec![0u8; 13];
    data[12] |= 1; // offset 0
    data[11] |= 1 << 1; // offset 9
    data[0] |= 1 << 4; // offset 100
    let key = format!("{prefix}/legacy-serviceips");
    let mut client = etcd_client::Client::connect([cp.etcd_endpoints()[0].as_str()], None).await.expect("etcd");
    client.put(key.as_str(), envelope("198.18.40.0/24", &data), None).await.expect("put legacy value");

    let (ok, out, err) = import(&["--etcd-key", &key, "--etcd-endpoints", &endpoints, "--etcd-prefix", &prefix]);
    assert!(ok, "{err}");
    assert!(out.contains("3 addresses, 3 newly recorded"), "{out}");

    let cfg = EtcdConfig { endpoints: cp.etcd_endpoints(), prefix: prefix.clone(), ..Default::default() };
    let store = EtcdStore::open(&cfg, vec![cidr.clone()]).await.expect("open");
    let want: BTreeSet<IpAddr> = ["198.18.40.1", "198.18.40.10", "198.18.40.101"].iter().map(|s| s.parse().expect("ip")).collect();
    assert_eq!(store.allocated().await.expect("read").into_iter().collect::<BTreeSet<_>>(), want);

    // The JSON form from a file, overlapping by one address: a union, nothing dropped.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("serviceips.json");
    use base64::Engine as _;
    let json = serde_json::json!({"range": "198.18.40.0/24", "data": base64::engine::general_purpose::STANDARD.encode([0b0000_0100u8, 0b0000_0001])});
    std::fs::write(&file, json.to_string()).expect("write");
    let (ok, out, err) = import(&["--file", &file.display().to_string(), "--etcd-endpoints", &endpoints, "--etcd-prefix", &prefix]);
    assert!(ok, "{err}");
    // Offsets 0 (already there) and 10 (new).
    assert!(out.contains("2 addresses, 1 newly recorded, 1 already recorded"), "{out}");
    let store = EtcdStore::open(&cfg, vec![cidr]).await.expect("reopen");
    assert_eq!(store.allocated().await.expect("read").len(), 4);
    let _ = client.delete(prefix.as_str(), Some(etcd_client::DeleteOptions::new().with_prefix())).await;
}

#[tokio::test]
async fn bad_sources_are_clear_errors() {
    let cp = control_plane();
    let endpoints = cp.etcd_endpoints().join(",");
    let (ok, _, err) = import(&["--etcd-key", "/clusterip-test/does-not-exist", "--etcd-endpoints", &endpoints]);
    assert!(!ok && err.contains("does not exist"), "{err}");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("garbage");
    std::fs::write(&file, b"\x00\x01garbage").expect("write");
    let (ok, _, err) = import(&["--file", &file.display().to_string(), "--etcd-endpoints", &endpoints]);
    assert!(!ok && err.contains("not a RangeAllocation"), "{err}");
    let beyond = serde_json::json!({"range": "198.18.41.0/30", "data": "/w=="});
    std::fs::write(&file, beyond.to_string()).expect("write");
    let (ok, _, err) = import(&["--file", &file.display().to_string(), "--etcd-endpoints", &endpoints]);
    assert!(!ok && err.contains("beyond"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
