//! Replays every committed fuzz corpus file of the main crate's targets through the same
//! harness the fuzzer runs (`clusterip::fuzzing`), so the ordinary suite covers the corpora
//! and every crash found so far (kept in the corpora as `crash-*` files) with no fuzzer
//! installed. Targets, invariants and figures: docs/reliability.md ("Fuzzing").

use std::path::{Path, PathBuf};

use clusterip::fuzzing;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus").join(target)
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
    let listed: Vec<&str> = fuzzing::TARGETS.to_vec();
    assert_eq!(listed, ["cidr", "snapshot", "range_allocation", "admission"], "add a replay test for a new target");
    for t in listed {
        assert!(corpus_dir(t).is_dir(), "{t}: no corpus folder");
    }
}

#[test]
fn cidr_corpus() {
    replay("cidr");
}

#[test]
fn snapshot_corpus() {
    replay("snapshot");
}

#[test]
fn range_allocation_corpus() {
    replay("range_allocation");
}

#[test]
fn admission_corpus() {
    replay("admission");
}
