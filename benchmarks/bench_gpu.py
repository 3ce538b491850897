#!/usr/bin/env python
"""GPU benchmark (issue 37): checksums where the bytes are, device-to-host staging, resume into
CUDA tensors, a training loop checkpointing every step at four demand levels, and the copy
threads with several ranks per node; each against a baseline measured in the same run.

Sections (``--only`` picks some):

* ``digest``: the two engines of wsum64 (``integrity/wsum.py``) against xxh3: on the host, one
  thread and the copier's threads, hash alone and fused with the copy (the numbers behind
  ``digests.algorithm_for`` keeping xxh3 for CPU tensors), against a memcpy; on the device, the
  tensor-op engine over a model-shaped state and one large tensor, against a device-to-device
  copy of the same bytes.
* ``d2h``: a CUDA state dict shaped like a model (``--size-gb``) staged into our tmpfs buffers
  (``async_save`` without a guard: the time the caller is held; and the whole blocking
  ``save``), against torch's copy into a pinned host buffer; the host bytes per save
  (``SaveResult.host_bytes``) and the cudaHostRegister calls per save.
* ``h2d``: a fresh process resumes the last save into CUDA tensors, against a pinned
  host-to-device copy of the same bytes in that process; every byte is checked.
* ``train``: a transformer checkpointing every step at ``--levels`` demands (state bytes per
  second of step; the step's micro-batches are calibrated to them): steady step time over
  ``--steps`` steps, its overhead against no checkpoint, the host's CPU % while training and
  the bytes the host touched per save, for ``--modes``: no checkpoint, ours with ``guard``, and
  DCP's ``async_save`` with ``DefaultStager(StagingOptions(True, True, True, True))`` into a
  FileSystemWriter on the tmpfs.
* ``threads``: 4 and 8 processes (ranks of one node) save and load at once with 4 and 8 copy
  threads each (``MLCHECKPOINT_COPY_THREADS``): the aggregate GB/s behind the default.

``--package DIR`` imports mlcheckpoint from DIR instead of this checkout (a copy of another
revision's package, e.g. main's for the baseline: ``benchmarks/device_check.sh``); a figure
that revision does not report is left out.

    python benchmarks/bench_gpu.py                         # on a CUDA machine, a few minutes
    python benchmarks/bench_gpu.py --only digest           # the engines' rates here
    python benchmarks/bench_gpu.py --device cpu --quick    # smoke run of the code paths, no GPU

Everything written lives in one directory under ``--shm-dir`` (default /dev/shm), removed at the end.
"""

from __future__ import annotations

import os
import sys


def _package_dir(argv: list[str]) -> str | None:
    """``--package DIR`` (or the parent's, for a child process), read before the import below."""
    for i, a in enumerate(argv):
        if a == "--package" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--package="):
            return a.split("=", 1)[1]
    return os.environ.get("BENCH_GPU_PACKAGE") or None


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, REPO_ROOT)
PACKAGE = _package_dir(sys.argv)
if PACKAGE:  # before the checkout: its mlcheckpoint wins; children inherit the choice
    PACKAGE = os.path.abspath(PACKAGE)
    sys.path.insert(0, PACKAGE)
    os.environ["BENCH_GPU_PACKAGE"] = PACKAGE

import argparse
import contextlib
import dataclasses
import json
import shutil
import subprocess
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import mlcheckpoint
from benchmarks.harness.processes import exit_on_sigterm, make_workspace
from benchmarks.harness.report import machine_info, progress
from benchmarks.harness.stats import GB, GiB, MiB, gbps, median, p90, proc_cpu, size_str
from benchmarks.harness.workloads import TensorSpec, model_layout, quiet_dcp
from mlcheckpoint import CheckpointManager
from mlcheckpoint.store import buffers

# Saves and loads without a process group (our manager's in one process, DCP's no_dist) warn
# on every call, from whichever thread runs them.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

PCIE5_GBPS = 50.0  # nominal host<->device rate of PCIe 5 x16, one direction (decimal GB/s)
JOB = "bench-gpu"
TRAIN_MODES = ("none", "ours_guard", "ours_blocking", "dcp_async")


