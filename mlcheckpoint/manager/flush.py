"""The preemption flush: this rank's part of the newest step memory holds, from tmpfs to the
persistent folder, in DCP's FileSystemWriter format, with no GPU and no collective.

A whole-job preemption (spot reclaim, maintenance, rack power) takes every node at once, so
memory cannot serve the restart; what it held since the last persistent step is lost unless
it reaches the persistent tier in the notice's grace period (``preemption.py`` turns the
notice into a call of ``Flusher.flush``). Each rank writes only what it owns and reads only
its own node's tmpfs, so a dead or hung peer cannot hold it; the ranks meet in the step's
folder instead of in a collective:

    step-<S>/__<rank>_flush-<save>.distcp           the rank's items, as FileSystemWriter
                                                      writes them (torch.save per tensor,
                                                      byte items as they are)
    step-<S>/.mlcheckpoint-flush/<save>/part-<r>.json  the rank's part is whole: where each of
                                                      its items lies in its file
    step-<S>/.mlcheckpoint-flush/<save>/metadata     the step's metadata as memory holds it
                                                      (header and checksum included), from
                                                      every rank whose node holds it
    step-<S>/.metadata                               DCP's metadata, written last

Whichever rank finds the staged metadata and every part's marker there (the last to finish,
or any after it) writes DCP's ``.metadata``, with ``storage_data`` pointing into the ranks'
files: only then is the step complete (``PersistentStorage.complete_steps``), so an
unfinished flush leaves the older persistent step the newest, and plain ``dcp.load`` with
``FileSystemReader`` loads a finished one. Markers and files are named by the save, so two
incarnations of a step number never combine. The data files' names differ from DCP's own
(``__<rank>_0.distcp``), so a persistent write of the same step still in flight on another
thread never shares a file with the flush.

Ranks need not agree on the step: one whose node lacks the newest step's metadata (it was on
its way from the coordinator's node) also writes its part of each newer step whose own shard
it committed, newest first, so whichever step some node holds whole gets every part; and a
rank that stays for the other parts (``flush_and_stay``) writes its part of any step the
others wrote parts of, where it holds its shard of that save (``joinable``). Once a step it
wrote is complete, a rank removes its parts of the older steps that are not (a rank's whole
shard each, on what is often shared storage, that nothing would ever read). A folder no flush
ever completed (a rank failed, a notice never came, the deadline passed) is removed at the
job's next start (``remove_abandoned``), once it is old enough that no flush still writes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta

from .. import history
from .._faults import pause_point
from ..dcp.placement import item_key
from ..errors import CorruptShardError, ShardNotFoundError
from ..integrity.verify import same_layout, verify_region
from ..persistent import ORIGIN_FILE, PersistentOrigin, PersistentStorage
from ..replication.core.budget import Budget
from ..replication.core.transport import Transport
from ..store import LocalStore, StepState
from ..store.layout import ItemLocation
from ..store.local_store import ShardSource
from ..store.manifest import ManifestItem, dcp_metadata, decode_metadata
from ..store.pins import Pins
from ..waiting import wait_until

log = logging.getLogger(__name__)

FLUSH_DIR = ".mlcheckpoint-flush"
# A rank's file of a flushed step (``__<rank>_flush-<save>.distcp``), and what an atomic write
# that died leaves (``<name>.tmp<rank>``): with FLUSH_DIR, all a folder that only a flush wrote
# holds until its finisher writes the layout's files and DCP's .metadata.
_PART_FILE = re.compile(r"__\d+_flush-[^/]+\.distcp")
_UNFINISHED_WRITE = re.compile(r".+\.tmp\d+")


def _part_file(rank: int, save_id: str) -> str:
    return f"__{rank}_flush-{save_id}.distcp"


def _marker(rank: int) -> str:
    """The name of a rank's marker in a save's staging folder: its part is whole."""
    return f"part-{rank:05d}.json"


def _has_markers(names: list[str]) -> bool:
    return any(n.startswith("part-") for n in names)


# A folder counts as abandoned once nothing in it changed for this many flush deadlines (a
# flush in flight stops at its deadline), and never sooner than ABANDONED_AFTER_S: a file
# server's clock may be off from ours.
ABANDONED_AFTER_DEADLINES = 2
ABANDONED_AFTER_S = 300.0
# How often a rank staying for the other parts looks for DCP's .metadata: every rank of the job
# looks, on what is often a shared file system's metadata server.
STAY_POLL_S = 0.2
# A rank whose part is missing is asked whether it still serves (``Transport.reachable``)
# within PROBE_TIMEOUT_S, again every PROBE_EVERY_S while it does: a live peer's kernel
# accepts a connection in milliseconds, even with the peer busy writing its part.
PROBE_TIMEOUT_S = 1.0
PROBE_EVERY_S = 1.0
# The version FileSystemWriter stamps on what it writes (None in a torch without it: the
# field is left as the save set it).
_DCP_VERSION: str | None = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", None)


class FlushCutShort(Exception):
    """The flush's deadline passed before this rank's part was whole."""


@dataclass
class FlushResult:
    """What one rank's flush did.

    ``step``: the newest step whose part this rank wrote (None: nothing to write, ``reason``
    says why); ``complete``: that step is complete in the persistent folder (every rank's part
    there and DCP's ``.metadata`` written), as far as this rank has seen; ``parts``: the steps
    whose part it wrote, newest first; ``removed``: those of them older than a complete
    ``step`` whose part it removed again, as they were incomplete; ``bytes``: the bytes it
    wrote; ``seconds``: how long it took; ``reason``: why nothing was written or the flush
    stopped short ("" otherwise).
    """

    step: int | None = None
    complete: bool = False
    parts: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    reason: str = ""
    saves: dict[int, str] = field(default_factory=dict, repr=False)  # each part's save


@dataclass(frozen=True)
class _Written:
    """An item as a rank's marker records it (a ``Recorded``)."""

    offset: int
    nbytes: int
    checksum: int
    algorithm: str | None


@dataclass(frozen=True)
class _Candidate:
    step: int
    save_id: str
    metadata: bytes | None  # the encoded metadata file, where this node holds this save's


class Flusher:
    """Writes this rank's parts of in-memory steps into a persistent folder.

    Args:
        store: this node's store.
        storage: the persistent folder; a plain DCP one on a file system
            (``PersistentStorage.flush_refused`` says why another is refused).
        rank: this rank (the owner of the shards it writes).
        pins: this rank's pins: a step being flushed is never retired under it.
        budget: this process's replication budget (None: no replication), unpaced while a
            preemption's flush runs (``flush_and_stay``).
        wait_for_parts: how long after the notice a preemption's flush stays for the other
            ranks' parts (``flush_and_stay``).
        peers: the replication transport (None: none), asked whether a rank whose part is
            missing is gone: a preemption's flush then stays no longer for a part that can
            never come.

    A flush during a resume (``resuming``) waits for the resume to end: the step it loads is
    the one to write. After a resume on a replaced node (``after_resume``), a flush waits for
    this rank's own shard of the loaded step to come back (``healing``) before it looks for
    its part, and a preemption's flush of that step stays until the step is complete
    (``flush_and_stay``): a rank still bringing its shard back may be reading it from this
    node. A preemption's flush of any other step stays for the other parts ``wait_for_parts``
    seconds at most: a notice may reach their nodes later; and no longer than until a rank
    whose part is missing is found gone (``peers``).
    """

    def __init__(self, store: LocalStore, storage: PersistentStorage, rank: int, pins: Pins,
                 budget: Budget | None = None, wait_for_parts: float = 0.0,
                 peers: Transport | None = None):
        self.store, self.storage, self.rank, self.pins = store, storage, rank, pins
        self.budget, self.wait_for_parts, self.peers = budget, wait_for_parts, peers
        self._ranks: dict[tuple[int, str], tuple[int, ...]] = {}  # (step, save) -> its ranks
        self.resumed = threading.Event()  # no resume in flight (cleared while one runs)
        self.resumed.set()
        self.healing: threading.Thread | None = None  # bringing this rank's own shard back
        self.rebuilt_step: int | None = None  # the loaded step some rank's shard comes back to

    @contextlib.contextmanager
    def resuming(self) -> Iterator[None]:
        """A resume runs in the block: a flush meanwhile waits (within its deadline) for its
        end, however it ends."""
        self.resumed.clear()
        try:
            yield
        finally:
            self.resumed.set()

    def after_resume(self, healing: threading.Thread | None, rebuilt_step: int | None) -> None:
        """What the resume left in flight: the thread bringing this rank's own shard back
        (None: its node had it), and the loaded step whose shards some rank of the job is
        bringing back (None: none)."""
        self.healing, self.rebuilt_step = healing, rebuilt_step

    # ------------------------------------------------------------------ what to flush
    def _unpersisted_steps(self) -> Iterator[tuple[int, StepState, str | None]]:
        """The steps held here newer than the persistent folder's newest complete one, newest
        first: each with its state here and the save of this rank's own committed shard of it
        (None: none)."""
        persisted = self.storage.complete_steps()
        newest_persistent = persisted[-1] if persisted else -1
        for step in sorted(self.store.inventory.steps(), reverse=True):
            if step <= newest_persistent:
                return
            st = self.store.inventory.step_state(step)
            yield step, st, (st.shard_saves.get(self.rank) if self.rank in st.committed_ranks
                             else None)

    def candidates(self) -> list[_Candidate]:
        """The steps this rank writes a part of, newest first: each step newer than the
        persistent folder's newest whose own shard is committed here, down to the newest one
        whose metadata (of the same save) is here too. A rank that owns nothing of that step
        still stages its metadata (its node may be the only one holding it)."""
        out: list[_Candidate] = []
        for step, st, own in self._unpersisted_steps():
            needed = self.rank in (st.required_ranks or ())
            if st.has_metadata and st.save_id and (own == st.save_id or not needed):
                with contextlib.suppress(ShardNotFoundError):  # (retired since the listing)
                    out.append(_Candidate(step, st.save_id, self.store.metadata.read_file(step)))
                    break
            if own is not None and self.rank not in st.partial:
                out.append(_Candidate(step, own, None))  # whole on another node, maybe
        return out

    # ------------------------------------------------------------------ the flush
    def flush(self, deadline: float) -> FlushResult:
        """Write this rank's part of each candidate step, newest first, and finish any step
        whose every part is there; stop at ``deadline`` (``time.monotonic()``)."""
        t0 = time.perf_counter()
        result = FlushResult()
        self._wait_for_heal(deadline)
        try:
            candidates = self.candidates()
        except OSError as e:
            result.reason = f"listing the steps failed: {e}"
            log.error("mlcheckpoint: preemption flush on rank %d: %s", self.rank, result.reason)
            return result
        if not candidates:
            result.reason = "no step newer than the persistent folder's newest is whole in memory"
            log.info("mlcheckpoint: preemption flush on rank %d: nothing to write (%s)",
                     self.rank, result.reason)
            return result
        for c in candidates:
            if any(self.complete(s) for s in result.parts):
                break  # a newer step was finished by another rank meanwhile
            if self._contribute(c, deadline, result) is not False:
                break  # complete (older steps are not needed), or out of time
        self._settle(result)
        result.seconds = time.perf_counter() - t0
        if result.step is not None:
            log.warning("mlcheckpoint: preemption flush on rank %d wrote step %d to %s (%d "
                        "bytes, %.2fs); step %s", self.rank, result.step,
                        self.storage.flush_path(result.step), result.bytes, result.seconds,
                        "complete" if result.complete else "waits for the other ranks' parts")
            history.record(self.store.job_dir, "flush", step=result.step, rank=self.rank,
                           bytes=result.bytes, seconds=round(result.seconds, 6),
                           complete=result.complete, location=self.storage.flush_path(result.step))
        return result

    def _contribute(self, c: _Candidate, deadline: float, result: FlushResult) -> bool | None:
        """Write this rank's part of ``c`` (noted in ``result``) and finish the step if every
        part is there: True if it is complete now, False if not (or this part failed: the
        caller goes on), None if the deadline cut it short."""
        if time.monotonic() >= deadline:
            result.reason = f"the deadline passed before step {c.step}"
            return None
        try:
            nbytes = self._write_part(c, deadline)
        except FlushCutShort as e:
            result.reason = str(e)
            log.error("mlcheckpoint: preemption flush of step %d on rank %d stopped: %s",
                      c.step, self.rank, e)
            return None
        except (OSError, CorruptShardError, ShardNotFoundError, ValueError) as e:
            log.error("mlcheckpoint: preemption flush of step %d on rank %d failed: %s",
                      c.step, self.rank, e)
            result.reason = f"step {c.step}: {e}"
            return False
        result.parts.append(c.step)
        result.parts.sort(reverse=True)
        result.saves[c.step] = c.save_id
        result.bytes += nbytes
        try:
            return self.finish(c.step, c.save_id)
        except (OSError, CorruptShardError, ValueError) as e:
            log.error("mlcheckpoint: finishing the flushed step %d on rank %d failed: %s",
                      c.step, self.rank, e)
            return False

    def _settle(self, result: FlushResult) -> None:
        """``result``'s step: the newest complete one of those it wrote, else the newest. With
        a complete one, this rank's parts of the older incomplete steps go: no load needs them.
        (Newer incomplete ones stay: a rank whose notice comes late may still complete one.)"""
        complete = [s for s in result.parts if self.complete(s)]
        result.step = complete[0] if complete else (result.parts[0] if result.parts else None)
        result.complete = bool(complete)
        for step in result.parts:
            if complete and step < complete[0] and step not in result.removed \
                    and self._remove_part(step, result.saves[step]):
                result.removed.append(step)

    def _hopeless(self, result: FlushResult, gone: _GoneRanks) -> list[str]:
        """Why none of the steps this rank wrote a part of can complete now (a rank whose part
        is missing is gone), one reason per step; [] while one still may (or nothing can tell:
        no staged metadata names the ranks, or no transport to ask). A step whose metadata is
        staged nowhere yet (a rank whose node lacked it wrote its part blind) needs the ranks
        a staged one of the others names: every rank of a run takes part in each of its saves,
        and a rank of another run is never found gone (its address is not known in this one)."""
        ranks_of = {s: self._ranks_of(s, result.saves[s]) for s in result.parts}
        known = [r for r in ranks_of.values() if r]
        if not known:
            return []
        reasons = []
        for step in result.parts:
            try:
                names = set(os.listdir(self._staging(step, result.saves[step])))
            except OSError:
                return []
            missing = [r for r in ranks_of[step] or known[0] if _marker(r) not in names]
            lost = [r for r in missing if gone.ask(r)]  # (every one asked: verdicts come sooner)
            if not lost:
                return []
            reasons.append(f"step {step} lacks the part of rank{'s' if len(lost) > 1 else ''} "
                           f"{', '.join(map(str, lost))}, gone (its replication listener "
                           "accepts no connection)")
        return reasons

    def _ranks_of(self, step: int, save_id: str) -> tuple[int, ...] | None:
        """The ranks whose parts ``step``'s save needs, from its staged metadata (None: none
        staged yet)."""
        key = (step, save_id)
        if key not in self._ranks:
            path = os.path.join(self._staging(step, save_id), "metadata")
            try:
                with open(path, "rb") as f:
                    header, _ = decode_metadata(f.read())
            except (OSError, ValueError, CorruptShardError):
                return None
            self._ranks[key] = tuple(header.ranks)
        return self._ranks[key]

    def _remove_part(self, step: int, save_id: str) -> bool:
        """Remove this rank's part of the incomplete ``step`` (its marker, then its file), and
        the step's folder once no rank's part is left in it; whether the part is gone. A rank
        finishing the step meanwhile read this marker or finds it gone (``finish`` checks the
        markers again after writing ``.metadata``): where the step completed before the marker
        went, the marker is put back and the part stays."""
        folder, staging = self.storage.flush_path(step), self._staging(step, save_id)
        marker = os.path.join(staging, _marker(self.rank))
        try:
            with open(marker, "rb") as f:
                recorded: bytes | None = f.read()
        except FileNotFoundError:
            recorded = None  # a rank owning nothing of the step staged its metadata, no part
        if recorded is not None:
            try:
                os.unlink(marker)
                if self.complete(step):
                    _write_atomic(marker, recorded, self.rank)
                    return False
                os.unlink(os.path.join(folder, _part_file(self.rank, save_id)))
            except OSError as e:
                log.warning("mlcheckpoint: preemption flush on rank %d: its part of the older "
                            "step %d in %s stays: %s", self.rank, step, folder, e)
                return False
            log.info("mlcheckpoint: preemption flush on rank %d removed its part of step %d "
                     "from %s: a newer step is complete", self.rank, step, folder)
        with contextlib.suppress(OSError):  # (gone already: another rank removed it)
            if not _has_markers(os.listdir(staging)):
                # No rank's part is left: only staged metadata, nothing to load. (Another
                # rank writing a part meanwhile fails its write, and logs it.)
                shutil.rmtree(folder, ignore_errors=True)
        return True

    def joinable(self, written: list[int]) -> list[_Candidate]:
        """Steps other ranks wrote parts of (their markers in the persistent folder) that this
        rank has not, newer than the folder's newest complete step, whose own shard of the
        same save is committed here; newest first. The ranks choose their steps alone and may
        differ (a save in flight on one rank at its notice, committed on another); a rank that
        stays writes its part of the steps the others chose too, so one of them completes."""
        out: list[_Candidate] = []
        for step, st, own in self._unpersisted_steps():
            if step in written or own is None or self.rank in st.partial:
                continue
            try:
                names = os.listdir(self._staging(step, own))
            except OSError:  # no rank wrote a part of this save
                continue
            if _has_markers(names):
                with contextlib.suppress(ShardNotFoundError):  # (retired since the listing)
                    metadata = (self.store.metadata.read_file(step)
                                if st.has_metadata and st.save_id == own else None)
                    out.append(_Candidate(step, own, metadata))
        return out

    def flush_and_stay(self, deadline: float) -> FlushResult:
        """``flush`` (what a preemption runs), then, where it wrote a part and no step it
        wrote is complete, stay until one is, for at most ``wait_for_parts`` seconds from the
        notice: notices reach nodes apart, and a rank that left at once would fail the
        collective its peers wait in before their own notice came, so they would never write
        their parts. Where it wrote a part of the loaded step whose shards some rank is still
        bringing back, stay until the deadline: that rank may be reading its shard from this
        node to write its own part, and leaving would end the read.

        It leaves sooner where every step it wrote lacks the part of a rank that is gone
        (``_hopeless``): its process died or its machine is lost (a node lost before the
        notice, an elastic restart's failed rank), so the part can never come.

        Meanwhile this process sends at the link's speed (``Budget.hurried``): a shard this
        node serves to a replaced node's heal must cross before that node's flush, which waits
        for it, runs out of time; the budget spares training's steps, and none are left."""
        noticed = time.monotonic()
        with self.budget.hurried() if self.budget is not None else contextlib.nullcontext():
            result = self.flush(deadline)
            if result.complete or not result.parts:
                return result
            until = deadline if self.rebuilt_step in result.parts else \
                min(deadline, noticed + self.wait_for_parts)
            if until > time.monotonic():
                log.warning("mlcheckpoint: preemption flush on rank %d: staying up to %.1fs for "
                            "the other ranks' parts of step %d", self.rank,
                            until - time.monotonic(), result.parts[0])
            tried: set[int] = set()  # each step joined once, whether its part was written or not
            gone = _GoneRanks(self.peers)
            hopeless: list[str] = []

            def converged() -> bool:
                if any(self.complete(s) for s in result.parts):
                    return True
                for c in self.joinable([*result.parts, *tried]):
                    tried.add(c.step)
                    log.warning("mlcheckpoint: preemption flush on rank %d: other ranks write "
                                "step %d: writing this rank's part of it too", self.rank, c.step)
                    if self._contribute(c, deadline, result):
                        return True
                hopeless[:] = self._hopeless(result, gone)
                return bool(hopeless)

            try:
                converged_in_time = wait_until(converged, until, poll=STAY_POLL_S)
            finally:
                gone.close()
            self._settle(result)
            if result.complete:
                assert result.step is not None  # (a complete step among its parts)
                log.warning("mlcheckpoint: preemption flush on rank %d: step %d is complete in "
                            "%s (the other ranks' parts came)", self.rank, result.step,
                            self.storage.flush_path(result.step))
            elif converged_in_time:
                result.reason = "; ".join(hopeless)
                log.warning("mlcheckpoint: preemption flush on rank %d: leaving with step %d "
                            "incomplete: %s", self.rank, result.parts[0], "; ".join(hopeless))
            else:
                log.warning("mlcheckpoint: preemption flush on rank %d: leaving with step %d "
                            "incomplete (a rank that never had a notice, or failed, writes no "
                            "part)", self.rank, result.parts[0])
        return result

    def _wait_for_heal(self, deadline: float) -> None:
        """Wait (until ``deadline``) for a resume in flight, then for the heal bringing this
        rank's own shard back."""
        if not self.resumed.is_set():
            log.warning("mlcheckpoint: preemption flush on rank %d waits for the resume in "
                        "flight: the step it loads is the one to write", self.rank)
            if not self.resumed.wait(max(0.0, deadline - time.monotonic())):
                log.error("mlcheckpoint: preemption flush on rank %d: the resume did not end "
                          "before the deadline", self.rank)
                return
        healing = self.healing
        if healing is None or not healing.is_alive():
            return
        log.warning("mlcheckpoint: preemption flush on rank %d waits for its own shard of the "
                    "loaded step, which is still coming back from other nodes", self.rank)
        healing.join(max(0.0, deadline - time.monotonic()))
        if healing.is_alive():
            log.error("mlcheckpoint: preemption flush on rank %d: its own shard of the loaded "
                      "step did not come back before the deadline; it has no part of that "
                      "step to write", self.rank)

    def _write_part(self, c: _Candidate, deadline: float) -> int:
        """This rank's items of ``c`` into its file, verified, then its marker and (where
        held) the staged metadata; returns the bytes written."""
        folder = self.storage.flush_path(c.step)
        staging = self._staging(c.step, c.save_id)
        os.makedirs(staging, exist_ok=True)
        if c.metadata is not None:
            _write_atomic(os.path.join(staging, "metadata"), c.metadata, self.rank)
        locations = self._own_locations(c)
        if locations is not None and not locations:
            return 0  # this rank owns nothing of the step: its metadata was all it had
        with self.pins.pinned(c.step), self.store.shards.open(c.step, self.rank, c.save_id) as shard:
            items = _items_to_write(shard.manifest.items, locations)
            name = _part_file(self.rank, c.save_id)
            entries, nbytes = _write_items(os.path.join(folder, name), name, shard, items,
                                           deadline, c.step)
        pause_point("flush_part", c.step, self.rank)
        marker = {"step": c.step, "rank": self.rank, "save_id": c.save_id, "items": entries}
        _write_atomic(os.path.join(staging, _marker(self.rank)),
                      json.dumps(marker, separators=(",", ":")).encode(), self.rank)
        return nbytes

    def _own_locations(self, c: _Candidate) -> dict[str, ItemLocation] | None:
        """This rank's primary items of the step by their key, from its metadata (None
        without it: then every item of its shard is written, and the finisher picks the
        primaries)."""
        if c.metadata is None:
            return None
        _, payload = decode_metadata(c.metadata)
        return {item_key(index): loc for index, loc in dcp_metadata(payload).storage_data.items()
                if loc.rank == self.rank}

    # ------------------------------------------------------------------ finishing
    def finish(self, step: int, save_id: str) -> bool:
        """Write DCP's ``.metadata`` of ``step`` if the staged metadata of ``save_id`` and every
        part it needs are in the folder; whether the step is complete now."""
        folder = self.storage.flush_path(step)
        staging = self._staging(step, save_id)
        try:
            with open(os.path.join(staging, "metadata"), "rb") as f:
                header, payload = decode_metadata(f.read())
        except FileNotFoundError:
            return False  # a rank whose node holds the metadata has not staged it yet
        if header.save_id != save_id or header.step != step:
            raise CorruptShardError(f"{staging}/metadata names step {header.step} save "
                                    f"{header.save_id!r}")
        markers: dict[int, dict[str, list]] = {}
        for r in header.ranks:
            try:
                with open(os.path.join(staging, _marker(r)), "rb") as f:
                    marker = json.loads(f.read())
            except FileNotFoundError:
                return False  # that rank's part is not whole (yet)
            if marker.get("save_id") != save_id or marker.get("rank") != r:
                raise CorruptShardError(f"{staging}: rank {r}'s marker names another save")
            markers[r] = {str(e[0]): e for e in marker["items"]}
        metadata = dcp_metadata(payload)
        storage_data: dict[Any, _StorageInfo] = {}
        for index, loc in metadata.storage_data.items():
            entry = markers[loc.rank].get(item_key(index))
            if entry is None or not same_layout([_Written(*entry[1:5])], [loc]):
                raise CorruptShardError(f"{staging}: rank {loc.rank}'s part lacks item "
                                        f"{index.fqn!r} as the step's metadata records it")
            storage_data[index] = _StorageInfo(entry[5], entry[6], entry[7])
        metadata.storage_data = storage_data
        for name, data in self.storage.flush_files(
                lambda fqn: _read_item(folder, storage_data, fqn)).items():
            _write_atomic(os.path.join(folder, name), data, self.rank)
        metadata.storage_meta = StorageMeta(checkpoint_id=folder, save_id=save_id)
        if _DCP_VERSION is not None:
            metadata.version = _DCP_VERSION
        with contextlib.suppress(OSError):  # without it the step still loads (persistent.py)
            self.storage.record_origin(step, PersistentOrigin(
                header.run_id, tuple((str(r), int(s)) for r, s in header.lineage), time.time()),
                folder)
        _write_atomic(os.path.join(folder, ".metadata"),
                      pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL), self.rank)
        # A rank removing its part of this step (``_remove_part``, a newer one is complete)
        # unlinks its marker before it looks for ``.metadata``: a marker gone now means its
        # file may be going too, so the step must not stand complete.
        if not all(os.path.exists(os.path.join(staging, _marker(r))) for r in header.ranks):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, ".metadata"))
            return False
        return True

    def complete(self, step: int) -> bool:
        """Whether ``step`` is complete in the persistent folder."""
        return os.path.exists(os.path.join(self.storage.flush_path(step), ".metadata"))

    def _staging(self, step: int, save_id: str) -> str:
        """Where the markers and the staged metadata of ``step``'s save ``save_id`` go."""
        return os.path.join(self.storage.flush_path(step), FLUSH_DIR, save_id)

    # ------------------------------------------------------------------ at the next start
    def remove_abandoned(self, deadline_s: float, now: float | None = None) -> list[str]:
        """Remove the folders of flushes that never completed: those holding only what a flush
        writes before its finisher (FLUSH_DIR, the ranks' part files, unfinished atomic
        writes), with no DCP ``.metadata``, in which nothing changed for
        ``ABANDONED_AFTER_DEADLINES`` flush deadlines (``deadline_s``) nor
        ``ABANDONED_AFTER_S``. Nothing can load or finish such a folder: the flush that wrote
        it ended with its run (an elastic restart stops every rank; a preemption takes the
        nodes), and a later flush of that save finds its parts gone and writes them again.
        Rank 0 calls it at the job's start, before the resume's first collective, so no rank
        of this run flushes meanwhile. Returns the folders removed."""
        now = time.time() if now is None else now
        quiet_for = max(ABANDONED_AFTER_S, ABANDONED_AFTER_DEADLINES * deadline_s)
        parent = os.path.dirname(self.storage.flush_path(0))
        try:
            names = sorted(os.listdir(parent))
        except OSError:
            return []  # no persistent folder yet
        removed = []
        for name in names:
            folder = os.path.join(parent, name)
            try:
                kept = _kept_because(folder, now - quiet_for)
                if kept is not None:
                    if kept:
                        log.info("mlcheckpoint: keeping the flush folder %s: %s", folder, kept)
                    continue
                shutil.rmtree(folder)
            except OSError as e:
                log.warning("mlcheckpoint: could not remove %s, a preemption flush that never "
                            "completed: %s", folder, e)
                continue
            removed.append(folder)
        if removed:
            log.warning("mlcheckpoint: removed %d folder(s) of preemption flushes that never "
                        "completed (no rank can finish them now): %s", len(removed),
                        ", ".join(removed))
            history.record(self.store.job_dir, "flush_abandoned_removed", rank=self.rank,
                           folders=removed)
        return removed


