//! `clusterip import-rangeallocation`: migrate Kubernetes' legacy Service IP bitmap (a
//! RangeAllocation) into the etcd backend's allocation map.

use anyhow::Context as _;

use crate::store::etcd::{EtcdArgs, EtcdConfig, EtcdStore};
use crate::store::legacy::RangeAllocation;

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["file", "etcd_key"])))]
pub struct ImportArgs {
    /// Read the RangeAllocation from a file: the raw etcd value (Kubernetes protobuf,
    /// `k8s\0…`) or its JSON form `{"range": "10.96.0.0/12", "data": "<base64>"}`.
    #[arg(long, value_name = "PATH")]
    pub file: Option<std::path::PathBuf>,

    /// Read it from this key of the etcd named by --etcd-endpoints, e.g.
    /// /registry/ranges/serviceips (the kube-apiserver's own key).
    #[arg(long, value_name = "KEY")]
    pub etcd_key: Option<String>,

    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Largest legacy value read (a /8 bitmap is 2 MiB; this leaves room for the envelope).
const MAX_LEGACY_BYTES: u64 = 32 << 20;

pub async fn run(args: ImportArgs) -> anyhow::Result<i32> {
    let cfg: EtcdConfig = args.etcd.clone().into();
    let source = match (args.file, args.etcd_key) {
        (Some(path), _) => Source::File(path),
        (None, Some(key)) => Source::EtcdKey(key),
        (None, None) => anyhow::bail!("give --file or --etcd-key"),
    };
    let imported = import(&cfg, &source).await?;
    println!("{imported}");
    Ok(0)
}

/// Where a legacy RangeAllocation is read from.
#[derive(Clone, Debug)]
pub enum Source {
    File(std::path::PathBuf),
    EtcdKey(String),
}

impl Source {
    /// `clusterip repair --import-rangeallocation <file|etcd key>`: an existing file, else a key.
    pub fn guess(arg: &str) -> Self {
        let path = std::path::Path::new(arg);
        if path.is_file() {
            Source::File(path.to_path_buf())
        } else {
            Source::EtcdKey(arg.to_string())
        }
    }
}

/// What an import did.
#[derive(Clone, Debug)]
pub struct Imported {
    pub cidr: crate::cidr::ServiceCidr,
    pub addresses: u64,
    pub added: usize,
}

impl std::fmt::Display for Imported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "imported {} from the RangeAllocation: {} addresses, {} newly recorded, {} already recorded",
            self.cidr,
            self.addresses,
            self.added,
            (self.addresses as usize).saturating_sub(self.added)
        )
    }
}

/// Read a legacy RangeAllocation and merge it into the etcd backend's map of its CIDR.
pub async fn import(cfg: &EtcdConfig, source: &Source) -> anyhow::Result<Imported> {
    let bytes = match source {
        Source::File(path) => {
            let len = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len();
            if len > MAX_LEGACY_BYTES {
                anyhow::bail!("{} is {len} bytes; a RangeAllocation is at most {MAX_LEGACY_BYTES}", path.display());
            }
            std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
        }
        Source::EtcdKey(key) => EtcdStore::read_key(cfg, key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("etcd key {key} does not exist at {} (and no file has that name)", cfg.endpoints.join(",")))?,
    };
    let legacy = RangeAllocation::decode(&bytes)?;
    let map = legacy.to_map()?;
    let store = EtcdStore::open(cfg, vec![map.cidr().clone()]).await?;
    let added = store.import(&map).await?;
    Ok(Imported { cidr: map.cidr().clone(), addresses: map.used(), added })
}
