#!/usr/bin/env bash
# Fuzz one target for a bounded time (cargo-fuzz / libFuzzer, nightly toolchain).
#
#   scripts/fuzz.sh --list                 the targets
#   scripts/fuzz.sh TARGET MINUTES         fuzz TARGET for MINUTES (whole minutes, ≥ 1)
#   scripts/fuzz.sh --merge TARGET         fold what runs found into the committed corpus
#                                          (tests/fuzz/corpus/TARGET): its seed-* and crash-*
#                                          files, plus the smallest set of inputs libFuzzer
#                                          finds covering every edge of both (set cover;
#                                          hit counts left out, so it stays small)
#   scripts/fuzz.sh --replay TARGET FILE   run one input through TARGET (a crash, say)
#
# The harnesses are the crates' `fuzzing` modules (src/fuzzing.rs, agent/src/fuzzing.rs);
# the fuzz crate is tests/fuzz (its own target directory: target/fuzz). A run starts from
# the committed corpus and the inputs earlier runs found (target/fuzz/corpus/TARGET, not
# committed), writes crashes to target/fuzz/artifacts/TARGET/, and ends with
#   fuzz: TARGET: N executions in S s, C crashes
# (also appended to target/fuzz/results.tsv). See docs/reliability.md ("Fuzzing").
#
# Bounds: libFuzzer stops itself after MINUTES (-max_total_time) and a hard `timeout` kills
# it a minute later if it has not; each input gets FUZZ_INPUT_TIMEOUT_S seconds (default 10)
# and libFuzzer's RSS limit; the whole run is under a memory cgroup of FUZZ_MEM_MIB (default
# 3072; scripts/lib/run-capped.sh), whose clean-up kills everything the run started when it
# ends or is killed (INT/TERM/HUP; after a SIGKILL, `scripts/dev-cluster.sh reap`). The
# agent's targets run in a network namespace of their own (`unshare --net`): the `nft`
# checks never see the machine's tables.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# shellcheck source=lib/run.sh
. scripts/lib/run.sh

main_targets=(cidr snapshot range_allocation admission)
agent_targets=(ruleset nft netlink_encode)
all_targets=("${main_targets[@]}" "${agent_targets[@]}")
fuzz_dir=$repo/tests/fuzz
out=$repo/target/fuzz
triple=$(rustc -vV | sed -n 's/^host: //p')
bin_dir=$out/$triple/release

usage() {
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
known() { local t; for t in "${all_targets[@]}"; do [ "$t" = "$1" ] && return 0; done; return 1; }
is_agent() { local t; for t in "${agent_targets[@]}"; do [ "$t" = "$1" ] && return 0; done; return 1; }

[ $# -ge 1 ] || usage
case $1 in
  --list) printf '%s\n' "${all_targets[@]}"; exit 0 ;;
  --merge) [ $# -eq 2 ] || usage; mode=merge; target=$2 ;;
  --replay) [ $# -eq 3 ] || usage; mode=replay; target=$2; input=$(cd "$(dirname "$3")" && pwd)/$(basename "$3") ;;
  -*) usage ;;
  *) [ $# -eq 2 ] || usage; mode=fuzz; target=$1; minutes=$2
     [[ $minutes =~ ^[1-9][0-9]*$ ]] || { echo "fuzz: MINUTES must be a whole number ≥ 1, not '$minutes'" >&2; exit 2; } ;;
esac
known "$target" || { echo "fuzz: unknown target '$target'; targets: ${all_targets[*]}" >&2; exit 2; }

# Everything below runs in a memory cgroup of its own, reaped at the end.
run_capped "${FUZZ_MEM_MIB:-3072}" "$@"

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz: no nightly toolchain (rustup toolchain install nightly); cargo-fuzz needs it" >&2; exit 2
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz is not installed (cargo install cargo-fuzz)" >&2; exit 2
fi

echo "fuzz: building $target (release, sanitizer-coverage; target/fuzz)" >&2
CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2} CARGO_TARGET_DIR=$out \
  cargo +nightly fuzz build --fuzz-dir "$fuzz_dir" -O "$target" >&2
