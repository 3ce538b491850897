"""File names inside a job directory. The only place that knows the on-disk layout.

    <local_dir>/<job_id>/
        .lock                                 flock for step-level bookkeeping
        .retention.lock                       flock: retention passes (alone) against commits (shared)
        .claim.lock                           flock held shared by every rank of the live run on this node (store/claim.py)
        claim.json                            the run that holds (or last held) the directory: host, pids, start, persistent_dir
        history.jsonl                         what was saved, loaded and persisted (history.py)
        locks/fetch-<nn>.lock                 flocks serialising fetches of one shard on a node
        locks/bandwidth                       the node's replication bandwidth schedule (replication/core/budget.py)
        locks/round                           the replication round the node's leader read (replication/schedule/rounds.py)
        locks/round-<local_rank:05d>          the round that rank of the node last finished
        locks/pg-bell                         the node's pg doorbell count its leader read (replication/pg/control.py)
        steps/<step:012d>/metadata            DCP global metadata (self-verifying, renamed in)
        steps/<step:012d>/rank-<r:05d>.data   raw item bytes of rank r's shard
        steps/<step:012d>/rank-<r:05d>.manifest   per-item checksums; its presence = committed
        steps/<step:012d>/*.inflight, *.tmp   in-flight writes: invisible, removed by gc
        pool/rank-<r:05d>-<token>.buf         retired shard buffers kept for reuse (pages stay touched)
        pool/rank-<r:05d>-<token>.buf.inflight a pool buffer being prepared
        orphans/<step:012d>-<token>/          a complete step a resume did not load, or an
                                              earlier run's step a first save set aside

Other modules build paths with ``JobPaths`` and ask ``classify(name)`` what a directory entry
is; none of them tests a name's prefix or suffix.

A file in flight ended in ``.partial`` in earlier versions (the word now names only a partial
replica, ``Manifest.partial``): such leftovers classify as in flight too, and gc removes them.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass

STEPS = "steps"
POOL = "pool"
ORPHANS = "orphans"
LOCKS = "locks"
LOCK = ".lock"
RETENTION_LOCK = ".retention.lock"
CLAIM_LOCK = ".claim.lock"
CLAIM = "claim.json"
FINISHED = "finished.json"  # the last run closed cleanly (store/claim.py: mark_finished)
HISTORY = "history.jsonl"
BANDWIDTH = "bandwidth"
ROUND = "round"
PG_BELL = "pg-bell"
METADATA = "metadata"
INFLIGHT = ".inflight"  # a shard's buffer (or a pool buffer) being written
LEGACY_INFLIGHT = ".partial"  # INFLIGHT in earlier versions: what their crashes left
TMP = ".tmp"

# Stripes of the fetch locks: a bounded set of files, whatever the number of shards.
FETCH_LOCK_STRIPES = 64

_STEP_RE = re.compile(r"^(\d{12})$")
_ORPHAN_RE = re.compile(r"^(\d{12})-[0-9a-f]{8}$")
_DATA_RE = re.compile(r"^rank-(\d{5})\.data$")
_MANIFEST_RE = re.compile(r"^rank-(\d{5})\.manifest$")
_POOL_RE = re.compile(r"^rank-(\d{5})-[0-9a-f]{16}\.buf$")
_OWNED_RE = re.compile(r"^rank-(\d{5})")  # any file of rank r's, in flight ones included
_FETCH_LOCK_RE = re.compile(r"^fetch-\d{2}\.lock$")
_ROUND_DONE_RE = re.compile(rf"^{ROUND}-\d{{5}}$")


class Kind(enum.Enum):
    """What an entry of a job directory is."""

    STEP = "step"                  # steps/<step>/
    ORPHAN = "orphan"              # orphans/<step>-<token>/: set aside by a resume
    DATA = "data"                  # a shard's bytes (committed once its manifest exists)
    MANIFEST = "manifest"          # a shard's manifest: the commit point
    METADATA = "metadata"          # a step's global metadata
    INFLIGHT = "in flight"         # a shard's buffer being written (rank-r.data.inflight)
    TEMP = "temp"                  # a manifest or metadata being written (*.tmp, other *.inflight)
    POOL_BUFFER = "pool buffer"    # a retired buffer kept for reuse
    POOL_INFLIGHT = "pool in flight"  # a pool buffer being prepared
    LOCK = "lock"                  # the node lock, a fetch lock, the bandwidth schedule, a round file
    CLAIM = "claim"                # the live run's claim on the directory and its record
    HISTORY = "history"
    FOLDER = "folder"              # steps/, pool/, orphans/, locks/
    UNKNOWN = "unknown"            # not ours


@dataclass(frozen=True)
class Entry:
    """A classified directory entry: its kind, the owner rank its name carries (if any) and
    the step it names (step and orphan folders)."""

    kind: Kind
    rank: int | None = None
    step: int | None = None

    @property
    def in_flight(self) -> bool:
        """Left by a write that has not finished (or never will: gc's to remove)."""
        return self.kind in (Kind.INFLIGHT, Kind.TEMP, Kind.POOL_INFLIGHT)

    @property
    def is_buffer(self) -> bool:
        """A shard's data file, committed or not: worth recycling into the pool."""
        return self.rank is not None and self.kind in (Kind.DATA, Kind.INFLIGHT)


_FIXED = {METADATA: Kind.METADATA, LOCK: Kind.LOCK, RETENTION_LOCK: Kind.LOCK, BANDWIDTH: Kind.LOCK,
          ROUND: Kind.LOCK, PG_BELL: Kind.LOCK, CLAIM_LOCK: Kind.CLAIM, CLAIM: Kind.CLAIM,
          HISTORY: Kind.HISTORY, STEPS: Kind.FOLDER, POOL: Kind.FOLDER, ORPHANS: Kind.FOLDER,
          LOCKS: Kind.FOLDER}


def classify(name: str) -> Entry:
    """What the directory entry ``name`` (a base name, anywhere in a job directory) is."""
    if name in _FIXED:
        return Entry(_FIXED[name])
    if m := _STEP_RE.match(name):
        return Entry(Kind.STEP, step=int(m.group(1)))
    if m := _ORPHAN_RE.match(name):
        return Entry(Kind.ORPHAN, step=int(m.group(1)))
    if m := _DATA_RE.match(name):
        return Entry(Kind.DATA, rank=int(m.group(1)))
    if m := _MANIFEST_RE.match(name):
        return Entry(Kind.MANIFEST, rank=int(m.group(1)))
    if m := _POOL_RE.match(name):
        return Entry(Kind.POOL_BUFFER, rank=int(m.group(1)))
    if _FETCH_LOCK_RE.match(name) or _ROUND_DONE_RE.match(name):
        return Entry(Kind.LOCK)
    owned = _OWNED_RE.match(name)
    rank = int(owned.group(1)) if owned else None
    for suffix in (INFLIGHT, LEGACY_INFLIGHT):
        if name.endswith(suffix):
            base = name.removesuffix(suffix)
            if pool := _POOL_RE.match(base):
                return Entry(Kind.POOL_INFLIGHT, rank=int(pool.group(1)))
            if data := _DATA_RE.match(base):
                return Entry(Kind.INFLIGHT, rank=int(data.group(1)))
    if name.endswith((INFLIGHT, LEGACY_INFLIGHT, TMP)):  # some other file being written: nothing to recycle
        return Entry(Kind.TEMP, rank=rank)
    return Entry(Kind.UNKNOWN, rank=rank)


def step_dirname(step: int) -> str:
    if not isinstance(step, int) or step < 0 or step >= 10**12:
        raise ValueError(f"step must be an int in [0, 1e12), got {step!r}")
    return f"{step:012d}"


def parse_step_dirname(name: str) -> int | None:
    e = classify(name)
    return e.step if e.kind is Kind.STEP else None


def parse_step(checkpoint_id: object) -> int:
    """The step a DCP checkpoint id names: an int, a numeric string, or
    'mlcheckpoint://<job>/<step>' (what the storage writer and reader call themselves)."""
    s = str(checkpoint_id).rstrip("/").rsplit("/", 1)[-1]
    if not s.isdigit():
        raise ValueError(f"checkpoint_id {checkpoint_id!r} does not name a step")
    return int(s)


def orphan_dirname(step: int, token: str) -> str:
    return f"{step_dirname(step)}-{token}"


def parse_orphan_dirname(name: str) -> int | None:
    e = classify(name)
    return e.step if e.kind is Kind.ORPHAN else None


def data_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.manifest"


def parse_manifest_name(name: str) -> int | None:
    e = classify(name)
    return e.rank if e.kind is Kind.MANIFEST else None


def pool_name(rank: int, token: str) -> str:
    return f"rank-{rank:05d}-{token}.buf"


def parse_pool_name(name: str) -> int | None:
    e = classify(name)
    return e.rank if e.kind is Kind.POOL_BUFFER else None


@dataclass(frozen=True)
class JobPaths:
    """Every path of one job's directory on this node."""

    job_dir: str

    @property
    def steps_dir(self) -> str:
        return os.path.join(self.job_dir, STEPS)

    @property
    def pool_dir(self) -> str:
        return os.path.join(self.job_dir, POOL)

    @property
    def orphans_dir(self) -> str:
        return os.path.join(self.job_dir, ORPHANS)

    @property
    def lock(self) -> str:
        return os.path.join(self.job_dir, LOCK)

    @property
    def retention_lock(self) -> str:
        return os.path.join(self.job_dir, RETENTION_LOCK)

    @property
    def history(self) -> str:
        return os.path.join(self.job_dir, HISTORY)

    @property
    def claim_lock(self) -> str:
        """The flock every rank of the run that holds the directory keeps, shared."""
        return os.path.join(self.job_dir, CLAIM_LOCK)

    @property
    def claim(self) -> str:
        """The record of the run that holds, or last held, the directory (store/claim.py)."""
        return os.path.join(self.job_dir, CLAIM)

    @property
    def finished(self) -> str:
        """Present while the run that last held the directory closed cleanly and no run holds
        it since (store/claim.py)."""
        return os.path.join(self.job_dir, FINISHED)

    def step_numbers(self) -> list[int]:
        """The steps that have a folder here, oldest first."""
        try:
            names = os.listdir(self.steps_dir)
        except FileNotFoundError:
            return []
        return sorted(e.step for e in map(classify, names) if e.kind is Kind.STEP and e.step is not None)

    @property
    def bandwidth(self) -> str:
        """The node's replication bandwidth schedule, shared by its ranks' processes."""
        return os.path.join(self.job_dir, LOCKS, BANDWIDTH)

    @property
    def round(self) -> str:
        """The replication round the node's leader read from the c10d store, for the node's
        other ranks (replication/schedule/rounds.py)."""
        return os.path.join(self.job_dir, LOCKS, ROUND)

    @property
    def pg_bell(self) -> str:
        """The count of the node's pg doorbell its leader read from the c10d store, for the
        node's ranks to know when to look in their mailboxes (replication/pg/control.py)."""
        return os.path.join(self.job_dir, LOCKS, PG_BELL)

    def round_done(self, local_rank: int) -> str:
        """The round the node's rank ``local_rank`` last finished, for the node's leader."""
        return os.path.join(self.job_dir, LOCKS, f"{ROUND}-{local_rank:05d}")

    def fetch_lock(self, stripe: int) -> str:
        return os.path.join(self.job_dir, LOCKS, f"fetch-{stripe % FETCH_LOCK_STRIPES:02d}.lock")

    def step_dir(self, step: int) -> str:
        return os.path.join(self.steps_dir, step_dirname(step))

    def data(self, step: int, rank: int) -> str:
        return os.path.join(self.step_dir(step), data_name(rank))

    def inflight(self, step: int, rank: int) -> str:
        """Where rank's shard of ``step`` is written before its commit."""
        return self.data(step, rank) + INFLIGHT

    def manifest(self, step: int, rank: int) -> str:
        return os.path.join(self.step_dir(step), manifest_name(rank))

    def manifest_tmp(self, step: int, rank: int) -> str:
        return self.manifest(step, rank) + TMP

    def metadata(self, step: int) -> str:
        return os.path.join(self.step_dir(step), METADATA)

    def metadata_tmp(self, step: int, token: str) -> str:
        return f"{self.metadata(step)}.{token}{TMP}"

    def pool_buffer(self, rank: int, token: str) -> str:
        return os.path.join(self.pool_dir, pool_name(rank, token))

    def pool_inflight(self, rank: int, token: str) -> str:
        """Where a pool buffer is prepared (gc's if its maker dies)."""
        return self.pool_buffer(rank, token) + INFLIGHT

    def orphan(self, step: int, token: str) -> str:
        return os.path.join(self.orphans_dir, orphan_dirname(step, token))


@dataclass(frozen=True)
class ItemLocation:
    """Where one DCP item lives; stored as ``WriteResult.storage_data`` in the global metadata.

    The checksum travels in the global metadata too, so a reader can verify bytes against what
    the coordinator recorded, whichever node's copy it reads.
    """

    rank: int
    offset: int
    nbytes: int
    checksum: int
    is_tensor: bool = True  # raw tensor bytes; False: as DCP stores it (pickled, torch.save)
    # (rank, offset) of agreeing copies of these bytes in other ranks' shards: kept by a
    # data-parallel replica of the item (``store/coverage.py``); read when ``rank``'s shard is
    # on no surviving node.
    copies: tuple[tuple[int, int], ...] = ()
    # The checksum's algorithm (``integrity/digests.py``); None: xxh3, as every location
    # pickled before items named one (such a pickle reads this class default).
    algorithm: str | None = None
