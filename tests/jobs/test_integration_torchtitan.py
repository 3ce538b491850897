"""torchtitan 0.3.0 (its main branch: test_integration_torchtitan_main.py): mlcheckpoint's
checkpointer, driven as torchtitan's Trainer drives it, on 2 simulated nodes (FSDP2 over gloo,
AdamW, an LR schedule, per-rank dataloader state).

One job checkpoints to memory every 2 steps and to torchtitan's folder every 4, until step 7,
then trains on to step 10 unsaved: the uninterrupted reference. Then
- node 1 is lost (its memory wiped): the restart resumes step 6 from node 0's replicas;
- checkpoint.load_step=4: torchtitan loads that step of its folder, newer memory is dropped;
- both nodes are lost: the restart falls back to torchtitan's own step-4 in its folder;
and each ends bit for bit where the reference did. In the second restart rank 1 then raises
mid-step while rank 0 waits in a collective: both close() from ``except``, as torchtitan's
train.py does, and the job exits instead of hanging in close()'s barrier.
"""

import importlib.util
import os
import shutil
import signal
import sys
import time

import pytest
import torch
from cluster import Cluster
from helpers import (  # put on the workers' PYTHONPATH
    TORCHTITAN_0_3_0,
    from_another_node,
)

pytestmark = pytest.mark.slow

STEPS, SAVED_UNTIL = "10", "7"


def torchtitan_at(path: str) -> str:
    """``path``, a folder holding the package ``torchtitan``; skips the test when it is absent."""
    if not os.path.isfile(os.path.join(path, "torchtitan", "components", "checkpointer", "dcp.py")):
        pytest.skip(f"no torchtitan checkpointer under {path} (scripts/setup.sh --test installs "
                    "torchtitan 0.3.0 there)")
    return path


def torchtitan_0_3_0() -> str:
    """The folder of torchtitan 0.3.0: scripts/setup.sh's, else an installed one."""
    spec = importlib.util.find_spec("torchtitan")  # finds it without importing it
    if not os.path.isdir(TORCHTITAN_0_3_0) and spec is not None and spec.origin is not None:
        return os.path.dirname(os.path.dirname(spec.origin))
    return torchtitan_at(TORCHTITAN_0_3_0)


def workers_path(torchtitan_dir: str) -> str:
    """The workers' PYTHONPATH: ``torchtitan_dir`` first, unless it is installed (already on
    the path, behind PYTHONPATH)."""
    return os.pathsep.join(p for p in (None if torchtitan_dir in sys.path else torchtitan_dir,
                                       os.environ.get("PYTHONPATH")) if p)


def _load(cluster: Cluster, tag: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(cluster.out_dir, f"titan_{tag}.pt"))


def _assert_same_run(cluster: Cluster, tag: str, ref: dict, resumed_step: int,
                     source: str | None) -> None:
    got = cluster.results(f"titan_{tag}")
    assert sorted(got) == [0, 1], cluster.logs()
    for rank, r in got.items():
        if source is None:  # torchtitan's own load
            assert r["resume"] is None
        else:
            assert r["resume"]["step"] == resumed_step and r["resume"]["source"] == source, r["resume"]
        assert r["resumed_step"] == resumed_step  # the train state came back
        later = {s: loss for s, loss in ref[rank]["losses"].items() if int(s) > resumed_step}
        assert r["losses"] == later  # every loss after the resume, exactly
        assert (r["position"], r["lr"]) == (ref[rank]["position"], ref[rank]["lr"])
    expected, final = _load(cluster, "ref"), _load(cluster, tag)
    assert expected.keys() == final.keys() and any(k.startswith("optim.") for k in final)
    differ = [k for k in expected if not torch.equal(expected[k], final[k])]
    assert not differ, f"{tag}: parameters/optimizer state differ from the reference: {differ}"