bin=$bin_dir/$target
[ -x "$bin" ] || { echo "fuzz: $bin was not built" >&2; exit 1; }

committed=$fuzz_dir/corpus/$target
work=$out/corpus/$target
artifacts=$out/artifacts/$target
mkdir -p "$work" "$artifacts" "$committed"

# Longest input tried: JSON objects need room, the text targets do not.
case $target in
  admission|ruleset|nft) max_len=16384 ;;
  snapshot|range_allocation) max_len=8192 ;;
  *) max_len=1024 ;;
esac
flags=(-rss_limit_mb="${FUZZ_RSS_MIB:-2048}" -malloc_limit_mb="${FUZZ_RSS_MIB:-2048}"
       -timeout="${FUZZ_INPUT_TIMEOUT_S:-10}" -max_len="$max_len")

# The agent's targets: in a network namespace of their own, which their nft checks use.
wrap=()
if is_agent "$target"; then
  wrap=(unshare --net --)
  export CLUSTERIP_FUZZ_OWN_NETNS=1
fi

case $mode in
  replay)
    exec "${wrap[@]}" "$bin" "${flags[@]}" "$input"
    ;;
  merge)
    # The smallest set of inputs covering every edge of the committed corpus and of what runs
    # found replaces the committed corpus, but for the hand-written seeds and the crash
    # inputs, which stay whatever they cover. Hit counts and value profiles are left out of
    # the cover: with them, five minutes of fuzzing kept thousands of files (2,547 for
    # admission) against 751 without. What runs found stays in target/fuzz/corpus for the
    # next run either way.
    before=$(find "$committed" -type f | wc -l)
    cover=$(mktemp -d "$out/cover.XXXXXX")
    trap 'rm -rf "$cover"' EXIT
    "${wrap[@]}" "$bin" "${flags[@]}" -use_counters=0 -use_value_profile=0 -set_cover_merge=1 "$cover" "$committed" "$work" >&2
    find "$committed" -type f ! -name 'seed-*' ! -name 'crash-*' -delete
    kept=$(cd "$committed" && sha1sum -- * | cut -d' ' -f1)
    for f in "$cover"/*; do
      [ -e "$f" ] || continue
      grep -qx "$(sha1sum < "$f" | cut -d' ' -f1)" <<<"$kept" || cp "$f" "$committed/"
    done
    after=$(find "$committed" -type f | wc -l)
    echo "fuzz: $target: committed corpus $before → $after files, $(du -sk "$committed" | cut -f1) KiB" >&2
    exit 0
    ;;
esac

seconds=$((minutes * 60))
log=$out/$target.log
stamp=$(mktemp "$out/.stamp.XXXXXX")
trap 'rm -f "$stamp"' EXIT
echo "fuzz: $target for ${minutes} min (log: $log)" >&2
started=$SECONDS
set +e
# New inputs go to the work corpus (the first folder); the committed one is read only.
timeout --kill-after=30 $((seconds + 60)) "${wrap[@]}" "$bin" "${flags[@]}" \
  -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$artifacts/" \
  "$work" "$committed" >"$log" 2>&1
rc=$?
set -e
elapsed=$((SECONDS - started))
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
secs=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
[ -n "$execs" ] || execs=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
mapfile -t found < <(find "$artifacts" -maxdepth 1 -type f -newer "$stamp" \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'slow-unit-*' \) | sort)
crashes=${#found[@]}
summary="fuzz: $target: ${execs:-0} executions in ${elapsed} s (${secs:-?}/s), $crashes crashes"
grep -E '^(==[0-9]+== ERROR|thread .* panicked|SUMMARY)' "$log" | head -5 >&2 || true
for f in "${found[@]}"; do echo "fuzz: input: $f (scripts/fuzz.sh --replay $target $f)" >&2; done
echo "$summary"
printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$target" "$elapsed" "${execs:-0}" "$crashes" "$(git rev-parse --short HEAD)" >>"$out/results.tsv"
# libFuzzer exits non-zero on a crash; a run that ended by its own time limit is a success.
[ "$crashes" -eq 0 ] || exit 1
[ $rc -eq 0 ] || { echo "fuzz: the fuzzer exited with status $rc (log: $log)" >&2; exit 1; }
