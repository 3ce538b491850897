"""Worker: tensor subclasses under FSDP2 (DTensors whose local tensor is a subclass), saved on
one world size and resumed on another, with DCP's FileSystemWriter/Reader and with ours.

The model: torchao's float8 training Linear layers with FSDP float8 all-gather (their weights
are WeightWithDynamicFloat8CastTensor; left out, and said so in the report, without torchao),
a parameter of our own wrapper subclass (tensor_kinds.ScaledTensor) and a plain one, each
fully_shard-ed on a 1-D CPU mesh; the state saved is {"model": get_model_state_dict, "step"}.

argv[1]:
  save    every save path of PATHS, each into its own job (``<job id>-<path>``; "fs": a
          FileSystemWriter directory in $TEST_PERSISTENT_DIR), each waited on until the
          partner node holds it. The asynchronous paths change every tensor right after the
          call returns (under ``guard``: the plain ones at the optimizer step). Then
          ``process_mode``. Reports "saved": {"results": {path: error or None}, "process":
          {backend: differences or error}, "torchao": whether the float8 layers are in}.
  resume  a template model of this world size (other values) loads each path's checkpoint
          (ours: ``ckpt.resume``); reports "resumed-w<world>": {path: {"diff": where this
          rank's shards differ from the source model built on this world size, or the error,
          "step", "source"}}.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import differences
from tensor_kinds import Mutating, contents, mutate, scaled
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mlcheckpoint import CheckpointManager

PATHS = ["fs", "save", "async_save", "guard_async_save", "dcp_save", "dcp_async_thread",
         "dcp_async_process"]


def torchao_float8():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    return lambda m: convert_to_float8_training(
        m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def build(world: int, seed: int) -> nn.Module:
    """The same full values on every world size for a seed; FSDP2 shards them on dim 0."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 8))
    convert = torchao_float8()
    if convert is not None:
        convert(model)
    model.register_parameter("scaled", nn.Parameter(scaled(seed, 8, 6), requires_grad=False))
    model.register_parameter("plain", nn.Parameter(torch.randn(12, 4)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def state(model: nn.Module, step: int) -> dict:
    return {"model": get_model_state_dict(model), "step": step}


def is_plain(t: torch.Tensor) -> bool:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return type(local) in (torch.Tensor, nn.Parameter)


def save(path: str, job: str, world: int) -> None:
    model = build(world, 0)
    sd = state(model, 7)
    if path == "fs":
        dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(os.environ["TEST_PERSISTENT_DIR"], "fs")))
        return
    ckpt = CheckpointManager(job_id=f"{job}-{path}", replication="tcp")
    try:
        if path == "save":
            ckpt.save(sd, 1)
        elif path == "async_save":
            ckpt.async_save(sd, 1)
            mutate(sd)
            ckpt.wait()
        elif path == "guard_async_save":
            opt = Mutating(list(model.parameters()))
            with ckpt.guard(opt):
                ckpt.async_save(sd, 1)
                mutate([t for t in sd["model"].values() if not is_plain(t)])  # taken at the call
                opt.step()  # waits for the snapshot of the plain ones
                ckpt.wait()
        elif path == "dcp_save":
            dcp.save(sd, storage_writer=ckpt.storage_writer(1))
        else:
            kind = AsyncCheckpointerType.PROCESS if path == "dcp_async_process" else AsyncCheckpointerType.THREAD
            fut = dcp.async_save(sd, storage_writer=ckpt.storage_writer(1),
                                 process_group=ckpt.process_group, async_checkpointer_type=kind)
            mutate(sd)
            fut.result()
        if not ckpt.wait_replicated(1, timeout=60):
            raise RuntimeError(f"step 1 of {path} not replicated within 60 s")
    finally:
        ckpt.close()


def local_state(world: int, seed: int) -> dict:
    """This rank's shards of the model as plain values (subclasses, not DTensors), under
    per-rank keys."""
    model = build(world, seed)
    return {f"rank{dist.get_rank()}": {k: v._local_tensor for k, v in get_model_state_dict(model).items()},
            "step": 7 + seed}


def process_mode(job: str, world: int) -> dict:
    """dcp.async_save in PROCESS mode of the ranks' local tensors (subclasses themselves, not
    DTensors of them), changed right after the call, loaded back: through
    FileSystemWriter/Reader and through ours."""
    out = {}
    for backend in ("fs", "ours"):
        sd = local_state(world, 0)
        expected = contents(sd)
        ckpt = CheckpointManager(job_id=f"{job}-process", replication="tcp")
        try:
            fs_dir = os.path.join(os.environ["TEST_PERSISTENT_DIR"], "process")
            writer = FileSystemWriter(fs_dir) if backend == "fs" else ckpt.storage_writer(1)
            fut = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            mutate(sd)
            fut.result()
            if backend == "ours" and not ckpt.wait_replicated(1, timeout=60):  # the metadata too
                raise RuntimeError("step 1 not replicated within 60 s")
            template = local_state(world, 1)
            reader = FileSystemReader(fs_dir) if backend == "fs" else ckpt.storage_reader(1)
            dcp.load(template, storage_reader=reader)
            out[backend] = differences(expected, contents(template))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 (the test reports it)
            out[backend] = f"error: {type(e).__name__}: {str(e)[-1500:]}"
        finally:
            ckpt.close()
    return out


def resume(path: str, job: str, world: int) -> dict:
    expected = contents(state(build(world, 0), 7))
    template = state(build(world, 1), 0)
    info = None
    if path == "fs":
        dcp.load(template, storage_reader=FileSystemReader(os.path.join(os.environ["TEST_PERSISTENT_DIR"], "fs")))
    else:
        ckpt = CheckpointManager(job_id=f"{job}-{path}", replication="tcp")
        try:
            info = ckpt.resume(template)
        finally:
            ckpt.close()
    types = sorted({type(v._local_tensor).__name__ for v in template["model"].values()})
    return {"diff": differences(expected, contents(template)), "types": types,
            "step": None if info is None else info.step,
            "source": None if info is None else info.sources.get(dist.get_rank(), info.source)}


def main() -> None:
    phase = sys.argv[1]
    _, world = init()
    job = os.environ["MLCHECKPOINT_JOB_ID"]
    results: dict = {}
    for path in PATHS:
        try:
            results[path] = save(path, job, world) if phase == "save" else resume(path, job, world)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 (the test reports it)
            results[path] = f"error: {type(e).__name__}: {str(e)[-1500:]}"
    name = "saved" if phase == "save" else f"resumed-w{world}"
    report(name, {"results": results, "torchao": torchao_float8() is not None,
                  "process": process_mode(job, world) if phase == "save" else None})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
