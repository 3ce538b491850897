"""Worker: the DCP contract on 4 ranks, with FileSystemWriter/Reader and with ours side by side.

Every case saves and loads through both backends: "filesystem" (FileSystemWriter/Reader in
$TEST_PERSISTENT_DIR) and "memory" (CheckpointManager.storage_writer/storage_reader, one step
per case). Each rank reports, per case and backend, the paths where what it loaded differs from
what the case expects ([] = identical), or the error raised. Rank 0 also writes what the saved
checkpoints hold in full (expected.pt) and which step/directory holds each case (cases.json),
so the test can load them again in one process (4 -> 1 ranks).

Cases: duplicates across ranks (three items all 4 ranks hold: DCP writes each once, so a rank
has nothing to write) with per-rank key orders; Shard/Replicate DTensors resharded on load to
other placements, another mesh and 2 ranks, with dtype casts; a save on 2 ranks loaded on 4;
async_save in THREAD mode (4 ranks) and PROCESS mode (2 ranks: a replicated tensor, then only
values); a no_dist save and load (sync and async) by one rank inside the job.
"""

import functools
import json
import os
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import differences
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mlcheckpoint import CheckpointManager
from mlcheckpoint.testing import internals

SUB = [0, 1]  # the ranks of the 2-rank group


def full(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Backends:
    """Where each case is saved and loaded, per backend."""

    # One step per case, fixed: ranks that skip a case must not number the next one otherwise.
    STEPS: ClassVar[dict[str, int]] = {name: i + 1 for i, name in enumerate(
        ["replicated", "dtensor", "two_ranks", "async_thread", "async_process",
         "async_process_values", "no_dist", "no_dist_async"])}

    def __init__(self, ckpt: CheckpointManager, fs_root: str):
        self.ckpt, self.fs_root = ckpt, fs_root

    def writer(self, backend: str, case: str):
        if backend == "filesystem":
            return FileSystemWriter(os.path.join(self.fs_root, case))
        return self.ckpt.storage_writer(self.step(case))

    def reader(self, backend: str, case: str):
        if backend == "filesystem":
            return FileSystemReader(os.path.join(self.fs_root, case))
        return self.ckpt.storage_reader(self.step(case))

    def step(self, case: str) -> int:
        return self.STEPS[case]


def checked(fn):
    """Run one backend's half of a case: its diff list, or the error it raised (any error is
    the case's result, for the test to report; DCP raises CheckpointException, a
    BaseException, on every rank)."""
    try:
        return fn()
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        return [f"error: {type(e).__name__}: {str(e)[-1500:]}"]


def full_values(sd: dict) -> dict:
    """DTensors as their full tensors (a collective over their mesh), other values as they are."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}


def as_zeros(sd: dict) -> dict:
    """A load target with the same layout as ``sd``: zeros, non-tensors None."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                        shape=v.shape, stride=v.stride())
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, dict):  # DCP flattens nested dicts: the target needs their keys
            out[k] = as_zeros(v)
        else:
            out[k] = None
    return out


# ---------------------------------------------------------------- cases

def case_replicated(b: Backends, backend: str, meshes: dict, rank: int) -> list[str]:
    """Every rank saves the same three items (a plain tensor, DDP-style; a Replicate() DTensor;
    a value): DCP writes each once, so at least one of the 4 ranks has nothing to write.
    Ranks insert the keys in different orders; the target has a third order."""
    items = [("rep", full(1, 6, 5)), ("yrep", distribute_tensor(full(12, 9), meshes["4"], [Replicate()])),
             ("step", 12)]
    sd = dict(items if rank % 2 == 0 else reversed(items))
    dcp.save(sd, storage_writer=b.writer(backend, "replicated"))
    target = {"step": None, "rep": torch.zeros(6, 5),
              "yrep": distribute_tensor(torch.zeros(9), meshes["4"], [Shard(0)])}
    dcp.load(target, storage_reader=b.reader(backend, "replicated"))
    order = [] if list(target) == ["step", "rep", "yrep"] else ["key order changed"]
    return order + differences(full_values(dict(items)), full_values(target))


def dtensor_state(mesh4: DeviceMesh, mesh2x2: DeviceMesh) -> dict:
    return {
        "x": distribute_tensor(full(2, 10, 6), mesh4, [Shard(0)]),  # uneven: 3, 3, 3, 1 rows
        "y": distribute_tensor(full(3, 5), mesh4, [Replicate()]),
        "z": distribute_tensor(full(4, 4, 8), mesh2x2, [Shard(0), Shard(1)]),
        "tiny": distribute_tensor(full(5, 3, 5), mesh4, [Shard(0)]),  # rank 3 holds no rows
        "b16": distribute_tensor(full(6, 8, 4, dtype=torch.bfloat16), mesh4, [Shard(1)]),
    }


