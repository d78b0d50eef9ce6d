//! Replays every committed fuzz corpus file of the agent's targets through the same harness
//! the fuzzer runs (`clusterip_agent::fuzzing`), crashes found so far included (`crash-*`
//! files). The `nft` and `netlink_encode` targets run `nft -c` in a network namespace of
//! their own per input (`unshare --net`; root, as the agent's other kernel tests);
//! `CLUSTERIP_FUZZ_NFT=0` turns those checks off. See docs/reliability.md ("Fuzzing").

use clusterip_agent::fuzzing;
use clusterip_test_support::fuzz::corpus_dir;

/// Every file of the target's corpus through the harness.
fn replay(target: &str) {
    clusterip_test_support::fuzz::replay(target, fuzzing::run);
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
