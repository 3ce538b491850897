"""Overlapped saves (issue 13): ``ckpt.guard(optimizer)``, then ``async_save`` returns before
the tensor copy, which runs while the next step computes. Every snapshot must be exact at
the point where the user's state next changes.

Each test holds the staging thread (a job queued ahead of the save's copy) until training has
changed the state, so the copy provably runs after the change: the bytes loaded back are
compared with a blocking save of the same state.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from states import assert_same
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from mlcheckpoint import CheckpointManager, StagingError
from mlcheckpoint.testing import internals

JOB = "overlap"


def make_manager(store_dir: str) -> CheckpointManager:
    return CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none", keep=8)


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def micro_batch(model: nn.Module, i: int) -> None:
    """Forward and backward: updates BatchNorm's running statistics and the gradients."""
    g = torch.Generator().manual_seed(i)
    model(torch.randn(16, 32, generator=g)).square().mean().backward()


def train_step(model: nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    optim.zero_grad()
    micro_batch(model, i)
    optim.step()


class HeldStaging:
    """Holds the staging thread: a save's copy queued behind it runs only after release()."""

    def __init__(self, ckpt: CheckpointManager):
        self.gate = threading.Event()
        internals(ckpt).snapshots.submit(lambda copied: self.gate.wait(), label=-1)

    def release(self) -> None:
        self.gate.set()

    def release_later(self, seconds: float = 0.3) -> threading.Timer:
        """Release from another thread while the training thread is blocked elsewhere."""
        timer = threading.Timer(seconds, self.gate.set)
        timer.start()
        return timer


def release_at_step(optim: torch.optim.Optimizer, holds: list[HeldStaging]) -> None:
    """Release the newest hold when optimizer.step() begins, before the guard (hooks run in
    the order they were registered): the guard then has a copy to wait for."""
    optim.register_step_pre_hook(lambda *_: holds and holds[-1].release())


def load(ckpt: CheckpointManager, step: int, like: dict) -> dict:
    out = copy.deepcopy(like)
    dcp.load(out, storage_reader=ckpt.storage_reader(step), no_dist=True)
    return out


def state(model, optim, sched=None) -> dict:
    sd = {"model": model.state_dict(), "optim": optim.state_dict()}
    if sched is not None:
        sd["sched"] = sched.state_dict()
    return copy.deepcopy(sd)


def test_optimizer_step_waits_and_the_snapshot_is_the_pre_step_state(store_dir):
    model, optim = build()
    with make_manager(store_dir) as ckpt:
        train_step(model, optim, 0)
        holds: list[HeldStaging] = []
        release_at_step(optim, holds)
        ckpt.guard(optim)
        sd = {"model": model, "optim": optim}
        ckpt.save(sd, 1)  # blocking: the reference bytes
        holds.append(HeldStaging(ckpt))
        fut = ckpt.async_save(sd, 2)
        assert not fut.done()  # returned before the copy: it waits behind the held job
        train_step(model, optim, 1)  # optimizer.step() releases the copy, the guard waits for it
        assert fut.result().step == 2
        # stats() gives the longest time a guard held the training thread
        assert ckpt.stats()["mlcheckpoint/guard_longest_wait_seconds"] == \
            internals(ckpt).snapshots.longest_wait_s
        after = state(model, optim)
        before = load(ckpt, 1, after)
        assert_same(load(ckpt, 2, after), before)
        assert not torch.equal(after["model"]["0.weight"], before["model"]["0.weight"])


def test_batchnorm_and_gradient_accumulation(store_dir):
    """A forward updates BatchNorm buffers before any optimizer.step(): they are captured at
    call time; the parameters wait for the guard across k micro-batches."""
    model, optim = build()
    with make_manager(store_dir) as ckpt:
        ckpt.guard(optim)
        sd = {"model": model, "optim": optim}
        train_step(model, optim, 0)
        ckpt.save(sd, 1)
        held = HeldStaging(ckpt)
        fut = ckpt.async_save(sd, 2)
        optim.zero_grad()
        for i in range(3):  # three micro-batches: forwards change the running statistics
            micro_batch(model, 10 + i)
        held.release()
        optim.step()
        fut.result()
        after = state(model, optim)
        before = load(ckpt, 1, after)
        assert_same(load(ckpt, 2, after), before)
        assert int(after["model"]["1.num_batches_tracked"]) == int(before["model"]["1.num_batches_tracked"]) + 3
        assert not torch.equal(after["model"]["1.running_mean"], before["model"]["1.running_mean"])


def test_stateful_and_python_leaves_are_taken_at_call_time(store_dir):
    model, optim = build()
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    extra = {"epoch": 3, "seen": [1, 2], "tags": {"warmup"}}
    with make_manager(store_dir) as ckpt:
        ckpt.guard(optim)
        train_step(model, optim, 0)
        sched.step()
        sd = {"model": model, "optim": optim, "sched": sched, "extra": extra}
        expected = {**state(model, optim, sched), "extra": copy.deepcopy(extra)}
        held = HeldStaging(ckpt)
        fut = ckpt.async_save(sd, 2)
        sched.step()  # the scheduler and the plain values change before the copy runs
        extra["epoch"] += 1
        extra["seen"].append(3)
        extra["tags"].add("decay")
        held.release()
        train_step(model, optim, 1)
        fut.result()
        assert_same(load(ckpt, 2, expected), expected)


def test_second_async_save_before_the_first_is_staged(store_dir):
    """The second call waits for the first save; both are exact, the second including the
    BatchNorm statistics a forward changed in between."""
    model, optim = build()
    with make_manager(store_dir) as ckpt:
        ckpt.guard(optim)
        sd = {"model": model, "optim": optim}
        train_step(model, optim, 0)
        first = state(model, optim)
        held = HeldStaging(ckpt)
        f2 = ckpt.async_save(sd, 2)
        with torch.no_grad():
            model.train()(torch.randn(16, 32))  # buffers change; parameters do not
        second = state(model, optim)
        timer = held.release_later()
        f3 = ckpt.async_save(sd, 3)  # waits for save 2 (held) before taking its snapshot
        timer.join()
        train_step(model, optim, 1)
        assert (f2.result().step, f3.result().step) == (2, 3)
        assert_same(load(ckpt, 2, first), first)
        assert_same(load(ckpt, 3, second), second)
        assert not torch.equal(first["model"]["1.running_mean"], second["model"]["1.running_mean"])


def test_close_during_staging_commits_the_exact_step(store_dir):
    model, optim = build()
    ckpt = make_manager(store_dir)
    ckpt.guard(optim)
    train_step(model, optim, 0)
    expected = state(model, optim)
    held = HeldStaging(ckpt)
    ckpt.async_save({"model": model, "optim": optim}, 2)
    timer = held.release_later()
    ckpt.close()  # waits for the snapshot and the commit
    timer.join()
    train_step(model, optim, 1)
    with make_manager(store_dir) as again:
        model2, optim2 = build(seed=1)
        sd2 = {"model": model2.state_dict(), "optim": optim2.state_dict()}
        # a fresh optimizer has no state yet: resume into the saved structure
        sd2["optim"] = copy.deepcopy(expected["optim"])
        info = again.resume(sd2)
        assert info.step == 2
        assert_same(sd2, expected)


def test_failing_close_during_staging_commits_nothing_torn(store_dir):
    """close(failed=True) does not wait: the snapshot in flight fails instead of committing
    bytes that training may be changing; the previous step stays resumable."""
    model, optim = build()
    ckpt = make_manager(store_dir)
    ckpt.guard(optim)
    sd = {"model": model, "optim": optim}
    train_step(model, optim, 0)
    ckpt.save(sd, 1)
    expected = state(model, optim)
    held = HeldStaging(ckpt)
    fut = ckpt.async_save(sd, 2)
    ckpt.close(failed=True)
    held.release()
    with pytest.raises(StagingError):
        fut.result(timeout=60)
    train_step(model, optim, 1)
    with make_manager(store_dir) as again:
        assert internals(again).store.inventory.complete_steps() == [1]
        out = copy.deepcopy(expected)
        assert again.resume(out).step == 1
        assert_same(out, expected)


def test_staging_failure_surfaces_at_the_guard_and_the_previous_step_resumes(store_dir):
    """A guarded tensor resized before the copy ran: the copy is refused (never a read of
    freed memory), optimizer.step() raises it, the step is committed nowhere."""
    model, optim = build()
    with make_manager(store_dir) as ckpt:
        ckpt.guard(optim)
        sd = {"model": model, "optim": optim}
        train_step(model, optim, 0)
        ckpt.save(sd, 1)
        expected = state(model, optim)
        held = HeldStaging(ckpt)
        fut = ckpt.async_save(sd, 2)
        exp_avg = optim.state[model[0].weight]["exp_avg"]
        kept = exp_avg.clone()
        exp_avg.resize_(1 << 16)  # a new, larger allocation under the planned copy
        held.release()
        with pytest.raises(StagingError, match="resized or replaced"):
            optim.step()
        with pytest.raises(StagingError):
            fut.result()
        exp_avg.resize_(kept.shape).copy_(kept)
        assert internals(ckpt).store.inventory.complete_steps() == [1]
        optim.step()  # raised once
        ckpt.async_save(sd, 3).result()  # its future said so: the next save goes ahead
        assert internals(ckpt).store.inventory.complete_steps() == [1, 3]
        out = copy.deepcopy(expected)
        assert_same(load(ckpt, 1, out), expected)


def test_without_a_guard_async_save_blocks(store_dir):
    model, optim = build()
    with make_manager(store_dir) as ckpt:
        train_step(model, optim, 0)
        held = HeldStaging(ckpt)
        expected = state(model, optim)
        fut = ckpt.async_save({"model": model, "optim": optim}, 2)  # copies before returning
        train_step(model, optim, 1)  # no guard: nothing waits, and nothing needs to
        held.release()
        fut.result()
        assert_same(load(ckpt, 2, expected), expected)
        handle = ckpt.guard(optim)
        handle.remove()
        assert not internals(ckpt).snapshots.guarded


def test_overlap_false_blocks_and_wait_staged_waits(store_dir):
    model, optim = build()
    with make_manager(store_dir) as ckpt:
        ckpt.guard(optim)
        train_step(model, optim, 0)
        expected = state(model, optim)
        sd = {"model": model, "optim": optim}
        held = HeldStaging(ckpt)
        ckpt.async_save(sd, 2, overlap=False)  # copied before returning: the hold is no matter
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # outside optimizer.step(): fine for a blocking save
        held.release()
        ckpt.wait()
        assert_same(load(ckpt, 2, expected), expected)
        expected = state(model, optim)
        held = HeldStaging(ckpt)
        ckpt.async_save(sd, 3, overlap=True)  # every tensor in the background
        timer = held.release_later()
        ckpt.wait_staged()
        timer.join()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ckpt.wait()
        assert_same(load(ckpt, 3, expected), expected)


# --------------------------------------------------------------------------- device tensors
# The device-to-host copy runs on a stream of its own, straight into the page-locked tmpfs
# buffer, and is hashed on the host once its event completes. Single process; skipped
# without CUDA.
def cpu_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    sd = copy.deepcopy({"model": model.state_dict(), "optim": optim.state_dict()})

    def to_cpu(x):
        if isinstance(x, dict):
            return {k: to_cpu(v) for k, v in x.items()}
        if isinstance(x, list):
            return [to_cpu(v) for v in x]
        return x.cpu() if isinstance(x, torch.Tensor) else x
    return to_cpu(sd)


def device_step(model: nn.Module, optim: torch.optim.Optimizer, i: int, big: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(i)
    optim.zero_grad()
    model(torch.randn(64, big, device="cuda", generator=g)).square().mean().backward()
    optim.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("big", [256, 4096])
def test_overlapped_device_save_is_the_pre_step_state(store_dir, big):
    gpu_ckpt = make_manager(store_dir)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(big, big), nn.BatchNorm1d(big), nn.ReLU(),
                          nn.Linear(big, 8)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    device_step(model, optim, 0, big)
    holds: list[HeldStaging] = []
    release_at_step(optim, holds)
    gpu_ckpt.guard(optim)
    sd = {"model": model, "optim": optim}
    gpu_ckpt.save(sd, 1)
    reference = cpu_state(model, optim)
    holds.append(HeldStaging(gpu_ckpt))
    fut = gpu_ckpt.async_save(sd, 2)
    assert not fut.done()
    device_step(model, optim, 1, big)  # the forward changes BN buffers on the device; the guard waits
    result = fut.result()
    optim_bytes = sum(t.numel() * t.element_size() for p in model.parameters()
                      for t in [p, *optim.state[p].values()] if isinstance(t, torch.Tensor))
    assert result.overlapped_bytes == optim_bytes  # parameters and Adam state: in the background
    assert_same(load(gpu_ckpt, 2, reference), load(gpu_ckpt, 1, reference))
    assert_same(load(gpu_ckpt, 2, reference), reference)
    assert not torch.equal(model[0].weight.cpu(), reference["model"]["0.weight"])
    gpu_ckpt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dcp_native_overlapped_device_save(store_dir):
    gpu_ckpt = make_manager(store_dir)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8)).cuda()
    optim = torch.optim.Adam(model.parameters())
    device_step(model, optim, 0, 512)
    gpu_ckpt.guard(optim)
    reference = cpu_state(model, optim)
    resp = dcp.async_save({"model": model, "optim": optim}, storage_writer=gpu_ckpt.storage_writer(3),
                          no_dist=True)
    assert isinstance(resp, AsyncSaveResponse)
    resp.staging_completion.result()
    device_step(model, optim, 1, 512)
    resp.upload_completion.result()
    assert_same(load(gpu_ckpt, 3, reference), reference)
    gpu_ckpt.close()
