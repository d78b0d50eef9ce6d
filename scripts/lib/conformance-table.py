#!/usr/bin/env python3
"""The results table of docs/conformance.md, from the runs of scripts/conformance.sh.

    scripts/lib/conformance-table.py RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a target/conformance/<configuration>-<date>/ directory (its results.tsv:
state, test, reason). Prints a Markdown table: one row per test any run selected, one column
per run (headed by its configuration), each cell pass, fail, skip or — (not selected by that
run); then, numbered, the first line of each failure or skip reason, so the table stays
narrow. Rows where the runs that selected a test disagree come first, marked ≠.
"""
import os
import re
import sys


def test_name(raw):
    # "[It] [sig-network] Services should … [Conformance] [sig-network, Conformance]":
    # drop the "[It] " and the label list ginkgo appends.
    name = re.sub(r"^\[It\] ", "", raw)
    name = re.sub(r" \[sig-[a-z-]+(, [^]]+)?\]$", "", name)
    return name.replace("[sig-network] ", "")


def main(dirs):
    if not dirs:
        sys.exit(__doc__.strip())
    columns, results = [], {}
    for d in dirs:
        tsv = os.path.join(d, "results.tsv")
        if not os.path.isfile(tsv):
            sys.exit(f"conformance-table: no results.tsv in {d}")
        config = re.sub(r"-\d{8}T\d{6}Z$", "", os.path.basename(os.path.normpath(d)))
        columns.append(config)
        with open(tsv) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) < 2:
                    continue
                state, raw = parts[0], parts[1]
                why = parts[2] if len(parts) > 2 else ""
                results.setdefault(test_name(raw), {})[len(columns) - 1] = (state, why)
    notes, note_of = [], {}

    def cell(entry):
        if entry is None:
            return "—"
        state, why = entry
        word = {"passed": "pass", "failed": "**fail**", "skipped": "skip"}.get(state, state)
        if state == "passed" or not why:
            return word
        why = re.sub(r"^skipped - ", "", why).strip()
        if why not in note_of:
            notes.append(why)
            note_of[why] = len(notes)
        return f"{word} ({note_of[why]})"

    def agree(name):
        # (among the runs that selected the test)
        return len({state for state, _ in results[name].values()}) == 1

    names = sorted(results, key=lambda n: (agree(n), n))
    print("| test (`[sig-network] …`) | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name in names:
        mark = "" if agree(name) else " ≠"
        cells = [cell(results[name].get(i)) for i in range(len(columns))]
        escaped = name.replace("|", "\\|")
        print(f"| {escaped}{mark} | " + " | ".join(cells) + " |")
    if notes:
        print()
        for i, why in enumerate(notes, 1):
            print(f"({i}) {why}")


if __name__ == "__main__":
    main(sys.argv[1:])
