"""One rank of bench_network's job, started by torchrun inside a node of a NetCluster.

    net_train_worker.py MODE NAME [--steps N --warmup W --params-mb P --batch B --seq-len L]
                                  [--keep K] [--hold] [--parallel ddp|fsdp|hsdp]
                                  [--host busy|idle]
                                  [--rank-state BYTES]
    net_train_worker.py resume NAME [--params-mb P --seq-len L --parallel ddp|fsdp|hsdp
                                     --rank-state BYTES]

MODE is one of bench_network's modes:
  none        DDP training, no CheckpointManager at all
  off         CheckpointManager(replication="none")
  unbudgeted  CheckpointManager(replication="tcp"); the benchmark sets
              MLCHECKPOINT_REPLICATION_BANDWIDTH=unlimited in the environment
  budgeted    CheckpointManager(replication="tcp") with MLCHECKPOINT_REPLICATION_BANDWIDTH
              and MLCHECKPOINT_ADAPTIVE_PACING unset: the library's default budget and pacing
  adaptive    the same with MLCHECKPOINT_ADAPTIVE_PACING=1 (the benchmark sets it): the
              delay-based pacing that grows into the idle link (issue 28)

Training: bench_training's transformer LM, AdamW, one compute thread, in one of three
parallelisms (``--parallel``; gloo, so every collective crosses the node's shaped link):
``ddp`` (DistributedDataParallel: every rank holds the whole model, its all-reduce of the
gradients runs in the backward), ``fsdp`` (fully_shard of each block and the root over all
ranks: parameters are all-gathered in forward and backward, gradients reduce-scattered; each
rank holds 1/world of the state), ``hsdp`` (fully_shard on a (nodes, ranks per node) mesh:
sharded within a node, replicated across nodes, whose gradients are all-reduced); ``ckpt.guard(optimizer)`` once and
``ckpt.async_save`` after every step. One untimed step first (Adam's moments exist after it),
then ``--steps`` timed steps. After each step, untimed: ``ckpt.protection()``, the node's
eth0 tx_bytes (``/sys/class/net/eth0``, this namespace's), the bytes replication booked on
the node's bandwidth schedule so far, the save result of the previous step. A thread samples RssAnon (``/proc/self/status``) every 20 ms from just before the
CheckpointManager is made. ``--hold``: wait (untimed) until the last step is on two nodes,
report, and keep the job (and its replication) alive until the benchmark kills the node.

``--host idle`` stands in for a GPU node, whose host CPUs are mostly idle during a step: before
the manager is made, CALIBRATION_STEPS real steps and as many of the collectives alone are
timed; each step then runs the same collectives (same sizes, same order, over the same link)
with the compute between them replaced by a wait of its calibrated length (``collectives``),
and the optimizer's arithmetic by a wait (its hooks, the guard's included, still run). The
state does not change from step to step; every save is still a new save and crosses whole.

resume: the same model (no DDP: nothing is trained) and optimizer state, then only
``ckpt.resume``; reports ResumeInfo and this rank's own bytes fetched (from the history line
``resume`` records), then waits to be killed.

Results go to ``$TEST_OUT_DIR/<NAME>.rank<r>.json`` (NetCluster.results).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.bench_training import model_for
from benchmarks.harness.report import cpu_ticks
from benchmarks.harness.workloads import tensors_of
from mlcheckpoint import CheckpointManager, history
from mlcheckpoint.replication.core.budget import NodeSchedule
from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing import internals
from mlcheckpoint.testing.cluster import write_result

BANDWIDTH_ENV = "MLCHECKPOINT_REPLICATION_BANDWIDTH"
ADAPTIVE_ENV = "MLCHECKPOINT_ADAPTIVE_PACING"
MODES = ("none", "off", "unbudgeted", "budgeted", "adaptive")
PARALLEL = ("ddp", "fsdp", "hsdp")
HOSTS = ("busy", "idle")
CALIBRATION_STEPS = 3  # real steps, then as many of the collectives alone, timed before the job


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=(*MODES, "resume"))
    p.add_argument("name")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--params-mb", type=float, default=134.0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--parallel", choices=PARALLEL, default="ddp")
    p.add_argument("--host", choices=HOSTS, default="busy",
                   help="busy: the real compute; idle: the same collectives over the link, the "
                        "compute replaced by a wait of its calibrated length (a GPU node's host)")
    p.add_argument("--compute-s", type=float, default=None,
                   help="--host idle: the forward+backward compute to wait, seconds (default: "
                        "calibrated by this launch)")
    p.add_argument("--optim-compute-s", type=float, default=None,
                   help="--host idle: the optimizer's arithmetic to wait, seconds (default: "
                        "calibrated by this launch)")
    p.add_argument("--rank-state", type=int, default=0,
                   help="bytes of per-rank state beside the model (an RNG state under this "
                        "rank's key, and a data loader's position), as real jobs keep")
    return p.parse_args()


def report(name: str, data: dict[str, Any]) -> None:
    """This rank's result ``name``, for ``NetCluster.results``."""
    write_result(name, dist.get_rank(), data)


