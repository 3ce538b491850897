"""The replication manager of one rank: off the training thread, newest work first.

The job replicates in rounds (``rounds.py``): rank 0 names one save, the newest it holds, every
rank pushes its partner rank(s) (``replicas`` of them) what they lack of its shard of that save
(the whole shard, or, where data parallelism keeps copies, only the items that lack their
places: ``store/coverage.py`` ``plan_push``; rank 0 also the global metadata, to one rank of every other node), and
the next round starts once every rank is done. Saves made meanwhile are skipped (*superseded*)
by every rank alike, so the steps that do get replicated are whole job-wide. Each rank records
per step: committed -> replicated (partner verified the checksums), failed, or superseded.
Job-wide progress is counted in the c10d store, per save (a step saved twice is two saves): a
step is *protected* when every item and the metadata of the save this node holds are on
1 + ``replicas`` nodes (``store/coverage.py``'s rule: a rank counts its shard once every
partner acknowledged what it lacked). Only a node's leader talks to the store; what it learns (the
rounds, which closed round left its save protected) reaches the node's other ranks through a
file (``rounds.py``): saves, ``protection()`` and ``wait_replicated`` cost it nothing per rank.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

from ... import history
from ..._messages import RateLimitedLog
from ...errors import CorruptShardError, MLCheckpointError, ShardNotFoundError
from ...settings import default
from ...store import LocalStore, coverage
from ...store.coverage import StepItems
from ...store.inventory import StepState
from ...topology import Topology
from ...waiting import deadline_in, wait_until
from ..core.rendezvous import Rendezvous
from ..core.transport import Transport
from .pairing import PairingStrategy, PairwiseRing, rank_sources, rank_targets, sources
from .rounds import Round, Rounds, protected_in_store
from .status import LagWarning, ProtectionStatus, save_interval, save_times
from .status import status as protection_status

log = logging.getLogger(__name__)
MAX_REPEAT_S = 30.0  # longest back-off before an unprotected save is named again


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
    seconds: float = 0.0  # pushing (0 when copies covered it: no push for the rate)
    # This process's budget counters over the push (heals it served meanwhile included),
    # summed over a striped push's streams: seconds in the kernel's send from the tmpfs file,
    # and held back by the budget.
    send_seconds: float = 0.0
    budget_wait_seconds: float = 0.0
    metadata_pushed: str | None = None  # the save whose metadata reached the other nodes


class Replicator:
    """Pushes this rank's committed shards (and, on rank 0, metadata) to partner ranks."""

    def __init__(self, store: LocalStore, transport: Transport, rdzv: Rendezvous,
                 topology: Topology, strategy: PairingStrategy | None = None, *,
                 poll_interval: float = default("replicator_poll"),
                 wait_poll: float = default("wait_poll")):
        self.store, self.transport, self.rdzv, self.topology = store, transport, rdzv, topology
        self.strategy = strategy = strategy or PairwiseRing()
        t = topology
        self.targets = rank_targets(strategy, t.rank, t.local_world_size, t.num_nodes)
        self.sources = rank_sources(strategy, t.rank, t.local_world_size, t.num_nodes)
        # Nodes a protected step is on: this one and every partner (at least two: a step is
        # never called protected while it is on one node only).
        # how many nodes each item should be on: this one and every partner (at least 2)
        self.places = max(2, 1 + len(self.targets))
        self.metadata_targets = ([n * t.local_world_size for n in range(t.num_nodes) if n != t.node_rank]
                                 if t.rank == 0 else [])
        self.poll_interval = poll_interval  # the worker's look for a new round
        self.wait_poll = wait_poll  # wait_replicated's and drain's look at the state
        self._states: dict[int, StepReplication] = {}
        self._unreplicated: dict[int, str] = {}  # step -> save id, saved since the last round
        self._metadata_due: dict[int, str] = {}  # rank 0: saves whose metadata only node 0 holds
        self._saves_lock = threading.Lock()  # for it and _superseded: notify runs on the save thread
        self._superseded = 0  # saves this rank was told of and never replicated
        self.skipped_bytes = 0  # shard bytes not sent: data parallelism's copies covered them
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._newest_protected: int | None = None
        self._recorded_protected: int | None = None  # the last step history says is protected
        self.rounds = Rounds(rdzv, t, store.paths)
        self._closed_seen = 0  # the last closed round this rank looked at (``_round_closed``)
        self._repeat_at = 0.0  # rank 0: not before this (monotonic) time is a round repeated
        self._repeat_after = 1.0
        self._logs = RateLimitedLog(log)
        self._lag_warning = LagWarning()
        # Paused until the job has resumed (or saves): before that the store may hold steps the
        # resume is about to drop, and pushing them would only waste the link.
        self._active = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlckpt-replicator", daemon=True)
        self._thread.start()
        log.info("mlcheckpoint: rank %d replicates to %s %s over %s, keeps replicas of %s",
                 t.rank, "rank" if len(self.targets) == 1 else "ranks", self.targets,
                 transport.name, self.sources)
        if t.is_node_leader:
            self._announce_partners(strategy)

    def _announce_partners(self, strategy: PairingStrategy) -> None:
        """Log and record (history, for ``mlcheckpoint ls``) which nodes keep this node's
        replicas and whose replicas it keeps, each with its failure domain."""
        t = self.topology
        targets = strategy.targets(t.node_rank, t.num_nodes)
        held = sources(strategy, t.node_rank, t.num_nodes)
        log.info("mlcheckpoint: %s replicates to %s, keeps the replicas of %s",
                 t.describe_node(t.node_rank), ", ".join(map(t.describe_node, targets)) or "nobody",
                 ", ".join(map(t.describe_node, held)) or "nobody")

        def domain(node: int) -> str:
            return t.domains[node] if t.domains else ""

        history.record(self.store.job_dir, "pairing", node=t.node_rank, domain=domain(t.node_rank),
                       targets=[[n, domain(n)] for n in targets],
                       sources=[[n, domain(n)] for n in held])

    # ------------------------------------------------------------------ inputs
    def notify(self, step: int, save_id: str, *, share_metadata: bool = False) -> None:
        """This rank's shard of ``step`` (save ``save_id``) is committed (the Saver: on every
        rank, once per save): start replicating if not yet, and look now rather than at the
        next poll. ``share_metadata``: no other node holds the save's metadata (a DCP-native
        save: only the coordinator's writer saw it); rank 0 sends it to them at its next look,
        not only when a round names the save."""
        with self._saves_lock:
            self._unreplicated[step] = save_id
            if share_metadata and self.metadata_targets:
                self._metadata_due[step] = save_id
        self.transport.budget.note_save()  # the saves' cadence: the default budget follows it
        self._active.set()
        self.rounds.hurry()
        self._wake.set()

    def wake(self) -> None:
        """Something changed here (e.g. a shard rebuilt after a resume): look now."""
        self._wake.set()

    def activate(self, *, reset: bool = False) -> None:
        """Start (or, with ``reset``, restart after a resume) pushing the newest step."""
        if reset:
            with self._lock:
                self._states.clear()
            self.rounds.forget()  # the loaded step may be older than the last round's
        self._active.set()
        self._wake.set()

    def profile(self) -> dict[str, float]:
        """Where replication's time went in this process, summed since it started: sending
        (``Budget.profile``) and receiving (``ReceiveSink.profile``)."""
        return {**self.transport.budget.profile(), **self.transport.sink.profile()}

    def state(self, step: int) -> StepReplication | None:
        with self._lock:
            return self._states.get(step)

    # ------------------------------------------------------------------ job-wide view
    def _save_here(self, step: int) -> str | None:
        """The save of ``step`` this rank holds: its own shard's, else the metadata's."""
        st = self.store.inventory.step_state(step)
        return st.shard_saves.get(self.topology.rank, st.save_id)

    def is_protected(self, step: int) -> bool:
        """Every rank's shard and the metadata of the save of ``step`` held here are on
        ``places`` nodes (job-wide): asks the c10d store (two operations), for ``ls``."""
        save = self._save_here(step)
        return save is not None and protected_in_store(self.rdzv, step, save,
                                                       self.topology.world_size)

    def newest_protected(self, ask: bool = True) -> int | None:
        """The newest protected step: that of the newest round that closed with its save
        protected, as the node's leader learnt it (no store operation); ``ask=False``: the
        one found so far (from any thread: nothing is recorded)."""
        r = self.rounds.protected
        if ask and r is not None and (self._newest_protected is None or r.step > self._newest_protected):
            self.seed_protected(r.step)
            self._record_protected(r.step)
        return self._newest_protected

    def round_step(self) -> int | None:
        """The step of the newest replication round this rank has seen (no store round trip):
        its shards must stay until a newer step is protected."""
        latest = self.rounds.taken()
        return None if latest is None else latest.step

    def protection(self, ask: bool = True) -> ProtectionStatus:
        """How far replication lags behind the saves (see ``ProtectionStatus``). Asks the c10d
        store nothing: the newest protected step is that of the last closed round the node
        heard of (``ask=False``: the one known at the last save)."""
        inv = self.store.inventory.all()
        newest = self.newest_protected(ask)
        with self._lock:
            pushed = sorted((st for st in self._states.values()
                             if st.state == "replicated" and st.seconds > 0), key=lambda st: st.step)[-5:]
        with self._saves_lock:
            superseded = self._superseded
        rate = sum(st.bytes for st in pushed) / sum(st.seconds for st in pushed) if pushed else None
        return protection_status(newest, save_times(inv), rate, superseded)

    def seed_protected(self, step: int | None) -> None:
        """After a restart the counters are new: take the newest step found on ``places``
        nodes."""
        if step is not None and (self._newest_protected is None or step > self._newest_protected):
            self._newest_protected = step

    def wait_replicated(self, step: int, timeout: float) -> bool:
        """Wait until the save of ``step`` held here is protected (True) or will never be (a
        round named a newer step first, or the step is no longer held here: retention retired
        it once newer steps were saved), or ``timeout`` passes (False). Watches what the node
        knows of the rounds; asks the store once, when a newer round settled the step's fate."""
        def settled() -> str | None:
            save = self._save_here(step)
            p, latest = self.rounds.protected, self.rounds.taken()
            newer = (latest is not None and latest.step > step) or (p is not None and p.step > step)
            if save is None:  # not saved here yet; or, once a newer step was named, retired
                return "retired" if newer else None
            if p is not None and (p.step, p.save_id) == (step, save):
                return "protected"
            if newer:
                return "protected" if self.is_protected(step) else "superseded"
            return None

        # (the replicator looks at its own pace: waking it at each look here would make a
        # leader ask the store every ``wait_poll``)
        outcome = wait_until(settled, deadline_in(timeout), self.wait_poll)
        if outcome == "superseded":
            log.warning("mlcheckpoint: step %d will not be protected: a newer step was named "
                        "for replication first", step)
        elif outcome == "retired":
            log.warning("mlcheckpoint: step %d is no longer held here (retention kept the newer "
                        "steps): it will not be protected", step)
        return outcome == "protected"

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while not self._closed.is_set():
            # Look for work when a save lands here (notify), and at each poll: the poll is how
            # this rank hears of what nothing here is told of: a round rank 0 named, or the
            # last round closed (the node's leader, in the store; its other ranks, in the
            # node's file), or a save that DCP committed in its checkpoint process (PROCESS
            # mode). A leader with no round in flight looks less often (``Rounds.wait_s``).
            self._wake.wait(self.rounds.wait_s(self.poll_interval))
            self._wake.clear()
            if not self._active.is_set():
                continue
            try:
                self._replicate_rounds()
            except Exception as e:  # noqa: BLE001  (keep replicating later steps whatever happened)
                # e.g. the c10d store is gone with rank 0's node: say so now and then, not 4x/s
                self._logs.log(logging.ERROR, "pass", "mlcheckpoint: replication pass failed: %s",
                               e, exc_info=True)
                self._closed.wait(self.poll_interval)

    def _replicate_rounds(self) -> None:
        """Do the round the job is in, if it is named; on rank 0, name the next one."""
        self._share_metadata()
        r = self.rounds.next()
        self._round_closed()
        if r is not None:
            self._replicate(r)
            self._wake.set()  # the next round may be named already
        elif self.topology.rank == 0:
            self._propose_next()

    def _round_closed(self) -> None:
        """If a round closed since the last look and left its save protected: note it (in the
        node's history, once per node) and, on rank 0, warn if the link cannot keep up."""
        closed, r = self.rounds.closed, self.rounds.protected
        if closed <= self._closed_seen:
            return
        self._closed_seen = closed
        if r is None or r.number != closed:
            return
        self.seed_protected(r.step)
        if not self.topology.is_node_leader:
            return
        saves = save_times(self.store.inventory.all())
        state = self.state(r.step)
        now = self._record_protected(r.step, saves)
        if self.topology.rank == 0 and state is not None and state.state == "replicated":
            self._lag_warning.check(state.seconds, save_interval(saves), now.lag_steps,
                                    self.transport.budget.lag_advice())

    def _record_protected(self, step: int, saves: dict[int, float] | None = None) -> ProtectionStatus:
        """Record in the node's history (once per node and step: local rank 0) that ``step``
        is protected, whoever found it: the replicator thread at a round's verdict, or
        ``protection()`` and a save's retention, from the node's view of the rounds.
        ``mlcheckpoint ls`` reads it, so after ``close`` it names the step ``protection()`` did."""
        saves = save_times(self.store.inventory.all()) if saves is None else saves
        now = protection_status(step, saves, None, 0)
        with self._lock:  # the replicator thread and protection()'s caller both come here
            if not self.topology.is_node_leader or step == self._recorded_protected:
                return now
            self._recorded_protected = step
        state = self.state(step)
        history.record(self.store.job_dir, "protected", step=step, rank=self.topology.rank,
                       lag_steps=now.lag_steps, age_seconds=now.age_seconds, copies=self.places,
                       push_seconds=None if state is None else round(state.seconds, 6))
        return now

    def _propose_next(self) -> None:
        """Rank 0: once every rank finished the current round, name the newest save this node
        holds the metadata of (or the same save again, after a back-off, if it is not
        protected yet)."""
        inv = self.store.inventory.all()
        saves = {s: sid for s, st in sorted(inv.items()) if (sid := st.save_id) is not None}
        if not saves:
            return
        step = max(saves)
        save_id = saves[step]
        last = self.rounds.latest
        repeat = last is not None and (step, save_id) == (last.step, last.save_id)
        if repeat and time.monotonic() < self._repeat_at:
            return
        if last is not None and not repeat and step < last.step:
            return  # nothing newer than the last round's save
        if not self.rounds.all_done(self.rounds.finished):
            return  # the round in flight is not done everywhere yet: look again at the next poll
        if repeat:
            p = self.rounds.protected
            if p is not None and (p.step, p.save_id) == (step, save_id):
                self._repeat_at = math.inf  # done with it: until a newer save comes
                return
            self._repeat_after = min(2 * self._repeat_after, MAX_REPEAT_S)
        else:
            self._repeat_after = 1.0
        # Saves older than ``step`` and never named are superseded: each rank marks its own
        # when it takes the round (``_replicate``).
        self._repeat_at = time.monotonic() + self._repeat_after
        self._push_metadata(step, save_id)  # first: it says which shards need no sending (store/coverage.py)
        self.rounds.propose(self.rounds.finished + 1, step, save_id)
        self._wake.set()  # take it at once, not at the next poll

    def _share_metadata(self) -> None:
        """Rank 0: send the metadata of the saves that only this node holds to every other
        node, so that each node holds every save whole that it holds the shards of, as after
        the manager's saves. Small, and once per save: not coalesced like shards."""
        with self._saves_lock:
            due, self._metadata_due = self._metadata_due, {}
        later: dict[int, str] = {}
        for step, save_id in sorted(due.items()):
            st = self.store.inventory.step_state(step)
            if st.save_id == save_id:
                self._push_metadata(step, save_id)
            elif st.save_id is None and st.shard_saves.get(self.topology.rank) == save_id:
                # The coordinator's metadata is not written yet (a DCP-native save tells us at
                # our shard's commit): look again at the next pass. Gone or replaced: drop it.
                later[step] = save_id
        if later:
            with self._saves_lock:
                self._metadata_due = {**later, **self._metadata_due}

    def _mark_superseded(self, steps: list[int], newer: int) -> None:
        """This rank's own shards of ``steps`` stay unpushed (listing and ``drain`` say so)."""
        inv = {s: self.store.inventory.step_state(s) for s in steps}
        with self._lock:
            for s, st in inv.items():
                save = st.shard_saves.get(self.topology.rank)
                if save is None:
                    continue
                rep = self._state_for(s, save)
                if rep.state in ("committed", "failed"):
                    rep.state, rep.reason = "superseded", f"step {newer} is newer"

    def _replicate(self, r: Round) -> None:
        """Push this rank's shard of round ``r``'s save (rank 0: also its metadata), then
        report the round done, whatever happened: the job moves on together."""
        with self._saves_lock:
            skipped = [s for s in self._unreplicated if s < r.step]
            for s in skipped:
                del self._unreplicated[s]
            if self._unreplicated.get(r.step) == r.save_id:  # (not a later save of that step)
                del self._unreplicated[r.step]
            self._superseded += len(skipped)
        counted = False
        try:
            older = [s for s in self.store.inventory.steps() if s < r.step]
            self._mark_superseded(older, r.step)
            st = self.store.inventory.step_state(r.step)
            if st.shard_saves.get(self.topology.rank) == r.save_id:
                counted = self._push_shard(r.step, r.save_id, st)
            else:
                with self._lock:
                    rep = self._state_for(r.step, r.save_id)
                    rep.state, rep.reason = "failed", "this rank's shard of that save is not here"
                log.info("mlcheckpoint: rank %d holds no shard of step %d (save %s) to replicate",
                         self.topology.rank, r.step, r.save_id)
            if self.metadata_targets and st.save_id == r.save_id:
                self._push_metadata(r.step, r.save_id)
        finally:
            self.rounds.finish(r, counted)

    def _state_for(self, step: int, save_id: str) -> StepReplication:
        """The state of this save of ``step``; a new save of the step starts afresh. Call with
        the lock held."""
        st = self._states.get(step)
        if st is None or st.save_id != save_id:
            st = self._states[step] = StepReplication(step, save_id)
        return st

    def _metadata_done(self, step: int, save_id: str | None) -> bool:
        with self._lock:
            st = self._states.get(step)
            return st is not None and st.metadata_pushed == save_id

    def _push_shard(self, step: int, save_id: str, st: StepState) -> bool:
        """Push to every partner what it lacks of this rank's shard of the save (``st``: the
        step here): the whole shard, only the items data parallelism's copies do not cover
        (a partial replica), or nothing (``coverage.plan_push``). True when every partner now
        has what it needs (its node's leader counts the shard, ``Rounds.finish``)."""
        with self._lock:
            rep = self._state_for(step, save_id)
            if rep.state == "replicated":  # the round was named again for another rank's sake
                return False
            rep.attempts += 1
        t0 = time.perf_counter()
        budget = self.transport.budget
        before = budget.profile()
        sent = skipped = 0
        try:
            m = self.store.shards.read_manifest(step, self.topology.rank)
            plan = coverage.plan_push(m, st, self._step_items(step, st, save_id), save_id,
                                     self.topology, self.places, self.targets)
            to_push = {peer: coverage.pushed_bytes(m, plan[peer]) for peer in self.targets}
            # What the node sends per save (its ranks' shards alike): the default budget's need.
            budget.need(self.topology.local_world_size * sum(to_push.values()))
            for peer in self.targets:
                skipped += m.data_bytes - to_push[peer]
                if peer in rep.acked_by or plan[peer] == []:
                    continue
                sent += self.transport.push_shard(peer, step, self.topology.rank, plan[peer])
                rep.acked_by.append(peer)
        except (MLCheckpointError, OSError) as e:
            with self._lock:
                rep.state, rep.reason = "failed", str(e)
            self._logs.warning(f"push {step}", "mlcheckpoint: replicating step %d of rank %d "
                               "failed (attempt %d): %s", step, self.topology.rank, rep.attempts, e)
            return False
        pushed = any(push != [] for push in plan.values())
        after = budget.profile()
        with self._lock:
            # (a push that sent nothing: every item was on its places already)
            rep.state, rep.reason = "replicated", None if pushed else "covered by data-parallel copies"
            rep.bytes, rep.seconds = sent, time.perf_counter() - t0 if pushed else 0.0
            rep.send_seconds = after["send_seconds"] - before["send_seconds"]
            rep.budget_wait_seconds = after["budget_wait_seconds"] - before["budget_wait_seconds"]
            self.skipped_bytes += skipped
        history.record(self.store.job_dir, "replicate", step=step, rank=self.topology.rank,
                       targets=self.targets, bytes=sent, seconds=round(rep.seconds, 6),
                       send_seconds=round(rep.send_seconds, 6),
                       budget_wait_seconds=round(rep.budget_wait_seconds, 6),
                       rate_bytes_per_s=round(budget.current_rate()),
                       transport=self.transport.name, skipped_bytes=skipped)
        log.debug("replicated step %d rank %d to %s: %d bytes in %.3fs (sending %.3fs, held "
                  "back by the budget %.3fs, at %.0f B/s; %d bytes covered by copies)", step,
                  self.topology.rank, self.targets, sent, rep.seconds, rep.send_seconds,
                  rep.budget_wait_seconds, budget.current_rate(), skipped)
        # Counted for the save the partners acknowledged: they compared save ids, so an ack
        # for an earlier save of this step cannot count here.
        return True

    def _step_items(self, step: int, st: StepState, save_id: str) -> StepItems | None:
        """The items of the save's owners by copy group, from its metadata here (None
        without it: then every shard goes whole)."""
        if st.save_id != save_id:
            return None
        try:
            return self.store.metadata.items(step)
        except (ShardNotFoundError, CorruptShardError):
            return None

    def _push_metadata(self, step: int, save_id: str) -> None:
        if self._metadata_done(step, save_id) or not self.metadata_targets:
            return
        try:
            for peer in self.metadata_targets:
                self.transport.push_metadata(peer, step)
        except (MLCheckpointError, OSError) as e:
            self._logs.warning("metadata", "mlcheckpoint: pushing metadata of step %d failed: %s",
                               step, e)
            return
        with self._lock:
            self._state_for(step, save_id).metadata_pushed = save_id
        self.rdzv.add(self.rdzv.counter("meta", step, save_id), 1)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def drain(self, timeout: float) -> None:
        """Wait until this rank's newest shard is replicated, superseded or given up on (best
        effort: rank 0 names it in a round once the round in flight is done)."""
        self.transport.budget.training_over()  # no step to slow: nothing held back, no back-off
        wait_until(self._drained, deadline_in(timeout), self.wait_poll)

    def _drained(self) -> bool:
        """Whether this rank's newest shard is replicated (with its metadata), superseded or
        given up on."""
        inv = self.store.inventory.all()
        mine = [s for s, st in inv.items() if self.topology.rank in st.committed_ranks]
        newest = max(mine, default=None)
        if newest is None:
            return True
        st = self.state(newest)
        if st is None:
            return False
        if st.state in ("superseded", "failed"):  # (nothing more will be sent of it)
            return True
        meta_ok = (not self.metadata_targets or not inv[newest].has_metadata
                   or self._metadata_done(newest, inv[newest].save_id))
        return st.state == "replicated" and meta_ok

