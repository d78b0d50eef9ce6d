//! Services written straight into the kube-apiserver's etcd, for benchmarks at a scale the
//! API cannot create in minutes (25–100 objects/s here): JSON values under the apiserver's
//! own keys, which it decodes like its protobuf ones. Each Service `bench-inject/svc-<i>`
//! holds one IPv4 address; with `ipaddresses`, also the IPAddress object naming it, as the
//! kube-apiserver's allocator would have written it (`/registry/ipaddresses/<address>`,
//! managed by `ipallocator.k8s.io`).

use std::net::IpAddr;

/// The namespace the injected Services are in.
pub const NAMESPACE: &str = "bench-inject";

/// Write Service `svc-<i>` with address `ip` for each `(i, ip)`, 128 per transaction.
pub async fn services(endpoints: &[String], addresses: impl IntoIterator<Item = (u64, IpAddr)>, ipaddresses: bool) -> Result<u64, etcd_client::Error> {
    let mut client = etcd_client::Client::connect(endpoints, None).await?;
    let mut written = 0;
    let mut batch = Vec::new();
    for (i, ip) in addresses {
        let ip = ip.to_string();
        let svc = serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": format!("svc-{i}"), "namespace": NAMESPACE, "uid": format!("00000000-0000-4000-8000-{i:012}"),
                         "creationTimestamp": "2026-11-22T16:00:00Z"},
            "spec": {"clusterIP": ip, "clusterIPs": [ip], "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "type": "ClusterIP",
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}], "sessionAffinity": "None",
                     "internalTrafficPolicy": "Cluster"},
            "status": {"loadBalancer": {}}
        });
        batch.push(etcd_client::TxnOp::put(format!("/registry/services/specs/{NAMESPACE}/svc-{i}"), svc.to_string(), None));
        if ipaddresses {
            let record = serde_json::json!({
                "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
                "metadata": {"name": ip, "uid": format!("00000000-0000-4000-9000-{i:012}"), "creationTimestamp": "2026-11-22T16:00:00Z",
                             "labels": {"ipaddress.kubernetes.io/ip-family": "IPv4", "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io"}},
                "spec": {"parentRef": {"group": "", "resource": "services", "namespace": NAMESPACE, "name": format!("svc-{i}")}}
            });
            batch.push(etcd_client::TxnOp::put(format!("/registry/ipaddresses/{ip}"), record.to_string(), None));
        }
        written += 1;
        if batch.len() >= 128 {
            client.txn(etcd_client::Txn::new().and_then(std::mem::take(&mut batch))).await?;
        }
    }
    if !batch.is_empty() {
        client.txn(etcd_client::Txn::new().and_then(batch)).await?;
    }
    Ok(written)
}
