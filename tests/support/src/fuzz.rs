//! Replaying the committed fuzz corpora (`tests/fuzz/corpus/<target>/`) through a crate's
//! fuzz harness, for the `fuzz_corpora` tests of both crates (docs/reliability.md,
//! "Fuzzing").

use std::path::PathBuf;

/// The corpus folder of a fuzz target.
pub fn corpus_dir(target: &str) -> PathBuf {
    crate::repo_root().join("tests/fuzz/corpus").join(target)
}

/// The files of a target's corpus, sorted (at least one: an empty corpus is a mistake).
pub fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
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

/// Every file of `target`'s corpus through `harness` (a crate's `fuzzing::run`: Some(true)
/// when the input reached the invariant checks, None for an unknown target); at least one
/// must get past the code's refusals to the invariant checks (a corpus of inputs that all
/// bounce off the parser tests little).
pub fn replay(target: &str, harness: fn(&str, &[u8]) -> Option<bool>) {
    let mut checked = 0;
    for (name, bytes) in corpus(target) {
        match std::panic::catch_unwind(|| harness(target, &bytes)) {
            Ok(Some(deep)) => checked += usize::from(deep),
            Ok(None) => panic!("unknown target {target}"),
            Err(_) => panic!("{target}: corpus file {name} fails the harness (its message is above)"),
        }
    }
    assert!(checked > 0, "{target}: no corpus file reaches the invariant checks");
}
