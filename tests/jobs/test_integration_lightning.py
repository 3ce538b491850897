"""Lightning 2.6: MLCheckpointStrategy (FSDP2, 2 CPU processes). A Trainer checkpoints to memory
and to Lightning's folder every 2 steps and is SIGKILLed after step 7. Resumed through the
strategy (fit(ckpt_path=LATEST)), it continues from step 6 in memory; with memory wiped, from
Lightning's own sharded step 6 in its folder; either way exactly as Lightning's own sharded
resume of step 6 does: the same loop position, losses, parameters and optimizer state."""

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

pytest.importorskip("mlcheckpoint.integrations.lightning",
                    reason="needs the [lightning] extra (scripts/setup.sh installs it)")

from cluster import Cluster, free_port

from mlcheckpoint.integrations.lightning import LATEST

pytestmark = pytest.mark.slow


def _run(cluster: Cluster, phase: str, folder: str, tag: str | None = None, **env: str) -> int:
    cluster.start("lightning_train.py", phase, folder, env={"LIGHTNING_TAG": tag or phase, **env})
    return max(cluster.wait(timeout=120))


# A progress bar's redraw ("Epoch 0: 100%|###| 10/10 [00:01<00:00, 7.82it/s, loss=0.187]"):
# tqdm redraws the same text at an epoch's end and at the trainer's, more often under load.
PROGRESS_BAR = re.compile(r"\| *\d+/(\d+|\?) \[[^\]]*(it/s|s/it)")


def repeated_lines(printed: str) -> dict[str, int]:
    """Lines printed more than twice (a line per save would be), progress-bar redraws aside."""
    return {line: n for line, n in Counter(printed.split("\n")).items()
            if n > 2 and line.strip() and not PROGRESS_BAR.search(line)}


def _printed(cluster: Cluster, node: int = 0) -> str:
    """What the node printed in its last launch."""
    return cluster.nodes[node].log().rsplit("\n===== ", 1)[-1]


def test_lightning_strategy_resumes_from_memory_and_folder_like_lightning():
    """The Lightning strategy resumes from memory, and with memory lost from Lightning's own
    folder, to the state Lightning's own checkpoint restores; our figures reach its loggers."""
    with Cluster(1, nproc=2) as cluster:
        folder = os.path.join(cluster.root, "ckpts")
        assert _run(cluster, "save", folder) != 0  # killed after step 7
        assert "step=6.ckpt" in os.listdir(folder)  # Lightning's own, written by Lightning
        assert _run(cluster, "resume", folder) == 0, cluster.logs()
        printed = _printed(cluster)
        assert f"Restored all states from the checkpoint at {LATEST}" in printed
        assert re.search(r"^mlcheckpoint: restored step 6 from local memory in [0-9.]+s$",
                         printed, re.MULTILINE), printed
        assert _run(cluster, "lightning", folder) == 0, cluster.logs()
        cluster.nodes[0].wipe()  # memory lost: Lightning's folder is all that is left
        assert _run(cluster, "resume", folder, tag="fallback") == 0, cluster.logs()
        assert re.search(r"^mlcheckpoint: restored step 6 from the persistent checkpoint in "
                         r"[0-9.]+s; memory holds no checkpoint of this job$", _printed(cluster), re.MULTILINE)

        own = cluster.results("lightning_lightning")
        expected = torch.load(os.path.join(cluster.out_dir, "lightning_lightning.pt"))
        for tag, source in (("resume", "local"), ("fallback", "persistent")):
            resumed = cluster.results(f"lightning_{tag}")
            assert sorted(resumed) == [0, 1], cluster.logs()
            for rank in (0, 1):
                logged = resumed[rank].pop("metrics")
                own[rank].pop("metrics", None)
                if tag == "resume":  # our figures reach Lightning's loggers, beside the loss
                    assert logged["6"]["mlcheckpoint/resume_step"] == 6, logged
                    assert logged["6"]["mlcheckpoint/resume_load_seconds"] > 0, logged
                    assert logged["10"]["mlcheckpoint/save_step"] in (8.0, 10.0), logged
                    assert logged["10"]["mlcheckpoint/save_bytes"] > 0, logged
                assert own[rank]["start"] == [6, 0] and own[rank]["global_step"] == 10
                assert own[rank]["counter"] == 6  # the module's hooks, as Lightning calls them
                assert resumed[rank]["source"] == source
                del resumed[rank]["source"], own[rank]["source"]
                assert resumed[rank] == own[rank]  # loop position, global step, every loss
                own[rank]["source"] = None
            final = torch.load(os.path.join(cluster.out_dir, f"lightning_{tag}.pt"))
            assert expected.keys() == final.keys() and any(k.startswith("optim.") for k in final)
            assert not [k for k in expected if not torch.equal(expected[k], final[k])], tag


