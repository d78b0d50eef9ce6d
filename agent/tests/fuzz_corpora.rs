//! Replays every committed fuzz corpus file of the agent's targets through the same harness
//! the fuzzer runs (`clusterip_agent::fuzzing`), crashes found so far included (`crash-*`
//! files). The `nft` and `netlink_encode` targets run `nft -c` in a network namespace of
//! their own per input (`unshare --net`; root, as the agent's other kernel tests);
//! `CLUSTERIP_FUZZ_NFT=0` turns those checks off. See docs/reliability.md ("Fuzzing").

use std::path::{Path, PathBuf};

use clusterip_agent::fuzzing;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fuzz/corpus").join(target)
}

/// The files of a target's corpus, sorted (at least one: an empty corpus is a mistake).
fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap_or_else(|e| panic!("{}: {e}", dir.display())).path())
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (name, bytes)
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no corpus files in {}", dir.display());
    files
}

/// Every file through the harness; at least one must get past the code's refusals to the
/// invariant checks (a corpus of inputs that all bounce off the parser tests little).
fn replay(target: &str) {
    let mut checked = 0;
    for (name, bytes) in corpus(target) {
        match std::panic::catch_unwind(|| fuzzing::run(target, &bytes)) {
            Ok(Some(deep)) => checked += usize::from(deep),
            Ok(None) => panic!("unknown target {target}"),
            Err(_) => panic!("{target}: corpus file {name} fails the harness (its message is above)"),
        }
    }
    assert!(checked > 0, "{target}: no corpus file reaches the invariant checks");
}

#[test]
fn every_target_has_a_corpus_and_a_test() {
    assert_eq!(fuzzing::TARGETS, ["ruleset", "nft", "netlink_encode"], "add a replay test for a new target");
    for t in fuzzing::TARGETS {
        assert!(corpus_dir(t).is_dir(), "{t}: no corpus folder");
    }
}

#[test]
fn nft_checks_run_in_a_namespace_of_their_own_and_refuse_bad_text() {
    if !fuzzing::nft_enabled() {
        eprintln!("CLUSTERIP_FUZZ_NFT=0: nft checks off");
        return;
    }
    // The checker says no when nft does (so a corpus passing it means something).
    assert!(fuzzing::nft_check("add table ip clusterip\nadd chain ip clusterip c { nonsense }\n").is_err());
    assert_eq!(fuzzing::nft_check("add table ip clusterip\nadd chain ip clusterip c\n"), Ok(()));
}

#[test]
fn ruleset_corpus() {
    replay("ruleset");
}

#[test]
fn nft_corpus() {
    replay("nft");
}

#[test]
fn netlink_encode_corpus() {
    replay("netlink_encode");
}