def hold_forever() -> None:
    while True:  # the benchmark kills this node
        time.sleep(1)


def tx_bytes() -> int:
    """Bytes this node has sent on its link (eth0 of this network namespace)."""
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, by name with numbers folded
    (``mlckpt-tcp-conn_3`` counts as ``mlckpt-tcp-conn``), and ``"(process)"``: the whole
    process, threads that have exited included. What replication's threads cost the training
    process, apart from the kernel's work for the other node and the link."""
    tick = os.sysconf("SC_CLK_TCK")
    python_names = {t.native_id: t.name for t in threading.enumerate()}  # others: the kernel's comm
    by_name: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = re.sub(r"[-_ (]?\d+\)?$", "", python_names.get(int(tid)) or f.read().strip())
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread exited meanwhile
            continue
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    t = os.times()
    by_name["(process)"] = t.user + t.system
    return by_name


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Peak RssAnon of this process, sampled every ``period`` seconds on a thread."""

    def __init__(self, period: float = 0.02):
        self.baseline = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period,), daemon=True, name="rss")
        self._thread.start()

    def _loop(self, period: float) -> None:
        while not self._stop.wait(period):
            self.peak = max(self.peak, rss_anon())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def shard(model: torch.nn.Module, parallel: str) -> None:
    """fully_shard each block, then the root: over every rank (fsdp), or sharded within a node
    and replicated across nodes (hsdp)."""
    world, per_node = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = (init_device_mesh("cpu", (world,)) if parallel == "fsdp" else
            init_device_mesh("cpu", (world // per_node, per_node),
                             mesh_dim_names=("replicate", "shard")))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class Trainer:
    """The model, its optimizer and one training step (``train``: each rank its own data)."""

    def __init__(self, args: argparse.Namespace, train: bool):
        self.args = args
        params_bytes = int(args.params_mb * 1e6)
        # bench_training's model_for sizes parameters + two Adam moments (12 bytes/parameter).
        model, self.shape = model_for(3 * params_bytes, args.seq_len)
        self.params = sum(p.numel() for p in model.parameters())
        if args.parallel == "ddp":  # a resume needs no DDP: the state dict's keys are the module's
            self.model: torch.nn.Module = DDP(model) if train else model
        else:  # a resume shards as the training did: its state dict holds the same DTensors
            shard(model, args.parallel)
            self.model = model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(1 + (dist.get_rank() if train else 0))
        # Per-rank state (``--rank-state``): each rank's own bytes, under its own key (DCP
        # would keep one rank's value of a key all ranks share).
        self.rank_state = torch.zeros(args.rank_state, dtype=torch.uint8)
        self._units: list[torch.Tensor] = []  # --host idle: set by ``calibrate``
        self.compute_s = self.optim_compute_s = 0.0

    def forward_backward(self) -> None:
        a = self.args
        tokens = torch.randint(self.shape["vocab"], (a.batch, a.seq_len + 1), generator=self.gen)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP's all-reduce (FSDP's all-gathers and reduce-scatters) run in here

    # -------------------------------------------------------------- the idle host (--host idle)
    def units(self) -> list[torch.Tensor]:
        """One flat fp32 buffer per communication unit: the parameters each collective of a
        step moves (fsdp/hsdp: the root's own and each block's, as fully_shard groups them;
        ddp: every parameter, one all-reduce)."""
        def numel(params: Any) -> int:
            return sum(p.numel() for p in params)

        if self.args.parallel == "ddp":
            return [torch.zeros(numel(self.model.parameters()))]
        blocks = list(self.model.blocks)  # type: ignore[union-attr]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        world = dist.get_world_size()
        sizes = [numel(p for p in self.model.parameters() if id(p) not in in_blocks)]
        sizes += [numel(b.parameters()) for b in blocks]
        # The full size of each (its local shards were all-gathered from the world's ranks).
        return [torch.zeros(world * -(-n // world)) for n in sizes]

    def collectives(self, compute_s: float = 0.0) -> None:
        """One step's collective traffic on the link with ``compute_s`` of waiting spread
        between them as the compute is (forward a third, backward two thirds); the model's
        DTensors are not touched. ddp: the gradients' all-reduce after the backward. fsdp:
        each unit all-gathered in forward (the root first) and again in backward (the blocks:
        they reshard after forward), its gradient reduce-scattered; hsdp likewise within the
        node (unemulated: its cross-node all-reduce only)."""
        units = self._units
        if self.args.parallel == "ddp":
            time.sleep(compute_s)
            dist.all_reduce(units[0])
            return
        world = dist.get_world_size()
        fwd, bwd = compute_s / 3 / len(units), 2 * compute_s / 3 / len(units)
        for full in units:  # forward
            dist.all_gather_into_tensor(full, full[:full.numel() // world].clone())
            time.sleep(fwd)
        for k, full in enumerate(reversed(units)):  # backward
            if k < len(units) - 1:  # (the root stays gathered after forward)
                dist.all_gather_into_tensor(full, full[:full.numel() // world].clone())
            time.sleep(bwd)
            out = torch.empty(full.numel() // world)
            dist.reduce_scatter_tensor(out, full)

    def calibrate(self) -> dict[str, float]:
        """The compute of a step, for ``--host idle``: median forward+backward and optimizer
        step of CALIBRATION_STEPS real steps, less the median of as many steps of the
        collectives alone (both before any checkpointing)."""
        self._units = self.units()
        if self.args.compute_s is not None:  # given (the benchmark's first launch measured it)
            self.compute_s = self.args.compute_s
            self.optim_compute_s = self.args.optim_compute_s or 0.0
            return {"given": True, "compute_s": self.compute_s,
                    "optim_compute_s": self.optim_compute_s}
        fb, opt, comm = [], [], []
        for _ in range(CALIBRATION_STEPS):
            t0 = time.perf_counter()
            self.forward_backward()
            t1 = time.perf_counter()
            self.optimizer.step()
            fb.append(t1 - t0)
            opt.append(time.perf_counter() - t1)
        for _ in range(CALIBRATION_STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            self.collectives()
            comm.append(time.perf_counter() - t0)
        def med(xs: list[float]) -> float:
            return sorted(xs)[len(xs) // 2]

        figures = {"fwd_bwd_s": med(fb), "optim_s": med(opt), "collectives_s": med(comm)}
        # Every rank waits alike (the slowest rank's figures): a step is as slow as its slowest.
        t = torch.tensor([max(0.0, figures["fwd_bwd_s"] - figures["collectives_s"]),
                          figures["optim_s"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.compute_s, self.optim_compute_s = float(t[0]), float(t[1])
        return {**figures, "compute_s": self.compute_s, "optim_compute_s": self.optim_compute_s}

    def idle_forward_backward(self) -> None:
        """The idle host's forward+backward: the collectives, and the compute as a wait. The
        gradients are dropped, so ``optimizer.step()`` runs its hooks (the guard) and nothing
        else; ``idle_optimizer_wait`` stands in for its arithmetic."""
        self.optimizer.zero_grad(set_to_none=True)
        self.collectives(self.compute_s)

    def idle_optimizer_wait(self) -> None:
        time.sleep(self.optim_compute_s)

    def state_dict(self, step: int) -> dict[str, Any]:
        """The live tensors (the optimizer updates them in place): one dict serves every save."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd = {"model": model_sd, "optim": optim_sd, "step": step}
        if self.rank_state.numel():
            rank = dist.get_rank()
            sd[f"rng.rank{rank}"] = self.rank_state
            sd[f"loader.rank{rank}"] = {"position": 0}
        return sd

    def advance_rank_state(self, sd: dict[str, Any], step: int) -> None:
        """The per-rank state moves on with each step, as an RNG and a data loader do."""
        if self.rank_state.numel():
            self.rank_state.random_(0, 256, generator=self.gen)
            sd[f"loader.rank{dist.get_rank()}"]["position"] = step * self.args.batch