def node_loss_then_folder_fallback(torchtitan_dir: str) -> None:
    """The whole scenario of this module's docstring, with the torchtitan found in
    ``torchtitan_dir`` (0.3.0 here, its main branch in test_integration_torchtitan_main.py)."""
    path = workers_path(torchtitan_dir)
    with Cluster(2) as cluster:
        dump = os.path.join(cluster.root, "dump")
        cluster.run("titan_train.py", dump, STEPS, SAVED_UNTIL,
                    env={"TITAN_TAG": "ref", "PYTHONPATH": path})
        ref = cluster.results("titan_ref")
        assert ref[0]["torchtitan"] == os.path.join(torchtitan_dir, "torchtitan"), ref[0]
        assert ref[0]["folder"] == ["step-4"], ref[0]  # torchtitan's own save, every 4 steps
        folder_at_crash = os.path.join(cluster.root, "dump-at-crash")
        shutil.copytree(dump, folder_at_crash)

        # Node 1 is replaced by an empty machine: memory still holds step 6 on node 0.
        cluster.nodes[1].wipe()
        cluster.run("titan_train.py", dump, STEPS,
                    env={"TITAN_TAG": "peer", "TITAN_SEED": "1", "PYTHONPATH": path})
        _assert_same_run(cluster, "peer", ref, 6, "peer")
        peer = cluster.results("titan_peer")[0]
        assert from_another_node(peer["resume"]["sources"], [1]), peer["resume"]
        # Our figures reach torchtitan's metric loggers: the resume at the step it loaded, and
        # each in-memory save (the last one published, by then) at the step that saved.
        logged = peer["metrics"]
        assert logged["6"]["mlcheckpoint/resume_step"] == 6, logged
        assert logged["6"]["mlcheckpoint/resume_fetch_seconds"] >= 0, logged
        assert {"8", "10"} <= set(logged), logged
        assert logged["10"]["mlcheckpoint/save_step"] in (8.0, 10.0), logged
        assert logged["10"]["mlcheckpoint/save_seconds"] > 0, logged
        # After the resume torchtitan's own saves go on: step 8, and the last step.
        assert {"step-8", "step-10"} <= set(peer["folder"]), peer["folder"]

        # checkpoint.load_step=4 names a step of the folder: torchtitan loads it, and memory's
        # steps 8 and 10 from the run above are dropped, not kept as the newest.
        cluster.run("titan_train.py", dump, STEPS, env={"TITAN_TAG": "step4", "TITAN_SEED": "3",
                                                        "TITAN_LOAD_STEP": "4", "PYTHONPATH": path})
        _assert_same_run(cluster, "step4", ref, 4, None)
        assert all(r["memory_after_load"] == [] for r in cluster.results("titan_step4").values())

        # Both nodes lost: only torchtitan's folder as it was at the crash is left.
        for node in cluster.nodes:
            node.wipe()
        cluster.start("titan_train.py", folder_at_crash, STEPS,
                      env={"TITAN_TAG": "folder", "TITAN_SEED": "2", "TITAN_RAISE_AT_END": "1",
                           "PYTHONPATH": path})
        codes = cluster.wait(timeout=90)  # a close() that waits for the failed rank hangs here
        _assert_same_run(cluster, "folder", ref, 4, "persistent")
        assert codes != [0, 0] and "injected failure on rank 1" in cluster.logs()
        assert "closing after an error on this rank" in cluster.nodes[1].log()


@pytest.mark.slow
def test_torchtitan_checkpointer_resumes_from_partner_then_from_its_folder():
    """torchtitan 0.3.0's checkpointer with ours: a lost node resumes from the partner, then
    with memory gone from torchtitan's folder, bit-exactly both times."""
    node_loss_then_folder_fallback(torchtitan_0_3_0())


@pytest.mark.slow
def test_a_preempted_torchtitan_job_keeps_its_newest_step_in_memory_in_torchtitans_folder():
    """A whole-job preemption (SIGTERM to both agents) after step 7, while memory holds step 6
    and torchtitan's folder step 4: the preemption flush writes step 6 into the folder as
    torchtitan's own ``step-6``. With both nodes lost, torchtitan's own load of it ends bit for
    bit where the uninterrupted job did. Before, the flush was refused for torchtitan's folder
    and the restart went back to step 4."""
    path = workers_path(torchtitan_0_3_0())
    with Cluster(2) as cluster:
        dump = os.path.join(cluster.root, "dump")
        cluster.start("titan_train.py", dump, STEPS, SAVED_UNTIL,
                      env={"TITAN_TAG": "ref", "TITAN_WAIT_AT_END": "1", "PYTHONPATH": path})
        deadline = time.monotonic() + 120
        while len(cluster.results("titan_ref")) < 2:  # trained to 10, saved until 7: waiting
            assert time.monotonic() < deadline and cluster.running() == [0, 1], cluster.logs()
            time.sleep(0.05)
        ref = cluster.results("titan_ref")
        assert ref[0]["folder"] == ["step-4"], ref[0]
        for node in cluster.nodes:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)
        cluster.wait(timeout=60)
        assert sorted(os.listdir(os.path.join(dump, "checkpoint"))) == ["step-4", "step-6"], \
            cluster.logs()

        for node in cluster.nodes:  # both nodes lost: only torchtitan's folder is left
            node.wipe()
        cluster.run("titan_train.py", dump, STEPS,
                    env={"TITAN_TAG": "flushed", "TITAN_SEED": "2", "PYTHONPATH": path})
        _assert_same_run(cluster, "flushed", ref, 6, "persistent")
