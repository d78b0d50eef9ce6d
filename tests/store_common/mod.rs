//! What the backend tests share: a fixture per test (its ranges, its etcd prefix, a clean
//! slate) and allocator processes run through the `clusterip allocate` command.

#![allow(dead_code)]

use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use clusterip::cidr::ServiceCidr;
use clusterip::store::etcd::{EtcdConfig, EtcdStore};
use clusterip::store::ipaddress::{IpAddressConfig, IpAddressStore, DEFAULT_MANAGER};
use clusterip::store::AllocationStore;
use clusterip_test_support::{control_plane, unique_name, ControlPlane};
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, ListParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Etcd,
    /// The etcd backend with the controller's address pool (dynamic requests answered from
    /// addresses recorded ahead of need); its processes (`clusterip allocate`) have none.
    EtcdPooled,
    IpAddress,
}

pub struct Fixture {
    pub backend: Backend,
    pub cidrs: Vec<ServiceCidr>,
    pub prefix: String,
    pub cp: Arc<ControlPlane>,
}

impl Fixture {
    /// A fixture on the shared test control plane.
    pub async fn new(backend: Backend, cidrs: &[&str]) -> Self {
        Self::on(control_plane(), backend, cidrs).await
    }

    /// A fixture on a given control plane; removes leftovers of earlier runs in its ranges.
    pub async fn on(cp: Arc<ControlPlane>, backend: Backend, cidrs: &[&str]) -> Self {
        let cidrs: Vec<ServiceCidr> = cidrs.iter().map(|c| ServiceCidr::parse(c).expect("test CIDR")).collect();
        let fx = Self { backend, cidrs, prefix: format!("/clusterip-test/{}", unique_name("run")), cp };
        if backend == Backend::IpAddress {
            fx.delete_ipaddresses().await;
        }
        fx
    }

    pub fn etcd_config(&self) -> EtcdConfig {
        let pool_size = if self.backend == Backend::EtcdPooled { 64 } else { 0 };
        EtcdConfig { endpoints: self.cp.etcd_endpoints(), prefix: self.prefix.clone(), pool_size, ..Default::default() }
    }

    pub async fn open(&self) -> Box<dyn AllocationStore> {
        match self.backend {
            Backend::Etcd | Backend::EtcdPooled => Box::new(EtcdStore::open(&self.etcd_config(), self.cidrs.clone()).await.expect("open etcd store")),
            Backend::IpAddress => {
                let cfg = IpAddressConfig { ranges: self.cidrs.clone(), ..Default::default() };
                Box::new(IpAddressStore::open(self.cp.client().await, cfg).await.expect("open IPAddress store"))
            }
        }
    }

    /// The `clusterip` arguments that select this fixture's backend and ranges.
    pub fn backend_args(&self) -> Vec<String> {
        let mut args = vec![
            "--service-cidr".to_string(),
            self.cidrs.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(","),
        ];
        match self.backend {
            Backend::Etcd | Backend::EtcdPooled => args.extend([
                "--backend".into(),
                "etcd".into(),
                "--etcd-endpoints".into(),
                self.cp.etcd_endpoints().join(","),
                "--etcd-prefix".into(),
                self.prefix.clone(),
            ]),
            Backend::IpAddress => args.extend([
                "--backend".into(),
                "ipaddress".into(),
                "--kubeconfig".into(),
                self.cp.kubeconfig().display().to_string(),
            ]),
        }
        args
    }

    /// Remove what the test recorded.
    pub async fn cleanup(&self, store: Box<dyn AllocationStore>) {
        drop(store);
        match self.backend {
            Backend::Etcd | Backend::EtcdPooled => {
                let mut client = etcd_client::Client::connect(self.cp.etcd_endpoints(), None).await.expect("etcd");
                client
                    .delete(self.prefix.clone(), Some(etcd_client::DeleteOptions::new().with_prefix()))
                    .await
                    .expect("delete test prefix");
            }
            Backend::IpAddress => self.delete_ipaddresses().await,
        }
    }

    /// Delete our IPAddress objects inside this fixture's ranges.
    async fn delete_ipaddresses(&self) {
        let api: Api<IPAddress> = Api::all(self.cp.client().await);
        let lp = ListParams::default().labels(&format!("ipaddress.kubernetes.io/managed-by={DEFAULT_MANAGER}"));
        let list = api.list(&lp).await.expect("list IPAddresses");
        let doomed: Vec<String> = list
            .items
            .into_iter()
            .filter_map(|a| a.metadata.name)
            .filter(|n| n.parse::<IpAddr>().map(|ip| self.cidrs.iter().any(|c| c.contains(ip))).unwrap_or(false))
            .collect();
        futures::future::join_all(doomed.iter().map(|n| {
            let api = api.clone();
            async move {
                let _ = api.delete(n, &DeleteParams::default()).await;
            }
        }))
        .await;
    }
}

/// What one allocator process reported.
pub struct Run {
    pub success: bool,
    pub ips: Vec<IpAddr>,
    pub stderr: String,
}

/// Start `procs` processes of `clusterip allocate --count N --concurrency C`.
pub fn spawn_allocators(fx: &Fixture, procs: usize, count: usize, concurrency: usize, extra: &[&str]) -> Vec<Child> {
    (0..procs)
        .map(|i| {
            clusterip_test_support::die_with_parent(&mut Command::new(env!("CARGO_BIN_EXE_clusterip")))
                .arg("allocate")
                .args(fx.backend_args())
                .args(["--count", &count.to_string(), "--concurrency", &concurrency.to_string()])
                .args(["--parent", &format!("services/default/proc-{i}")])
                .args(extra)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start clusterip allocate")
        })
        .collect()
}

/// Wait for allocator processes and parse what they printed. Every child's output is read
/// at once, each on a thread of its own: read one after another, a child whose stderr
/// filled its pipe (64 KiB of warnings while an apiserver restarts) blocked until the ones
/// before it ended, and the run hung (found by `scripts/test-soak.sh`).
pub fn collect(children: Vec<Child>) -> Vec<Run> {
    let readers: Vec<_> = children.into_iter().map(|c| std::thread::spawn(move || c.wait_with_output())).collect();
    readers
        .into_iter()
        .map(|r| {
            let out = r.join().expect("the reader thread").expect("allocator output");
            let stdout = String::from_utf8_lossy(&out.stdout);
            Run {
                success: out.status.success(),
                ips: stdout.lines().map(|l| l.parse().unwrap_or_else(|_| panic!("allocator printed {l:?}"))).collect(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }
        })
        .collect()
}

pub fn run_allocators(fx: &Fixture, procs: usize, count: usize, concurrency: usize, extra: Option<&[&str]>) -> Vec<Run> {
    collect(spawn_allocators(fx, procs, count, concurrency, extra.unwrap_or(&[])))
}
