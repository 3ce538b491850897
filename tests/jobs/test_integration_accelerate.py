"""Hugging Face accelerate (issue 24, item 4): examples/accelerate_train.py, the documented
recipe, as a real 2-process ``accelerate launch`` job on CPU (DDP over gloo).

One launch trains 10 steps uninterrupted: the reference. Another saves every step to memory,
is SIGKILLed (the whole launch, agent and workers) once step 6 is committed, and is launched
again: it resumes step 6 from this node's memory and ends bit for bit where the reference did
(the losses of steps 7-9, the learning rate, every parameter and optimizer tensor). Each launch
says what it restored in one line (issue 44); with memory lost, the persistent step, at WARNING.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from cluster import free_port

pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh --test installs it)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "accelerate_train.py")
STEPS, KILLED_AFTER = 10, 6


def launch(workdir: str, job: str, out: str, *extra: str) -> subprocess.Popen:
    """``accelerate launch`` of the example: 2 processes on this machine's CPU."""
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), EXAMPLE, "--steps", str(STEPS),
           "--folder", os.path.join(workdir, f"{job}-folder"), "--out", out, *extra]
    env = dict(os.environ, MLCHECKPOINT_LOCAL_DIR=os.path.join(workdir, "shm"),
               MLCHECKPOINT_JOB_ID=job, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               ACCELERATE_USE_CPU="1")  # one DDP job over gloo, not 2 single-process ones
    with open(os.path.join(out, "log.txt"), "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, out: str, timeout: float = 240) -> None:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        kill(proc)
    assert code == 0, f"accelerate launch exited {code}:\n{_tail(out)}"


def _tail(out: str) -> str:
    return _log(out)[-6000:]


def _log(out: str) -> str:
    with open(os.path.join(out, "log.txt")) as f:
        return f.read()


def _ours(out: str) -> list[str]:
    """The lines mlcheckpoint printed in a launch (its log, both processes)."""
    return [line for line in _log(out).splitlines() if line.startswith("mlcheckpoint:")]


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launch: its agent and the workers, which torchrun starts in sessions of
    their own (so killing the launch's process group alone would leave them running)."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def results(out: str) -> dict[int, dict]:
    found = {}
    for rank in (0, 1):
        with open(os.path.join(out, f"result-{rank}.json")) as f:
            found[rank] = json.load(f)
    return found


@pytest.mark.slow
def test_accelerate_job_killed_after_a_save_resumes_bit_exact(store_dir):
    """An accelerate launch SIGKILLed after a save resumes from local memory with every later
    loss and the learning rate as in an uninterrupted run, and says so in one line."""
    workdir = store_dir  # memory (tmpfs) and persistent folders for the launches
    ref_out = os.path.join(workdir, "ref")
    finish(launch(workdir, "accel-ref", ref_out), ref_out)

    crash_out = os.path.join(workdir, "crash")
    proc = launch(workdir, "accel-crash", crash_out, "--hang-after", str(KILLED_AFTER))
    try:
        deadline = time.monotonic() + 240
        while not all(os.path.exists(os.path.join(crash_out, f"saved-{r}")) for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, _tail(crash_out)
            time.sleep(0.2)
    finally:
        kill(proc)  # SIGKILL: the launcher and both workers, no clean-up of any kind

    resumed_out = os.path.join(workdir, "resumed")
    finish(launch(workdir, "accel-crash", resumed_out), resumed_out)

    ref, resumed = results(ref_out), results(resumed_out)
    assert ref[0]["losses"] != ref[1]["losses"]  # each process trained on its own half
    for rank in (0, 1):
        assert (resumed[rank]["resumed"], resumed[rank]["source"]) == (KILLED_AFTER, "local")
        assert ref[rank]["resumed"] is None
        later = {s: loss for s, loss in ref[rank]["losses"].items() if int(s) > KILLED_AFTER}
        assert resumed[rank]["losses"] == later  # every loss after the resume, exactly
        assert resumed[rank]["lr"] == ref[rank]["lr"]
    # Each launch says what it restored in one line (rank 0, through logging); the saves print
    # nothing each.
    assert _ours(ref_out) == [("mlcheckpoint: nothing restored, starting fresh: memory holds no "
                               "checkpoint of this job and there is no persistent checkpoint")]
    (line,) = _ours(resumed_out)
    assert re.fullmatch(r"mlcheckpoint: restored step 6 from local memory in [0-9.]+s", line), line
    for out in (ref_out, resumed_out):
        lines = Counter(line for line in _log(out).splitlines() if line.strip())
        assert not {line: n for line, n in lines.items() if n > 2}, _tail(out)
    # Memory lost: the folder's step 9 (written at the end of the last launch), at WARNING.
    shutil.rmtree(os.path.join(workdir, "shm", "accel-crash"))
    fallback_out = os.path.join(workdir, "fallback")
    finish(launch(workdir, "accel-crash", fallback_out), fallback_out)
    (line,) = _ours(fallback_out)
    assert re.fullmatch(r"mlcheckpoint: restored step 9 from the persistent checkpoint in [0-9.]+s; "
                        r"memory holds no checkpoint of this job", line), line

    expected = torch.load(os.path.join(ref_out, "final.pt"))
    final = torch.load(os.path.join(resumed_out, "final.pt"))
    flat_expected, flat_final = _flatten(expected), _flatten(final)
    assert flat_expected.keys() == flat_final.keys() and any("exp_avg" in k for k in flat_final)
    differ = [k for k in flat_expected if not torch.equal(flat_expected[k], flat_final[k])]
    assert not differ, f"parameters/optimizer state differ from the uninterrupted run: {differ}"


def _flatten(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}/{key}").items()}
    return {}
