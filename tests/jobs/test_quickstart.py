"""A fresh start with mlcheckpoint trains bit for bit as the same program without it (issue 36):
examples/quickstart.py, the README's program, under torchrun with 2 ranks, against its own model
and training step in a plain loop (tests/workers/quickstart_without.py). The quickstart hands
``resume`` its state behind a DCP ``Stateful``, so a fresh start reads no state dict: reading
an optimizer's before its first step (``get_state_dict``) creates its state, AdamW's ``step``
becomes 1 and every later update differs."""

import os
import re

import pytest
from cluster import WORKERS, Cluster

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(REPO, "examples", "quickstart.py")
STEPS = 20  # the quickstart's total_steps
_LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def _launch(cluster: Cluster, script: str) -> tuple[str, dict[int, float]]:
    """Run ``script`` on the cluster's node (2 ranks): what it printed, and rank 0's loss by step."""
    cluster.run(script, timeout=240)
    printed = cluster.nodes[0].log().rsplit("\n===== ", 1)[-1]  # this launch's part of the log
    losses: dict[int, float] = {}
    for step, loss in _LOSS.findall(printed):
        assert int(step) not in losses, f"step {step} printed twice:\n{printed}"
        losses[int(step)] = float(loss)  # Python's repr of a float gives back the same double
    return printed, losses


def test_a_fresh_start_trains_bit_for_bit_as_without_mlcheckpoint(monkeypatch):
    """The quickstart trains bit-for-bit as the same script without mlcheckpoint, and writes
    its persistent steps: checkpointing must not change training."""
    with Cluster(1, nproc=2) as cluster:
        monkeypatch.chdir(cluster.root)  # where the quickstart's "checkpoints" folder goes
        _, without = _launch(cluster, os.path.join(WORKERS, "quickstart_without.py"))
        printed, with_us = _launch(cluster, QUICKSTART)
        assert "resumed: step None from None" in printed, printed  # a fresh start
        assert sorted(without) == list(range(STEPS)), cluster.logs()
        assert sorted(with_us) == list(range(STEPS)), cluster.logs()
        differ = [f"step {s}: {with_us[s].hex()} with mlcheckpoint, {without[s].hex()} without"
                  for s in range(STEPS) if with_us[s].hex() != without[s].hex()]
        assert not differ, "\n".join(differ)
        # It did checkpoint: steps 9 and 19 went to the persistent folder.
        assert sorted(os.listdir(os.path.join(cluster.root, "checkpoints"))) == [
            "step-000000000009", "step-000000000019"]
