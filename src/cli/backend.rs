//! Flags that choose and configure the allocation backend, shared by every subcommand that
//! reads or writes allocation records.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;

use crate::cidr::ServiceCidr;
use crate::store::etcd::{EtcdArgs, EtcdStore};
use crate::store::ipaddress::{IpAddressConfig, IpAddressStore, DEFAULT_MANAGER};
use crate::store::AllocationStore;
pub use crate::store::BackendKind;

#[derive(Clone, Debug, clap::Args)]
pub struct BackendArgs {
    /// Backend that records allocations.
    #[arg(long, value_enum, default_value_t = BackendKind::Ipaddress, env = "CLUSTERIP_BACKEND")]
    pub backend: BackendKind,

    /// Service CIDR to allocate from; repeat for several ranges (at most one default family:
    /// the family of the first range is the default for Services).
    #[arg(long = "service-cidr", value_name = "CIDR", value_delimiter = ',')]
    pub service_cidrs: Vec<String>,

    /// (ipaddress backend) Also allocate from the cluster's ServiceCIDR objects that are
    /// Ready and not being deleted.
    #[arg(long)]
    pub use_servicecidrs: bool,

    /// (ipaddress backend) Value of the ipaddress.kubernetes.io/managed-by label on the
    /// IPAddress objects we create.
    #[arg(long, default_value = DEFAULT_MANAGER)]
    pub manager: String,

    /// kubeconfig for the ipaddress backend (default: KUBECONFIG, then in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    #[command(flatten)]
    pub etcd: EtcdArgs,
}

impl BackendArgs {
    /// The configured ranges, parsed strictly.
    pub fn ranges(&self) -> anyhow::Result<Vec<ServiceCidr>> {
        let ranges = self
            .service_cidrs
            .iter()
            .map(|s| ServiceCidr::parse(s).map_err(|e| anyhow::anyhow!("--service-cidr {s}: {e}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                if a.overlaps(b) {
                    anyhow::bail!("--service-cidr {a} and {b} overlap; give ranges that do not share addresses");
                }
            }
        }
        Ok(ranges)
    }

    /// Open the chosen backend.
    pub async fn open(&self) -> anyhow::Result<Arc<dyn AllocationStore>> {
        self.open_with_pool(0).await
    }

    /// Open the chosen backend; the etcd backend keeps an address pool of `pool_size`
    /// addresses per range (0 = none; see `clusterip controller --etcd-address-pool`).
    pub async fn open_with_pool(&self, pool_size: usize) -> anyhow::Result<Arc<dyn AllocationStore>> {
        let ranges = self.ranges()?;
        match self.backend {
            BackendKind::Etcd => {
                if ranges.is_empty() {
                    anyhow::bail!("the etcd backend needs at least one --service-cidr");
                }
                let mut cfg: crate::store::etcd::EtcdConfig = self.etcd.clone().into();
                cfg.pool_size = pool_size;
                let store = EtcdStore::open(&cfg, ranges).await?;
                Ok(Arc::new(store))
            }
            BackendKind::Ipaddress => {
                if ranges.is_empty() && !self.use_servicecidrs {
                    anyhow::bail!("the ipaddress backend needs --service-cidr, --use-servicecidrs, or both");
                }
                let client = kube_client(self.kubeconfig.as_deref()).await?;
                let cfg = IpAddressConfig {
                    ranges,
                    use_servicecidrs: self.use_servicecidrs,
                    manager: self.manager.clone(),
                    ..Default::default()
                };
                Ok(Arc::new(IpAddressStore::open(client, cfg).await?))
            }
        }
    }
}

/// A kube client from an explicit kubeconfig, or the usual defaults.
pub async fn kube_client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no kubeconfig given and none found (KUBECONFIG, ~/.kube/config, in-cluster)")?,
    };
    kube::Client::try_from(config).context("building the Kubernetes client")
}
