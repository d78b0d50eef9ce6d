//! Replays every committed fuzz corpus file of the main crate's targets through the same
//! harness the fuzzer runs (`clusterip::fuzzing`), so the ordinary suite covers the corpora
//! and every crash found so far (kept in the corpora as `crash-*` files) with no fuzzer
//! installed. Targets, invariants and figures: docs/reliability.md ("Fuzzing").

use clusterip::fuzzing;
use clusterip_test_support::fuzz::corpus_dir;

/// Every file of the target's corpus through the harness.
fn replay(target: &str) {
    clusterip_test_support::fuzz::replay(target, fuzzing::run);
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