class _GoneRanks:
    """Which ranks are gone, asked of the replication transport on a thread of its own: a
    probe may wait its timeout on a lost machine, and the stay's poll never waits for it. A
    rank asked is probed at once, and again every PROBE_EVERY_S while it answers; "gone" is
    kept. ``close`` when the stay ends."""

    def __init__(self, peers: Transport | None):
        self.peers = peers
        self.gone: set[int] = set()
        self._due: dict[int, float] = {}  # rank -> when to probe it next
        self._lock = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        """Stop probing (a probe under way ends on its own, its answer unread)."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()

    def ask(self, rank: int) -> bool:
        """Whether ``rank`` is known gone; if not known, it is (or stays) probed."""
        if self.peers is None:
            return False
        with self._lock:
            if rank in self.gone:
                return True
            if rank not in self._due:
                self._due[rank] = 0.0
                self._lock.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._probe, name="mlckpt-flush-probe",
                                                daemon=True)
                self._thread.start()
        return False

    def _probe(self) -> None:
        assert self.peers is not None
        while True:
            with self._lock:
                while not self._stop and not self._due:
                    self._lock.wait()
                if self._stop:
                    return
                rank, due = min(self._due.items(), key=lambda kv: kv[1])
                if due > time.monotonic():
                    self._lock.wait(due - time.monotonic())
                    continue
                self._due[rank] = time.monotonic() + PROBE_EVERY_S
            try:
                answered = self.peers.reachable(rank, PROBE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - (its address unknown, the store gone): cannot tell
                log.debug("mlcheckpoint: cannot tell whether rank %d is gone: %s", rank, e)
                answered = None
            if answered is False:
                with self._lock:
                    self.gone.add(rank)
                    self._due.pop(rank, None)


def _kept_because(folder: str, changed_before: float) -> str | None:
    """Why ``folder`` is not an abandoned flush: "" where it holds no flush, else what keeps
    it (DCP's ``.metadata``, a file no flush writes, a change since ``changed_before``,
    ``time.time()``); None where it holds a flush and nothing else, unchanged since."""
    if not os.path.isdir(os.path.join(folder, FLUSH_DIR)) or os.path.islink(folder):
        return ""
    for name in os.listdir(folder):
        if name not in (FLUSH_DIR, ORIGIN_FILE) and not _PART_FILE.fullmatch(name) \
                and not _UNFINISHED_WRITE.fullmatch(name):
            return f"it holds {name!r}, which a flush does not write" if name != ".metadata" \
                else "it is complete"
    for root, dirs, files in os.walk(folder):
        for entry in [root, *(os.path.join(root, n) for n in files + dirs)]:
            changed = os.lstat(entry).st_mtime
            if changed >= changed_before:
                return f"{entry} changed {time.time() - changed:.0f}s ago"
    return None


def _read_item(folder: str, storage_data: dict[Any, _StorageInfo], fqn: str) -> bytes:
    """The bytes written for item ``fqn`` (a non-tensor: one entry) in the flushed ``folder``."""
    for index, info in storage_data.items():
        if index.fqn == fqn:
            with open(os.path.join(folder, info.relative_path), "rb") as f:
                f.seek(info.offset)
                return f.read(info.length)
    raise CorruptShardError(f"{folder}: the flushed step has no item {fqn!r}")


def _items_to_write(items: list[ManifestItem],
                    locations: dict[str, ItemLocation] | None) -> list[ManifestItem]:
    """The manifest's items that ``locations`` name (all of them without), in file order."""
    if locations is None:
        return sorted(items, key=lambda it: it.offset)
    by_key = {it.key: it for it in items}
    chosen = []
    for key, loc in locations.items():
        it = by_key.get(key)
        if it is None or not same_layout([it], [loc]):
            raise CorruptShardError(f"the shard here lacks item {key!r} as the step's metadata "
                                    "records it")
        chosen.append(it)
    return sorted(chosen, key=lambda it: it.offset)


