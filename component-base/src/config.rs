//! Versioned configuration files whose fields are the flags (`--config FILE`):
//!
//! ```yaml
//! apiVersion: clusterip.allocator/v1alpha1
//! kind: ControllerConfiguration        # AgentConfiguration for clusterip-agent
//! serviceCidr: [10.96.0.0/12]          # --service-cidr, repeated
//! leaderElectLeaseName: clusterip      # --leader-elect-lease-name
//! addressBlockLeaseDuration: 2m        # --address-block-lease-duration
//! useServicecidrs: true                # --use-servicecidrs (a switch: true sets it)
//! ```
//!
//! Every field is a flag of the command, named in camelCase (`--leader-elect-lease-name`
//! → `leaderElectLeaseName`); its value is what the flag takes — a string, number or
//! boolean, or a list for a flag that may be repeated. A flag given on the command line
//! overrides the field (a list field as a whole); a field overrides an environment
//! variable, which overrides the default. Everything is checked before the command runs:
//! an unknown `apiVersion` or `kind`, an unknown field, or a value the flag refuses is
//! reported — every one, each with its field and flag — and the command does not start.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, Command};

/// The `apiVersion` of every configuration file.
pub const API_VERSION: &str = "clusterip.allocator/v1alpha1";

/// The flag naming the file.
const CONFIG_FLAG: &str = "config";

/// Which component a file configures: its `kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigKind {
    /// `clusterip controller`.
    Controller,
    /// `clusterip-agent`.
    Agent,
}

impl ConfigKind {
    pub fn kind(self) -> &'static str {
        match self {
            ConfigKind::Controller => "ControllerConfiguration",
            ConfigKind::Agent => "AgentConfiguration",
        }
    }
}

/// `--leader-elect-lease-name` → `leaderElectLeaseName`.
pub fn field_name(long: &str) -> String {
    let mut out = String::new();
    let mut upper = false;
    for c in long.chars() {
        if c == '-' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// The arguments `args` (as the process got them, program name first) with the fields of
/// the configuration file they name (`--config FILE` of `subcommand`, or of the top-level
/// command when `subcommand` is None) added as flags, those given on the command line
/// excepted. Without `--config`, `args` unchanged. `cmd` is the whole command line's
/// definition; `kind` the `kind` the file must have. The error lists every problem found.
pub fn expand_config(cmd: &Command, subcommand: Option<&str>, kind: ConfigKind, args: Vec<OsString>) -> Result<Vec<OsString>, String> {
    // What the command line alone says (its own errors are clap's to report, later).
    let Ok(matches) = cmd.clone().ignore_errors(true).try_get_matches_from(args.iter().cloned()) else { return Ok(args) };
    let matches = match subcommand {
        Some(name) => match matches.subcommand_matches(name) {
            Some(m) => m.clone(),
            None => return Ok(args),
        },
        None => matches,
    };
    let Ok(Some(path)) = matches.try_get_one::<PathBuf>(CONFIG_FLAG) else { return Ok(args) };
    let target = match subcommand {
        Some(name) => cmd.find_subcommand(name).ok_or_else(|| format!("no subcommand {name}"))?,
        None => cmd,
    };
    let fields = read(path, kind)?;
    let given_on_command_line = |id: &str| matches!(matches.try_contains_id(id), Ok(true)) && matches.value_source(id) == Some(ValueSource::CommandLine);
    let mut extra: Vec<OsString> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    for (field, value) in &fields {
        let Some(arg) = target.get_arguments().chain(cmd.get_arguments().filter(|a| a.is_global_set())).find(|a| a.get_long().is_some_and(|l| field_name(l) == *field && l != CONFIG_FLAG)) else {
            errors.push(format!("field {field:?}: unknown (each field is a flag of the command in camelCase, e.g. leaderElectLeaseName for --leader-elect-lease-name; see --help)"));
            continue;
        };
        let long = arg.get_long().unwrap_or_default();
        let values = match flag_values(value) {
            Ok(v) => v,
            Err(e) => {
                errors.push(format!("field {field:?} (--{long}): {e}"));
                continue;
            }
        };
        let mut these: Vec<OsString> = Vec::new();
        match arg.get_action() {
            ArgAction::SetTrue | ArgAction::SetFalse => match values.as_slice() {
                [v] if v == "true" || v == "false" => {
                    if (v == "true") == matches!(arg.get_action(), ArgAction::SetTrue) {
                        these.push(format!("--{long}").into());
                    }
                }
                _ => {
                    errors.push(format!("field {field:?} (--{long}): a switch takes true or false, not {value:?}"));
                    continue;
                }
            },
            ArgAction::Append => these.extend(values.iter().map(|v| OsString::from(format!("--{long}={v}")))),
            _ => match values.as_slice() {
                [v] => these.push(format!("--{long}={v}").into()),
                _ => {
                    errors.push(format!("field {field:?} (--{long}): takes one value, not a list"));
                    continue;
                }
            },
        }
        // Check the value as the flag would, alone (so every bad field is named, not only
        // the first clap meets).
        let mut probe: Vec<OsString> = vec![cmd.get_name().into()];
        probe.extend(subcommand.map(OsString::from));
        probe.extend(these.iter().cloned());
        if let Err(e) = cmd.clone().try_get_matches_from(probe) {
            if !matches!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument | clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion) {
                let text = e.to_string();
                let first = text.lines().next().unwrap_or_default().trim_start_matches("error: ").to_string();
                errors.push(format!("field {field:?} (--{long}): {first}"));
                continue;
            }
        }
        if !given_on_command_line(arg.get_id().as_str()) {
            extra.extend(these);
        }
    }
    if !errors.is_empty() {
        return Err(format!("configuration file {}:\n  {}", path.display(), errors.join("\n  ")));
    }
    let mut out = args;
    out.extend(extra);
    Ok(out)
}

/// The fields of a configuration file, `apiVersion` and `kind` checked and removed.
fn read(path: &Path, kind: ConfigKind) -> Result<BTreeMap<String, serde_yaml::Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("configuration file {}: {e}", path.display()))?;
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| format!("configuration file {}: not YAML: {e}", path.display()))?;
    let serde_yaml::Value::Mapping(map) = doc else {
        return Err(format!("configuration file {}: expected a mapping with apiVersion: {API_VERSION} and kind: {}", path.display(), kind.kind()));
    };
    let mut fields = BTreeMap::new();
    let mut errors = Vec::new();
    for (k, v) in map {
        let Some(k) = k.as_str().map(str::to_string) else {
            errors.push(format!("field {k:?}: a field name must be a string"));
            continue;
        };
        fields.insert(k, v);
    }
    match fields.remove("apiVersion").as_ref().and_then(|v| v.as_str()) {
        Some(API_VERSION) => {}
        other => errors.push(format!("apiVersion {:?}: this version reads {API_VERSION}", other.unwrap_or("(none)"))),
    }
    match fields.remove("kind").as_ref().and_then(|v| v.as_str()) {
        Some(k) if k == kind.kind() => {}
        other => errors.push(format!("kind {:?}: this command reads kind {}", other.unwrap_or("(none)"), kind.kind())),
    }
    if errors.is_empty() {
        Ok(fields)
    } else {
        Err(format!("configuration file {}:\n  {}", path.display(), errors.join("\n  ")))
    }
}