def case_dtensor_4(b: Backends, backend: str, meshes: dict) -> list[str]:
    """Save on 4 ranks; load on 4 into other placements, another mesh shape and dtypes."""
    mesh4, mesh2x2 = meshes["4"], meshes["2x2"]
    sd = dtensor_state(mesh4, mesh2x2)
    dcp.save(sd, storage_writer=b.writer(backend, "dtensor"))
    target = {
        "x": distribute_tensor(torch.zeros(10, 6, dtype=torch.bfloat16), mesh4, [Shard(1)]),
        "y": distribute_tensor(torch.zeros(5), mesh4, [Shard(0)]),
        "z": distribute_tensor(torch.zeros(4, 8), mesh2x2, [Replicate(), Shard(0)]),
        "tiny": distribute_tensor(torch.zeros(3, 5), mesh2x2, [Shard(1), Replicate()]),
        "b16": distribute_tensor(torch.zeros(8, 4), mesh4, [Replicate()]),  # bf16 -> fp32
    }
    dcp.load(target, storage_reader=b.reader(backend, "dtensor"))
    expected = full_values(sd)
    expected = {k: v.to(target[k].dtype) for k, v in expected.items()}
    return differences(expected, full_values(target))


def case_dtensor_4_to_2(b: Backends, backend: str, meshes: dict, rank: int) -> list[str]:
    """Load the 4-rank save on a 2-rank group."""
    if rank not in SUB:
        return []
    mesh = meshes["sub"]
    target = {"x": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]),
              "y": distribute_tensor(torch.zeros(5), mesh, [Replicate()]),
              "z": distribute_tensor(torch.zeros(4, 8), mesh, [Shard(1)]),
              "tiny": distribute_tensor(torch.zeros(3, 5), mesh, [Shard(0)]),
              "b16": distribute_tensor(torch.zeros(8, 4, dtype=torch.bfloat16), mesh, [Shard(0)])}
    dcp.load(target, storage_reader=b.reader(backend, "dtensor"), process_group=meshes["sub_pg"])
    expected = {"x": full(2, 10, 6), "y": full(3, 5), "z": full(4, 4, 8), "tiny": full(5, 3, 5),
                "b16": full(6, 8, 4, dtype=torch.bfloat16)}
    return differences(expected, full_values(target))


def case_2_to_4(b: Backends, backend: str, meshes: dict, rank: int) -> list[str]:
    """Save on a 2-rank group (one rank left with only a byte item); load on all 4 ranks."""
    if rank in SUB:
        sd = {"x": distribute_tensor(full(7, 7, 3), meshes["sub"], [Shard(0)]),
              "rep": full(8, 9), "note": {"saved_by": 2}}
        dcp.save(sd, storage_writer=b.writer(backend, "two_ranks"), process_group=meshes["sub_pg"])
    dist.barrier()
    target = {"x": distribute_tensor(torch.zeros(7, 3), meshes["4"], [Shard(1)]),
              "rep": torch.zeros(9), "note": {"saved_by": None}}
    dcp.load(target, storage_reader=b.reader(backend, "two_ranks"))
    return differences({"x": full(7, 7, 3), "rep": full(8, 9), "note": {"saved_by": 2}}, full_values(target))


def scribble(sd: dict) -> None:
    """Change the live state after async_save returned, as the next training step would."""
    for v in sd.values():
        if isinstance(v, DTensor):
            v.to_local().add_(100)
        elif isinstance(v, torch.Tensor):
            v.add_(100)
        elif isinstance(v, dict):
            v["mutated"] = True


def async_round_trip(b: Backends, backend: str, case: str, sd: dict, pg, **kw) -> list[str]:
    """async_save ``sd``, change it at once, wait; load: what was saved is ``sd`` as it was
    when async_save returned."""
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else dict(v))
                for k, v in full_values(sd).items()}
    target = as_zeros(sd)
    fut = dcp.async_save(sd, storage_writer=b.writer(backend, case), process_group=pg, **kw)
    scribble(sd)
    fut.result()
    dcp.load(target, storage_reader=b.reader(backend, case), process_group=pg)
    return [f"{case}: {d}" for d in differences(expected, full_values(target))]


