#!/usr/bin/env python
"""A real training loop with a checkpoint every step: what each way of checkpointing adds to the
step time.

A small transformer language model (token embedding, pre-norm transformer blocks, LM head)
trains with AdamW on random tokens, one compute thread (``torch.set_num_threads(1)``: the other
cores serve checkpointing, as a GPU host's cores serve a GPU job). Its state dict (fp32
parameters and the two Adam moments, ~12 bytes per parameter) is about ``--size-gb``. In one
run, interleaved in rounds (each round runs every mode for ``--steps`` steps, the first
``--warmup`` of each block discarded), it measures the step time of:

* none: no checkpointing;
* ours, overlapped: ``ckpt.guard(optimizer)`` once, ``ckpt.async_save(sd, step)`` every step:
  the snapshot is taken while the next step's forward and backward run, and the training
  thread waits only at ``optimizer.step()`` if it is not done;
* ours, blocking: ``ckpt.async_save`` without a guard (it returns once the copy is taken);
* DCP anchor: ``dcp.async_save`` into a FileSystemWriter on /dev/shm with
  ``DefaultStager(StagingOptions(False, False, True, False))`` (staging on a background
  thread), waiting on ``staging_completion`` before ``optimizer.step()`` and on the previous
  ``upload_completion`` before the next save.

It prints the median and p90 step time per mode, each as overhead over no checkpointing, ours
against the anchor, and the longest time the training thread waited at the guard.

    python benchmarks/bench_training.py                 # ~1 GiB state dict (~90M parameters)
    python benchmarks/bench_training.py --quick         # tiny model, a smoke run

Single process, ``replication="none"``; everything is written under one directory in
``--shm-dir``, removed at the end, also on error or SIGTERM.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, REPO_ROOT)

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from benchmarks.harness.gilprobe import GilProbe
from benchmarks.harness.processes import exit_on_sigterm, make_workspace
from benchmarks.harness.report import machine_info, progress, run_and_report
from benchmarks.harness.stats import GiB, median, p90, size_str
from benchmarks.harness.workloads import quiet_dcp, tensors_of
from mlcheckpoint import CheckpointManager

MODES = ("none", "overlapped", "blocking", "dcp")
LABELS = {"none": "no checkpointing", "overlapped": "ours, overlapped (guard)",
          "blocking": "ours, blocking (no guard)", "dcp": "DCP async_save, staged (anchor)"}
BYTES_PER_PARAM = 12  # fp32 parameter + Adam's exp_avg and exp_avg_sq

TARGET_OVERLAPPED = 0.02  # <= 2% median step-time overhead with a checkpoint every step
TARGET_VS_ANCHOR = 0.5  # less than half the anchor's overhead
TARGET_P90 = 0.05  # p90 step time within 5% of no checkpointing


# ---------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Config:
    size_bytes: int
    rounds: int
    steps: int  # per mode per round
    warmup: int  # discarded steps at the start of each block
    batch: int
    seq_len: int
    threads: int
    keep: int
    modes: tuple[str, ...]
    shm_dir: str
    quick: bool
    json_path: str | None


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=None,
                   help="state dict size (parameters + Adam moments) in GiB (default 1.0; 0.02 "
                        "with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every mode (default 5; 2 with --quick)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per mode per round (default 8; 4 with --quick)")
    p.add_argument("--warmup", type=int, default=1, help="steps discarded at the start of each block")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default 64; 32 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch compute threads (default 1)")
    p.add_argument("--keep", type=int, default=2, help="CheckpointManager keep= (default 2)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="modes to run (none is always run: the others are measured against it)")
    p.add_argument("--json", metavar="PATH", help="also write every figure to PATH as JSON")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs to work in (default /dev/shm)")
    a = p.parse_args(argv)
    size_gb = a.size_gb if a.size_gb is not None else (0.02 if a.quick else 1.0)
    rounds = a.rounds if a.rounds is not None else (2 if a.quick else 5)
    steps = a.steps if a.steps is not None else (4 if a.quick else 8)
    if size_gb <= 0 or rounds < 1 or a.warmup < 0 or steps <= a.warmup or a.threads < 1:
        p.error("need --size-gb > 0, --rounds >= 1, --warmup >= 0, --steps > --warmup, --threads >= 1")
    modes = ("none", *[m for m in MODES if m in a.modes and m != "none"])
    return Config(size_bytes=int(size_gb * GiB), rounds=rounds, steps=steps, warmup=a.warmup,
                  batch=a.batch, seq_len=a.seq_len or (32 if a.quick else 64), threads=a.threads,
                  keep=a.keep, modes=modes, shm_dir=a.shm_dir, quick=a.quick, json_path=a.json)


# ---------------------------------------------------------------------------------- the model
class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def model_for(size_bytes: int, max_len: int) -> tuple[TinyLM, dict[str, int]]:
    """A model whose parameters and Adam moments take about ``size_bytes``: width from the size
    (768 at ~90M parameters), then as many blocks (12 d^2 parameters each) as fit."""
    params = size_bytes // BYTES_PER_PARAM
    d = max(64, round(math.sqrt(params / 150) / 64) * 64)
    vocab = 8192 if d >= 512 else 2048
    layers = max(1, round((params - 2 * vocab * d) / (12 * d * d)))
    shape = {"vocab": vocab, "d_model": d, "layers": layers, "heads": max(1, d // 64)}
    torch.manual_seed(0)
    return TinyLM(vocab, d, layers, shape["heads"], max_len), shape


# ---------------------------------------------------------------------------------- the modes
@dataclass
class ModeTimes:
    step_s: list[float] = field(default_factory=list)  # whole step, save call included
    save_call_s: list[float] = field(default_factory=list)  # time the save call held the loop
    optim_step_s: list[float] = field(default_factory=list)  # optimizer.step(), guard included
    guard_wait_s: list[float] = field(default_factory=list)  # at the guard (overlapped)


class GuardClock:
    """Times whatever runs between two optimizer step pre-hooks: one registered before
    ``ckpt.guard(optimizer)``, one after. Hooks run in the order they were registered, so the
    difference is the time the guard held the training thread."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.t0 = self.waited = 0.0
        self._before = optimizer.register_step_pre_hook(self._start)
        self._after: Any = None

    def _start(self, *_: Any) -> None:
        self.t0 = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        self.waited = time.perf_counter() - self.t0

    def arm(self, optimizer: torch.optim.Optimizer) -> None:
        """Call right after ``guard``: the second hook runs after the guard's."""
        self._after = optimizer.register_step_pre_hook(self._stop)

    def take(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited

    def remove(self) -> None:
        for h in (self._before, self._after):
            if h is not None:
                h.remove()


class Saver:
    """One way of checkpointing, as the training loop sees it: ``before_optimizer_step`` (what
    the loop must wait for before the state changes) and ``save`` (after the step)."""

    name = "none"

    def before_optimizer_step(self) -> None:
        pass

    def save(self, sd: dict[str, Any], step: int) -> None:
        pass

    def drain(self) -> None:
        """Wait for everything in the background, between blocks (untimed)."""

    def close(self) -> None:
        pass


class Ours(Saver):
    def __init__(self, name: str, root: str, keep: int, optimizer: torch.optim.Optimizer | None):
        self.name = name
        self.ckpt = CheckpointManager(job_id=f"bench-train-{name}", local_dir=os.path.join(root, name),
                                      keep=keep, replication="none")
        self.futures: list[Any] = []
        self.guard = self.ckpt.guard(optimizer) if optimizer is not None else None

    def save(self, sd: dict[str, Any], step: int) -> None:
        self.futures.append(self.ckpt.async_save(sd, step))

    def drain(self) -> None:
        self.ckpt.wait()
        for f in self.futures:
            f.result()  # a failed save fails the benchmark: no figures from broken saves
        self.futures.clear()

    def longest_guard_wait_s(self) -> float | None:
        """The manager's own count of the longest guard wait, where it keeps one."""
        return getattr(getattr(self.ckpt, "snapshots", None), "longest_wait_s", None)

    def close(self) -> None:
        if self.guard is not None and hasattr(self.guard, "remove"):
            self.guard.remove()
        self.ckpt.close()


class DcpAnchor(Saver):
    """DCP's own overlapped save: background staging (a copy in a thread), then
    FileSystemWriter in another thread, into two directories in turn."""

    name = "dcp"

    def __init__(self, root: str):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.root = root
        self.stager = DefaultStager(StagingOptions(False, False, True, False))
        self.response: Any = None

    def before_optimizer_step(self) -> None:
        if self.response is not None:
            self.response.staging_completion.result()

    def save(self, sd: dict[str, Any], step: int) -> None:
        if self.response is not None:
            self.response.upload_completion.result()
        writer = dcp.FileSystemWriter(os.path.join(self.root, f"dcp-{step % 2}"), overwrite=True)
        self.response = dcp.async_save(sd, storage_writer=writer, async_stager=self.stager, no_dist=True)

    def drain(self) -> None:
        if self.response is not None:
            self.response.staging_completion.result()
            self.response.upload_completion.result()
            self.response = None

    def close(self) -> None:
        self.drain()
        self.stager.close()


# ---------------------------------------------------------------------------------- the loop
class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model, self.shape = model_for(cfg.size_bytes, cfg.seq_len)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(1)
        self.step_no = 0
        self.guard_clock = GuardClock(self.optimizer)
        self.sd: dict[str, Any] = {"step": 0}
        self.step(Saver())  # Adam's moments exist after the first step: the full state dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        # The live tensors: the optimizer updates them in place, so one dict serves every save
        # (each save reads them when it is called, as a user's ``state_dict()`` call would).
        self.sd = {"model": model_sd, "optim": optim_sd, "step": 0}
        self.state_bytes = sum(t.nbytes for t in tensors_of(self.sd))

    def step(self, saver: Saver, times: ModeTimes | None = None) -> None:
        t0 = time.perf_counter()
        tokens = torch.randint(self.shape["vocab"], (self.cfg.batch, self.cfg.seq_len + 1), generator=self.gen)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        saver.before_optimizer_step()
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        self.sd["step"] = self.step_no
        saver.save(self.sd, self.step_no)
        t3 = time.perf_counter()
        self.step_no += 1
        waited = self.guard_clock.take()
        if times is not None:
            times.step_s.append(t3 - t0)
            times.optim_step_s.append(t2 - t1)
            times.save_call_s.append(t3 - t2)
            times.guard_wait_s.append(waited)


def make_savers(cfg: Config, root: str, trainer: Trainer) -> tuple[dict[str, Saver], dict[str, str]]:
    savers: dict[str, Saver] = {"none": Saver()}
    skipped: dict[str, str] = {}
    for mode in cfg.modes[1:]:
        if mode == "overlapped":
            if not hasattr(CheckpointManager, "guard"):
                skipped[mode] = "not available (CheckpointManager has no guard())"
                continue
            savers[mode] = Ours(mode, root, cfg.keep, trainer.optimizer)
            trainer.guard_clock.arm(trainer.optimizer)  # after the guard's hook
        elif mode == "blocking":
            savers[mode] = Ours(mode, root, cfg.keep, None)
        else:
            savers[mode] = DcpAnchor(root)
    return savers, skipped


def gil_holds(trainer: Trainer, saver: Saver, repeats: int = 3) -> dict[str, float]:
    """The longest time a save kept another Python thread from running (the longest GIL
    hold): a probe thread's worst wake-up delay while one save is staged, committed and
    retired with the training thread idle, beside the same probe with no save running."""
    with GilProbe() as idle:
        time.sleep(1.0)
    during = []
    for _ in range(repeats):
        with GilProbe() as probe:
            saver.save(trainer.sd, trainer.step_no)
            trainer.step_no += 1
            saver.drain()
        during.append(probe.longest_s)
    return {"idle_s": idle.longest_s, "save_s": max(during)}


def run(cfg: Config, root: str) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    trainer = Trainer(cfg)
    savers, skipped = make_savers(cfg, root, trainer)
    times = {mode: ModeTimes() for mode in savers}
    try:
        # Warm-up, untimed: the first saves of each mode allocate their buffers.
        for saver in savers.values():
            for _ in range(cfg.keep + 2):
                trainer.step(saver)
            saver.drain()
        order = list(savers)
        for r in range(cfg.rounds):
            for mode in order[r % len(order):] + order[:r % len(order)]:  # rotate: no mode always first
                saver = savers[mode]
                block = ModeTimes()
                for i in range(cfg.steps):
                    trainer.step(saver, block if i >= cfg.warmup else None)
                saver.drain()
                for k, v in asdict(block).items():
                    getattr(times[mode], k).extend(v)
            progress(f"round {r + 1}/{cfg.rounds}: " + ", ".join(
                f"{m} {median(t.step_s[-(cfg.steps - cfg.warmup):]):.3f} s" for m, t in times.items()))
        overlapped = savers.get("overlapped")
        manager_wait = overlapped.longest_guard_wait_s() if isinstance(overlapped, Ours) else None
        gil = gil_holds(trainer, overlapped) if isinstance(overlapped, Ours) else None
    finally:
        for saver in savers.values():
            saver.close()
        trainer.guard_clock.remove()
    return {"manager_longest_guard_wait_s": manager_wait, "gil_hold": gil,
            "shape": trainer.shape, "params": sum(p.numel() for p in trainer.model.parameters()),
            "state_bytes": trainer.state_bytes, "skipped": skipped,
            "modes": {m: asdict(t) for m, t in times.items()}}


# ---------------------------------------------------------------------------------- report
def summarize(res: dict[str, Any]) -> dict[str, Any]:
    modes = res["modes"]
    base_med, base_p90 = median(modes["none"]["step_s"]), p90(modes["none"]["step_s"])
    base_optim = median(modes["none"]["optim_step_s"])
    s: dict[str, Any] = {"modes": {}}
    for m, t in modes.items():
        s["modes"][m] = {
            "steps": len(t["step_s"]), "median_s": median(t["step_s"]), "p90_s": p90(t["step_s"]),
            "overhead": median(t["step_s"]) / base_med - 1, "p90_overhead": p90(t["step_s"]) / base_p90 - 1,
            "save_call_s": median(t["save_call_s"]),
            # cross-check of the guard wait: optimizer.step() beyond its time without checkpoints
            "optim_excess_s": median(t["optim_step_s"]) - base_optim,
            "guard_wait_max_s": max(t["guard_wait_s"], default=0.0),
            "guard_wait_median_s": median(t["guard_wait_s"]),
        }
    ov, anchor = s["modes"].get("overlapped"), s["modes"].get("dcp")
    targets = []
    if ov is not None:
        targets.append({"name": f"ours, overlapped: median overhead <= {TARGET_OVERLAPPED:.0%}",
                        "value": ov["overhead"], "pass": ov["overhead"] <= TARGET_OVERLAPPED})
        targets.append({"name": f"ours, overlapped: p90 within {TARGET_P90:.0%} of no checkpointing",
                        "value": ov["p90_overhead"], "pass": ov["p90_overhead"] <= TARGET_P90})
        if anchor is not None:
            ratio = ov["overhead"] / anchor["overhead"] if anchor["overhead"] > 0 else float("nan")
            s["overlapped_vs_anchor"] = ratio
            targets.append({"name": f"ours, overlapped: < {TARGET_VS_ANCHOR:g}x the anchor's overhead",
                            "value": ratio, "pass": ov["overhead"] < TARGET_VS_ANCHOR * anchor["overhead"]})
    s["targets"] = targets
    return s


def report(cfg: Config, res: dict[str, Any], s: dict[str, Any], machine: dict[str, Any]) -> None:
    sh = res["shape"]
    print(f"\nmlcheckpoint {machine['mlcheckpoint']} training benchmark: a transformer LM "
          f"({sh['layers']} blocks, d_model {sh['d_model']}, vocab {sh['vocab']}, {res['params'] / 1e6:.1f}M "
          f"parameters) with AdamW,\n  state dict {size_str(res['state_bytes'])} (parameters + Adam moments), "
          f"a checkpoint every step, batch {cfg.batch} x {cfg.seq_len} tokens, "
          f"{cfg.threads} compute thread(s)")
    print(f"  {machine['cores']} cores, {machine['cpu']}, torch {machine['torch']}; load average "
          f"{machine['load_average'][0]:.2f} at start")
    print(f"  {cfg.rounds} rounds x {cfg.steps} steps per mode, interleaved; the first {cfg.warmup} "
          f"step(s) of each block discarded" + (" [--quick]" if cfg.quick else ""))
    for mode, why in res["skipped"].items():
        print(f"  {LABELS[mode]}: {why}")
    print(f"\n{'mode':<34}{'steps':>6}{'median s':>10}{'p90 s':>9}{'overhead':>10}{'p90 ovh.':>10}"
          f"{'save call':>11}{'guard wait max':>16}")
    for mode, m in s["modes"].items():
        guard = f"{m['guard_wait_max_s'] * 1e3:.1f} ms" if mode == "overlapped" else "-"
        ovh = "-" if mode == "none" else f"{m['overhead']:+.1%}"
        p90o = "-" if mode == "none" else f"{m['p90_overhead']:+.1%}"
        print(f"{LABELS[mode]:<34}{m['steps']:>6}{m['median_s']:>10.4f}{m['p90_s']:>9.4f}{ovh:>10}{p90o:>10}"
              f"{m['save_call_s'] * 1e3:>8.1f} ms{guard:>16}")
    print("overhead: median (and p90) step time over no checkpointing's; save call: median time the "
          "save call held the loop")
    if "overlapped" in s["modes"]:
        ov = s["modes"]["overlapped"]
        print(f"ours, overlapped: longest wait at the guard {ov['guard_wait_max_s'] * 1e3:.1f} ms, median "
              f"{ov['guard_wait_median_s'] * 1e3:.1f} ms (cross-check: optimizer.step() took "
              f"{ov['optim_excess_s'] * 1e3:+.1f} ms more than without checkpoints, median"
              + (f"; the manager's own longest wait {res['manager_longest_guard_wait_s'] * 1e3:.1f} ms"
                 if res.get("manager_longest_guard_wait_s") is not None else "") + ")")
        if res.get("gil_hold"):
            g = res["gil_hold"]
            print(f"ours, overlapped: longest GIL hold during a save {g['save_s'] * 1e3:.1f} ms "
                  f"(a probe thread's worst wake-up delay; {g['idle_s'] * 1e3:.1f} ms with no save)")
    else:
        print("overlapped: not available")
    if "overlapped_vs_anchor" in s:
        print(f"ours, overlapped vs the DCP anchor: {s['modes']['overlapped']['overhead']:+.1%} against "
              f"{s['modes']['dcp']['overhead']:+.1%} overhead ({s['overlapped_vs_anchor']:.2f}x)")
    if s["targets"]:
        print("\ntargets")
        for t in s["targets"]:
            shown = f"{t['value']:.2f}x" if "anchor" in t["name"] else f"{t['value']:+.1%}"
            print(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {shown}")


def run_all(cfg: Config) -> dict[str, Any]:
    """Every figure: the machine, every mode's steps, and their summary."""
    # Peak tmpfs use: keep+1 steps per manager (two of them) and two DCP checkpoints.
    root = make_workspace("mlckpt-bench-train-", cfg.shm_dir, need_bytes=(2 * (cfg.keep + 2) + 2) * cfg.size_bytes)
    threads_before = torch.get_num_threads()
    try:
        machine = machine_info(cfg.shm_dir)
        with quiet_dcp():  # process-wide: also in DCP's upload thread
            res = run(cfg, root)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called from a longer-lived process
        shutil.rmtree(root, ignore_errors=True)
    return {"config": asdict(cfg), "machine": machine, **res, "summary": summarize(res)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report and return every figure (see --json)."""
    cfg = parse_args(argv)
    return run_and_report(cfg, run_all, lambda cfg, f: report(cfg, f, f["summary"], f["machine"]),
                          cfg.json_path)



if __name__ == "__main__":
    exit_on_sigterm()
    main()
