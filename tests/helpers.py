"""Helpers shared by the test modules (test modules never import each other).

- waiting: ``wait_for``
- damage: ``damage_shard`` (a committed shard: flipped, truncated, deleted, bad manifest),
  ``flip_byte`` (one byte of any file)
- a real, small tmpfs: ``mounted_tmpfs``
- shards written straight into a LocalStore: ``payload``, ``begin``, ``put_shard``,
  ``put_metadata``, ``put_step``, ``pool_files``; one save spread over several nodes' stores,
  with data-parallel copies and partial replicas: ``put_save``
- what a directory holds, to show a run changed nothing there: ``snapshot``
- the most memory torch's CPU allocator held for a call beyond what it held before:
  ``peak_cpu_allocation``
- state dicts are tests/workers/states.py's (``make_state``, ``zeros_like_state``,
  ``differences``, ...: one home for tests and workers, on the path through ``WORKERS``)

Simulated clusters live in mlcheckpoint/testing: cluster.py (loopback; tests/cluster.py names
the workers directory) and netcluster.py (network namespaces joined by shaped links); TCP
endpoints joined in one job in tcp_job.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.integrity.verify import digest_item
from mlcheckpoint.store import LocalStore
from mlcheckpoint.store.identity import Lineage
from mlcheckpoint.store.inventory import StepState
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.store.manifest import Manifest, ManifestItem
from mlcheckpoint.waiting import deadline_in, wait_until

# tests/workers holds what tests and workers share (states.py) beside the worker scripts, which
# run with it first on their path; test modules find it (``from states import ...``) through
# this line, which runs before any test module is imported (conftest.py -> tcp_job.py -> here).
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
if WORKERS not in sys.path:
    sys.path.insert(0, WORKERS)

# Where a replaced node's rank reads its step from: another node's whole replica of its shard
# ("peer"), or, where the job keeps data parallelism's copies, the partial replica of its
# per-rank items plus the copies other ranks' shards keep ("copies"; a node short of room keeps
# none and gets whole replicas). Either way the bytes come from another node.
FROM_ANOTHER_NODE = ("peer", "copies")


def from_another_node(sources: dict, replaced: range | list[int]) -> bool:
    """Whether every rank in ``replaced`` read from another node and every other rank from
    its own (``sources``: rank, as str or int -> source, as the resume reports them)."""
    by_rank = {int(k): v for k, v in sources.items()}
    return all((v in FROM_ANOTHER_NODE) if r in replaced else v == "local" for r, v in by_rank.items())


WAIT = 120  # generous bound on waiting for another process/thread (never asserted on)

T = TypeVar("T")


# --------------------------------------------------------------------------- torchtitan
# Where scripts/setup.sh --test puts torchtitan 0.3.0: outside the environment's site-packages
# (its trainer's dependencies are not installed), so tests put it on the path themselves.
TORCHTITAN_0_3_0 = os.environ.get(
    "MLCHECKPOINT_TORCHTITAN",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "torchtitan-0.3.0"))


def torchtitan_integration(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``mlcheckpoint.integrations.torchtitan``, importable with torchtitan 0.3.0 from where
    scripts/setup.sh --test puts it; skips the test without it."""
    monkeypatch.syspath_prepend(TORCHTITAN_0_3_0)
    return pytest.importorskip("mlcheckpoint.integrations.torchtitan")


# --------------------------------------------------------------------------- waiting
def wait_for(cond: Callable[[], T], what: str, timeout: float = WAIT, interval: float = 0.02,
             diag: Callable[[], str] = lambda: "") -> T:
    """Poll ``cond`` until truthy and return its value; fail (with ``diag()``) when it never
    becomes so within ``timeout`` seconds (a bound on a hang, not a timing assertion)."""
    v = wait_until(cond, deadline_in(timeout), interval)
    if not v:
        pytest.fail(f"gave up waiting for {what}\n{diag()}")
    return v


