"""Replication rounds: which save every rank of the job replicates next, agreed job-wide, with
control traffic per node, not per rank.

When the link cannot carry every checkpoint, replication must skip steps. If each rank skipped
to its own newest step, ranks would skip different steps, and the replicas a node keeps for its
partner would rarely add up to one whole step: a step is only worth keeping twice when *every*
rank's shard of it is on two nodes. So the job replicates in rounds:

1. rank 0 names round g: one save (step, save id), the newest one whose metadata it holds;
2. every rank pushes its shard of that save (rank 0 also the metadata), then reports done;
3. once every rank has reported round g, round g is *closed*, and rank 0 names round g + 1.
   Saves made in between were never named: they are *superseded*.

A round that left its save unprotected (a partner was down, a replaced node had not rebuilt
its own shard yet) is named again after a back-off, unless a newer save exists by then.

Who talks to the c10d store: one rank per node, its *leader* (local rank 0). It reads each
round from the store and writes it into a file of the node's job directory
(``layout.JobPaths.round``); the node's other ranks read that file and report each round done
in a file of their own (``JobPaths.round_done``). Once all of its node's ranks are done, the
leader reports for the node with one count of the shards they pushed and one count of nodes
done; the leader whose count completes the round seals the verdict (closed, and whether its
save is now protected) under the round's key. Each leader then learns the verdict with one
look and writes it into the node's file. Per round that is a handful of store operations per
node; an idle job costs each leader one look per ``IDLE_LOOK_S`` (and the other ranks none).

What a stranger can do: rounds, verdicts and counters live in the c10d store under HMAC-named
keys and each value is sealed with the job's secret (``core/keys.Seal``), which never passes
through the store; a stranger who can reach it can neither find the keys nor steer
replication with a forged round. The node's files are in the job directory (0700: only the
job's user can open them) and are sealed too, bound to this run's session: a file an earlier
run left behind, or any file not written by this run, is ignored. Each is written to a
temporary name and renamed, so a reader never sees half of one.

Failures: every look is one store operation or one file read, never a blocking wait, so a
``close`` is never held. If a node's leader dies, its other ranks see no new round; nothing of
theirs waits on it beyond its own timeout (``wait_replicated``, ``drain``). If any rank dies,
its node never reports and no further round is named: the job is failing, as it is when a rank
dies in a collective.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..._messages import RateLimitedLog
from ...errors import ProtocolError
from ...store.layout import JobPaths
from ...topology import Topology
from ..core.keys import Seal
from ..core.rendezvous import Rendezvous

log = logging.getLogger(__name__)
IDLE_LOOK_S = 1.0  # a leader with no round in flight looks for the next one at most this seldom
QUICK_LOOKS = 4  # looks per poll on a hop that asks the store nothing (or once per job)
MAX_FILE_BYTES = 4096  # a node round file is a few hundred bytes


@dataclass(frozen=True)
class Round:
    """Round ``number`` replicates the save ``save_id`` of ``step``."""

    number: int
    step: int
    save_id: str


def protected_in_store(rdzv: Rendezvous, step: int, save_id: str, world_size: int) -> bool:
    """Every rank's shard and the metadata of this save are on their partners (the job-wide
    counters: the ranks' pushed shards, counted per node, and rank 0's metadata)."""
    shards = rdzv.add(rdzv.counter("shards", step, save_id), 0)
    meta = rdzv.add(rdzv.counter("meta", step, save_id), 0)
    return shards >= world_size and meta >= 1


class Rounds:
    """One rank's view of the job's replication rounds (see the module docstring).

    Every rank calls ``next`` (the round to do now, if any) and ``finish`` (done with it); only
    rank 0 calls ``propose``, once ``all_done(finished)``. What the rank knows of the job:
    ``latest`` (the newest round named), ``closed`` (the newest round every rank finished) and
    ``protected`` (the newest closed round whose save was then protected). One thread calls
    these methods (the replicator's); others may read those three attributes.
    """

    def __init__(self, rdzv: Rendezvous, topology: Topology, paths: JobPaths):
        self.rdzv, self.topology, self.paths = rdzv, topology, paths
        self.leader = topology.is_node_leader
        self._seal = Seal(rdzv.secret(), rdzv.session, rdzv.prefix)
        self._round_key = f"node/{topology.node_rank}/round"  # what seals the node's file
        self.finished = 0  # the last round this rank finished
        self.latest: Round | None = None
        self.closed = 0
        self.protected: Round | None = None
        self.floor = 0  # rounds up to this one were named before a resume (``forget``)
        self._counted = 0  # leader: shards its own rank pushed (newly) in the round it finished
        self._reported = 0  # leader: the last round it reported for the node
        # file -> ((inode, mtime, size), its message) when last read: unchanged files are not
        # read again
        self._seen: dict[str, tuple[tuple[int, int, int], dict | None]] = {}
        self._look = 0.0  # leader: seconds until the next look while idle (grows)
        self._expect = False  # leader: a save was made here, so a new round is coming
        self._logs = RateLimitedLog(log, interval=60.0)
        os.makedirs(os.path.dirname(paths.round), mode=0o700, exist_ok=True)

    # ------------------------------------------------------------------ every rank
    def next(self) -> Round | None:
        """The round this rank is to do now, if it is named yet. A leader looks in the store
        (one operation, or none), any other rank in the node's file."""
        if self.leader:
            self._lead()
        else:
            self._follow()
        r = self.latest
        return r if r is not None and r.number == self.finished + 1 else None

    def finish(self, r: Round, counted: bool) -> None:
        """This rank is done with round ``r`` (pushed, or gave up); ``counted``: its shard
        newly reached every partner in this round (the save's ``shards`` count goes up by one)."""
        self.finished = r.number
        if self.leader:
            self._counted = int(counted)
            self._lead()  # the node's other ranks may all be done already
        else:
            self._seal.write_file(self.paths.round_done(self.topology.local_rank), self._done_key(),
                        {"round": r.number, "counted": int(counted)})

    def all_done(self, number: int) -> bool:
        """Every rank finished round ``number`` (round 0 is the start: always done)."""
        return number <= self.closed

    def taken(self) -> Round | None:
        """The newest round named since the last ``forget``."""
        r = self.latest
        return r if r is not None and r.number > self.floor else None

    def forget(self) -> None:
        """After a resume: the rounds named so far may name steps the resume dropped."""
        self.floor = self.latest.number if self.latest is not None else 0

    def wait_s(self, poll: float) -> float:
        """How long the replicator may sleep before its next look. A quarter of ``poll`` on a
        hop of a round's path that costs the store nothing or once per job (a rank waiting for
        its node's file after a save, a leader for its node's reports, rank 0 for the verdict),
        so the hops the node adds cost less than a poll each; ``poll`` while a round is in
        flight or a save was made here; otherwise a leader looks less and less often, up to
        ``IDLE_LOOK_S``."""
        longest = max(poll, IDLE_LOOK_S)
        quick = poll / QUICK_LOOKS
        if not self.leader:
            return quick if self._expect else poll
        if self._reported < self.finished or (self.topology.rank == 0 and self._in_flight()):
            return quick
        if self.topology.rank == 0 or self._expect or self._in_flight():
            self._look = poll
            return poll
        wait = min(max(self._look, poll), longest)
        self._look = min(2 * wait, longest)
        return wait

    def hurry(self) -> None:
        """A save was made here (every rank makes each save): rank 0 names it next, so look
        sooner until a new round comes."""
        self._expect = True

    # ------------------------------------------------------------------ rank 0
    def propose(self, number: int, step: int, save_id: str) -> Round:
        """Name round ``number`` (rank 0 only, once the previous round is all done)."""
        key = self.rdzv.counter("round", number)
        self.rdzv.store.set(key, self._seal.seal(key, {"step": step, "save_id": save_id}))
        log.debug("replication round %d: step %d (save %s)", number, step, save_id)
        self.latest = Round(number, step, save_id)
        self._publish()
        return self.latest

    # ------------------------------------------------------------------ the node's leader
    def _in_flight(self) -> bool:
        latest = self.latest
        return latest is not None and self.closed < latest.number

    def _lead(self) -> None:
        if self._reported < self.finished:
            self._report()
        if self._reported == self.finished and self.closed < self._reported:
            self._look_closed(self._reported)
        if (self.closed == self.finished and self.topology.rank != 0
              and (self.latest is None or self.latest.number == self.finished)):
            self._look_named(self.finished + 1)

    def _report(self) -> None:
        """Once every rank of the node finished the round this leader finished: count the
        node's pushed shards and the node done, in two store operations. The count that
        completes the round seals its verdict."""
        number, r = self.finished, self.latest
        assert r is not None and r.number == number
        counted = self._counted
        for local in range(1, self.topology.local_world_size):
            done = self._read(self.paths.round_done(local), self._done_key(local))
            if done is None or done.get("round") != number:
                return  # not yet: look again at the next pass
            c = done.get("counted")
            if c not in (0, 1) or isinstance(c, bool):
                raise ProtocolError(f"node round report of local rank {local} is malformed: {done}")
            counted += c
        if counted:
            self.rdzv.add(self.rdzv.counter("shards", r.step, r.save_id), counted)
        if self.rdzv.add(self.rdzv.counter("round-done", number), 1) >= self.topology.num_nodes:
            protected = protected_in_store(self.rdzv, r.step, r.save_id, self.topology.world_size)
            key = self.rdzv.counter("round-closed", number)
            self.rdzv.store.set(key, self._seal.seal(key, {"protected": protected}))
        self._reported = number

    def _look_closed(self, number: int) -> None:
        """One look for round ``number``'s verdict; the node's file gets it."""
        key = self.rdzv.counter("round-closed", number)
        store = self.rdzv.store
        if not store.check([key]):
            return
        try:
            protected = self._seal.open(key, store.get(key)).get("protected")
        except ProtocolError as e:  # not ours: the true verdict is set over it
            self._logs.warning("closed", "mlcheckpoint: ignored a replication round verdict: %s", e)
            return
        self.closed = number
        r = self.latest
        if protected is True and r is not None and r.number == number:
            self.protected = r
        self._publish()

    def _look_named(self, number: int) -> None:
        """One look for round ``number`` (an operation more once it is there)."""
        key = self.rdzv.counter("round", number)
        store = self.rdzv.store
        if not store.check([key]):
            return
        msg = self._seal.open(key, store.get(key))
        step, save_id = msg.get("step"), msg.get("save_id")
        if not isinstance(step, int) or not isinstance(save_id, str):
            raise ProtocolError(f"replication round {number} is malformed: {msg}")
        self.latest = Round(number, step, save_id)
        self._expect = False
        self._look = 0.0
        self._publish()

    def _publish(self) -> None:
        """The node's file: what this leader knows, for the node's other ranks."""
        def three(r: Round | None) -> list | None:
            return None if r is None else [r.number, r.step, r.save_id]

        self._seal.write_file(self.paths.round, self._round_key,
                    {"latest": three(self.latest), "closed": self.closed,
                     "protected": three(self.protected)})

    # ------------------------------------------------------------------ the node's other ranks
    def _follow(self) -> None:
        view = self._read(self.paths.round, self._round_key)
        if view is None:
            return
        try:
            latest, protected = _round(view.get("latest")), _round(view.get("protected"))
            closed = view.get("closed")
            if not isinstance(closed, int) or isinstance(closed, bool):
                raise TypeError(f"closed is not a round number: {closed!r}")
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"node round file is malformed: {e}: {view}") from None
        if latest is not None and latest.number > self.finished:
            self._expect = False
        self.latest, self.closed, self.protected = latest, closed, protected

    # ------------------------------------------------------------------ files and keys
    def _done_key(self, local: int | None = None) -> str:
        local = self.topology.local_rank if local is None else local
        return f"node/{self.topology.node_rank}/round-done/{local}"

    def _read(self, path: str, key: str) -> dict | None:
        """The message sealed in ``path`` by this run (None: missing, or not sealed by this
        run). A file is read again only once it changed (a rename gives it a new inode)."""
        try:
            st = os.stat(path)  # one system call while nothing changed
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            seen = self._seen.get(path)
            if seen is not None and seen[0] == sig:
                return seen[1]
            # (replaced again before this read: the next stat differs, and it is read again)
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        msg = None
        if len(raw) > MAX_FILE_BYTES:
            self._logs.warning(path, "mlcheckpoint: ignored %s: larger than %d bytes", path,
                               MAX_FILE_BYTES)
        else:
            try:
                msg = self._seal.open(key, raw)
            except ProtocolError as e:  # e.g. left by an earlier run of the job: not ours
                self._logs.log(logging.DEBUG, path, "mlcheckpoint: ignored %s: %s", path, e)
        self._seen[path] = (sig, msg)
        return msg


def _round(v: object) -> Round | None:
    if v is None:
        return None
    if (not isinstance(v, list) or len(v) != 3 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                          for x in v[:2]) or not isinstance(v[2], str)):
        raise TypeError(f"not a round: {v!r}")
    return Round(v[0], v[1], v[2])
