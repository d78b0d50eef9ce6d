//! The dev control plane is real: Services get addresses from the kube-apiserver's own
//! allocator, which records them as networking.k8s.io/v1 IPAddress objects under the
//! default ServiceCIDR.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};

use clusterip_test_support::{control_plane, unique_name};

fn service(name: &str) -> Service {
    Service {
        metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort { port: 80, ..Default::default() }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn service_gets_a_cluster_ip_recorded_as_an_ipaddress() {
    let cp = control_plane();
    let client = cp.client().await;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let name = unique_name("first");

    let created = services.create(&PostParams::default(), &service(&name)).await.expect("create Service");
    let ip: IpAddr = created
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.as_deref())
        .expect("clusterIP set by the apiserver")
        .parse()
        .expect("clusterIP parses");
    let IpAddr::V4(v4) = ip else { panic!("default family is IPv4, got {ip}") };
    assert_eq!(v4.octets()[..2], [198, 19], "{ip} is outside 198.19.0.0/16");

    // Read back through a GET, not only the create response.
    let read = services.get(&name).await.expect("get Service");
    assert_eq!(read.spec.and_then(|s| s.cluster_ip), Some(ip.to_string()));

    // The apiserver's allocator recorded the address as an IPAddress owned by the Service.
    let ipaddresses: Api<IPAddress> = Api::all(client.clone());
    let record = ipaddresses.get(&ip.to_string()).await.expect("IPAddress named by the clusterIP");
    let parent = record.spec.parent_ref;
    assert_eq!((parent.resource.as_str(), parent.namespace.as_deref(), parent.name.as_str()), ("services", Some("default"), name.as_str()));
    let labels = record.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("ipaddress.kubernetes.io/managed-by").map(String::as_str), Some("ipallocator.k8s.io"));
    assert_eq!(labels.get("ipaddress.kubernetes.io/ip-family").map(String::as_str), Some("IPv4"));

    services.delete(&name, &DeleteParams::default()).await.expect("delete Service");
}

#[tokio::test]
async fn default_servicecidr_lists_both_families() {
    let cp = control_plane();
    let client = cp.client().await;
    let cidrs: Api<ServiceCIDR> = Api::all(client.clone());
    let list = cidrs.list(&ListParams::default()).await.expect("list ServiceCIDRs");
    let default = list
        .items
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("kubernetes"))
        .expect("the default ServiceCIDR named kubernetes");
    let spec_cidrs = default.spec.as_ref().and_then(|s| s.cidrs.clone()).unwrap_or_default();
    assert_eq!(spec_cidrs, vec!["198.19.0.0/16".to_string(), "fd00:10:96::/112".to_string()]);

    // The list of IPAddresses works and holds at least the kubernetes Service's address.
    let ipaddresses: Api<IPAddress> = Api::all(client);
    let all = ipaddresses.list(&ListParams::default()).await.expect("list IPAddresses");
    assert!(all.items.iter().any(|a| a.metadata.name.as_deref() == Some("198.19.0.1")), "198.19.0.1 (the kubernetes Service) not recorded");
}
