"""Job-wide facts exchanged through the job's c10d store: secret, addresses, counters.

Keys live under ``mlcheckpoint/<job_id>/<restart>/`` so a restarted job never reads what an
earlier incarnation left in a long-lived store.
"""

from __future__ import annotations

import os
import secrets
import threading
from datetime import timedelta

import torch.distributed as dist


class Rendezvous:
    def __init__(self, store: dist.Store, job_id: str, rank: int, world_size: int,
                 timeout: float = 300.0):
        generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"mlcheckpoint/{job_id}/{generation}/"
        self._base = _innermost(store)
        self._local = threading.local()
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.timeout = timeout
        self._addresses: dict[int, str] = {}

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
    def from_default_group(cls, job_id: str, timeout: float = 300.0) -> "Rendezvous":
        from torch.distributed.distributed_c10d import _get_default_store
        return cls(_get_default_store(), job_id, dist.get_rank(), dist.get_world_size(), timeout)

    def _get(self, key: str) -> bytes:
        self.store.wait([key], timedelta(seconds=self.timeout))
        return self.store.get(key)

    def secret(self) -> bytes:
        """The per-job secret every replication connection must prove it knows."""
        if self.rank == 0:
            self.store.set("secret", secrets.token_hex(32))
        return bytes.fromhex(self._get("secret").decode())

    def publish(self, kind: str, value: str) -> None:
        self.store.set(f"{kind}/{self.rank}", value)

    def lookup(self, kind: str, rank: int) -> str:
        key = (kind, rank)
        if key not in self._addresses:  # type: ignore[comparison-overlap]
            self._addresses[key] = self._get(f"{kind}/{rank}").decode()  # type: ignore[index]
        return self._addresses[key]  # type: ignore[index]

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))


def _innermost(store: dist.Store) -> dist.Store:
    """The store under any PrefixStores (we use our own prefix)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store
