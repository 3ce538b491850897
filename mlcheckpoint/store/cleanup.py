"""Clearing up a job directory: what crashes left behind (gc), after a resume what does not
belong to the job's history any more (settle, set-aside steps), and before the first save of
a run that did not resume, an earlier run's steps (set_aside_runs).

Each function acts on the store's parts (the inventory, the shard files and the paths they
share), never on the ``LocalStore`` facade, which calls them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable

from .._messages import plural
from ..errors import CorruptShardError, ShardNotFoundError
from .identity import Lineage
from .inventory import Inventory
from .layout import JobPaths, Kind, classify
from .shards import ShardFiles

log = logging.getLogger(__name__)


def gc(listing: Inventory, shards: ShardFiles, ranks: Iterable[int] | None = None,
       min_age_s: float = 0.0) -> list[str]:
    """Remove what crashes left behind: uncommitted buffers, temp files, orphan metadata.

    ``ranks`` limits the sweep of in-flight files to those owners (a rank cleaning up after
    itself while other ranks of the node may be saving); ``min_age_s`` spares files younger
    than that. Returns the removed paths.
    """
    owners = None if ranks is None else set(ranks)
    now = time.time()
    removed = []
    pool = shards.pool
    inventory = listing.all()
    complete = {s for s, st in inventory.items() if st.complete}
    newest_complete = max(complete, default=-1)
    for step in inventory:
        d = shards.paths.step_dir(step)
        with contextlib.suppress(FileNotFoundError):
            entries = {name: classify(name) for name in os.listdir(d)}
            committed = {e.rank for e in entries.values() if e.kind is Kind.MANIFEST}
            for name, entry in entries.items():
                path = os.path.join(d, name)
                owner = entry.rank
                if owners is not None and owner is not None and owner not in owners:
                    continue
                if not (entry.in_flight or (entry.kind is Kind.DATA and owner not in committed)):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if now - os.stat(path).st_mtime < min_age_s:
                        continue
                if entry.is_buffer and owner is not None:
                    pool.recycle(path, owner)
                else:
                    pool.unlink(path)
                removed.append(path)
            if owners is None and step < newest_complete and step not in complete and not committed:
                shards.remove_step_if_empty(step)
            elif not committed:
                shards.remove_step_if_empty(step, keep_metadata=True)  # nothing left in it
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(shards.paths.pool_dir):  # buffers whose preparation was cut short
            entry = classify(e.name)
            if entry.kind is not Kind.POOL_INFLIGHT:
                continue
            if owners is not None and entry.rank not in owners:
                continue
            with contextlib.suppress(FileNotFoundError):
                if now - e.stat().st_mtime < min_age_s:
                    continue
            pool.unlink(e.path)
            removed.append(e.path)
    if removed:
        log.info("gc removed %s of job %s", plural(len(removed), "uncommitted file"), shards.job_id)
    return removed


def settle(listing: Inventory, shards: ShardFiles, lineage: Lineage, loaded: int | None,
           set_aside: Iterable[int] = ()) -> list[int]:
    """After a resume: keep only what belongs to the job's history up to the loaded step.

    - Steps newer than ``loaded`` (all steps if None) are orphans of the failed run: the
      job continues from ``loaded`` and saves new checkpoints under the same numbers.
      They are dropped, except those in ``set_aside`` (complete steps that recovery did
      not load, e.g. because loading them failed): those move out of sight into
      ``orphans/`` (an operator may still want them; gc removes them once the job has a
      complete step past them), never deleted.
    - In older steps, every file of a save outside ``lineage`` (another run of this job)
      and every unreadable shard is removed.
    Returns the steps dropped or set aside.
    """
    aside = set(set_aside)
    gone = []
    for step in listing.steps():
        if loaded is not None and step <= loaded:
            _drop_foreign(listing, shards, step, lineage)
            continue
        gone.append(step)
        if step in aside:
            dest = _set_aside(shards, step)
            log.warning("step %d is complete but was not resumed; kept out of the way in %s "
                        "until the job has a newer complete step", step, dest)
        else:
            _drop_step(shards, step)
    return gone


def _drop_foreign(listing: Inventory, shards: ShardFiles, step: int, lineage: Lineage) -> None:
    st = listing.step_state(step)
    for rank in sorted(st.committed_ranks | st.damaged.keys()):
        try:
            keep = (rank not in st.damaged
                    and lineage.admits(shards.read_manifest(step, rank).run_id, step))
        except ShardNotFoundError:
            continue
        except CorruptShardError:
            keep = False
        if not keep:
            log.info("dropping step %d rank %d here: not part of this job's history or damaged",
                     step, rank)
            shards.retire(step, rank)
    if st.has_metadata and not lineage.admits(st.run_id, step):
        shards.pool.unlink(shards.paths.metadata(step))
    shards.remove_step_if_empty(step, keep_metadata=True)  # a replaced node's shards come later


def _drop_step(shards: ShardFiles, step: int) -> None:
    d, pool = shards.paths.step_dir(step), shards.pool
    with shards.lock.held(), contextlib.suppress(FileNotFoundError):
        for name in os.listdir(d):  # uncommit everything first
            if classify(name).kind is Kind.MANIFEST:
                pool.unlink(os.path.join(d, name))
        for name in os.listdir(d):
            entry = classify(name)
            if entry.kind is Kind.DATA and entry.rank is not None:
                pool.recycle(os.path.join(d, name), entry.rank)
            else:
                pool.unlink(os.path.join(d, name))
        os.rmdir(d)


def set_aside_runs(listing: Inventory, shards: ShardFiles, lineage: Lineage) -> list[int]:
    """Before the first save of a run that did not resume: move every step holding anything
    committed by a run outside ``lineage`` (an earlier run's saves: own shards, replicas,
    metadata) into ``orphans/``. Otherwise retention keeps the earlier run's numerically newer
    steps and retires the new run's saves, and a later resume loads the earlier run's step.
    Nothing is deleted here; retention removes a set-aside step once the job has a newer
    complete one (``plan_retention``). Returns the steps moved."""
    moved = []
    for step in listing.steps():
        st = listing.step_state(step)
        runs = {st.run_id} if st.has_metadata else set()
        for rank in sorted(st.committed_ranks):
            with contextlib.suppress(ShardNotFoundError, CorruptShardError):
                runs.add(shards.read_manifest(step, rank).run_id)
        if st.damaged or any(not lineage.admits(run, step) for run in runs):
            _set_aside(shards, step)
            moved.append(step)
    return moved


def _set_aside(shards: ShardFiles, step: int) -> str:
    """Move a step's folder into ``orphans/``; returns where it went."""
    dest = shards.paths.orphan(step, secrets.token_hex(4))
    os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
    with shards.lock.held(), contextlib.suppress(FileNotFoundError):
        os.rename(shards.paths.step_dir(step), dest)
    return dest


def orphans(paths: JobPaths) -> list[tuple[int, str]]:
    """(step, path) of steps set aside by ``settle``."""
    root = paths.orphans_dir
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = ((classify(n), os.path.join(root, n)) for n in names)
    return sorted((e.step, path) for e, path in found if e.kind is Kind.ORPHAN and e.step is not None)


def remove_orphan(paths: JobPaths, path: str) -> None:
    """Delete a step set aside by ``settle`` (a path ``orphans`` returned)."""
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(paths.orphans_dir):
        raise ValueError(f"{path} is not a step set aside in {paths.orphans_dir}")
    shutil.rmtree(path, ignore_errors=True)