def case_async_thread(b: Backends, backend: str, meshes: dict) -> list[str]:
    sd = {"rep": full(9, 33), "cfg": {"lr": 0.5},
          "x": distribute_tensor(full(10, 6, 4), meshes["4"], [Shard(0)])}
    # the manager's writer runs on its own group (the default one is refused)
    pg = None if backend == "filesystem" else b.ckpt.process_group
    return async_round_trip(b, backend, "async_thread", sd, pg)


def case_async_process(b: Backends, backend: str, meshes: dict, rank: int) -> list[str]:
    """PROCESS mode on 2 ranks: one replicated tensor (one rank writes nothing), then only
    values (nothing staged at all)."""
    if rank not in SUB:
        return []
    kw = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}
    return (async_round_trip(b, backend, "async_process", {"rep": full(9, 33)}, meshes["sub_pg"], **kw)
            + async_round_trip(b, backend, "async_process_values", {"cfg": {"lr": 0.5}},
                               meshes["sub_pg"], **kw))


def case_no_dist(b: Backends, backend: str, rank: int) -> list[str]:
    """One rank saves and loads on its own (no_dist=True) while the job's group exists; sync
    and async (THREAD)."""
    if rank != 2:
        return []
    sd = {"own": full(11, 4, 4), "n": 3}
    dcp.save(sd, storage_writer=b.writer(backend, "no_dist"), no_dist=True)
    dcp.async_save(sd, storage_writer=b.writer(backend, "no_dist_async"), no_dist=True).result()
    out = []
    for case in ("no_dist", "no_dist_async"):
        target = {"own": torch.zeros(4, 4), "n": None}
        dcp.load(target, storage_reader=b.reader(backend, case), no_dist=True)
        out += [f"{case}: {d}" for d in differences(sd, target)]
    return out


def main() -> None:
    rank, world = init()
    assert world == 4, world
    sub_pg = dist.new_group(SUB)
    meshes = {"4": init_device_mesh("cpu", (4,)), "2x2": init_device_mesh("cpu", (2, 2)),
              "sub_pg": sub_pg, "sub": DeviceMesh.from_group(sub_pg, "cpu") if rank in SUB else None}
    ckpt = CheckpointManager(replication="none", keep=64)
    b = Backends(ckpt, os.environ["TEST_PERSISTENT_DIR"])
    cases = {
        "replicated": lambda be: case_replicated(b, be, meshes, rank),
        "dtensor": lambda be: case_dtensor_4(b, be, meshes),
        "dtensor_4_to_2": lambda be: case_dtensor_4_to_2(b, be, meshes, rank),
        "two_ranks_to_4": lambda be: case_2_to_4(b, be, meshes, rank),
        "async_thread": lambda be: case_async_thread(b, be, meshes),
        "async_process": lambda be: case_async_process(b, be, meshes, rank),
        "no_dist": lambda be: case_no_dist(b, be, rank),
    }
    results: dict[str, dict[str, list[str]]] = {}
    for name, run in cases.items():
        for backend in ("filesystem", "memory"):
            results.setdefault(name, {})[backend] = checked(functools.partial(run, backend))
            dist.barrier()
    # What each rank's shard holds in our store: ranks 1-3 have no item of "replicated".
    items = {}
    for case in ("replicated", "async_process", "async_process_values") if rank in SUB else ("replicated",):
        try:
            items[case] = len(internals(ckpt).store.shards.read_manifest(b.step(case), rank).items)
        except Exception as e:  # noqa: BLE001 - reported, the test names it
            items[case] = f"{type(e).__name__}: {e}"
    report("conformance", {"results": results, "items": items, "gc": internals(ckpt).store.gc(ranks=[rank])})
    if rank == 0:
        out = os.environ["TEST_OUT_DIR"]
        torch.save({"dtensor": {"x": full(2, 10, 6), "y": full(3, 5), "z": full(4, 4, 8),
                                "tiny": full(5, 3, 5), "b16": full(6, 8, 4, dtype=torch.bfloat16)},
                    "two_ranks": {"x": full(7, 7, 3), "rep": full(8, 9), "note": {"saved_by": 2}},
                    "replicated": {"rep": full(1, 6, 5), "yrep": full(12, 9), "step": 12}},
                   os.path.join(out, "expected.pt"))
        with open(os.path.join(out, "cases.json"), "w") as f:
            json.dump({"steps": b.STEPS, "job_id": ckpt.job_id, "local_dir": internals(ckpt).store.local_dir}, f)
    dist.barrier()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
