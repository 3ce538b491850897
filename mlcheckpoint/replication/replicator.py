"""The replication manager of one rank: off the training thread, newest work first.

It watches the store for this rank's committed shards (nudged by the writer, and polling so
saves made in DCP's PROCESS mode are seen too), pushes the newest one to the partner rank(s),
and records per step: committed -> replicated (partner verified the checksums) or failed.
Rank 0 also pushes each step's global metadata to one rank of every other node.
Job-wide progress is counted in the c10d store, per save (a step saved twice is two saves),
so any rank can tell when a step is *protected*: every shard and the metadata of the save this
node holds are on two nodes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from .. import history
from .._ratelimit import RateLimitedLog
from ..errors import MLCheckpointError
from ..store import LocalStore
from ..topology import Topology
from .pairing import PairingStrategy, PairwiseRing, rank_sources, rank_targets
from .rendezvous import Rendezvous
from .transport import Transport

log = logging.getLogger(__name__)


@dataclass
class StepReplication:
    """This rank's view of one step's replication."""

    step: int
    save_id: str = ""  # the save of ``step`` this state is about (a re-save starts afresh)
    state: str = "committed"  # committed | replicated | failed | superseded
    acked_by: list[int] = field(default_factory=list)
    reason: str | None = None
    attempts: int = 0
    bytes: int = 0
    seconds: float = 0.0
    metadata_pushed: str | None = None  # the save whose metadata reached the other nodes


class Replicator:
    """Pushes this rank's committed shards (and, on rank 0, metadata) to partner ranks."""

    def __init__(self, store: LocalStore, transport: Transport, rdzv: Rendezvous,
                 topology: Topology, strategy: PairingStrategy | None = None, *,
                 retries: int = 3, poll_interval: float = 0.25):
        self.store, self.transport, self.rdzv, self.topology = store, transport, rdzv, topology
        strategy = strategy or PairwiseRing()
        t = topology
        self.targets = rank_targets(strategy, t.rank, t.local_world_size, t.num_nodes)
        self.sources = rank_sources(strategy, t.rank, t.local_world_size, t.num_nodes)
        self.metadata_targets = ([n * t.local_world_size for n in range(t.num_nodes) if n != t.node_rank]
                                 if t.rank == 0 else [])
        self.retries, self.poll_interval = retries, poll_interval
        self._states: dict[int, StepReplication] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._newest_protected: int | None = None
        self._metadata_retry_at = 0.0  # no metadata push before this (monotonic) time
        self._logs = RateLimitedLog(log)
        # Paused until the job has resumed (or saves): before that the store may hold steps the
        # resume is about to drop, and pushing them would only waste the link.
        self._active = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlckpt-replicator", daemon=True)
        self._thread.start()
        log.info("mlcheckpoint: rank %d replicates to rank(s) %s over %s, keeps replicas of %s",
                 t.rank, self.targets, transport.name, self.sources)

    # ------------------------------------------------------------------ inputs
    def notify(self, *_: object) -> None:
        """A shard or metadata was committed here: look now rather than at the next poll."""
        self._wake.set()

    def activate(self, *, reset: bool = False) -> None:
        """Start (or, with ``reset``, restart after a resume) pushing the newest step."""
        if reset:
            with self._lock:
                self._states.clear()
        self._active.set()
        self._wake.set()

    def state(self, step: int) -> StepReplication | None:
        with self._lock:
            return self._states.get(step)

    # ------------------------------------------------------------------ job-wide view
    def _save_here(self, step: int) -> str | None:
        """The save of ``step`` this rank holds: its own shard's, else the metadata's."""
        st = self.store.step_state(step)
        return st.shard_saves.get(self.topology.rank, st.save_id)

    def is_protected(self, step: int) -> bool:
        """Every rank's shard and the metadata of the save of ``step`` held here are on two
        nodes (job-wide)."""
        save = self._save_here(step)
        if save is None:
            return False
        shards = self.rdzv.add(self.rdzv.counter("shards", step, save), 0)
        meta = self.rdzv.add(self.rdzv.counter("meta", step, save), 0)
        return shards >= self.topology.world_size and meta >= 1

    def is_superseded(self, step: int) -> bool:
        """Some rank skipped this save for a newer one: it will never be protected."""
        save = self._save_here(step)
        return save is not None and self.rdzv.add(self.rdzv.counter("superseded", step, save), 0) > 0

    def newest_protected(self, candidates: list[int]) -> int | None:
        """Newest protected step among ``candidates`` (those newer than the last one found)."""
        for step in sorted(candidates, reverse=True):
            if self._newest_protected is not None and step <= self._newest_protected:
                break
            if self.is_protected(step):
                self._newest_protected = step
                break
        return self._newest_protected

    def known_protected(self) -> int | None:
        """The newest protected step found so far (no store round trip)."""
        return self._newest_protected

    def seed_protected(self, step: int | None) -> None:
        """After a restart the counters are new: take the newest step found on two nodes."""
        if step is not None and (self._newest_protected is None or step > self._newest_protected):
            self._newest_protected = step

    def wait_replicated(self, step: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_protected(step):
            if self.is_superseded(step):
                log.warning("mlcheckpoint: step %d will not be replicated: a newer step "
                            "superseded it before it was pushed", step)
                return False
            if time.monotonic() >= deadline:
                return False
            self._wake.set()
            time.sleep(0.02)
        return True

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.poll_interval)
            self._wake.clear()
            if not self._active.is_set():
                continue
            try:
                self._replicate_newest()
            except Exception:  # keep replicating later steps whatever happened to this one
                log.exception("mlcheckpoint: replication pass failed")

    def _replicate_newest(self) -> None:
        inv = self.store.inventory()
        rank = self.topology.rank
        mine = {s: st.shard_saves[rank] for s, st in sorted(inv.items()) if rank in st.committed_ranks}
        todo = [s for s, save in mine.items() if self._needs_push(s, save)]
        if todo:
            newest = todo[-1]
            superseded = []
            with self._lock:  # older pending work is dropped: only the newest step matters
                for s in todo[:-1]:
                    st = self._state_for(s, mine[s])
                    if st.state in ("committed", "failed"):
                        st.state, st.reason = "superseded", f"step {newest} is newer"
                        superseded.append(s)
            for s in superseded:
                self.rdzv.add(self.rdzv.counter("superseded", s, mine[s]), 1)
            self._push_shard(newest, mine[newest])
        if self.metadata_targets:  # only the newest step's metadata matters, like its shards
            with_meta = [s for s in mine if inv[s].has_metadata]
            if with_meta:
                newest_meta = inv[with_meta[-1]]
                if (not self._metadata_done(newest_meta.step, newest_meta.save_id)
                        and time.monotonic() >= self._metadata_retry_at):
                    self._push_metadata(newest_meta.step, newest_meta.save_id)

    def _state_for(self, step: int, save_id: str) -> StepReplication:
        """The state of this save of ``step``; a new save of the step starts afresh. Call with
        the lock held."""
        st = self._states.get(step)
        if st is None or st.save_id != save_id:
            st = self._states[step] = StepReplication(step, save_id)
        return st

    def _needs_push(self, step: int, save_id: str) -> bool:
        with self._lock:
            st = self._states.get(step)
        if st is None or st.save_id != save_id:
            return True
        return st.state == "committed" or (st.state == "failed" and st.attempts < self.retries)

    def _metadata_done(self, step: int, save_id: str | None) -> bool:
        with self._lock:
            st = self._states.get(step)
            return st is not None and st.metadata_pushed == save_id

    def _push_shard(self, step: int, save_id: str) -> None:
        with self._lock:
            st = self._state_for(step, save_id)
            st.attempts += 1
        t0 = time.perf_counter()
        sent = 0
        try:
            for peer in self.targets:
                if peer in st.acked_by:
                    continue
                sent += self.transport.push_shard(peer, step, self.topology.rank)
                st.acked_by.append(peer)
        except (MLCheckpointError, OSError) as e:
            with self._lock:
                st.state, st.reason = "failed", str(e)
            level = logging.WARNING if st.attempts < self.retries else logging.ERROR
            log.log(level, "mlcheckpoint: replicating step %d of rank %d failed (attempt %d/%d): %s",
                    step, self.topology.rank, st.attempts, self.retries, e)
            if st.attempts < self.retries:
                self._retry_later()
            return
        with self._lock:
            st.state, st.reason = "replicated", None
            st.bytes, st.seconds = sent, time.perf_counter() - t0
        # Counted for the save the partners acknowledged: they compared save ids, so an ack
        # for an earlier save of this step cannot count here.
        self.rdzv.add(self.rdzv.counter("shards", step, save_id), 1)
        history.record(self.store.job_dir, "replicate", step=step, rank=self.topology.rank,
                       targets=self.targets, bytes=sent, seconds=round(st.seconds, 6),
                       transport=self.transport.name)
        log.debug("replicated step %d rank %d to %s: %d bytes in %.3fs", step,
                  self.topology.rank, self.targets, sent, st.seconds)

    def _push_metadata(self, step: int, save_id: str | None) -> None:
        try:
            for peer in self.metadata_targets:
                self.transport.push_metadata(peer, step)
        except (MLCheckpointError, OSError) as e:
            # wait_replicated wakes the replicator every few ms: retry once a second, not then
            self._metadata_retry_at = time.monotonic() + 1.0
            self._logs.warning("metadata", "mlcheckpoint: pushing metadata of step %d failed: %s",
                               step, e)
            self._retry_later()
            return
        with self._lock:
            st = self._states.setdefault(step, StepReplication(step, save_id or ""))
            st.metadata_pushed = save_id
        self.rdzv.add(self.rdzv.counter("meta", step, save_id), 1)

    def _retry_later(self) -> None:
        threading.Timer(1.0, self._wake.set).start()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def drain(self, timeout: float) -> None:
        """Wait until nothing this rank committed is waiting to be pushed (best effort)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            inv = self.store.inventory()
            mine = [s for s, st in inv.items() if self.topology.rank in st.committed_ranks]
            newest = max(mine, default=None)
            if newest is None:
                return
            st = self.state(newest)
            meta_ok = (not self.metadata_targets or not inv[newest].has_metadata
                       or self._metadata_done(newest, inv[newest].save_id))
            if st is not None and st.state in ("replicated", "superseded") and meta_ok:
                return
            if st is not None and st.state == "failed" and st.attempts >= self.retries:
                return
            self._wake.set()
            time.sleep(0.02)