@pytest.mark.parametrize("nnodes,nproc", [(1, 2), (2, 1)])
def test_a_preempted_job_keeps_its_newest_step_in_memory_as_a_lightning_checkpoint(nnodes, nproc):
    """SIGTERM (a whole-job preemption) to a job checkpointing to memory every step and to
    Lightning's folder every 10: the preemption flush writes the newest step memory holds into
    that folder as a sharded Lightning checkpoint (``preempted-step=<S>.ckpt``). With memory
    gone, ``fit(ckpt_path=LATEST)`` resumes it, and plain Lightning loading it by its path
    trains on exactly as our resume does. Before, the flush was refused for Lightning's folder
    and the restart went back to Lightning's step 10 (or 20). On one node of two processes,
    and on two nodes of one (the metadata, which becomes ``meta.pt``, is in rank 0's part,
    written from node 0)."""
    with Cluster(nnodes, nproc=nproc) as cluster:
        folder = os.path.join(cluster.root, "ckpts")
        cluster.start("lightning_train.py", "preempt", folder,
                      env={"LIGHTNING_TAG": "preempt", "LIGHTNING_STEPS": "400", "LIGHTNING_EVERY": "1"})
        deadline = time.monotonic() + 120
        while min((r["step"] for r in cluster.results("progress").values()), default=0) < 15 \
                or len(cluster.results("progress")) < 2:
            assert time.monotonic() < deadline and cluster.running() == list(range(nnodes)), \
                cluster.logs()
            time.sleep(0.05)
        reached = min(r["step"] for r in cluster.results("progress").values())
        for node in cluster.nodes:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)
        cluster.wait(timeout=60)
        flushed = [n for n in os.listdir(folder) if n.startswith("preempted-step=")]
        assert len(flushed) == 1, (os.listdir(folder), cluster.logs())
        step = int(flushed[0].removeprefix("preempted-step=").removesuffix(".ckpt"))
        own = max(int(n[len("step="):-len(".ckpt")]) for n in os.listdir(folder) if n.startswith("step="))
        assert step > own and step >= reached - 1, (step, own, reached)
        path = os.path.join(folder, flushed[0])
        assert torch.load(os.path.join(path, "meta.pt"), weights_only=False)["global_step"] == step

        for node in cluster.nodes:  # new machines: Lightning's folder is all that is left
            node.wipe()
        end = str(step + 4)
        assert _run(cluster, "resume", folder, tag="after", LIGHTNING_STEPS=end) == 0, cluster.logs()
        assert re.search(rf"^mlcheckpoint: restored step {step} from the persistent checkpoint",
                         _printed(cluster), re.MULTILINE), _printed(cluster)
        assert _run(cluster, "lightning", folder, tag="own_flushed", LIGHTNING_STEPS=end,
                    LIGHTNING_CKPT=path) == 0, cluster.logs()
        ours, own_run = cluster.results("lightning_after"), cluster.results("lightning_own_flushed")
        for rank in (0, 1):
            for r in (ours[rank], own_run[rank]):
                r.pop("metrics")
                r.pop("source")
            assert ours[rank] == own_run[rank] and ours[rank]["start"][0] == step, (ours, own_run)
        expected = torch.load(os.path.join(cluster.out_dir, "lightning_own_flushed.pt"))
        final = torch.load(os.path.join(cluster.out_dir, "lightning_after.pt"))
        assert expected.keys() == final.keys()
        assert not [k for k in expected if not torch.equal(expected[k], final[k])]


