"""torchtitan's real trainer (llama3 debug model, FSDP2 over gloo) on CPU, 2 simulated nodes,
checkpointing with mlcheckpoint (examples/torchtitan_config.py). Not part of CI: run it through
examples/torchtitan_cpu.sh, which sets up torchtitan with its dependencies and test assets.

    python examples/torchtitan_cpu.py --workdir DIR

1. reference: 12 steps, uninterrupted;
2. the job: node 1 dies after step 7 (its rank SIGKILLs itself; node 0's rank then fails in
   the next collective and closes at once); node 1's memory is wiped;
3. restart: node 1's shards of step 6 come from node 0's replicas; training ends at step 12;
4. restart of the crashed job with both nodes' memory wiped: torchtitan's own step-4 in its
   folder is the fallback.
The losses after each resume, and the final parameters and optimizer state (torchtitan's
last-step checkpoint), must equal the reference's.

With ``--worker``, this file is what torchrun runs: torchtitan's ``train.main`` with the
patches it needs on CPU (each says why).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, KILL_AFTER = 12, 7
TRAIN_ARGS = ["--module", "examples.torchtitan_config", "--config", "llama3_debugmodel_mlcheckpoint",
              f"--training.steps={STEPS}", "--training.seq_len=256", "--training.local_batch_size=2",
              "--parallelism.spmd_backend=partial_dtensor", "--debug.seed=0"]


# ---------------------------------------------------------------------------- worker side
def patch_torchtitan_for_cpu() -> None:
    import importlib.util
    import types

    import torch
    import torch._utils
    import torch.nn.functional as F

    # torchtitan falls back to "cuda" when no accelerator is found.
    torch._utils._get_available_device_type = lambda: "cpu"
    if importlib.util.find_spec("triton") is None:
        # Expert-parallel GPU kernels, imported at start-up, unused by the debug model.
        stub = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
        stub.__getattr__ = lambda name: None
        sys.modules[stub.__name__] = stub

    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fsdp_collectives
    import torchtitan.distributed.utils as dist_utils
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.components import metrics
    from torchtitan.models.common import attention

    class CpuMemoryMonitor:  # the device memory monitor asks CUDA for its name and capacity
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    def eager_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                             kernel_options):
        # FlexAttention has no backward on CPU: the same block-causal mask, through SDPA.
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=enable_gqa), None

    divide_factors = fsdp_collectives._get_gradient_divide_factors

    def sum_reduction(rs_group, ar_group, dtype, device_type="", factor=None, *_, **__):
        return divide_factors(rs_group, ar_group, dtype, device_type, factor, True)  # gloo: no PREMUL_SUM

    metrics.build_device_memory_monitor = CpuMemoryMonitor
    attention.FlexAttention.compiled_flex_attn = staticmethod(eager_flex_attention)
    fsdp_collectives._get_gradient_divide_factors = sum_reduction
    dist_utils.set_pg_timeouts = lambda **_: None  # its barrier passes a CUDA device id


def die_after_step(step: int) -> None:
    """Node 1's rank SIGKILLs itself once ``step`` is trained and step-1's in-memory checkpoint
    is on both nodes: a machine lost mid-training."""
    from torchtitan.trainer import Trainer

    train_step = Trainer.train_step

    def train_step_then_die(self, *args, **kwargs):
        train_step(self, *args, **kwargs)
        if self.step == step:
            ckpt = self.checkpointer.checkpoints
            ckpt.wait()
            ckpt.wait_replicated(step - 1, timeout=60)
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer.train_step = train_step_then_die


def worker() -> None:
    patch_torchtitan_for_cpu()
    if os.environ.get("DIE_AFTER_STEP") and os.environ.get("GROUP_RANK") == "1":
        die_after_step(int(os.environ["DIE_AFTER_STEP"]))
    from torchtitan.train import main
    main()


# ---------------------------------------------------------------------------- driver side
def launch(workdir: str, name: str, job: str, dump: str, env_extra: dict | None = None) -> list[int]:
    """Two torchrun agents (nodes 0 and 1, one rank each) on this machine; wait for both."""
    port = 29500 + (hash((name, time.time())) % 2000)
    procs = []
    for node in (0, 1):
        env = dict(os.environ, MLCHECKPOINT_JOB_ID=job, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   MLCHECKPOINT_LOCAL_DIR=os.path.join(workdir, f"{job}-node{node}"),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        env.update(env_extra or {})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
               "--max-restarts=0", os.path.abspath(__file__), "--worker", *TRAIN_ARGS,
               f"--dump_folder={dump}"]
        # The child holds its own copy of the descriptor: ours can close at once.
        with open(os.path.join(workdir, f"{name}.node{node}.log"), "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    return [p.wait(timeout=600) for p in procs]


def losses(workdir: str, name: str) -> dict[int, str]:
    with open(os.path.join(workdir, f"{name}.node0.log")) as f:
        text = re.sub(r"\x1b\[[0-9;]*m", "", f.read())
    return {int(s): loss for s, loss in re.findall(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", text)}


def final_state(dump: str) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(dump, "final.pt")
    dcp_to_torch_save(os.path.join(dump, "checkpoint", f"step-{STEPS}"), out)
    return torch.load(out, weights_only=False)


def same_tensors(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return True  # pickled extras (dataloader bytes, step counters) are compared through losses


def compare(workdir: str, name: str, ref: dict, ref_state: dict, dump: str, resumed: int) -> bool:
    got = losses(workdir, name)
    expected = {s: v for s, v in ref.items() if s > resumed}
    same_losses = got == expected
    same_state = same_tensors(final_state(dump), ref_state)
    print(f"{name}: resumed at step {resumed}: losses {'identical' if same_losses else 'DIFFER'} "
          f"({len(got)} steps), final parameters and optimizer state "
          f"{'identical' if same_state else 'DIFFER'}")
    return same_losses and same_state


def resumed_step(workdir: str, name: str) -> tuple[int, str]:
    with open(os.path.join(workdir, f"{name}.node0.log")) as f:  # ResumeInfo.summary's line
        m = re.search(r"restored step (\d+) (from the persistent|from local memory|in .* from node)",
                      f.read())
    if not m:
        return 0, "nothing"
    words = m.group(2)
    return int(m.group(1)), ("persistent" if "persistent" in words else
                             "local" if "local" in words else "peer")


def drive(workdir: str) -> int:
    os.makedirs(workdir, exist_ok=True)
    job = f"titan-cpu-{os.getpid()}"
    print("1. reference run ...", flush=True)
    assert launch(workdir, "reference", job + "-ref", os.path.join(workdir, "ref")) == [0, 0]
    ref, ref_state = losses(workdir, "reference"), final_state(os.path.join(workdir, "ref"))

    print(f"2. the job; node 1 dies after step {KILL_AFTER} ...", flush=True)
    dump = os.path.join(workdir, "job")
    codes = launch(workdir, "crash", job, dump, {"DIE_AFTER_STEP": str(KILL_AFTER)})
    print(f"   exit codes {codes}; torchtitan's folder: {sorted(os.listdir(os.path.join(dump, 'checkpoint')))}")
    shutil.copytree(dump, dump + "-at-crash")
    shutil.rmtree(os.path.join(workdir, f"{job}-node1"))  # a replacement machine: empty memory

    print("3. restart with node 1 replaced ...", flush=True)
    assert launch(workdir, "peer", job, dump) == [0, 0]
    step, source = resumed_step(workdir, "peer")
    ok = source == "peer" and compare(workdir, "peer", ref, ref_state, dump, step)

    print("4. restart of the crashed job, both nodes' memory lost ...", flush=True)
    for node in (0, 1):
        shutil.rmtree(os.path.join(workdir, f"{job}-node{node}"), ignore_errors=True)
    assert launch(workdir, "fallback", job, dump + "-at-crash") == [0, 0]
    step, source = resumed_step(workdir, "fallback")
    ok = source == "persistent" and compare(workdir, "fallback", ref, ref_state, dump + "-at-crash", step) and ok
    print("TORCHTITAN CPU RUN PASSED" if ok else "TORCHTITAN CPU RUN FAILED (logs in " + workdir + ")")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.argv = [sys.argv[0], *sys.argv[2:]]
        worker()
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--workdir", required=True, help="needs tests/assets/{tokenizer,c4_test}")
        sys.exit(drive(os.path.abspath(parser.parse_args().workdir)))