# --------------------------------------------------------------------------- state dicts
def device_tensors(specs: list[TensorSpec], device: str, seed: int) -> dict[str, torch.Tensor]:
    """The tensors of ``specs``, made on ``device`` from a seeded generator there (a fresh
    process makes the same ones: the resume check)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return {s.name: torch.randn(s.shape, device=device, generator=g).to(s.dtype) for s in specs}


def nbytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def pinned_views(tensors: dict[str, torch.Tensor], device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One host buffer (pinned on CUDA, touched) and a view of it per tensor, aligned."""
    offsets, end = [], 0
    for t in tensors.values():
        offsets.append(end)
        end += -(-(t.numel() * t.element_size()) // 512) * 512
    host = torch.empty(end, dtype=torch.uint8, pin_memory=device == "cuda")
    host[::4096] = 0  # touch: the first copy should not pay for page faults
    views = [host[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
             for o, t in zip(offsets, tensors.values())]
    return host, views


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class RegistrationCounter:
    """Counts the cudaHostRegister calls our buffers make (and their seconds), by wrapping
    ``MappedFile.register_for_device_copies``: a registration on a save's path shows here."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._orig = buffers.MappedFile.register_for_device_copies
        counter = self

        def counting(mapped: buffers.MappedFile, *device: int | None) -> None:
            before = mapped._cuda_registered
            t0 = time.perf_counter()
            counter._orig(mapped, *device)  # (a baseline revision's takes no device)
            if not before and mapped._cuda_registered:
                counter.seconds.append(time.perf_counter() - t0)

        buffers.MappedFile.register_for_device_copies = counting  # type: ignore[method-assign]

    def close(self) -> None:
        buffers.MappedFile.register_for_device_copies = self._orig  # type: ignore[method-assign]


# --------------------------------------------------------------------------- digest
def best_rate(fn, nbytes: int, reps: int, device: str = "cpu") -> float:
    """GB/s of the fastest of ``reps`` runs of ``fn`` (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return gbps(nbytes, min(times))


def run_digest(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from mlcheckpoint.integrity import checksum as xxh3
        from mlcheckpoint.integrity import copier, digests, wsum
    except ImportError as e:
        return {"skipped": f"this package has no wsum64 ({e})"}
    n = int(args.digest_mb * MiB)
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros_like(src)
    out = np.zeros(wsum.n_chunks(n), dtype=np.uint64)
    host: dict[str, float] = {"memcpy": best_rate(lambda: np.copyto(dst, src), n, args.reps)}
    if xxh3.native_hash_copy is not None:
        host["xxh3, 1 thread"] = best_rate(
            lambda: xxh3.native_hash_copy(src.ctypes.data, 0, n, xxh3.CHUNK_BYTES, out.ctypes.data), n, args.reps)
        host["copy+xxh3, 1 thread"] = best_rate(
            lambda: xxh3.native_hash_copy(src.ctypes.data, dst.ctypes.data, n, xxh3.CHUNK_BYTES, out.ctypes.data),
            n, args.reps)
    if wsum.native_wsum_copy is not None:
        host["wsum64, 1 thread"] = best_rate(
            lambda: wsum.native_wsum_copy(src.ctypes.data, 0, n, out.ctypes.data), n, args.reps)
        host["copy+wsum64, 1 thread"] = best_rate(
            lambda: wsum.native_wsum_copy(src.ctypes.data, dst.ctypes.data, n, out.ctypes.data), n, args.reps)
    threads = copier.default_threads()
    for name, algorithm in (("xxh3", digests.XXH3), ("wsum64", digests.WSUM)):
        for fused in (False, True):
            spans = [copier.Span(src=src.ctypes.data, nbytes=n, dst=dst.ctypes.data if fused else None,
                                 algorithm=algorithm)]
            label = f"{'copy+' if fused else ''}{name}, copier ({threads} threads)"
            host[label] = best_rate(lambda spans=spans: copier.process(spans), n, args.reps)
    fig: dict[str, Any] = {"bytes": n, "copy_threads": threads, "host_gbps": host}
    progress("digest: host engines done")
    size = int(args.size_gb * GiB) if args.device == "cuda" else min(n, 32 * MiB)
    tensors = list(device_tensors(model_layout(size, args.seed), args.device, args.seed).values())
    big = torch.randn(size // 4, device=args.device)
    total = sum(t.numel() * t.element_size() for t in tensors)
    reps = args.reps if args.device == "cuda" else 1
    dev = {
        f"wsum64 of a model's {len(tensors)} tensors": best_rate(lambda: wsum.tensor_digests(tensors), total, reps, args.device),
        "wsum64 of one large tensor": best_rate(lambda: wsum.tensor_digests([big]), size, reps, args.device),
    }
    copy_target = torch.empty_like(big)
    dev["device copy, bytes read"] = best_rate(lambda: copy_target.copy_(big), size, reps, args.device)
    fig.update(device_gbps=dev, device_bytes=total, device=args.device)
    # the two engines agree here too
    fig["engines_agree"] = wsum.to_unsigned(wsum.tensor_digests(tensors[:50]).cpu()) == [
        wsum.digest_at(a.ctypes.data, a.nbytes)
        for a in (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors[:50])]
    return fig


# --------------------------------------------------------------------------- d2h
def pinned_copy_seconds(tensors: dict[str, torch.Tensor], device: str, reps: int) -> tuple[list[float], float]:
    """torch's device-to-host copy into one pinned host buffer (views per tensor): the
    baseline. Returns the copies' seconds and the pinned allocation's."""
    t0 = time.perf_counter()
    host, views = pinned_views(tensors, device)
    alloc = time.perf_counter() - t0
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for v, t in zip(views, tensors.values()):
            v.copy_(t, non_blocking=True)
        sync(device)
        out.append(time.perf_counter() - t0)
    del views, host
    return out, alloc


def run_d2h(args: argparse.Namespace, root: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    total = nbytes_of(tensors)
    progress(f"d2h: pinned baseline, {size_str(total)}")
    pinned, pinned_alloc = pinned_copy_seconds(tensors, args.device, args.reps)
    counter = RegistrationCounter()
    staging, saves, registrations, stage_phase, host_bytes = [], [], [], [], []
    try:
        ckpt = CheckpointManager(job_id=JOB, local_dir=root, replication="none", keep=1)
        step = 0
        for i in range(args.saves):  # async_save without a guard: the caller waits for the copy
            progress(f"d2h: async_save {i + 1}/{args.saves}")
            n = len(counter.seconds)
            step += 1
            res = ckpt.async_save({"model": tensors}, step).result()
            staging.append(res.blocking_seconds)
            host_bytes.append(getattr(res, "host_bytes", None))
            registrations.append(len(counter.seconds) - n)
            ckpt.wait()  # (the next save's buffer is prepared meanwhile: not on its path)
        for i in range(args.saves):
            progress(f"d2h: save {i + 1}/{args.saves}")
            n = len(counter.seconds)
            step += 1
            t0 = time.perf_counter()
            res = ckpt.save({"model": tensors}, step)
            saves.append(time.perf_counter() - t0)
            stage_phase.append(res.phases.get("stage", float("nan")))
            host_bytes.append(getattr(res, "host_bytes", None))
            registrations.append(len(counter.seconds) - n)
        ckpt.wait()
    finally:
        counter.close()
    return {"bytes": total, "pinned_seconds": pinned, "pinned_alloc_seconds": pinned_alloc,
            "staging_seconds": staging, "save_seconds": saves, "save_stage_phase": stage_phase,
            "host_bytes_per_save": host_bytes,
            "registrations_per_save": registrations, "registration_seconds": counter.seconds,
            "last_step": step, "ckpt": ckpt}


# --------------------------------------------------------------------------- h2d (fresh process)
def run_h2d(args: argparse.Namespace, root: str, specs: list[TensorSpec], step: int) -> dict[str, Any]:
    out, spec_path = os.path.join(root, "h2d.json"), os.path.join(root, "h2d-spec.json")
    with open(spec_path, "w") as f:  # thousands of tensors: too long for a command line
        json.dump({"root": root, "device": args.device, "seed": args.seed, "step": step, "out": out,
                   "reps": args.reps, "specs": [[s.name, list(s.shape), str(s.dtype)] for s in specs]}, f)
    progress("h2d: resume in a fresh process")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--_resume-child", spec_path],
                   check=True, timeout=args.timeout)
    with open(out) as f:
        return json.load(f)


def resume_child(spec: dict[str, Any]) -> None:
    device = spec["device"]
    specs = [TensorSpec(n, tuple(shape), getattr(torch, d.removeprefix("torch."))) for n, shape, d in spec["specs"]]
    target = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=device) for s in specs}
    sync(device)  # the CUDA context and the targets exist: a restarted job has its model
    ckpt = CheckpointManager(job_id=JOB, local_dir=spec["root"], replication="none")
    t0 = time.perf_counter()
    info = ckpt.resume({"model": target})
    sync(device)
    seconds = time.perf_counter() - t0
    expected = device_tensors(specs, device, spec["seed"])
    wrong = [k for k, v in expected.items() if not torch.equal(v, target[k])]
    del expected
    total = nbytes_of(target)
    _host, views = pinned_views(target, device)  # the views keep it alive
    pinned = []
    for _ in range(spec["reps"]):
        sync(device)
        t0 = time.perf_counter()
        for v, t in zip(views, target.values()):
            t.copy_(v, non_blocking=True)
        sync(device)
        pinned.append(time.perf_counter() - t0)
    ckpt.close()
    try:  # a baseline revision may have no ring, or no times of it
        from mlcheckpoint.dcp import ring
        times = getattr(ring, "times", None)
    except ImportError:
        times = None
    with open(spec["out"], "w") as f:
        json.dump({"step": info.step, "resume_seconds": seconds, "phases": info.phases,
                   "ring": dataclasses.asdict(times) if times is not None else None,
                   "pinned_seconds": pinned, "bytes": total, "wrong": wrong}, f)


# --------------------------------------------------------------------------- train
def build_model(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model,
                                                dropout=0.0, batch_first=True, norm_first=True)
    model = nn.Sequential(*[layer() for _ in range(args.layers)]).to(args.device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)


class OwnedStager:
    """DCP's DefaultStager as torch 2.13 treats one passed to ``async_save``: the caller's to
    close, keeping its page-locked buffers across saves, as DCP intends. Two closes of older
    torch are deferred until ``release`` (counted in ``closes_deferred``): torch 2.11 closed
    the stager after a save, and its ``_stage`` closed the inner StateDictStager after every
    staging; a save through a closed one failed with ``KeyError(<class 'type'>)`` (its copy
    table cleared)."""

    def __init__(self, options: Any):
        from torch.distributed.checkpoint.staging import DefaultStager

        owner = self

        class Kept(DefaultStager):
            def close(self) -> None:
                owner.closes_deferred += 1

        self.closes_deferred = 0
        self.stager = Kept(options)
        inner = self.stager._state_dict_stager
        self._close_inner = inner.close

        def deferred() -> None:
            self.closes_deferred += 1

        inner.close = deferred  # type: ignore[method-assign]

    def release(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager

        self.stager._state_dict_stager.close = self._close_inner  # type: ignore[method-assign]
        DefaultStager.close(self.stager)


class Trainer:
    """A transformer, a batch and a step of ``accum`` micro-batches; what each mode runs."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.device = args, args.device
        self.model, self.optim = build_model(args)
        self.micro = args.batch
        self.accum = 1
        self.x = torch.randn(self.micro, args.seq, args.d_model, device=self.device)
        self.amp = torch.autocast(self.device, dtype=torch.bfloat16) if self.device == "cuda" \
            else contextlib.nullcontext()
        self.pending: list[Any] = []  # DCP's responses of the saves in flight
        self.step()  # optimizer state exists from here on
        self.state_bytes = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *(
            v for st in self.optim.state.values() for v in st.values() if isinstance(v, torch.Tensor))])

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def resize(self, micro: int) -> None:
        self.micro = max(1, micro)
        self.x = torch.randn(self.micro, self.args.seq, self.args.d_model, device=self.device)

    def step(self) -> float:
        """One step (``accum`` micro-batches, then the optimizer); the GPU milliseconds of the
        forwards and backwards (CUDA events)."""
        self.optim.zero_grad(set_to_none=True)
        cuda = self.device == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for _ in range(self.accum):
            with self.amp:
                loss = self.model(self.x).float().square().mean()
            loss.backward()
        if cuda:
            end.record()
        if self.pending:  # DCP: the snapshot must be staged before the parameters change
            self.pending[-1].staging_completion.result()
        self.optim.step()
        loss.item()  # the loop logs its loss: the step ends when the device has finished it
        return start.elapsed_time(end) if cuda else 0.0

    def seconds_per_step(self, steps: int = 4) -> float:
        self.step()
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - t0) / steps


def calibrate(trainer: Trainer, demands: list[float]) -> list[tuple[float, int]]:
    """The micro-batch size that makes a one-micro-batch step take state_bytes / (the highest
    demand), then per demand the micro-batches per step that come closest: [(demand, accum)]."""
    target = trainer.state_bytes / (max(demands) * GB)
    for _ in range(3):
        t = trainer.seconds_per_step()
        micro = max(1, round(trainer.micro * target / t))
        if micro == trainer.micro:
            break
        trainer.resize(micro)
    t = trainer.seconds_per_step()
    return [(d, max(1, round(trainer.state_bytes / (d * GB) / t))) for d in demands]


def run_train(args: argparse.Namespace, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.staging import StagingOptions

    trainer = Trainer(args)
    params = sum(p.numel() for p in trainer.model.parameters())
    progress(f"train: {params / 1e6:.0f} M parameters, {size_str(trainer.state_bytes)} of parameters and AdamW state")
    demands = [float(x) for x in args.levels.split(",")]
    if args.micro_batch:  # another run's calibration (the baseline's steps are the same steps)
        trainer.resize(args.micro_batch)
        levels = list(zip(demands, (int(a) for a in args.accums.split(",")), strict=True))
    else:
        levels = calibrate(trainer, demands)
    progress(f"train: micro-batch {trainer.micro} x {args.seq}; micro-batches per step for "
             f"{', '.join(f'{d:g} GB/s: {a}' for d, a in levels)}")
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, Any] = {"parameters": params, "state_bytes": trainer.state_bytes,
                               "micro_batch": trainer.micro, "seq": args.seq, "levels": {},
                               "accums": ",".join(str(a) for _, a in levels)}
    cuda = args.device == "cuda"
    for demand, accum in levels:
        trainer.accum = accum
        level: dict[str, Any] = {"accum": accum}
        for mode in modes:
            mode_dir = os.path.join(root, f"{demand:g}-{mode}")
            os.makedirs(mode_dir)
            progress(f"train: {demand:g} GB/s, {mode}")
            try:
                level[mode] = run_mode(args, trainer, mode, mode_dir, cuda, StagingOptions)
            except Exception as e:  # noqa: BLE001  # one mode failing leaves the rest
                progress(f"train: {mode} failed: {e!r}")
                level[mode] = {"error": repr(e)}
                for response in trainer.pending:  # let DCP's writes end before the directory goes
                    with contextlib.suppress(Exception):
                        response.upload_completion.result()
                trainer.pending.clear()
            shutil.rmtree(mode_dir, ignore_errors=True)
        none = level.get("none", {}).get("step_seconds")
        level["demand_gbps"] = gbps(trainer.state_bytes, median(none)) if none else None
        results["levels"][f"{demand:g}"] = level
    return results


def run_mode(args: argparse.Namespace, trainer: Trainer, mode: str, mode_dir: str, cuda: bool,
             options_type: Any) -> dict[str, Any]:
    """Warm-up and measured steps of one mode: step seconds, GPU ms, the save call's seconds,
    the process's CPU % over the measured steps, and what the saves report."""
    ckpt = guard = stager = None
    steps = args.dcp_steps if mode == "dcp_async" else args.steps
    if mode.startswith("ours"):
        ckpt = CheckpointManager(job_id=f"{JOB}-{mode}", local_dir=mode_dir, replication="none", keep=1)
        if mode == "ours_guard":
            guard = ckpt.guard(trainer.optim)
    if mode == "dcp_async":  # the options on CUDA; on the CPU (smoke run): no pinning
        stager = OwnedStager(options_type(cuda, cuda, True, cuda))
    times, gpu_ms, blocked, futures = [], [], [], []
    try:
        for i in range(args.warmup + steps):
            if i == args.warmup:
                cpu0, wall0 = proc_cpu(), time.perf_counter()
            t_step = time.perf_counter()
            gpu_ms.append(trainer.step())
            t0 = time.perf_counter()
            if mode == "ours_guard":
                futures.append(ckpt.async_save(trainer.state(), i))  # type: ignore[union-attr]
            elif mode == "ours_blocking":
                futures.append(ckpt.save(trainer.state(), i))  # type: ignore[union-attr]
            elif mode == "dcp_async":
                if trainer.pending:
                    trainer.pending[-1].upload_completion.result()
                    trainer.pending.clear()
                path = os.path.join(mode_dir, f"s{i % 2}")
                shutil.rmtree(path, ignore_errors=True)  # the one before the last: written anew
                with quiet_dcp():
                    trainer.pending.append(dcp.async_save(
                        trainer.state(), checkpoint_id=path, async_stager=stager.stager,  # type: ignore[union-attr]
                        no_dist=True))
            now = time.perf_counter()
            blocked.append(now - t0)
            times.append(now - t_step)
        cpu_pct = 100 * (proc_cpu() - cpu0) / (time.perf_counter() - wall0)
        for response in trainer.pending:
            response.upload_completion.result()
        trainer.pending.clear()
        saved = [f.result() if hasattr(f, "result") else f for f in futures[args.warmup:]]
        stats = ckpt.stats() if ckpt is not None else {}
    finally:
        if guard is not None:
            guard.remove()
        if ckpt is not None:
            ckpt.close()
        if stager is not None:
            stager.release()
    w = args.warmup
    out: dict[str, Any] = {"step_seconds": times[w:], "gpu_ms": gpu_ms[w:], "save_call_seconds": blocked[w:],
                           "cpu_percent": cpu_pct}
    if saved:
        out["save_seconds"] = median([s.seconds for s in saved])
        if all(hasattr(s, "host_bytes") for s in saved):  # (a revision that reports it)
            out["host_bytes_per_save"] = median([s.host_bytes for s in saved])
    if stats:
        out["guard_longest_wait_seconds"] = stats.get("mlcheckpoint/guard_longest_wait_seconds")
    if stager is not None:
        out["stager_closes_deferred"] = stager.closes_deferred
    return out


# --------------------------------------------------------------------------- threads
def run_threads(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """``procs`` processes save (then load) ``--threads-gb`` each at once, for each copy-thread
    count: the aggregate GB/s of the steady saves and of the loads."""
    out: dict[str, Any] = {}
    for procs in (int(p) for p in args.threads_procs.split(",")):
        for threads in (int(t) for t in args.threads_counts.split(",")):
            run_dir = os.path.join(root, f"threads-{procs}x{threads}")
            os.makedirs(run_dir)
            progress(f"threads: {procs} processes x {threads} copy threads")
            env = {**os.environ, "MLCHECKPOINT_COPY_THREADS": str(threads), "OMP_NUM_THREADS": "1"}
            workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_threads-child",
                                         json.dumps({"dir": run_dir, "rank": r, "gb": args.threads_gb,
                                                     "saves": args.threads_saves})], env=env)
                       for r in range(procs)]
            try:
                deadline = time.monotonic() + args.timeout
                while len([n for n in os.listdir(run_dir) if n.endswith(".ready")]) < procs:
                    if time.monotonic() > deadline or any(w.poll() not in (None, 0) for w in workers):
                        raise RuntimeError("a threads worker failed before it was ready")
                    time.sleep(0.05)
                with open(os.path.join(run_dir, "go"), "w"):
                    pass
                for w in workers:
                    w.wait(timeout=max(1.0, deadline - time.monotonic()))
                results = []
                for r in range(procs):
                    with open(os.path.join(run_dir, f"{r}.json")) as f:
                        results.append(json.load(f))
            finally:
                for w in workers:
                    if w.poll() is None:
                        w.kill()
                        w.wait()
                shutil.rmtree(run_dir, ignore_errors=True)
            total = sum(r["bytes"] for r in results)
            save_window = max(r["saves_end"] for r in results) - min(r["saves_start"] for r in results)
            load_window = max(r["loads_end"] for r in results) - min(r["loads_start"] for r in results)
            out[f"{procs}x{threads}"] = {"procs": procs, "threads": threads, "bytes_per_proc": results[0]["bytes"],
                                         "save_gbps": gbps(total * args.threads_saves, save_window),
                                         "load_gbps": gbps(total, load_window)}
    return out


def threads_child(cfg: dict[str, Any]) -> None:
    from benchmarks.harness.workloads import (
        model_state_dict,
        state_dict_bytes,
        warm_target,
    )

    sd, _ = model_state_dict(int(cfg["gb"] * GiB), seed=cfg["rank"])
    nbytes = state_dict_bytes(sd)
    rank, run_dir = cfg["rank"], cfg["dir"]
    with CheckpointManager(job_id=f"threads-{rank}", local_dir=run_dir, replication="none", keep=1) as ckpt:
        ckpt.save(sd, 0)  # cold: the buffers' first pages, before the measured saves
        ckpt.save(sd, 1)
        with open(os.path.join(run_dir, f"{rank}.ready"), "w"):
            pass
        while not os.path.exists(os.path.join(run_dir, "go")):
            time.sleep(0.01)
        saves_start = time.time()
        for i in range(cfg["saves"]):
            ckpt.save(sd, 2 + i)
        saves_end = time.time()
        target = warm_target(sd)
        loads_start = time.time()
        with quiet_dcp():
            dcp.load(target, storage_reader=ckpt.storage_reader(1 + cfg["saves"]), no_dist=True)
        loads_end = time.time()
    with open(os.path.join(run_dir, f"{rank}.json"), "w") as f:
        json.dump({"bytes": nbytes, "saves_start": saves_start, "saves_end": saves_end,
                   "loads_start": loads_start, "loads_end": loads_end}, f)


# --------------------------------------------------------------------------- report
def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def report(args: argparse.Namespace, fig: dict[str, Any]) -> None:
    m = fig["machine"]
    print(f"\nbench_gpu on {m.get('gpu', 'no GPU')}, {m['cores']} cores, torch {m['torch']}, "
          f"{m['shm_dir']} {size_str(m['shm_total_bytes'])}, mlcheckpoint from {m['package']}")
    if "digest" in fig:
        d = fig["digest"]
        if "skipped" in d:
            print(f"\nDigest engines: {d['skipped']}")
        else:
            print(f"\nDigest engines, host, {size_str(d['bytes'])} (best of {args.reps}; GB/s of the source)")
            for k, v in d["host_gbps"].items():
                print(f"  {k:<34} {v:7.2f} GB/s")
            print(f"Digest engines, {d['device']}, {size_str(d['device_bytes'])} "
                  f"(engines agree: {d['engines_agree']})")
            for k, v in d["device_gbps"].items():
                print(f"  {k:<34} {v:7.1f} GB/s")
    if "d2h" in fig:
        d = fig["d2h"]
        n = d["bytes"]
        pinned = median(d["pinned_seconds"])
        steady = median(d["staging_seconds"][-3:]) if len(d["staging_seconds"]) > 3 else float("nan")
        print(f"\nD2H staging of {size_str(n)} (medians; steady state = the last 3 async_saves)")
        print(f"  torch copy into pinned buffer : {pinned:.3f} s  {gbps(n, pinned):6.1f} GB/s  "
              f"(allocating it: {d['pinned_alloc_seconds']:.2f} s)")
        print(f"  nominal PCIe 5 x16            : {n / (PCIE5_GBPS * GB):.3f} s  {PCIE5_GBPS:6.1f} GB/s")
        print(f"  ours, async_save first (cold) : {d['staging_seconds'][0]:.3f} s  "
              f"{gbps(n, d['staging_seconds'][0]):6.1f} GB/s")
        print(f"  ours, async_save steady       : {steady:.3f} s  {gbps(n, steady):6.1f} GB/s  "
              f"= {ratio(pinned, steady)} of pinned (target >= 0.8x), "
              f"{ratio(n / (PCIE5_GBPS * GB), steady)} of PCIe 5")
        sv = median(d["save_seconds"])
        print(f"  ours, blocking save (+checksums, commit): {sv:.3f} s  {gbps(n, sv):6.1f} GB/s  "
              f"= {ratio(pinned, sv)} of pinned; its stage phase {median(d['save_stage_phase']):.3f} s")
        print(f"  host bytes per save: {d['host_bytes_per_save']}")
        print(f"  cudaHostRegister calls per save: {d['registrations_per_save']} "
              f"(seconds each: {', '.join(f'{s:.2f}' for s in d['registration_seconds'])})")
    if "h2d" in fig:
        h = fig["h2d"]
        n = h["bytes"]
        pinned = median(h["pinned_seconds"])
        print(f"\nResume of {size_str(n)} into {args.device} tensors in a fresh process (step {h['step']}; "
              f"{'every byte equal' if not h['wrong'] else 'WRONG: ' + ', '.join(h['wrong'][:5])})")
        print(f"  pinned H2D copy               : {pinned:.3f} s  {gbps(n, pinned):6.1f} GB/s")
        print(f"  ours, resume                  : {h['resume_seconds']:.3f} s  "
              f"{gbps(n, h['resume_seconds']):6.1f} GB/s  = {ratio(pinned, h['resume_seconds'])} "
              f"of pinned (target >= 0.7x)")
        print("  resume phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in h["phases"].items()))
        if h.get("ring"):  # host-bound (fill) or device-bound (wait)?
            r = h["ring"]
            print(f"  its ring: {r['loads']} loads of {size_str(r['bytes'])}: filling slots (host) "
                  f"{r['fill']:.3f} s, waiting for the device {r['wait']:.3f} s, device checksums "
                  f"{r['verify']:.3f} s")
    if "train" in fig:
        t = fig["train"]
        print(f"\nTraining loop, a checkpoint every step: {t['parameters'] / 1e6:.0f} M parameters, "
              f"{size_str(t['state_bytes'])} of parameters + AdamW state, micro-batch {t['micro_batch']} x {t['seq']}")
        print(f"  {'demand':>9} {'mode':<14} {'median':>8} {'p90':>8} {'overhead':>9} {'CPU %':>7} "
              f"{'host/save':>10} {'GPU fwd+bwd':>12} {'save call':>10}")
        for name, level in t["levels"].items():
            base = median(level["none"]["step_seconds"]) if "step_seconds" in level.get("none", {}) else float("nan")
            demand = level.get("demand_gbps")
            for mode in (m for m in TRAIN_MODES if m in level):
                r = level[mode]
                label = f"{demand:6.2f} GB/s" if demand else f"{name} GB/s"
                if "error" in r:
                    print(f"  {label:>9} {mode:<14} failed: {r['error']}")
                    continue
                med = median(r["step_seconds"])
                host = r.get("host_bytes_per_save")
                host_s = "-" if host is None else size_str(host)
                print(f"  {label:>9} {mode:<14} {med:8.3f} {p90(r['step_seconds']):8.3f} "
                      f"{100 * (med / base - 1):8.1f}% {r['cpu_percent']:6.0f}% {host_s:>10} "
                      f"{median(r['gpu_ms']):10.1f}ms {median(r['save_call_seconds']):9.3f}s")
    if "threads" in fig:
        print("\nCopy threads, several ranks per node saving and loading at once (aggregate)")
        for r in fig["threads"].values():
            print(f"  {r['procs']} processes x {r['threads']} threads ({size_str(r['bytes_per_proc'])} each): "
                  f"save {r['save_gbps']:6.2f} GB/s, load {r['load_gbps']:6.2f} GB/s")


# --------------------------------------------------------------------------- summary
def overhead(level: dict[str, Any], mode: str, base: dict[str, Any] | None = None) -> float | None:
    """A mode's median step time over no checkpoint's (``base``'s level: another run's, on the
    same card and the same steps), in percent."""
    none, r = (base or level).get("none", {}), level.get(mode, {})
    if "step_seconds" not in none or "step_seconds" not in r:
        return None
    return 100 * (median(r["step_seconds"]) / median(none["step_seconds"]) - 1)


def summarize(after: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The figures the issue asks for, ``after`` (this revision) beside ``baseline`` (an
    earlier revision's run on the same card): what docs/performance.md quotes."""
    out: dict[str, Any] = {"device": after.get("machine", {}).get("gpu"),
                           "torch": after.get("machine", {}).get("torch")}
    runs = {"after": after, "baseline": baseline or {}}
    for name, fig in runs.items():
        row: dict[str, Any] = {}
        if "d2h" in fig:
            d = fig["d2h"]
            pinned, steady = median(d["pinned_seconds"]), median(d["staging_seconds"][-3:])
            row["d2h"] = {"bytes": d["bytes"], "pinned_gbps": gbps(d["bytes"], pinned),
                          "steady_gbps": gbps(d["bytes"], steady), "vs_pinned": pinned / steady,
                          "blocking_save_gbps": gbps(d["bytes"], median(d["save_seconds"])),
                          "host_bytes_per_save": d.get("host_bytes_per_save"),
                          "registrations_per_save": d["registrations_per_save"]}
        if "h2d" in fig:
            h = fig["h2d"]
            pinned = median(h["pinned_seconds"])
            row["resume"] = {"bytes": h["bytes"], "seconds": h["resume_seconds"],
                             "gbps": gbps(h["bytes"], h["resume_seconds"]),
                             "vs_pinned": pinned / h["resume_seconds"], "correct": not h["wrong"],
                             "phases": h["phases"], "ring": h.get("ring")}
        if "train" in fig:
            levels = {}
            for key, level in fig["train"]["levels"].items():
                base = after["train"]["levels"].get(key) if name == "baseline" else None
                levels[key] = {"demand_gbps": (base or level).get("demand_gbps"),
                               **{f"{m}_overhead_percent": overhead(level, m, base)
                                  for m in TRAIN_MODES if m in level and m != "none"},
                               **{f"{m}_cpu_percent": level[m].get("cpu_percent") for m in TRAIN_MODES if m in level},
                               **{f"{m}_host_bytes_per_save": level[m].get("host_bytes_per_save")
                                  for m in TRAIN_MODES if m in level and "host_bytes_per_save" in level[m]}}
            row["train"] = levels
        out[name] = row
    if "digest" in after:
        out["digest"] = after["digest"]
    if "threads" in after:
        out["threads"] = after["threads"]
    return out


def print_summary(s: dict[str, Any]) -> None:
    print(f"\nSummary on {s['device']} (torch {s['torch']}): after | baseline")
    for key in ("d2h", "resume"):
        a, b = s["after"].get(key), s["baseline"].get(key)
        if a:
            def fmt(r: dict[str, Any] | None) -> str:
                if not r:
                    return "-"
                return (f"{r.get('steady_gbps', r.get('gbps')):.1f} GB/s = {r['vs_pinned']:.2f}x pinned")
            print(f"  {key:<7} {fmt(a)} | {fmt(b)}")
    for key, a in s["after"].get("train", {}).items():
        b = s["baseline"].get("train", {}).get(key, {})
        demand = a.get("demand_gbps")
        cells = [f"ours {a.get('ours_guard_overhead_percent')}", f"main {b.get('ours_guard_overhead_percent')}",
                 f"dcp {a.get('dcp_async_overhead_percent')}"]
        print(f"  train {demand if demand is None else round(demand, 1)} GB/s: overhead % " + ", ".join(cells))


# --------------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--package", default=None, help="import mlcheckpoint from this directory")
    p.add_argument("--size-gb", type=float, default=8.0, help="state dict of the d2h/h2d sections (GiB)")
    p.add_argument("--digest-mb", type=float, default=256, help="host buffer of the digest section (MiB)")
    p.add_argument("--reps", type=int, default=5, help="pinned baseline copies, digest runs")
    p.add_argument("--saves", type=int, default=6, help="async_saves, then blocking saves, in d2h")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="first guess of the micro-batch (calibrated)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--levels", default="24,12,6,2", help="demands, GB/s of state per second of step")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="skip the calibration: this micro-batch, and --accums micro-batches per step")
    p.add_argument("--accums", default="", help="with --micro-batch: micro-batches per step, per level")
    p.add_argument("--modes", default="none,ours_guard,dcp_async", help=f"train modes: {', '.join(TRAIN_MODES)}")
    p.add_argument("--steps", type=int, default=50, help="measured steps per train mode")
    p.add_argument("--dcp-steps", type=int, default=12, help="measured steps of dcp_async (its saves are slow)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads-procs", default="4,8")
    p.add_argument("--threads-counts", default="4,8")
    p.add_argument("--threads-gb", type=float, default=0.5, help="state of each threads process (GiB)")
    p.add_argument("--threads-saves", type=int, default=3)
    p.add_argument("--only", default="digest,d2h,h2d,train,threads", help="sections, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_gb, args.reps, args.saves, args.digest_mb = min(args.size_gb, 0.0625), 2, 4, 16
        args.layers, args.d_model, args.heads, args.batch, args.seq = 2, 128, 4, 2, 64
        args.steps, args.dcp_steps, args.warmup, args.levels = 4, 3, 1, "4,1"
        args.threads_procs, args.threads_counts, args.threads_gb, args.threads_saves = "2", "1,2", 0.02, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --device cpu for a smoke run")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    exit_on_sigterm()
    sections = set(args.only.split(","))
    size = int(args.size_gb * GiB)
    root = make_workspace("mlckpt-bench-gpu-", args.shm_dir, need_bytes=3 * size if "d2h" in sections else 0)
    fig: dict[str, Any] = {"machine": machine_info(args.shm_dir), "args": vars(args)}
    fig["machine"]["package"] = os.path.dirname(os.path.dirname(os.path.abspath(mlcheckpoint.__file__)))
    if args.device == "cuda":
        fig["machine"]["gpu"] = torch.cuda.get_device_name()
    try:
        if "digest" in sections:
            fig["digest"] = run_digest(args)
            report(args, {"machine": fig["machine"], "digest": fig["digest"]})
        if sections & {"d2h", "h2d"}:
            specs = model_layout(size, args.seed)
            tensors = device_tensors(specs, args.device, args.seed)
            d2h = run_d2h(args, os.path.join(root, "d2h"), tensors)
            ckpt = d2h.pop("ckpt")
            if "d2h" in sections:
                fig["d2h"] = d2h
                report(args, {"machine": fig["machine"], "d2h": d2h})
            del tensors
            ckpt.close()  # the run has ended: a restart is a fresh process (it claims the directory)
            if "h2d" in sections:
                fig["h2d"] = run_h2d(args, os.path.join(root, "d2h"), specs, d2h["last_step"])
                report(args, {"machine": fig["machine"], "h2d": fig["h2d"]})
        if "train" in sections:
            fig["train"] = run_train(args, os.path.join(root, "train"))
            report(args, {"machine": fig["machine"], "train": fig["train"]})
        if "threads" in sections:
            fig["threads"] = run_threads(args, root)
            report(args, {"machine": fig["machine"], "threads": fig["threads"]})
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(fig, f, indent=2, default=str)
    return fig


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_resume-child":
        with open(sys.argv[2]) as spec_file:
            resume_child(json.load(spec_file))
    elif len(sys.argv) == 3 and sys.argv[1] == "--_threads-child":
        threads_child(json.loads(sys.argv[2]))
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "--summarize":  # out.json after.json [baseline.json]
        loaded = []
        for path in sys.argv[3:]:
            with open(path) as f:
                loaded.append(json.load(f))
        summary = summarize(loaded[0], loaded[1] if len(loaded) > 1 else None)
        print_summary(summary)
        with open(sys.argv[2], "w") as f:
            json.dump(summary, f, indent=2, default=str)
    else:
        main()