def resolved_budget(ckpt: CheckpointManager | None) -> Any:
    """The replication budget the manager resolved, where this build has one."""
    if ckpt is None:
        return None
    grouped = getattr(ckpt.options, "replication", None)  # ReplicationOptions since issue 30
    if grouped is not None and not isinstance(grouped, str):
        return grouped.bandwidth
    return getattr(ckpt.options, "replication_bandwidth", None)


def describe_budget(ckpt: CheckpointManager | None) -> str | None:
    """How the transport paces (its log line), where it has a budget."""
    replicator = internals(ckpt).replicator if ckpt is not None else None
    transport = getattr(replicator, "transport", None)
    budget = getattr(transport, "budget", None)
    return budget.describe() if budget is not None else None


def pushed_bytes(ckpt: CheckpointManager | None, steps: int) -> dict[str, int]:
    """This rank's replication pushes: how many of its steps, and their bytes (the
    replicator's own count of what it sent)."""
    states = [ckpt.replication_state(s) for s in range(steps)] if ckpt is not None else []
    done = [st for st in states if st is not None and st.state == "replicated"]
    return {"steps": len(done), "bytes": sum(st.bytes for st in done)}


def push_profiles(ckpt: CheckpointManager | None, steps: int) -> list[dict[str, Any]]:
    """Each push this rank made: step, bytes, seconds, of them sending and held back."""
    states = [ckpt.replication_state(s) for s in range(steps)] if ckpt is not None else []
    # (getattr: a build before issue 45 keeps no per-push profile)
    return [{"step": st.step, "bytes": st.bytes, "seconds": st.seconds,
             "send_seconds": getattr(st, "send_seconds", None),
             "budget_wait_seconds": getattr(st, "budget_wait_seconds", None)}
            for st in states if st is not None and st.state == "replicated" and st.bytes]


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    trainer = Trainer(args, train=True)
    trainer.forward_backward()  # untimed: DDP's first step, and Adam's moments come to exist
    trainer.optimizer.step()
    sd = trainer.state_dict(0)
    state_bytes = sum(t.nbytes for t in tensors_of(sd))
    idle = args.host == "idle"
    calibration = trainer.calibrate() if idle else None
    forward_backward = trainer.idle_forward_backward if idle else trainer.forward_backward

    rss = RssSampler()  # from before the manager: everything checkpointing adds shows
    ckpt = None
    if args.mode != "none":
        if args.mode in ("budgeted", "adaptive"):
            os.environ.pop(BANDWIDTH_ENV, None)  # the default budget, whatever the caller's shell set
        if args.mode == "budgeted":
            os.environ.pop(ADAPTIVE_ENV, None)  # the default pacing, likewise
        ckpt = CheckpointManager(keep=args.keep, replication="none" if args.mode == "off" else "tcp")
        ckpt.guard(trainer.optimizer)
    schedule = (NodeSchedule(LocalStore(ckpt.options.local_dir, ckpt.job_id, create=False).paths.bandwidth)
                if ckpt is not None else None)
    steps: list[dict[str, Any]] = []
    save_bytes: list[int] = []
    staged_bytes: list[int | None] = []  # copied before DCP planned (None: a build without it)
    pending = None
    cpu_before = thread_cpu()
    t_start = time.perf_counter()
    for step in range(args.steps):
        cpu0 = cpu_ticks()  # (outside the timed step, as cpu1 is)
        t0 = time.perf_counter()
        forward_backward()
        t1 = time.perf_counter()
        trainer.optimizer.step()  # the guard waits here for the previous snapshot
        if idle:
            trainer.idle_optimizer_wait()
        t2 = time.perf_counter()
        sd["step"] = step
        trainer.advance_rank_state(sd, step)
        future = ckpt.async_save(sd, step) if ckpt is not None else None
        t3 = time.perf_counter()
        cpu1 = cpu_ticks()
        # Untimed from here: what the step left behind.
        if pending is not None:
            save_bytes.append(pending.result().bytes)  # done: this step's save waited for it
            staged_bytes.append(getattr(pending.result(), "staged_bytes", None))
        pending = future
        p = ckpt.protection() if ckpt is not None else None
        steps.append({"step": step, "t": t3 - t_start, "step_s": t3 - t0, "fwd_bwd_s": t1 - t0,
                      "optim_s": t2 - t1, "save_call_s": t3 - t2, "tx_bytes": tx_bytes(),
                      "cpu_busy": (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]),
                      "booked_bytes": schedule.total_bytes() if schedule is not None else None,
                      "newest_protected": None if p is None else p.newest_protected,
                      "lag_steps": None if p is None else p.lag_steps,
                      "age_s": None if p is None else p.age_seconds,
                      "rate_bytes_per_s": None if p is None else p.rate_bytes_per_s,
                      "superseded": None if p is None else p.superseded,
                      "sample_s": time.perf_counter() - t3})
    cpu_after = thread_cpu()
    if ckpt is not None:
        ckpt.wait()
        if pending is not None:
            save_bytes.append(pending.result().bytes)
            staged_bytes.append(getattr(pending.result(), "staged_bytes", None))
    # A held launch is the memory a resume case starts from: its newest step must be on two
    # nodes before the benchmark kills a node, or (on a loaded machine) the resume finds no
    # replica and measures a fresh start. Untimed: the step figures above are already taken.
    replicated = None
    if args.hold and ckpt is not None and args.mode != "off":
        replicated = ckpt.wait_replicated(args.steps - 1, timeout=120)
    rss.stop()
    if schedule is not None:
        schedule.close()
    result = {"rank": rank, "parallel": args.parallel, "node": int(os.environ["GROUP_RANK"]), "mode": args.mode,
              "params": trainer.params, "shape": trainer.shape, "state_bytes": state_bytes,
              "save_bytes": save_bytes, "staged_bytes": staged_bytes,
              "pushed": pushed_bytes(ckpt, args.steps), "steps": steps, "warmup": args.warmup,
              "rss_anon_baseline": rss.baseline, "rss_anon_peak": rss.peak,
              "guard_longest_wait_s": None if ckpt is None else ckpt.stats()["mlcheckpoint/guard_longest_wait_seconds"],
              "budget": resolved_budget(ckpt), "budget_env": os.environ.get(BANDWIDTH_ENV),
              "pacing": describe_budget(ckpt), "host": args.host, "calibration": calibration,
              "replication_profile": None if ckpt is None else {
                  k.removeprefix("mlcheckpoint/replication_"): v for k, v in ckpt.stats().items()
                  if k.startswith("mlcheckpoint/replication_")},
              "pushes": push_profiles(ckpt, args.steps),
              "thread_cpu_s": {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after},
              "job_id": None if ckpt is None else ckpt.job_id, "replicated_before_report": replicated}
    report(args.name, result)
    if args.hold:
        hold_forever()
    if ckpt is not None:
        ckpt.close()