def end_peer(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Let a peer worker that serves until its stdin closes finish; SIGKILL its process group
    if it is not gone within ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


# --------------------------------------------------------------------------- damage
def flip_byte(path: str, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` of the file at ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


SHARD_DAMAGES = ("flipped", "truncated", "deleted", "bad_manifest")


def damage_shard(store: LocalStore, step: int, owner: int, how: str = "flipped", *,
                 item: str | int | None = None, at: int | None = None) -> ManifestItem | None:
    """Damage ``owner``'s committed shard of ``step`` in ``store`` after its checksums were
    recorded, as a fault in memory would (one of ``SHARD_DAMAGES``):

    - "flipped": one byte of an item inverted, ``at`` bytes into it (default: its middle); the
      item is ``item``: its key as DCP names it (``"model.w"``; a ``@...`` suffix the store
      adds need not be given), its index in the manifest, or (None) the largest. Returns that item.
    - "truncated": the data file cut to half the shard's data bytes;
    - "deleted": the data file removed;
    - "bad_manifest": the manifest overwritten with bytes that are not JSON;
    - "rewritten" (not in ``SHARD_DAMAGES``): "flipped", and the shard's manifest rewritten to
      record the damaged bytes' checksum (the shard agrees with itself, not with the step's
      metadata).

    A byte at a position of the file rather than of an item: ``flip_byte(store.paths.data(...))``.
    """
    data = store.paths.data(step, owner)
    if how == "bad_manifest":
        with open(store.paths.manifest(step, owner), "wb") as f:
            f.write(b"{not json")
        return None
    if how == "deleted":
        os.unlink(data)
        return None
    m = store.shards.read_manifest(step, owner)
    if how == "truncated":
        os.truncate(data, m.data_bytes // 2)
        return None
    assert how in ("flipped", "rewritten"), how
    if item is None:
        chosen = max(m.items, key=lambda it: it.nbytes)
    elif isinstance(item, int):
        chosen = m.items[item]
    else:
        chosen = next(it for it in m.items if item in (it.key, it.key.split("@")[0]))
    offset = chosen.nbytes // 2 if at is None else at
    assert 0 <= offset < chosen.nbytes, (chosen, offset)
    flip_byte(data, chosen.offset + offset)
    if how == "rewritten":
        with open(data, "rb") as f:
            f.seek(chosen.offset)
            damaged = f.read(chosen.nbytes)
        path = store.paths.manifest(step, owner)
        with open(path) as f:
            record = json.load(f)
        for it in record["items"]:
            if it["key"] == chosen.key:
                it["checksum"] = digest_item(damaged, it.get("algorithm") or record["algorithm"])
        with open(path, "w") as f:
            json.dump(record, f)
    return chosen


# --------------------------------------------------------------------------- a real, small tmpfs
@contextlib.contextmanager
def mounted_tmpfs(path: str, options: str) -> Iterator[str]:
    """A tmpfs of its own mounted at ``path`` (made if missing) with mount ``options`` (e.g.
    "size=8m"), unmounted afterwards, pass or fail; skips the test where mounting is refused."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root/CAP_SYS_ADMIN): "
                    f"{res.stderr.strip() or res.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


# --------------------------------------------------------------------------- shards in a store
def payload(step: int, rank: int, nbytes: int = 4096) -> bytes:
    """Deterministic bytes that differ per (step, rank)."""
    return np.random.default_rng(step * 1000 + rank).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def begin(store: LocalStore, step: int, rank: int, data: bytes):
    """Fill an uncommitted shard with two items (halves of ``data``); return the writer."""
    sw = store.begin_shard(step, rank, len(data))
    sw.buffer.array[:] = np.frombuffer(data, dtype=np.uint8)
    half = len(data) // 2
    sw.add_item(ManifestItem("first", 0, half, checksum(data[:half]), dtype="uint8", shape=[half]))
    sw.add_item(ManifestItem("second", half, len(data) - half, checksum(data[half:])))
    return sw


def put_shard(store: LocalStore, step: int, rank: int, data: bytes | None = None) -> Manifest:
    return begin(store, step, rank, payload(step, rank) if data is None else data).commit()


def put_metadata(store: LocalStore, step: int, ranks=(0,)) -> None:
    store.metadata.write(step, f"meta-of-{step}".encode(), world_size=max(ranks) + 1,
                         ranks=ranks, total_bytes=4096 * len(ranks))


def put_step(store: LocalStore, step: int, ranks=(0,)) -> None:
    for r in ranks:
        put_shard(store, step, r)
    put_metadata(store, step, ranks)


def put_save(stores: list[LocalStore], step: int, shards: dict[int, list[str]],
             held: list[dict[int, list[str] | None]], *, metadata_on: list[int] | None = None,
             primary: dict[str, int] | None = None, save_id: str = "save-1", run_id: str = "run-1",
             item_bytes: int = 256) -> None:
    """One save of ``step`` written straight into the stores of several nodes, as a data-parallel
    job and its replication leave it, without running either.

    ``shards[rank]`` names the items of rank's shard; an item named in several shards is one
    item of the step, its primary in the shard of ``primary[name]`` (default: the lowest rank
    naming it) and agreeing copies in the others' (the metadata records them:
    ``ItemLocation.copies``, the header's copy groups).
    ``held[n][rank]`` is what node ``n`` (``stores[n]``) holds of rank's shard: None, the shard
    whole; a list, a partial replica listing those items. The metadata goes on the nodes
    ``metadata_on`` (default: every node)."""
    offsets = {r: {name: i * item_bytes for i, name in enumerate(names)} for r, names in shards.items()}

    def data(name: str) -> bytes:  # the same bytes in every shard that keeps the item
        return hashlib.sha256(f"{step}/{name}".encode()).digest() * (item_bytes // 32)

    def manifest(store: LocalStore, rank: int) -> Manifest:
        items = [ManifestItem(n, o, item_bytes, checksum(data(n))) for n, o in offsets[rank].items()]
        return Manifest(store.job_id, step, rank, len(items) * item_bytes, items,
                        world_size=max(shards) + 1, save_id=save_id, run_id=run_id)

    locations = {}
    for name in sorted({n for names in shards.values() for n in names}):
        keepers = sorted(r for r, names in shards.items() if name in names)
        if primary is not None and name in primary:
            keepers.remove(primary[name])
            keepers.insert(0, primary[name])
        locations[name] = ItemLocation(keepers[0], offsets[keepers[0]][name], item_bytes,
                                       checksum(data(name)),
                                       copies=tuple((r, offsets[r][name]) for r in keepers[1:]))
    md = Metadata(state_dict_metadata={},
                  storage_data={MetadataIndex(n): loc for n, loc in locations.items()})
    for n, store in enumerate(stores):
        for rank, names in held[n].items():
            m = manifest(store, rank)
            if names is not None:
                m = m.only([it for it in m.items if it.key in names])
            shard = store.begin_shard(step, rank, m.data_bytes, m.held_ranges() if m.partial else None)
            for it in m.items:
                shard.buffer.array[it.offset:it.offset + it.nbytes] = np.frombuffer(data(it.key), np.uint8)
            shard.commit_manifest(m)
        if metadata_on is None or n in metadata_on:
            store.metadata.write(step, pickle.dumps(md), world_size=max(shards) + 1, ranks=sorted(shards),
                                 total_bytes=item_bytes * len(locations), save_id=save_id,
                                 lineage=Lineage(run_id))


def pool_files(store: LocalStore) -> list[str]:
    return sorted(os.path.join(store.pool_dir, n) for n in os.listdir(store.pool_dir))


def snapshot(root: str) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: its size, modification time and a digest of its bytes."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            st = os.stat(p)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns,
                                                  hashlib.sha256(f.read()).hexdigest())
    return out


def peak_cpu_allocation(fn: Callable[[], Any]) -> int:
    """The most bytes torch's CPU allocator held at once while ``fn`` ran, beyond what it held
    before: every allocation and free torch's profiler records (``profile_memory``), with its
    running total; tensors made before the call count as 0."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    totals: list[tuple[int, int]] = []

    def walk(node: Any) -> None:
        if node.tag == _EventType.Allocation:
            totals.append((node.start_time_ns, node.extra_fields.total_allocated))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    assert totals, "the profiler recorded no allocation: its memory events changed shape"
    return max(total for _, total in sorted(totals))


# ---------------------------------------------------------------------------- planner inputs
def held_step(owners: Iterable[int] = (), *, has_metadata: bool = True,
              required: Iterable[int] | None = None, world_size: int | None = None,
              shard_bytes: Any = (), save_id: str = "", run_id: str = "",
              ancestors: Iterable[tuple[str, int]] = (), created: float = 0.0,
              shard_saves: Any = None, damaged: Any = (), copy_groups: Any = (),
              partial: Any = (), step: int = 0) -> StepState:
    """What one node holds of one step (``StepState``, as ``Inventory.step_state`` lists it),
    for the planner's tests: the committed ``owners`` with their shards' ``shard_bytes`` and
    save ids (``shard_saves``, default ""), and with ``has_metadata`` a metadata header naming
    ``save_id``, ``run_id``, ``ancestors`` and ``created``. Mappings may come as pairs."""
    owners = set(owners)
    meta = {"save_id": save_id, "run_id": run_id, "created": created,
            "ancestors": tuple(tuple(a) for a in ancestors)} if has_metadata else {}
    return StepState(step, has_metadata=has_metadata, committed_ranks=owners,
                     required_ranks=None if required is None or not has_metadata else tuple(required),
                     world_size=world_size if has_metadata else None, **meta,
                     shard_saves=dict(shard_saves) if shard_saves is not None else dict.fromkeys(owners, ""),
                     damaged=dict(damaged), copy_groups={o: [tuple(g) for g in gs] for o, gs in dict(copy_groups).items()},
                     partial=dict(partial), shard_bytes=dict(shard_bytes))


def restate(st: StepState, **changes: Any) -> StepState:
    """``st`` with ``changes`` (``held_step``'s arguments)."""
    fields: dict[str, Any] = {
        "owners": st.committed_ranks, "has_metadata": st.has_metadata,
        "required": st.required_ranks, "world_size": st.world_size,
        "shard_bytes": st.shard_bytes, "save_id": st.save_id or "", "run_id": st.run_id,
        "ancestors": st.ancestors, "created": st.created, "shard_saves": st.shard_saves,
        "damaged": st.damaged, "copy_groups": st.copy_groups, "partial": st.partial,
        "step": st.step}
    fields.update(changes)
    return held_step(**fields)
