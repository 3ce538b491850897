"""torchtitan's main branch: the node-loss test of test_integration_torchtitan.py, run against a
snapshot of pytorch/torchtitan's main instead of the 0.3.0 release.

Main has dropped the legacy ``torchtitan.components.checkpoint`` module (pytorch/torchtitan#4184)
and routes its path probes through a ``CheckpointStorage`` seam (#4186); the integration builds
on ``torchtitan.components.checkpointer`` only, which both have. Nothing of the snapshot is
vendored: point MLCHECKPOINT_TORCHTITAN_MAIN at a folder holding its ``torchtitan`` package
(default /work/.torchtitan-main), e.g. from a clone:

    git clone --depth 1 https://github.com/pytorch/torchtitan /tmp/torchtitan-main
    MLCHECKPOINT_TORCHTITAN_MAIN=/tmp/torchtitan-main pytest tests/jobs/test_integration_torchtitan_main.py

Tested at main's commit b5bcd76 (2026-08-21), whose checkpointer imports with torch 2.13 and
tyro alone. Skipped when no snapshot is there.
"""

import os

import pytest
from test_integration_torchtitan import node_loss_then_folder_fallback, torchtitan_at

TORCHTITAN_MAIN = os.environ.get("MLCHECKPOINT_TORCHTITAN_MAIN", "/work/.torchtitan-main")


@pytest.mark.slow
def test_torchtitan_main_checkpointer_resumes_from_partner_then_from_its_folder():
    """The same node loss and folder fallback with torchtitan's main-branch checkpointer
    (skipped where it is not checked out)."""
    node_loss_then_folder_fallback(torchtitan_at(TORCHTITAN_MAIN))
