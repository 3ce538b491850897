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
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"),
                           "--steps", "8", "--kill-at", "3"],
                          capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "DEMO PASSED" in out
    assert "losses identical to the uninterrupted run:     YES" in out
    assert "parameters identical to the uninterrupted run: YES" in out
    m = re.search(r"resumed step (\d+) from (\w+) \(per rank: (\{.*?\})\)", out)
    assert m, out[-4000:]
    assert int(m.group(1)) >= 2  # not a fresh start: steps before the kill came back
    assert m.group(2) == "peer"
    # node 1's ranks (2, 3) lost their memory: their shards came from node 0's replicas
    assert from_another_node(ast.literal_eval(m.group(3)), [2, 3]), m.group(3)
    leftovers = [d for d in os.listdir("/dev/shm") if d.startswith("mlcheckpoint-demo-")]
    assert not leftovers, f"demo left {leftovers} behind"