def _tensor_of(array: Any, it: ManifestItem) -> torch.Tensor:
    """The raw bytes of item ``it`` as the tensor they hold, without a copy: its storage is
    exactly those bytes, so ``torch.save`` writes them and nothing more."""
    dtype = getattr(torch, it.dtype or "", None)
    if not isinstance(dtype, torch.dtype) or it.shape is None:
        raise CorruptShardError(f"item {it.key!r} records dtype {it.dtype!r}, shape {it.shape!r}")
    if it.nbytes == 0:
        return torch.empty(it.shape, dtype=dtype)
    raw = torch.from_numpy(array[it.offset:it.offset + it.nbytes])
    return raw.view(dtype).reshape(it.shape)


def _write_items(path: str, name: str, shard: ShardSource, items: list[ManifestItem],
                 deadline: float, step: int) -> tuple[list[list], int]:
    """Write ``items`` of ``shard`` into ``path`` as FileSystemWriter writes a rank's file,
    each verified against its checksum; returns the marker's entries (key, shard offset,
    nbytes, checksum, algorithm, file, file offset, length) and the bytes written.

    Tensors are read through the mapping the save left in this process where it covers them
    (its page tables are built: a fresh mapping's page faults cost more than the write to a
    fast folder); byte items, which a save appends past that mapping, with ``pread``."""
    tensors = [it for it in items if it.kind == "tensor"]
    end = max((it.offset + it.nbytes for it in tensors), default=0)
    array = shard.mapping(end).array if end else None
    entries = []
    where = f"step {step} rank {shard.manifest.rank}"
    with open(path, "wb") as f:
        for it in items:
            if time.monotonic() >= deadline:
                raise FlushCutShort(f"the deadline passed while writing step {step}")
            start = f.tell()
            if it.kind == "tensor":
                torch.save(_tensor_of(array, it), f)
            else:  # a byte item, or a tensor DCP's own route serialized: its bytes as they are
                raw = shard.read(it.offset, it.nbytes)
                verify_region(np.frombuffer(raw, dtype=np.uint8), [dataclasses.replace(it, offset=0)],
                              where, lambda it: f"item {it.key!r}")
                f.write(raw)
            entries.append([it.key, it.offset, it.nbytes, it.checksum, it.algorithm, name, start,
                            f.tell() - start])
        f.flush()
        os.fsync(f.fileno())
        written = f.tell()
    if array is not None:
        # Checked after the write: bytes that changed under it (or were damaged before) fail
        # here, and the part is never marked whole.
        verify_region(array, tensors, where, lambda it: f"item {it.key!r}")
    return entries, written


def _write_atomic(path: str, data: bytes, rank: int) -> None:
    """``data`` into ``path`` whole or not at all (a temporary file per rank, synced, renamed)."""
    tmp = f"{path}.tmp{rank}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
