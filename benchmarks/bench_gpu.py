#!/usr/bin/env python
"""GPU benchmark: device-to-host staging, resume into CUDA tensors, and checkpointing every step
of a GPU training loop, each against a baseline measured in the same run.

Sections (``--only`` picks some):

* ``d2h``: a CUDA state dict shaped like a model (``--size-gb``, default 8) staged into our tmpfs
  buffers (``async_save`` without a guard: the time the caller is held, i.e. the copy; and the
  whole blocking ``save``, checksums and commit included), against torch's copy into a pinned
  host buffer of the same size and a nominal 50 GB/s (PCIe 5 x16). The first save registers the
  buffer's pages with CUDA (cudaHostRegister); the run counts registrations per save: after the
  first buffers, none should happen.
* ``h2d``: a fresh process (new interpreter, new CheckpointManager) resumes the last save
  straight into CUDA tensors, against a pinned host-to-device copy of the same bytes in that
  process; every byte is checked.
* ``train``: a transformer (``--layers``/``--d-model``: by default ~0.5 B fp32 parameters, ~6 GiB
  of parameters and AdamW state) checkpointing every step: median and p90 step time with no
  checkpoint, ours with ``guard`` (overlapped), ours blocking, and DCP's ``async_save`` with
  ``DefaultStager(StagingOptions(True, True, True, True))`` into a FileSystemWriter on the
  tmpfs. The GPU time of forward and backward (CUDA events) shows whether the overlapped
  device-to-host copy slows the next step's compute.

    python benchmarks/bench_gpu.py                         # on a CUDA machine, a few minutes
    python benchmarks/bench_gpu.py --size-gb 2 --layers 4  # smaller
    python benchmarks/bench_gpu.py --device cpu --quick    # smoke run of the code paths, no GPU

Everything written lives in one directory under ``--shm-dir`` (default /dev/shm), removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, REPO_ROOT)

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from benchmarks.harness.processes import exit_on_sigterm, make_workspace
from benchmarks.harness.report import machine_info, progress
from benchmarks.harness.stats import GB, GiB, gbps, median, p90, size_str
from benchmarks.harness.workloads import TensorSpec, model_layout, quiet_dcp
from mlcheckpoint import CheckpointManager
from mlcheckpoint.store import buffers

PCIE5_GBPS = 50.0  # nominal host<->device rate of PCIe 5 x16, one direction (decimal GB/s)
JOB = "bench-gpu"


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
    ``MappedFile.register_for_device_copies``: a registration per save would show here."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._orig = buffers.MappedFile.register_for_device_copies
        counter = self

        def counting(mapped: buffers.MappedFile) -> None:
            before = mapped._cuda_registered
            t0 = time.perf_counter()
            counter._orig(mapped)
            if not before and mapped._cuda_registered:
                counter.seconds.append(time.perf_counter() - t0)

        buffers.MappedFile.register_for_device_copies = counting  # type: ignore[method-assign]

    def close(self) -> None:
        buffers.MappedFile.register_for_device_copies = self._orig  # type: ignore[method-assign]


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
    staging, saves, registrations, stage_phase = [], [], [], []
    try:
        ckpt = CheckpointManager(job_id=JOB, local_dir=root, replication="none", keep=1)
        step = 0
        for i in range(args.saves):  # async_save without a guard: the caller waits for the copy
            progress(f"d2h: async_save {i + 1}/{args.saves}")
            n = len(counter.seconds)
            step += 1
            res = ckpt.async_save({"model": tensors}, step).result()
            staging.append(res.blocking_seconds)
            registrations.append(len(counter.seconds) - n)
        for i in range(args.saves):
            progress(f"d2h: save {i + 1}/{args.saves}")
            n = len(counter.seconds)
            step += 1
            t0 = time.perf_counter()
            res = ckpt.save({"model": tensors}, step)
            saves.append(time.perf_counter() - t0)
            stage_phase.append(res.phases.get("stage", float("nan")))
            registrations.append(len(counter.seconds) - n)
        ckpt.wait()
    finally:
        counter.close()
    return {"bytes": total, "pinned_seconds": pinned, "pinned_alloc_seconds": pinned_alloc,
            "staging_seconds": staging, "save_seconds": saves, "save_stage_phase": stage_phase,
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
    with open(spec["out"], "w") as f:
        json.dump({"step": info.step, "resume_seconds": seconds, "phases": info.phases,
                   "pinned_seconds": pinned, "bytes": total, "wrong": wrong}, f)


# --------------------------------------------------------------------------- train
def build_model(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model,
                                                dropout=0.0, batch_first=True, norm_first=True)
    model = nn.Sequential(*[layer() for _ in range(args.layers)]).to(args.device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)


def run_train(args: argparse.Namespace, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    device = args.device
    model, optim = build_model(args)
    x = torch.randn(args.batch, args.seq, args.d_model, device=device)
    amp = torch.autocast(device, dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    state = lambda: {"model": model.state_dict(), "optim": optim.state_dict()}
    # DCP's DefaultStager (torch 2.11) fails on CPU tensors and other objects it has to rebuild
    # (KeyError: <class 'type'>): it gets the device tensors, flat (AdamW's step counters and
    # param_groups, a few hundred bytes, left out)
    tensors_only = lambda: {**{f"model.{k}": v for k, v in model.state_dict().items()},
                            **{f"optim.{i}.{k}": v for i, st in enumerate(optim.state.values())
                               for k, v in st.items() if v.device.type == device}}
    pending: list[Any] = []  # DCP's response of the last save

    def step() -> float:
        """One step; returns the GPU milliseconds of forward and backward (CUDA events)."""
        optim.zero_grad(set_to_none=True)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        with amp:
            loss = model(x).float().square().mean()
        loss.backward()
        if device == "cuda":
            end.record()
        if pending:  # DCP: the snapshot must be staged before the parameters change
            pending[-1].staging_completion.result()
        optim.step()
        loss.item()  # the loop logs its loss: the step ends when the device has finished it
        return start.elapsed_time(end) if device == "cuda" else 0.0

    step()  # optimizer state exists from here on
    params = sum(p.numel() for p in model.parameters())
    tensor_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *(
        v for st in optim.state.values() for v in st.values() if isinstance(v, torch.Tensor))])
    progress(f"train: {params / 1e6:.0f} M parameters, {size_str(tensor_bytes)} of parameters and AdamW state")
    results: dict[str, Any] = {"parameters": params, "state_bytes": tensor_bytes}
    # The options on CUDA; on the CPU (smoke run) no pinned memory, still staged async.
    cuda = device == "cuda"
    stager = DefaultStager(StagingOptions(cuda, cuda, True, cuda))

    def run_mode(mode: str, ckpt: CheckpointManager | None, mode_dir: str) -> tuple[list, list, list]:
        """Warm-up and measured steps of one mode: step seconds, GPU ms, save-call seconds."""
        times, gpu_ms, blocked = [], [], []
        t_prev = time.perf_counter()
        for i in range(args.warmup + args.steps):
            gpu_ms.append(step())
            t0 = time.perf_counter()
            if mode == "ours_guard":
                ckpt.async_save(state(), i)  # type: ignore[union-attr]
            elif mode == "ours_blocking":
                ckpt.save(state(), i)  # type: ignore[union-attr]
            elif mode == "dcp_async":
                if pending:
                    pending[-1].upload_completion.result()
                with quiet_dcp():
                    pending.append(dcp.async_save(tensors_only(), checkpoint_id=os.path.join(mode_dir, f"s{i % 2}"),
                                                  async_stager=stager, no_dist=True))
            blocked.append(time.perf_counter() - t0)
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
        if pending:
            pending[-1].upload_completion.result()
            pending.clear()
        return times, gpu_ms, blocked

    for mode in ("none", "ours_guard", "ours_blocking", "dcp_async", "none_again"):
        mode_dir = os.path.join(root, mode)
        os.makedirs(mode_dir)
        ckpt = guard = None
        if mode.startswith("ours"):
            ckpt = CheckpointManager(job_id=f"{JOB}-{mode}", local_dir=mode_dir, replication="none", keep=1)
            if mode == "ours_guard":
                guard = ckpt.guard(optim)
        progress(f"train: {mode}")
        try:
            times, gpu_ms, blocked = run_mode(mode, ckpt, mode_dir)
        except Exception as e:  # noqa: BLE001  # one mode failing (torch's stager, say) leaves the rest
            progress(f"train: {mode} failed: {e!r}")
            results[mode] = {"error": repr(e)}
            for response in pending:  # let DCP's writes end before the directory goes
                response.upload_completion.exception()
            pending.clear()
        else:
            w = args.warmup
            results[mode] = {"step_seconds": times[w:], "gpu_ms": gpu_ms[w:], "save_call_seconds": blocked[w:]}
        if guard is not None:
            guard.remove()
        if ckpt is not None:
            ckpt.close()
        shutil.rmtree(mode_dir, ignore_errors=True)
    stager.close()
    return results


# --------------------------------------------------------------------------- report
def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def report(args: argparse.Namespace, fig: dict[str, Any]) -> None:
    m = fig["machine"]
    print(f"\nbench_gpu on {m.get('gpu', 'no GPU')}, {m['cores']} cores, torch {m['torch']}, "
          f"{m['shm_dir']} {size_str(m['shm_total_bytes'])}")
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
        print(f"  ours, blocking save (+hash, commit): {sv:.3f} s  {gbps(n, sv):6.1f} GB/s  "
              f"= {ratio(pinned, sv)} of pinned; its stage phase {median(d['save_stage_phase']):.3f} s")
        print(f"  cudaHostRegister calls per save: {d['registrations_per_save']} "
              f"(seconds each: {', '.join(f'{s:.2f}' for s in d['registration_seconds'])})")
    if "h2d" in fig:
        h = fig["h2d"]
        n = h["bytes"]
        pinned = median(h["pinned_seconds"])
        print(f"\nResume of {size_str(n)} into CUDA tensors in a fresh process (step {h['step']}; "
              f"{'every byte equal' if not h['wrong'] else 'WRONG: ' + ', '.join(h['wrong'][:5])})")
        print(f"  pinned H2D copy               : {pinned:.3f} s  {gbps(n, pinned):6.1f} GB/s")
        print(f"  ours, resume                  : {h['resume_seconds']:.3f} s  "
              f"{gbps(n, h['resume_seconds']):6.1f} GB/s  = {ratio(pinned, h['resume_seconds'])} "
              f"of pinned (target >= 0.7x)")
        print("  resume phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in h["phases"].items()))
    if "train" in fig:
        t = fig["train"]
        base = median(t["none"]["step_seconds"])
        print(f"\nTraining loop, checkpoint every step: {t['parameters'] / 1e6:.0f} M parameters, "
              f"{size_str(t['state_bytes'])} of parameters + AdamW state; {args.steps} steps per mode")
        print(f"  {'mode':<14} {'median':>8} {'p90':>8} {'overhead':>9} {'GPU fwd+bwd':>12} {'save call':>10}")
        for mode in ("none", "ours_guard", "ours_blocking", "dcp_async", "none_again"):
            r = t[mode]
            if "error" in r:
                print(f"  {mode:<14} failed: {r['error']}")
                continue
            med = median(r["step_seconds"])
            print(f"  {mode:<14} {med:8.3f} {p90(r['step_seconds']):8.3f} {100 * (med / base - 1):8.1f}% "
                  f"{median(r['gpu_ms']):10.1f}ms {median(r['save_call_seconds']):9.3f}s")


# --------------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--size-gb", type=float, default=8.0, help="state dict of the d2h/h2d sections (GiB)")
    p.add_argument("--reps", type=int, default=5, help="pinned baseline copies")
    p.add_argument("--saves", type=int, default=6, help="async_saves, then blocking saves, in d2h")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12, help="measured steps per training mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default="d2h,h2d,train", help="sections, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_gb, args.reps, args.saves = min(args.size_gb, 0.0625), 2, 4
        args.layers, args.d_model, args.heads, args.batch, args.seq = 2, 128, 4, 2, 64
        args.steps, args.warmup = 4, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --device cpu for a smoke run")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    exit_on_sigterm()
    sections = set(args.only.split(","))
    size = int(args.size_gb * GiB)
    root = make_workspace("mlckpt-bench-gpu-", args.shm_dir, need_bytes=3 * size if "d2h" in sections else 0)
    fig: dict[str, Any] = {"machine": machine_info(args.shm_dir)}
    if args.device == "cuda":
        fig["machine"]["gpu"] = torch.cuda.get_device_name()
    try:
        if sections & {"d2h", "h2d"}:
            specs = model_layout(size, args.seed)
            tensors = device_tensors(specs, args.device, args.seed)
            d2h = run_d2h(args, os.path.join(root, "d2h"), tensors)
            ckpt = d2h.pop("ckpt")
            if "d2h" in sections:
                fig["d2h"] = d2h
                report(args, {"machine": fig["machine"], "d2h": d2h})
            del tensors
            if "h2d" in sections:
                fig["h2d"] = run_h2d(args, os.path.join(root, "d2h"), specs, d2h["last_step"])
                report(args, {"machine": fig["machine"], "h2d": fig["h2d"]})
            ckpt.close()
        if "train" in sections:
            fig["train"] = run_train(args, os.path.join(root, "train"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if "train" in fig:
        report(args, {"machine": fig["machine"], "train": fig["train"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2, default=str)
    return fig


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_resume-child":
        with open(sys.argv[2]) as spec_file:
            resume_child(json.load(spec_file))
    else:
        main()