def test_a_fresh_start_trains_as_lightning_alone_and_claims_no_restore():
    """fit(ckpt_path=LATEST) with nothing in memory or the folder trains exactly as Lightning's
    own strategy without a checkpoint (losses, parameters, optimizer state); Lightning does
    not report "Restored all states from the checkpoint at mlcheckpoint://latest" and calls
    no checkpoint hook (the module's on_load_checkpoint reads a key of its own: called with
    nothing restored, it raises KeyError). Its 20 saves to memory print nothing per save."""
    steps = {"LIGHTNING_STEPS": "20", "LIGHTNING_EVERY": "1"}
    with Cluster(1, nproc=2) as cluster:
        folder = os.path.join(cluster.root, "ckpts")
        assert _run(cluster, "fresh", folder, **steps) == 0, cluster.logs()
        printed = _printed(cluster)  # this launch's part
        assert _run(cluster, "plain", folder, **steps) == 0, cluster.logs()
        assert "Restored all states" not in printed, printed
        lines = [line for line in printed.splitlines() if line.startswith("mlcheckpoint:")]
        assert lines == [("mlcheckpoint: nothing restored, starting fresh: memory holds no "
                         "checkpoint of this job and there is no persistent checkpoint")], printed
        # No line per save: not Lightning's "`weights_only` was not set", nor any of ours.
        assert "weights_only" not in printed, printed
        assert not repeated_lines(printed), repeated_lines(printed)

        fresh, plain = cluster.results("lightning_fresh"), cluster.results("lightning_plain")
        assert sorted(fresh) == sorted(plain) == [0, 1], cluster.logs()
        for rank in (0, 1):
            for result in (fresh[rank], plain[rank]):
                result.pop("metrics")
            assert fresh[rank].pop("source") is None and plain[rank].pop("source") is None
            assert fresh[rank]["start"] == [0, 0] and fresh[rank]["global_step"] == 20
            assert fresh[rank]["counter"] is None  # no hook called
            assert fresh[rank] == plain[rank]  # every loss, bit for bit (JSON keeps a float's repr)
        ours = torch.load(os.path.join(cluster.out_dir, "lightning_fresh.pt"))
        alone = torch.load(os.path.join(cluster.out_dir, "lightning_plain.pt"))
        assert ours.keys() == alone.keys() and any(k.startswith("optim.") for k in ours)
        assert not [k for k in ours if not torch.equal(ours[k], alone[k])]


def test_each_resume_says_in_one_line_what_it_restored_and_from_where():
    """2 nodes x 1 rank. Killed after step 7 (step 6 in memory on both nodes), the job resumes
    from each node's own memory; killed again and node 1 replaced by an empty machine, rank 1
    reads step 6 from node 0; with both nodes' memory gone, Lightning's folder serves it. Each
    launch prints one line on rank 0 through Lightning's console saying so."""
    with Cluster(2, nproc=1) as cluster:
        folder = os.path.join(cluster.root, "ckpts")
        kill = {"LIGHTNING_KILL": "1"}
        assert _run(cluster, "save", folder) != 0  # killed after step 7
        expected = {
            "local": r"restored step 6 from local memory in [0-9.]+s",
            "peer": r"restored step 6 in [0-9.]+s \(rank 0 local, rank 1 from node 0\)",
            "fallback": r"restored step 6 from the persistent checkpoint in [0-9.]+s; "
                        r"memory holds no checkpoint of this job"}
        for tag, lose in (("local", []), ("peer", [1]), ("fallback", [0, 1])):
            for node in lose:
                cluster.nodes[node].wipe()
            code = _run(cluster, "resume", folder, tag, **({} if tag == "fallback" else kill))
            assert (code == 0) == (tag == "fallback"), cluster.logs()
            printed, other = _printed(cluster, 0), _printed(cluster, 1)
            ours = [line for line in printed.splitlines() if line.startswith("mlcheckpoint:")]
            assert len(ours) == 1 and re.fullmatch(f"mlcheckpoint: {expected[tag]}", ours[0]), printed
            assert "\nmlcheckpoint:" not in other, other  # rank 0's line only
        resumed = cluster.results("lightning_fallback")
        assert [resumed[r]["start"] for r in (0, 1)] == [[6, 0], [6, 0]]
        assert [resumed[r]["counter"] for r in (0, 1)] == [6, 6]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "lightning_fsdp2.py")


