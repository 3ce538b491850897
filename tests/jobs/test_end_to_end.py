"""End to end: the example FSDP2 job loses a node mid-training, resumes from the partner's
replica and ends bit-identical to an uninterrupted run (what the README's demo shows)."""

import ast
import os
import re
import subprocess
import sys

import pytest
from helpers import from_another_node

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_node_loss_mid_training_continues_bit_exactly():
    """The README's demo: node 1 lost mid-training, its ranks read node 0's replicas and the
    run ends bit-identical to an uninterrupted one, leaving nothing in /dev/shm."""
    before = demo_dirs()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"),
                           "--steps", "8", "--kill-at", "3", "--verbose"],
                          capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "DEMO PASSED" in out
    assert "losses identical to the uninterrupted run:     YES" in out
    assert "parameters identical to the uninterrupted run: YES" in out
    # One line, in words: node 1's ranks (2, 3) lost their memory and read from node 0.
    m = re.search(r"\] restored step (\d+) in [0-9.]+s \(ranks 0-1 local, ranks 2-3 from node 0\)"
                  r"(; [^;]*)?; restart to finish", out)
    assert m, out[-4000:]
    assert int(m.group(1)) >= 2  # not a fresh start: steps before the kill came back
    assert "unusable" not in out and "lost are" not in out, out[-4000:]
    # --verbose: the layout words (the replicas of node 0, or the copies data parallelism kept)
    m = re.search(r"per-rank sources: (\{.*?\})", out)
    assert m and from_another_node(ast.literal_eval(m.group(1)), [2, 3]), out[-4000:]
    leftovers = demo_dirs() - before
    assert not leftovers, f"demo left {leftovers} behind"


def demo_dirs() -> set[str]:
    """The demo's directories in /dev/shm (another run's demo may be running beside this one:
    the test looks only at those that appeared during its own)."""
    return {d for d in os.listdir("/dev/shm") if d.startswith("mlcheckpoint-demo-")}
