"""Job-wide facts: the replication secret, and what goes through the job's c10d store
(listener addresses, counters, the pg transport's authenticated control messages).

Store keys live under ``mlcheckpoint/<job_id>/<restart>/`` so a restarted job never reads what
an earlier incarnation left in a long-lived store.

The secret never passes through the c10d store: anyone who can reach the master port can read
and write it. It comes from the launcher (``MLCHECKPOINT_REPLICATION_SECRET``, hex, or
``MLCHECKPOINT_REPLICATION_SECRET_FILE``, a file only the job's user can read) or, by default,
rank 0 makes one and shares it over a dedicated gloo group of the job.
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
from datetime import timedelta

import torch.distributed as dist

from ...errors import ConfigError
from ...settings import default, secret_sources
from . import keys

SECRET_ENV = "MLCHECKPOINT_REPLICATION_SECRET"
SECRET_FILE_ENV = "MLCHECKPOINT_REPLICATION_SECRET_FILE"
MIN_SECRET_BYTES = 16
SESSION_BYTES = 16


class Rendezvous:
    """The job's c10d store under our prefix, plus the replication secret and run session.

    Args:
        store: the job's c10d store.
        secret: the replication secret; default: the launcher's (see ``configured_secret``).
        session: random bytes every rank of this run shares (``from_default_group`` makes them);
            control messages of one run are never accepted in another.
        generation: torchrun's restart count (``settings.Launcher``): keeps one attempt's
            keys apart from the next.
    """

    def __init__(self, store: dist.Store, job_id: str, rank: int, world_size: int,
                 timeout: float = default("rendezvous"), *, secret: bytes | None = None,
                 session: bytes = b"", generation: str = default("restart_count")):
        self._prefix = f"mlcheckpoint/{job_id}/{generation}"  # PrefixStore adds the "/"
        self._base = _innermost(store)
        self._local = threading.local()
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.timeout = timeout
        self._secret = secret
        self.session = session
        self._addresses: dict[tuple[str, int], str] = {}

    @property
    def prefix(self) -> str:
        """Where our keys live in the job's store (``<prefix>/<key>``)."""
        return self._prefix

    @property
    def store(self) -> dist.Store:
        """This thread's own client: a c10d client is not safe to share between threads (one
        thread's blocking wait garbles another's request), so each gets its own connection."""
        client = getattr(self._local, "client", None)
        if client is None:
            base = self._base.clone() if hasattr(self._base, "clone") else self._base
            client = self._local.client = dist.PrefixStore(self._prefix, base)
        return client

    @classmethod
    def from_default_group(cls, job_id: str, timeout: float = default("rendezvous"), *,
                           group: dist.ProcessGroup | None = None,
                           generation: str = default("restart_count")) -> Rendezvous:
        """Collective (every rank calls it): the default group's store, and the secret and
        session agreed over ``group`` (a dedicated gloo group; default: a new one)."""
        from torch.distributed.distributed_c10d import _get_default_store
        if group is None:
            group = dist.new_group(backend="gloo")
        secret, session = share_secret(group)
        return cls(_get_default_store(), job_id, dist.get_rank(), dist.get_world_size(), timeout,
                   secret=secret, session=session, generation=generation)

    def _get(self, key: str) -> bytes:
        self.store.wait([key], timedelta(seconds=self.timeout))
        return self.store.get(key)

    def secret(self) -> bytes:
        """The per-job secret every replication connection must prove it knows."""
        if self._secret is None:
            self._secret = configured_secret()
        if self._secret is None:
            raise ConfigError(f"no replication secret: construct the Rendezvous with "
                              f"from_default_group, or set {SECRET_ENV} or {SECRET_FILE_ENV}")
        return self._secret

    def publish(self, kind: str, value: str) -> None:
        self.store.set(f"{kind}/{self.rank}", value)

    def lookup(self, kind: str, rank: int) -> str:
        key = (kind, rank)
        if key not in self._addresses:
            self._addresses[key] = self._get(f"{kind}/{rank}").decode()
        return self._addresses[key]

    def known(self, kind: str, rank: int) -> str | None:
        """What ``lookup`` found before for ``rank``, without asking the store (None: never
        looked up)."""
        return self._addresses.get((kind, rank))

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))

    def counter(self, *parts: object) -> str:
        """The store key of a job-wide counter (e.g. acknowledged replicas of one save): named by
        an HMAC under the secret, so a stranger who can reach the store cannot find it, let alone
        raise it and make a step look protected."""
        name = "/".join(map(str, parts)).encode()
        return keys.counter_key(self.secret(), self.session, name)


