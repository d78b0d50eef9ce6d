//! `clusterip repair`: one repair pass from the command line — a dry run by default.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;

use crate::repair::{Outcome, PassResult, Repairer, Target};

use super::backend::{BackendArgs, BackendKind};
use super::OutputFormat;

/// Exit code: nothing found.
pub const EXIT_CONSISTENT: i32 = 0;
/// Exit code: drift found (dry run) or left after --fix.
pub const EXIT_DRIFT: i32 = 1;
/// Exit code: the pass could not run or an action failed.
pub const EXIT_ERROR: i32 = 2;

#[derive(Debug, clap::Args)]
#[command(after_long_help = "Exit codes: 0 = consistent, 1 = drift found (or left after --fix), 2 = error.\n\n\
Leaks: the controller releases a leaked allocation-map address after it was seen leaked on 3 \
consecutive passes, and an orphaned IPAddress once it is older than --grace-period. A one-shot \
`repair --fix` has seen a leak only once, so it releases nothing leaked from the etcd backend \
unless --release-leaks-now is given; with the ipaddress backend it releases orphans older than \
--grace-period.")]
pub struct RepairArgs {
    #[command(flatten)]
    pub backend: BackendArgs,

    /// Output format of the report.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,

    /// Apply the actions: recreate missing records, replace wrong ones, release leaks (only
    /// under the grace rules, see --release-leaks-now) and post Warning Events on Services.
    /// Never takes an address from a live Service.
    #[arg(long)]
    pub fix: bool,

    /// With --fix: release every leaked record found now, without waiting for 3 passes
    /// (etcd backend) or the grace period (ipaddress backend). An address the webhook has
    /// just assigned to a Service not yet stored looks leaked for a moment: use this only
    /// when no Services are being created.
    #[arg(long, requires = "fix")]
    pub release_leaks_now: bool,

    /// (ipaddress backend) An IPAddress whose Service does not exist is released only once
    /// it is older than this, e.g. 60s.
    #[arg(long, default_value = "60s", value_parser = clusterip_component_base::parse_duration)]
    pub grace_period: Duration,

    /// Read-only audit of a cluster where only the kube-apiserver allocates: its IPAddress
    /// objects (managed-by ipallocator.k8s.io) against its Services, ranges from its
    /// ServiceCIDR objects. Needs only a kubeconfig; changes nothing.
    #[arg(long, conflicts_with_all = ["fix", "import_rangeallocation"])]
    pub audit_apiserver: bool,

    /// Before the pass, migrate Kubernetes' legacy Service IP bitmap (a RangeAllocation) from
    /// this file, or else from this etcd key (e.g. /registry/ranges/serviceips), into the
    /// etcd backend (as `clusterip import-rangeallocation` does).
    #[arg(long, value_name = "FILE|ETCD_KEY")]
    pub import_rangeallocation: Option<String>,

    /// (etcd backend) Before the pass, replace every allocation map that cannot be read
    /// with one rebuilt from the cluster: the addresses of every Service and IPAddress
    /// object, the owner records and the replicas' address pools. Readable maps are left
    /// alone. The way back from a corrupt map (docs/operations.md, "Corrupt records").
    #[arg(long, conflicts_with = "audit_apiserver")]
    pub rebuild: bool,
}

pub async fn run(args: RepairArgs) -> anyhow::Result<i32> {
    match pass(&args).await {
        Ok((result, took)) => {
            let code = if result.failed() > 0 {
                EXIT_ERROR
            } else if result.remaining() > 0 {
                EXIT_DRIFT
            } else {
                EXIT_CONSISTENT
            };
            print(&args, &result, took)?;
            Ok(code)
        }
        Err(e) => {
            clear_progress();
            Err(e)
        }
    }
}

async fn pass(args: &RepairArgs) -> anyhow::Result<(PassResult, Duration)> {
    let client = super::backend::kube_client(args.backend.kubeconfig.as_deref()).await?;
    let mut imported = None;
    if let Some(src) = &args.import_rangeallocation {
        if args.backend.backend != BackendKind::Etcd {
            anyhow::bail!("--import-rangeallocation needs --backend etcd: the legacy bitmap is migrated into the etcd backend");
        }
        let source = super::import::Source::guess(src);
        let done = super::import::import(&args.backend.etcd.clone().into(), &source).await?;
        eprintln!("{done}");
        imported = Some(done.cidr);
    }
    if args.rebuild {
        if args.backend.backend != BackendKind::Etcd {
            anyhow::bail!("--rebuild needs --backend etcd: it rebuilds the etcd backend's allocation maps (IPAddress objects are rebuilt by the pass itself)");
        }
        rebuild(args, &client).await?;
    }
    let target = if args.audit_apiserver {
        Target::Audit
    } else {
        // (The range just imported is the etcd backend's range when none is given.)
        let mut backend = args.backend.clone();
        if backend.backend == BackendKind::Etcd && backend.service_cidrs.is_empty() {
            if let Some(c) = &imported {
                backend.service_cidrs.push(c.to_string());
            }
        }
        backend.repair_target().await?
    };
    let mut repairer = Repairer::new(client, target).with_grace(args.grace_period);
    if args.fix {
        repairer = repairer.with_events(Some(format!("clusterip-repair-{}", std::process::id())));
    }
    let tty = std::io::stderr().is_terminal();
    let progress = move |phase: &str, n: usize| {
        if tty {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K{phase}: {n}");
            let _ = err.flush();
        }
    };
    let started = std::time::Instant::now();
    let result = repairer.run_once(args.fix, args.release_leaks_now, Some(&progress)).await.context("repair pass")?;
    clear_progress();
    Ok((result, started.elapsed()))
}