/// A field's value as flag values: a scalar is one, a list each of its scalars.
fn flag_values(v: &serde_yaml::Value) -> Result<Vec<String>, String> {
    use serde_yaml::Value;
    let scalar = |v: &Value| -> Result<String, String> {
        match v {
            Value::String(s) => Ok(s.clone()),
            Value::Number(n) => Ok(n.to_string()),
            Value::Bool(b) => Ok(b.to_string()),
            Value::Null => Err("no value (null)".into()),
            _ => Err(format!("{v:?} is not a flag value (a string, number or boolean)")),
        }
    };
    match v {
        Value::Sequence(items) => items.iter().map(scalar).collect(),
        other => Ok(vec![scalar(other)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction};

    fn cmd() -> Command {
        Command::new("clusterip")
            .arg(Arg::new("log-format").long("log-format").global(true).value_parser(["text", "json"]).default_value("text"))
            .subcommand(
                Command::new("controller")
                    .arg(Arg::new("config").long("config").value_parser(clap::value_parser!(PathBuf)))
                    .arg(Arg::new("service-cidr").long("service-cidr").action(ArgAction::Append))
                    .arg(Arg::new("leader-elect-lease-name").long("leader-elect-lease-name").default_value("clusterip-controller"))
                    .arg(Arg::new("lease-duration").long("lease-duration").value_parser(crate::parse_duration).default_value("120s"))
                    .arg(Arg::new("use-servicecidrs").long("use-servicecidrs").action(ArgAction::SetTrue))
                    .arg(Arg::new("kubeconfig").long("kubeconfig").env("CIP_TEST_KUBECONFIG")),
            )
    }

    fn file(text: &str) -> tempfile_path::Path {
        tempfile_path::Path::new(text)
    }

    /// A file removed on drop (no tempfile crate in this crate's dependencies).
    mod tempfile_path {
        pub struct Path(pub std::path::PathBuf);
        impl Path {
            pub fn new(text: &str) -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!("cip-config-{}-{}.yaml", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
                std::fs::write(&p, text).expect("write the test file");
                Self(p)
            }
        }
        impl Drop for Path {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    fn run(args: &[&str]) -> Result<clap::ArgMatches, String> {
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let expanded = expand_config(&cmd(), Some("controller"), ConfigKind::Controller, args)?;
        let m = cmd().try_get_matches_from(expanded).map_err(|e| e.to_string())?;
        Ok(m)
    }

    fn sub(m: &clap::ArgMatches) -> &clap::ArgMatches {
        m.subcommand_matches("controller").expect("controller")
    }

    #[test]
    fn fields_become_flags_and_the_command_line_wins() {
        let f = file("apiVersion: clusterip.allocator/v1alpha1\nkind: ControllerConfiguration\nserviceCidr: [10.96.0.0/16, fd00::/112]\nleaderElectLeaseName: from-file\nleaseDuration: 1m30s\nuseServicecidrs: true\nlogFormat: json\n");
        let path = f.0.to_str().expect("utf-8 path");
        let m = run(&["clusterip", "controller", "--config", path]).expect("valid");
        let c = sub(&m);
        let cidrs: Vec<&String> = c.get_many::<String>("service-cidr").expect("cidrs").collect();
        assert_eq!(cidrs, ["10.96.0.0/16", "fd00::/112"]);
        assert_eq!(c.get_one::<String>("leader-elect-lease-name").map(String::as_str), Some("from-file"));
        assert_eq!(c.get_one::<std::time::Duration>("lease-duration"), Some(&std::time::Duration::from_secs(90)));
        assert!(c.get_flag("use-servicecidrs"));
        assert_eq!(m.get_one::<String>("log-format").map(String::as_str), Some("json"), "a global flag from the file");
        // The command line overrides a field; a list field as a whole.
        let m = run(&["clusterip", "controller", "--service-cidr=10.0.0.0/24", "--config", path, "--leader-elect-lease-name=flag"]).expect("valid");
        let c = sub(&m);
        assert_eq!(c.get_many::<String>("service-cidr").expect("cidrs").collect::<Vec<_>>(), ["10.0.0.0/24"]);
        assert_eq!(c.get_one::<String>("leader-elect-lease-name").map(String::as_str), Some("flag"));
        // Without --config, nothing changes.
        let m = run(&["clusterip", "controller"]).expect("valid");
        assert_eq!(sub(&m).get_one::<String>("leader-elect-lease-name").map(String::as_str), Some("clusterip-controller"));
    }

    #[test]
    fn a_field_beats_the_environment() {
        let f = file("apiVersion: clusterip.allocator/v1alpha1\nkind: ControllerConfiguration\nkubeconfig: /from/file\n");
        std::env::set_var("CIP_TEST_KUBECONFIG", "/from/env");
        let m = run(&["clusterip", "controller", "--config", f.0.to_str().expect("path")]).expect("valid");
        assert_eq!(sub(&m).get_one::<String>("kubeconfig").map(String::as_str), Some("/from/file"));
    }

    #[test]
    fn every_bad_field_is_named() {
        let f = file("apiVersion: clusterip.allocator/v1alpha1\nkind: ControllerConfiguration\nleaseDuration: 90 seconds\nserviceCIDR: [10.0.0.0/8]\nuseServicecidrs: yes-please\nleaderElectLeaseName: [a, b]\nlogFormat: xml\n");
        let e = run(&["clusterip", "controller", "--config", f.0.to_str().expect("path")]).expect_err("invalid");
        for want in [
            "field \"leaseDuration\" (--lease-duration): invalid value '90 seconds'",
            "field \"serviceCIDR\": unknown",
            "field \"useServicecidrs\" (--use-servicecidrs): a switch takes true or false",
            "field \"leaderElectLeaseName\" (--leader-elect-lease-name): takes one value, not a list",
            "field \"logFormat\" (--log-format): invalid value 'xml'",
        ] {
            assert!(e.contains(want), "{want:?} missing from:\n{e}");
        }
        assert_eq!(e.lines().count(), 6, "one line per problem after the file's name:\n{e}");
    }

    #[test]
    fn the_version_and_kind_are_checked() {
        let f = file("apiVersion: v1\nkind: AgentConfiguration\n");
        let e = run(&["clusterip", "controller", "--config", f.0.to_str().expect("path")]).expect_err("invalid");
        assert!(e.contains("apiVersion \"v1\": this version reads clusterip.allocator/v1alpha1"), "{e}");
        assert!(e.contains("kind \"AgentConfiguration\": this command reads kind ControllerConfiguration"), "{e}");
        let e = run(&["clusterip", "controller", "--config", "/nonexistent/config.yaml"]).expect_err("missing");
        assert!(e.contains("/nonexistent/config.yaml"), "{e}");
        let f = file("- a\n- b\n");
        assert!(run(&["clusterip", "controller", "--config", f.0.to_str().expect("path")]).is_err_and(|e| e.contains("expected a mapping")));
    }

    #[test]
    fn field_names_are_the_flags_in_camel_case() {
        assert_eq!(field_name("leader-elect-lease-name"), "leaderElectLeaseName");
        assert_eq!(field_name("service-cidr"), "serviceCidr");
        assert_eq!(field_name("backend"), "backend");
    }
}
