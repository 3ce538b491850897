"""A tmpfs that fills up after the capacity check (issue 11, item 5), on real small tmpfs mounts.

The space is reserved before any byte is written, so a full tmpfs is a CapacityError on every
rank, never a SIGBUS (exit -7): the process lives and the previous step stays resumable. The
ranks of a node share one tmpfs, so the check and the reservation are one step node-wide.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from cluster import WORKERS, Cluster
from helpers import mounted_tmpfs

pytestmark = pytest.mark.slow

MiB = 1 << 20


def run_fill_worker(mnt: str, scenario: str) -> dict:
    """tests/workers/fill_after_check.py in a process of its own (a SIGBUS must not kill pytest)."""
    res = subprocess.run([sys.executable, os.path.join(WORKERS, "fill_after_check.py"), mnt, scenario],
                         capture_output=True, text=True, timeout=120, check=False)
    died = " (SIGBUS)" if res.returncode == -signal.SIGBUS else ""
    assert res.returncode == 0, f"worker exited {res.returncode}{died}:\n{res.stderr[-4000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario", ["shard", "replica"])
def test_tmpfs_filled_after_the_check_is_a_capacity_error(store_dir, scenario):
    """Another program takes the space between the check and the copy, for a shard being
    saved and for a replica a partner pushes over a socket: refused cleanly, nothing left."""
    with mounted_tmpfs(os.path.join(store_dir, "tmpfs"), "size=16m,mode=0700") as mnt:
        r = run_fill_worker(mnt, scenario)
    assert r["outcome"] == "CapacityError", r
    assert r["needed"] == 6 * MiB and r["available"] < r["needed"]
    assert mnt in r["message"] and "MiB" in r["message"]
    assert r["leftovers"] == []  # no partial file, no half-reserved buffer in the pool
    assert r["step_dirs"] == 1  # step 1's: not even the refused step's folder is left
    assert r["step1_intact"] and r["complete"] == [1]
    assert r["after"] == 6 * MiB  # once there is room again, the same save goes in


def test_buffer_preparation_stops_quietly_when_the_tmpfs_fills(store_dir):
    """The background preparation of buffers loses the race too: it makes none and leaves no
    buffer whose pages were never allocated (a later save would SIGBUS on it)."""
    with mounted_tmpfs(os.path.join(store_dir, "tmpfs"), "size=16m,mode=0700") as mnt:
        r = run_fill_worker(mnt, "prewarm")
    assert r["outcome"] == "prewarmed" and r["made"] == 0
    assert r["leftovers"] == []
    assert r["step1_intact"] and r["complete"] == [1]
    assert r["after"] == 6 * MiB


def test_two_ranks_of_one_node_cannot_both_fit(store_dir):
    """Two ranks of one node save 20 MiB each at once into a 32 MiB tmpfs: one shard fits,
    both do not. Every rank gets CapacityError (save and async_save) and no rank dies; step 1
    still loads bit-exact; the shard one rank did write is given back, so a 7 MiB step fits
    again in the same run; the restarted job resumes that step."""
    with Cluster(nnodes=1, nproc=2) as c, mounted_tmpfs(c.nodes[0].local_dir, "size=32m,mode=0700"):
        c.run("capacity_race.py", "save", timeout=240)  # every exit code 0: nobody died
        race = c.results("race")
        for r in (0, 1):
            assert race[r] == {"save": "CapacityError", "async_save": "CapacityError",
                               "complete": [1], "step1_mismatch": [], "save3": "ok"}, (r, race[r])
        c.run("capacity_race.py", "resume", timeout=240)
        resumed = c.results("resumed")  # no rank died (SIGBUS or else): c.run wants exit 0
    assert resumed == {r: {"step": 3, "source": "local", "mismatch": []} for r in (0, 1)}
