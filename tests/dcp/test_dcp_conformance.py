"""The DCP contract: whatever FileSystemWriter/FileSystemReader save and load, ours must too.

Every case runs on both backends, "filesystem" (DCP's own, on a tmpfs directory) and "memory"
(MemoryStorageWriter/Reader through CheckpointManager or a LocalStore), and both must load
exactly what the case expects. Single-process cases run here; multi-rank cases run in one
4-rank torchrun job (tests/workers/conformance_dcp.py) whose checkpoints are then loaded
again here, on one rank. Shards without tensor bytes are also replicated over TCP and
recovered after a node loss (tests/workers/conformance_repl.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cluster import Cluster
from states import assert_same, clone_state, make_state, zeros_like_state
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.stateful import Stateful

from mlcheckpoint import (
    CheckpointManager,
    MemoryStorageReader,
    MemoryStorageWriter,
)
from mlcheckpoint.store import LocalStore

JOB = "job-conformance"
BACKENDS = ["filesystem", "memory"]
LAUNCH_TIMEOUT = 180

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.timeout(600)]


class Backend:
    """One backend's writer and reader per named checkpoint."""

    def __init__(self, kind: str, root: str, ckpt: CheckpointManager):
        self.kind, self.root, self.ckpt = kind, root, ckpt
        self._steps: dict[str, int] = {}

    def writer(self, name: str):
        if self.kind == "filesystem":
            return FileSystemWriter(os.path.join(self.root, name))
        return self.ckpt.storage_writer(self._step(name))

    def reader(self, name: str):
        if self.kind == "filesystem":
            return FileSystemReader(os.path.join(self.root, name))
        return self.ckpt.storage_reader(self._step(name))

    def _step(self, name: str) -> int:
        return self._steps.setdefault(name, len(self._steps) + 1)

    def save(self, sd, name: str = "ckpt", **kw) -> None:
        dcp.save(sd, storage_writer=self.writer(name), no_dist=True, **kw)

    def load(self, sd, name: str = "ckpt", **kw) -> None:
        dcp.load(sd, storage_reader=self.reader(name), no_dist=True, **kw)


@pytest.fixture(params=BACKENDS)
def backend(request, store_dir):
    ckpt = CheckpointManager(job_id=JOB, local_dir=os.path.join(store_dir, "local"),
                             replication="none", keep=8)
    try:
        yield Backend(request.param, os.path.join(store_dir, "fs"), ckpt)
    finally:
        ckpt.close()


# ---------------------------------------------------------------- one process

def test_empty_state_dict(backend):
    backend.save({})
    out: dict = {}
    backend.load(out)
    assert out == {}


def test_non_tensor_only_state_dict(backend):
    sd = {"step": 41, "name": "run-7", "none": None, "cfg": {"lr": 0.5, "betas": [0.9, 0.99]}}
    backend.save(sd)
    out = {"step": 0, "name": "", "none": 1, "cfg": {"lr": None, "betas": None}}
    backend.load(out)
    assert out == sd


def test_round_trip_of_every_kind_of_value(backend):
    """Dtypes, NaN/-0.0, scalars, empty and non-contiguous tensors, nested non-tensor values."""
    sd = make_state(3)
    expected = clone_state(sd)
    backend.save(sd)
    out = zeros_like_state(sd)
    backend.load(out)
    assert_same(expected, out)


@pytest.mark.parametrize("saved,loaded", [(torch.float32, torch.bfloat16),
                                          (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float64)])
def test_dtype_cast_on_load(backend, saved, loaded):
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(16, 8, generator=g).to(saved), "v": torch.randn(5, generator=g).to(saved)}
    backend.save(sd)
    out = {"w": torch.zeros(16, 8, dtype=loaded), "v": torch.zeros(10, dtype=loaded)[::2]}
    backend.load(out)
    for k, v in sd.items():  # DCP copies into the target, casting as Tensor.copy_ does
        assert out[k].dtype == loaded and torch.equal(out[k], v.to(loaded)), k


class Counter(Stateful):
    """An application object DCP saves through state_dict() and restores with load_state_dict()."""

    def __init__(self, n: int = 0, weights: torch.Tensor | None = None):
        self.n = n
        self.weights = weights if weights is not None else torch.zeros(6)
        self.loaded = 0

    def state_dict(self):
        return {"n": self.n, "weights": self.weights}

    def load_state_dict(self, state_dict) -> None:
        self.n, self.weights = state_dict["n"], state_dict["weights"]
        self.loaded += 1


