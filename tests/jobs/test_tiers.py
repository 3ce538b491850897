"""The tiers never fail together (issue 42, parts 2-4), in real torchrun jobs of 1 node x 2
ranks (tests/workers/tiers.py), their local_dir a 20 MiB tmpfs mounted here:

- every RAM save fails (another program holds the tmpfs), yet the persistent steps asked for
  (5 and 10) are written, and a fresh run with empty memory resumes step 10 exactly; the
  failure is logged once, then counted in stats(), and one line says when saves succeed again;
- the room a save asks of tmpfs is what each rank writes after DCP's de-duplication;
- a job directory removed under a live run: one error naming it, and the persistent steps
  are still written;
- a copy whose manifest was rewritten to agree with its damaged bytes is refused with a
  warning naming step, rank, node, item and why (2 nodes x 1 rank, replicating).
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import pytest
from cluster import Cluster
from helpers import damage_shard, mounted_tmpfs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAILING, LAST = 12, 13  # as in the worker: steps 0-11 fail, 12 and 13 fit


def persistent_steps(c: Cluster) -> list[str]:
    return sorted(d for d in os.listdir(c.persistent_dir)
                  if os.path.exists(os.path.join(c.persistent_dir, d, ".metadata")))


def test_ram_saves_that_fail_still_write_the_persistent_steps_asked_for():
    """On a 20 MiB tmpfs, failing RAM saves still write the persistent steps asked for, are
    logged once and counted, and a fresh run resumes persistent step 10."""
    with Cluster(1, 2) as c, mounted_tmpfs(c.nodes[0].local_dir, "size=20m,mode=0700"):
        c.run("tiers.py", "persist", timeout=300)
        res = c.results("persist")
        log = c.nodes[0].log()
        assert sorted(res) == [0, 1], log
        for rank, r in res.items():
            saves = r["saves"]
            assert all(s.startswith("CapacityError: async save of step ") for s in saves[:FAILING]), saves
            assert saves[FAILING:] == ["ok", "ok"], (rank, saves)
            for step in (5, 10):
                assert saves[step].endswith(f"step {step}: persistent checkpoint written instead"), saves[step]
            stats = r["stats"]
            assert (stats["mlcheckpoint/failed_saves"], stats["mlcheckpoint/failed_saves_in_a_row"]) == (12, 0)
        assert persistent_steps(c) == ["step-000000000005", "step-000000000010"]
        # Logged once for the job, with its cause; then counted; one line when they stop.
        failed = [line for line in log.splitlines() if "mlcheckpoint.manager.saving ERROR" in line]
        assert len(failed) == 1 and "async save of step 0 failed on rank" in failed[0], failed
        assert "checkpoint shard needs" in failed[0] and "counted in stats()" in failed[0], failed
        again = [line for line in log.splitlines() if "RAM saves succeed again" in line]
        assert len(again) == 1 and "after 12 failures (failing since step 0; step 12 saved)" in again[0], again
        # A fresh run, memory empty (new machines): the persistent step 10, exactly.
        c.nodes[0].wipe()
        c.run("tiers.py", "resume", timeout=300)
        for rank, r in c.results("resume").items():
            assert (r["step"], r["source"], r["match"]) == (10, "persistent", True), (rank, r)


def test_the_room_a_save_asks_is_what_each_rank_writes_after_deduplication():
    """7.25 MiB per rank, 7 of them equal on both ranks: DCP gives each rank 3.75 MiB. Two
    steps (keep=1 and the one being saved) of 7.5 MiB fit in 20 MiB; reserving each rank's
    whole state (the step kept and 14.5 MiB more) did not."""
    with Cluster(1, 2) as c, mounted_tmpfs(c.nodes[0].local_dir, "size=20m,mode=0700"):
        c.run("tiers.py", "dedup", timeout=300)
        for rank, r in c.results("dedup").items():
            assert r["saves"] == ["ok"] * 4, (rank, r["saves"])
            assert r["stats"]["mlcheckpoint/save_bytes"] < 4 * 2**20, r["stats"]  # its share only


def test_a_job_directory_removed_under_the_run_is_named_and_persistent_steps_go_on():
    """A job directory removed under a live run: each save fails naming it (no bare
    FileNotFoundError), and the persistent steps are still written."""
    with Cluster(1, 2) as c:
        c.run("tiers.py", "vanish", timeout=300)
        job_dir = os.path.join(c.nodes[0].local_dir, c.job_id)
        for r in c.results("vanish").values():
            saves = r["saves"]
            assert saves[:3] == ["ok"] * 3, saves
            for step, said in enumerate(saves[3:], start=3):
                assert said.startswith(f"JobDirGoneError: async save of step {step} failed on rank "), said
                assert f"the job directory {job_dir} is gone" in said and "FileNotFoundError" not in said, said
            assert saves[5].endswith("step 5: persistent checkpoint written instead"), saves[5]
            assert saves[10].endswith("step 10: persistent checkpoint written instead"), saves[10]
        assert persistent_steps(c) == ["step-000000000005", "step-000000000010"]


def test_a_copy_whose_manifest_agrees_with_its_damaged_bytes_is_refused_with_a_warning():
    """Node 0's own shard of step 3: one byte flipped and its manifest rewritten to agree, so
    only the step's metadata tells. The resume reads the item from node 1's replica, exactly,
    and rank 0 says once which copy it refused and why."""
    with Cluster(2) as c:
        job = c.sub_job("damaged")
        c.run("rec_jobs.py", json.dumps([{"job": job, "first": 2, "last": 3}]), timeout=150)
        with contextlib.closing(c.sub_job_store(0, "damaged")) as store:
            item = damage_shard(store, 3, 0, "rewritten")
        assert item is not None
        c.clear_results()
        c.run("rec_jobs.py", json.dumps([{"job": job}]), timeout=150)
        res = c.sub_job_results("resume", "damaged")
        for rank, r in res.items():
            assert (r["step"], r["match"]) == (3, True), (rank, r)
        assert res[0]["refused_copies"] == 1 and res[1]["refused_copies"] == 0, res
        warned = [line for line in c.nodes[0].log().splitlines()
                  if "WARNING" in line and "refused the copy" in line]
        name = item.key.split("@")[0]
        assert len(warned) == 1, warned
        assert re.search(rf"refused the copy of rank 0's shard of step 3 on node 0 \(item '{name}[^)]*'\): "
                         r"its manifest disagrees with the step's metadata: its checksum", warned[0]), warned
        assert not any("refused the copy" in line for line in c.nodes[1].log().splitlines())
