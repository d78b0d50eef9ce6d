//! `clusterip completion bash|zsh|fish`: each shell gets a script that names every
//! subcommand; bash parses it and, sourced, completes with it; zsh and fish parse theirs
//! where they are installed.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use clap::CommandFactory;

fn clusterip(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_clusterip")).args(args).output().expect("run clusterip")
}

fn script(shell: &str) -> String {
    let out = clusterip(&["completion", shell]);
    assert!(out.status.success(), "completion {shell}: {}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stderr.is_empty(), "completion {shell} wrote to stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 script")
}

/// The subcommands the command line declares (so a new one is covered without a change here).
fn subcommands() -> Vec<String> {
    let names: Vec<String> = clusterip::cli::Cli::command().get_subcommands().map(|c| c.get_name().to_string()).collect();
    assert!(names.len() >= 8 && names.iter().any(|n| n == "completion"), "{names:?}");
    names
}

/// `shell ARGS…` with `input` on stdin; None when the shell is not installed.
fn shell_with_stdin(shell: &str, args: &[&str], input: &str) -> Option<Output> {
    let mut child = match Command::new(shell).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("run {shell}: {e}"),
    };
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write stdin");
    Some(child.wait_with_output().expect("wait"))
}

#[test]
fn each_shell_gets_a_script_naming_every_subcommand() {
    for (shell, registers) in [("bash", "-F _clusterip"), ("zsh", "#compdef clusterip"), ("fish", "complete -c clusterip")] {
        let text = script(shell);
        assert!(text.contains(registers), "{shell}: {registers:?} missing:\n{text}");
        for name in subcommands() {
            assert!(text.contains(&name), "{shell}: subcommand {name} missing:\n{text}");
        }
    }
}

#[test]
fn bash_parses_the_script_and_completes_with_it() {
    let text = script("bash");
    let out = shell_with_stdin("bash", &["-n"], &text).expect("bash");
    assert!(out.status.success(), "bash -n: {}", String::from_utf8_lossy(&out.stderr));
    // Sourced, as `source <(clusterip completion bash)`: complete `clusterip re` and
    // `clusterip completion `.
    let session = format!(
        "{text}\nCOMP_WORDS=(clusterip re); COMP_CWORD=1; _clusterip clusterip re clusterip; echo \"${{COMPREPLY[*]}}\"\n\
         COMP_WORDS=(clusterip completion ''); COMP_CWORD=2; _clusterip clusterip '' completion; echo \"${{COMPREPLY[*]}}\"\n"
    );
    let out = shell_with_stdin("bash", &["-s"], &session).expect("bash");
    assert!(out.status.success(), "bash: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Vec<&str>> = stdout.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert_eq!(lines[0], ["release", "repair"], "clusterip re<TAB>");
    for shell in ["bash", "zsh", "fish"] {
        assert!(lines[1].contains(&shell), "clusterip completion <TAB>: {shell} missing: {:?}", lines[1]);
    }
}

#[test]
fn zsh_and_fish_parse_their_scripts_where_installed() {
    for (shell, check) in [("zsh", "-n"), ("fish", "--no-execute")] {
        match shell_with_stdin(shell, &[check], &script(shell)) {
            None => eprintln!("{shell} is not installed: its script's syntax is not checked here"),
            Some(out) => assert!(out.status.success(), "{shell} {check}: {}", String::from_utf8_lossy(&out.stderr)),
        }
    }
}

#[test]
fn help_says_how_to_install_and_other_shells_are_refused() {
    let out = clusterip(&["completion", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in ["source <(clusterip completion bash)", "~/.zfunc/_clusterip", "~/.config/fish/completions/clusterip.fish"] {
        assert!(help.contains(needle), "{needle:?} missing from the help:\n{help}");
    }
    let out = clusterip(&["completion", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("[possible values: bash, zsh, fish]"), "{}", String::from_utf8_lossy(&out.stderr));
}