def test_stateful_objects(backend):
    backend.save({"app": Counter(7, torch.arange(6.0)), "plain": torch.ones(3)})
    app, plain = Counter(), torch.zeros(3)
    backend.load({"app": app, "plain": plain})
    assert app.loaded == 1 and app.n == 7 and torch.equal(app.weights, torch.arange(6.0))
    assert torch.equal(plain, torch.ones(3))


def test_partial_load_and_key_order(backend):
    """A target with a subset of the keys, in another order, gets exactly those keys."""
    g = torch.Generator().manual_seed(1)
    sd = {"a": torch.randn(4, generator=g), "b": torch.randn(3, generator=g), "c": 3,
          "nested": {"x": torch.randn(2, 2, generator=g), "y": "why"}}
    backend.save(sd)
    out = {"nested": {"y": None}, "c": None, "a": torch.zeros(4)}
    backend.load(out)
    assert list(out) == ["nested", "c", "a"] and list(out["nested"]) == ["y"]
    assert torch.equal(out["a"], sd["a"]) and out["c"] == 3 and out["nested"]["y"] == "why"


def test_missing_key_fails_unless_partial_load_allowed(backend):
    backend.save({"a": torch.arange(4.0)})
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: extra"):
        backend.load({"a": torch.zeros(4), "extra": torch.zeros(2)})
    out = {"a": torch.zeros(4), "extra": torch.full((2,), 5.0)}
    backend.load(out, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["a"], torch.arange(4.0)) and torch.equal(out["extra"], torch.full((2,), 5.0))


def test_async_save_thread_mode_snapshots_at_return(backend):
    """async_save (THREAD mode, no process group): what is saved is the state when it returned."""
    sd = {"w": torch.arange(12.0).reshape(3, 4), "cfg": {"lr": 0.25}, "note": "before"}
    expected = clone_state(sd)
    expected["cfg"] = dict(sd["cfg"])
    fut = dcp.async_save(sd, storage_writer=backend.writer("async"), no_dist=True)
    sd["w"].add_(100)
    sd["cfg"]["lr"] = -1.0
    fut.result()
    out = {"w": torch.zeros(3, 4), "cfg": {"lr": None}, "note": None}
    backend.load(out, "async")
    assert_same(expected, out)


@pytest.mark.parametrize("sd", [{}, {"epoch": 3, "cfg": {"lr": 0.5}}], ids=["empty", "values"])
def test_async_save_without_tensors(backend, sd):
    """Nothing to stage: async_save still saves."""
    dcp.async_save(sd, storage_writer=backend.writer("async"), no_dist=True).result()
    out = zeros_like_state(sd)
    backend.load(out, "async")
    assert out == sd


# ---------------------------------------------------------------- ours: what an empty shard is

def test_rank_without_tensor_bytes_commits_a_shard(store):
    """An empty or non-tensor state dict commits a shard (no tensor region), the step is complete,
    and nothing half-written is left."""
    dcp.save({}, storage_writer=MemoryStorageWriter(1, store))
    dcp.save({"n": 5}, storage_writer=MemoryStorageWriter(2, store))
    empty, only_bytes = store.shards.read_manifest(1, 0), store.shards.read_manifest(2, 0)
    assert (empty.items, empty.data_bytes) == ([], 0)
    assert [it.kind for it in only_bytes.items] == ["bytes"] and only_bytes.data_bytes > 0
    assert store.metadata.read(1)[0].ranks == [] and store.metadata.read(2)[0].ranks == [0]
    assert store.inventory.complete_steps() == [1, 2]
    for step in (1, 2):
        store.verify_shard(step, 0)
    out = {"n": None}
    dcp.load(out, storage_reader=MemoryStorageReader(2, store))
    assert out == {"n": 5}
    assert store.gc() == []


def test_retired_empty_shard_does_not_displace_pooled_buffers(store):
    """An empty shard has no buffer worth recycling: retiring it keeps the pool as it was."""
    full = store.begin_shard(1, 0, 4096)
    full.commit()
    store.shards.retire(1, 0)
    pooled = sorted(os.listdir(store.pool_dir))
    assert len(pooled) == 1
    empty = store.begin_shard(2, 0, 0)
    assert empty.buffer.size == 0 and sorted(os.listdir(store.pool_dir)) == pooled  # not taken
    empty.commit()
    store.shards.retire(2, 0)
    assert sorted(os.listdir(store.pool_dir)) == pooled
    assert store.inventory.steps() == [] and store.gc() == []


# ---------------------------------------------------------------- 4 ranks, one node

MULTI_RANK_CASES = ["replicated", "dtensor", "dtensor_4_to_2", "two_ranks_to_4", "async_thread",
                    "async_process", "no_dist"]