/// `--rebuild`: rewrite the unreadable maps, one line per map on stderr.
async fn rebuild(args: &RepairArgs, client: &kube::Client) -> anyhow::Result<()> {
    let ranges = args.backend.ranges()?;
    if ranges.is_empty() {
        anyhow::bail!("the etcd backend needs at least one --service-cidr");
    }
    let store = crate::store::etcd::EtcdStore::open(&args.backend.etcd.clone().into(), ranges).await?;
    let cluster = crate::repair::cluster_addresses(client).await.context("reading what the cluster holds")?;
    let done = store.rebuild_unreadable(&cluster).await?;
    if done.is_empty() {
        eprintln!("rebuild: every allocation map is readable; nothing rebuilt");
    }
    for r in done {
        eprintln!(
            "rebuild: {}: wrote a new map of {} addresses ({} held by Services and IPAddresses, {} with an owner record, {} in address pools)",
            r.key, r.addresses, r.from_cluster, r.owned, r.pooled
        );
    }
    Ok(())
}

fn clear_progress() {
    if std::io::stderr().is_terminal() {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K");
        let _ = err.flush();
    }
}

fn outcome_text(o: &Outcome, fix: bool) -> String {
    match o {
        Outcome::Applied => "done".into(),
        Outcome::Failed(e) => format!("failed: {e}"),
        Outcome::NotApplied if fix => "-".into(),
        Outcome::NotApplied => "dry run".into(),
    }
}

fn print(args: &RepairArgs, r: &PassResult, took: Duration) -> anyhow::Result<()> {
    let ranges: Vec<String> = r.ranges.iter().map(|c| c.to_string()).collect();
    let mut by_kind = std::collections::BTreeMap::new();
    for f in &r.report.findings {
        *by_kind.entry(f.kind.as_str()).or_insert(0usize) += 1;
    }
    let summary = format!(
        "{} finding(s){} in {} Services and {} records ({} backend, ranges {}, {:.2}s); {} left{}{}",
        r.report.findings.len(),
        if by_kind.is_empty() { String::new() } else { format!(" ({})", by_kind.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")) },
        r.report.services,
        r.report.records,
        r.backend,
        if ranges.is_empty() { "none".into() } else { ranges.join(",") },
        took.as_secs_f64(),
        r.remaining(),
        if r.failed() > 0 { format!(", {} action(s) failed", r.failed()) } else { String::new() },
        if args.fix || args.audit_apiserver { "" } else { " (dry run: nothing changed; --fix applies)" },
    );
    match args.output {
        OutputFormat::Json => {
            let findings: Vec<_> = r
                .report
                .findings
                .iter()
                .zip(&r.outcomes)
                .map(|(f, o)| {
                    json!({
                        "kind": f.kind.as_str(),
                        "address": f.address,
                        "owner": f.owner,
                        "action": f.action.code(),
                        "detail": f.action.to_string(),
                        "result": match o { Outcome::Applied => "applied", Outcome::NotApplied => "not-applied", Outcome::Failed(_) => "failed" },
                        "error": match o { Outcome::Failed(e) => Some(e.to_string()), _ => None },
                        "event": f.event.as_ref().map(|e| json!({"reason": e.reason, "message": e.note})),
                    })
                })
                .collect();
            let doc = json!({
                "backend": r.backend,
                "ranges": ranges,
                "services": r.report.services,
                "records": r.report.records,
                "foreign": r.report.foreign,
                "duration_s": took.as_secs_f64(),
                "fix": args.fix,
                "findings": findings,
                "remaining": r.remaining(),
                "failed": r.failed(),
                "consistent": r.remaining() == 0 && r.failed() == 0,
                "summary": summary,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
        OutputFormat::Text => {
            let mut out = std::io::stdout().lock();
            if !r.report.findings.is_empty() {
                let rows: Vec<[String; 5]> = r
                    .report
                    .findings
                    .iter()
                    .zip(&r.outcomes)
                    .map(|(f, o)| [f.kind.as_str().to_string(), f.address.clone(), f.owner.clone(), f.action.to_string(), outcome_text(o, args.fix)])
                    .collect();
                let header = ["KIND", "ADDRESS", "OWNER", "ACTION", "RESULT"];
                let mut widths = header.map(str::len);
                for row in &rows {
                    for (w, cell) in widths.iter_mut().zip(row) {
                        *w = (*w).max(cell.len());
                    }
                }
                let line = |cells: [&str; 5]| {
                    let mut s = String::new();
                    for (i, c) in cells.iter().enumerate() {
                        if i == 4 {
                            s.push_str(c);
                        } else {
                            s.push_str(&format!("{c:<w$}  ", w = widths[i]));
                        }
                    }
                    s
                };
                writeln!(out, "{}", line(header))?;
                for row in &rows {
                    writeln!(out, "{}", line([&row[0], &row[1], &row[2], &row[3], &row[4]]))?;
                }
            }
            writeln!(out, "{summary}")?;
        }
    }
    Ok(())
}
