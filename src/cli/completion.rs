//! `clusterip completion SHELL`: the shell's completion script for this command line,
//! generated from the clap definition (so it always knows every subcommand and flag).

use std::io::Write;

use clap::CommandFactory;
use clap_complete::Shell;

use super::Cli;

#[derive(Debug, clap::Args)]
#[command(after_long_help = "Install it for every new shell:\n\n  \
bash  clusterip completion bash > ~/.local/share/bash-completion/completions/clusterip\n        \
(loaded by bash-completion; else: source <(clusterip completion bash) in ~/.bashrc)\n  \
zsh   mkdir -p ~/.zfunc && clusterip completion zsh > ~/.zfunc/_clusterip\n        \
(in ~/.zshrc, before compinit: fpath=(~/.zfunc $fpath))\n  \
fish  clusterip completion fish > ~/.config/fish/completions/clusterip.fish\n\n\
In this shell only: source <(clusterip completion bash); source <(clusterip completion zsh) \
(after compinit); clusterip completion fish | source.")]
pub struct CompletionArgs {
    /// The shell to complete in.
    #[arg(value_enum)]
    pub shell: CompletionShell,
}

/// The shells a completion script is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

impl From<CompletionShell> for Shell {
    fn from(shell: CompletionShell) -> Self {
        match shell {
            CompletionShell::Bash => Shell::Bash,
            CompletionShell::Zsh => Shell::Zsh,
            CompletionShell::Fish => Shell::Fish,
        }
    }
}

/// The completion script of `clusterip` for `shell`.
pub fn script(shell: CompletionShell) -> Vec<u8> {
    let mut cmd = Cli::command();
    let name = cmd.get_name().to_string();
    let mut out = Vec::new();
    clap_complete::generate(Shell::from(shell), &mut cmd, name, &mut out);
    out
}

/// Print the script on stdout. A reader that stops early (`| head`) is no error.
pub fn run(args: CompletionArgs) -> anyhow::Result<i32> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(&script(args.shell)).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(0),
    }
}