@pytest.fixture(scope="module")
def four_ranks():
    """One 4-rank job that runs every multi-rank case on both backends (see the worker), and
    the checkpoints it left, to be loaded again here."""
    with Cluster(1, 4) as c:
        c.run("conformance_dcp.py", timeout=LAUNCH_TIMEOUT)
        with open(os.path.join(c.out_dir, "cases.json")) as f:
            cases = json.load(f)
        yield {"cluster": c, "results": c.results("conformance"), "cases": cases,
               "expected": torch.load(os.path.join(c.out_dir, "expected.pt"))}


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", MULTI_RANK_CASES)
def test_multi_rank(four_ranks, case, backend_name):
    """Each multi-rank case saved and loaded by 4 ranks (one torchrun job) ends as
    DCP's own FileSystemWriter/Reader end: a rank that loads otherwise fails."""
    results = four_ranks["results"]
    assert sorted(results) == [0, 1, 2, 3], four_ranks["cluster"].logs()
    bad = {rank: r["results"][case][backend_name] for rank, r in results.items()
           if r["results"][case][backend_name]}
    assert not bad, bad


@pytest.mark.slow
def test_multi_rank_dedup_left_ranks_with_nothing_to_write(four_ranks):
    """The cases above did exercise empty shards: DCP gave some rank no item at all."""
    items = {rank: r["items"] for rank, r in four_ranks["results"].items()}
    assert 0 in [i["replicated"] for i in items.values()], items
    for case in ("async_process", "async_process_values"):
        assert 0 in [items[0][case], items[1][case]], items


@pytest.mark.slow
def test_multi_rank_saves_leave_no_uncommitted_buffer(four_ranks):
    """async_save stages under the process's own rank before DCP names the rank it saves as
    (0 with no_dist): the staged buffer becomes that rank's shard, nothing is left behind."""
    assert {rank: r["gc"] for rank, r in four_ranks["results"].items()} == {r: [] for r in range(4)}


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", ["replicated", "dtensor", "two_ranks"])
def test_load_multi_rank_checkpoint_on_one_rank(four_ranks, case, backend_name):
    """4 (or 2) ranks -> 1: DTensor shards and de-duplicated items load into plain tensors."""
    c, expected = four_ranks["cluster"], four_ranks["expected"][case]
    out = zeros_like_state(expected)
    if backend_name == "filesystem":
        dcp.load(out, storage_reader=FileSystemReader(os.path.join(c.persistent_dir, case)), no_dist=True)
    else:
        info = four_ranks["cases"]
        store = LocalStore(info["local_dir"], info["job_id"], create=False)
        try:
            dcp.load(out, storage_reader=MemoryStorageReader(info["steps"][case], store), no_dist=True)
        finally:
            store.close()
    assert_same(expected, out)


# ---------------------------------------------------------------- 2 nodes: replication, recovery

@pytest.fixture(scope="module")
def replicated_empty_shards():
    with Cluster(2, 1) as c:
        c.run("conformance_repl.py", "save", timeout=LAUNCH_TIMEOUT)
        saved = c.results("repl_save")
        c.nodes[1].wipe()  # a replacement machine: rank 1's shards survive only on node 0
        c.run("conformance_repl.py", "resume", timeout=LAUNCH_TIMEOUT)
        yield saved, c.results("repl_resume"), c.logs()


@pytest.mark.slow
def test_shards_without_tensor_bytes_replicate(replicated_empty_shards):
    """A rank with no tensor bytes (no item, or one 1-byte item) still commits a shard that
    replicates to the partner, so the step is protected; a skipped empty shard fails."""
    saved, _, logs = replicated_empty_shards
    assert sorted(saved) == [0, 1], logs
    for rank, r in saved.items():
        assert r["protected"], (rank, r)
        held = {int(s): {int(o): v for o, v in owners.items()} for s, owners in r["held"].items()}
        # Both nodes hold both owners' shards of both steps, verified: step 1 has an owner with
        # no item and no byte, step 2 one with a single byte item.
        assert sorted(held) == [1, 2] and all(sorted(h) == [0, 1] for h in held.values()), held
        assert [0, 0] in held[1].values(), held
        assert any(n == 1 and nbytes > 0 for n, nbytes in held[2].values()), held


@pytest.mark.slow
def test_shard_without_tensor_bytes_recovers_from_peer(replicated_empty_shards):
    """With node 1 wiped, step 2 resumes exactly, node 1's empty shard read from node 0, and
    the step heals; a resume that chokes on an empty shard fails."""
    _, resumed, logs = replicated_empty_shards
    assert sorted(resumed) == [0, 1], logs
    for rank, r in resumed.items():
        assert r["step"] == 2 and r["mismatch"] == [], (rank, r, logs)
        assert r["sources"] == {"0": "local", "1": "peer"}, r
        assert r["healed"], r