def resume(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    trainer = Trainer(args, train=False)
    for p in trainer.model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()  # Adam's moments exist: the state dict has their tensors
    sd = trainer.state_dict(-1)
    ckpt = CheckpointManager(replication="tcp")
    dist.barrier()  # every rank is ready: the resume alone is timed
    t0 = time.perf_counter()
    info = ckpt.resume(sd)
    wall = time.perf_counter() - t0
    own = [e for e in history.read(LocalStore(ckpt.options.local_dir, ckpt.job_id, create=False).job_dir)
           if e.get("event") == "resume" and e.get("rank") == rank]
    report(args.name, {"rank": rank, "node": int(os.environ["GROUP_RANK"]), "step": info.step,
                       "loaded_step": sd["step"], "source": info.source,
                       "sources": {str(k): v for k, v in info.sources.items()},
                       "seconds": info.seconds, "wall_s": wall, "bytes_fetched": info.bytes_fetched,
                       "own_bytes_fetched": own[-1].get("bytes") if own else None,
                       "reason": info.reason, "phases": info.phases})
    hold_forever()  # the benchmark kills the job once every rank has reported


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the node's other cores serve checkpointing (bench_training's habit)
    dist.init_process_group("gloo")
    if args.mode == "resume":
        resume(args)
    else:
        train(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