def _documented_snippet() -> list[str]:
    """The code lines of docs/integration.md's Lightning snippet."""
    with open(os.path.join(REPO, "docs", "integration.md")) as f:
        text = f.read().split("## PyTorch Lightning", 1)[1]
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_documented_snippet_is_the_example():
    """Issue 44: the snippet a user copies is what examples/lightning_fsdp2.py runs, line for line
    (its imports at the top of the file, the rest in order in main())."""
    with open(EXAMPLE) as f:
        example = [line.strip() for line in f.read().splitlines()]
    snippet = _documented_snippet()
    imports = [line for line in snippet if line.startswith(("import ", "from "))]
    text = " ".join(example)  # its imports may be wrapped over lines
    for line in imports:
        module, _, names = line.partition(" import ")
        assert (line in example if not names else
                f"{module} import" in text and all(n.strip() in text for n in names.split(","))), line
    code = snippet[len(imports):]
    start = example.index(code[0])
    assert example[start:start + len(code)] == code, (code, example[start:start + len(code)])


def test_the_example_runs_as_written_and_resumes(store_dir):
    """examples/lightning_fsdp2.py (the documented snippet) under torchrun, 2 CPU processes, as
    its docstring says: one job over both ranks (no "trains alone" warning at setup), 10 steps
    saved every 5 to memory; launched again for 20 steps it restores step 10 from memory and
    says so in one line. No per-save line in either launch."""
    env = dict(os.environ, MLCHECKPOINT_JOB_ID="lightning-example", OMP_NUM_THREADS="1",
               MLCHECKPOINT_LOCAL_DIR=os.path.join(store_dir, "shm"), CUDA_VISIBLE_DEVICES="")
    printed = []
    for steps in (10, 20):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", EXAMPLE,
               "--steps", str(steps)]
        done = subprocess.run(cmd, cwd=store_dir, env=env, capture_output=True, text=True,
                              timeout=240, check=False)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-6000:]
        printed.append(out)
    first, second = printed
    for out in printed:
        assert "trains alone" not in out and "weights_only" not in out, out[-6000:]
        assert not repeated_lines(out), out[-6000:]
    ours = [line for line in first.splitlines() if line.startswith("mlcheckpoint:")]
    assert ours == [("mlcheckpoint: nothing restored, starting fresh: memory holds no checkpoint "
                     "of this job and there is no persistent checkpoint")], first[-6000:]
    ours = [line for line in second.splitlines() if line.startswith("mlcheckpoint:")]
    assert len(ours) == 1 and re.fullmatch(r"mlcheckpoint: restored step 10 from local memory in "
                                           r"[0-9.]+s", ours[0]), second[-6000:]


def test_a_mesh_on_which_every_rank_trains_alone_is_reported_at_setup():
    """MLCheckpointStrategy() with Lightning's defaults on one node of 2 processes: data-parallel
    size 1, tensor-parallel size 2; the module shards over device_mesh["data_parallel"] (size 1),
    so no parameter spans two ranks. The strategy says so once, at setup, with the fix."""
    with Cluster(1, nproc=2) as cluster:
        folder = os.path.join(cluster.root, "ckpts")
        assert _run(cluster, "fresh", folder, LIGHTNING_DEFAULT_MESH="1", LIGHTNING_STEPS="2") == 0, \
            cluster.logs()
        printed = _printed(cluster)
        assert printed.count("trains alone") == 1, printed
        assert ("the device mesh is data_parallel=1 x tensor_parallel=2 and no parameter of the "
                "model is sharded or replicated over more than one rank") in printed, printed
        assert "MLCheckpointStrategy(data_parallel_size=2, tensor_parallel_size=1)" in printed