def _innermost(store: dist.Store) -> dist.Store:
    """The store under any PrefixStores (we use our own prefix)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


# --------------------------------------------------------------------------- the secret
def _parse_secret(text: str, source: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"{source}: the replication secret must be hex digits") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{source}: the replication secret must be at least {MIN_SECRET_BYTES} "
                          f"bytes ({2 * MIN_SECRET_BYTES} hex digits), not {len(secret)}")
    return secret


def read_secret_file(path: str) -> bytes:
    """The hex secret in ``path``, refused unless only its owner, this user, can access it."""
    try:
        with open(path) as f:
            st = os.fstat(f.fileno())  # the file we read, not whatever the path names later
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{SECRET_FILE_ENV}={path}: not a regular file")
            if st.st_uid != os.geteuid():
                raise ConfigError(f"{SECRET_FILE_ENV}={path}: owned by uid {st.st_uid}, "
                                  f"not by this user (uid {os.geteuid()})")
            if st.st_mode & 0o077:
                raise ConfigError(f"{SECRET_FILE_ENV}={path}: mode {stat.S_IMODE(st.st_mode):o} "
                                  f"lets other users access it; chmod 600 it")
            text = f.read(1 << 16)
    except OSError as e:
        raise ConfigError(f"{SECRET_FILE_ENV}={path}: {e.strerror or e}") from None
    return _parse_secret(text, f"{SECRET_FILE_ENV}={path}")


def configured_secret() -> bytes | None:
    """The secret the launcher gave: ``$MLCHECKPOINT_REPLICATION_SECRET`` (hex), else the file
    named by ``$MLCHECKPOINT_REPLICATION_SECRET_FILE``; None when neither is set."""
    env, path = secret_sources()
    if env:
        return _parse_secret(env, SECRET_ENV)
    return read_secret_file(path) if path else None


def share_secret(group: dist.ProcessGroup) -> tuple[bytes, bytes]:
    """(secret, session) that every rank of ``group`` agrees on; collective.

    One all_gather: each rank says whether the launcher configured a secret (and a fingerprint
    of it, or why reading it failed); rank 0 adds a fresh secret and the run's session. Every
    rank reaches the same verdict, so a misconfigured rank fails the whole job at once rather
    than leaving the others waiting in a later collective.
    """
    mine: dict = {}
    try:
        configured = configured_secret()
        mine["fingerprint"] = None if configured is None else keys.fingerprint(configured)
    except ConfigError as e:
        configured, mine["error"] = None, str(e)
    if dist.get_rank(group) == 0:
        mine["session"] = secrets.token_bytes(SESSION_BYTES)
        if configured is None:
            mine["fresh"] = secrets.token_bytes(32)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return _agree(everyone, configured)


def _agree(everyone: list[dict], configured: bytes | None) -> tuple[bytes, bytes]:
    errors = [f"rank {r}: {d['error']}" for r, d in enumerate(everyone) if "error" in d]
    if errors:
        raise ConfigError("replication secret: " + "; ".join(errors))
    prints = {d["fingerprint"] for d in everyone}
    if len(prints) > 1:
        with_secret = [r for r, d in enumerate(everyone) if d["fingerprint"] is not None]
        raise ConfigError(f"replication secret: ranks disagree ({SECRET_ENV} or "
                          f"{SECRET_FILE_ENV} set on ranks {with_secret}, not the same value "
                          f"or not on every rank)")
    secret = configured if configured is not None else everyone[0]["fresh"]
    return secret, everyone[0]["session"]
