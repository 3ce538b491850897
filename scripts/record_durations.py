#!/usr/bin/env python3
"""Writes tests/durations.json from a run's ``--durations=0`` report, or from the per-test
record of ``MLCHECKPOINT_TEST_CPU_LOG`` (tests/conftest.py: JSON lines with ``wall_s``).

    scripts/test.sh --durations=0 | tee run.log
    python scripts/record_durations.py run.log

The file holds each test's seconds (setup, call and teardown together) for the tests that took
a second or more; tests/conftest.py starts the longest work first on the parallel workers.
Only the order matters, so the figures of a loaded machine serve as well as a quiet one's.
"""

from __future__ import annotations

import json
import os
import re
import sys

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                   "durations.json")
LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")
MIN_S = 1.0


def parse(lines: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for line in lines:
        if line.startswith("{"):  # a CPU log's record
            record = json.loads(line)
            seconds[record["test"]] = seconds.get(record["test"], 0.0) + record["wall_s"]
            continue
        m = LINE.match(line)
        if m:
            nodeid = m[3]
            if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's group suffix
                nodeid = nodeid[:nodeid.rfind("@")]
            seconds[nodeid] = seconds.get(nodeid, 0.0) + float(m[1])
    return {k: round(v, 1) for k, v in sorted(seconds.items()) if v >= MIN_S}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], errors="replace") as f:
        seconds = parse(f.read().splitlines())
    if not seconds:
        print(f"no --durations=0 lines or CPU log records in {argv[0]}", file=sys.stderr)
        return 1
    with open(OUT, "w") as f:
        json.dump(seconds, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"{len(seconds)} tests, {sum(seconds.values()):.0f} s in all -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
