"""The process-group transport's control channel: sealed messages in the job's c10d store.

Anyone who can reach the master port can read and write that store, so every control message
is sealed: an HMAC under a key derived from the job's secret and this run's session, over the
message, the store key it was written to and, for a reply, the random nonce of the request it
answers. A message is read once, at its key (a rank reads its mailbox slots in order), so a
stranger can neither forge one nor replay an old one; the most it can do is delete them.
Metadata blobs go through the store too and are accepted only with the digest the sealed
message names.

Who looks at the store while nothing happens: one rank per node. Each node has a *doorbell*, a
counter in the store that ``Mailbox.post`` raises after it wrote a request for a rank of that
node. The node's leader (local rank 0) alone reads it, every ``mailbox_poll``, and writes what
it read into a file of the node's job directory (``JobPaths.pg_bell``); every rank of the node
reads that file and looks in its mailbox only when it changed. A request is in its slot before
its ring is counted, so a rank that looks after seeing a count finds every request rung up to
it. An idle job costs one store operation per node and poll; a request waits at most two polls
more (the leader's, then its rank's). The doorbell is named by an HMAC like the job's counters
(a stranger who cannot find it cannot set it to something that is not a count); the file is
sealed like the messages (one left by another run is ignored). A stranger who rings a bell
only makes a node's ranks look in their mailboxes once more.
"""

from __future__ import annotations

import logging
import os
import secrets
from datetime import timedelta

from ...errors import ProtocolError
from ...topology import Topology
from ..core import keys
from ..core.keys import Seal
from ..core.rendezvous import Rendezvous

log = logging.getLogger(__name__)
MAX_TAG = 1 << 30  # gloo tags are 32-bit
MAX_BELL_FILE_BYTES = 4096  # a sealed count is a couple of hundred bytes


def bell_key(rdzv: Rendezvous, node: int) -> str:
    """The store key of ``node``'s doorbell (see the module docstring)."""
    return rdzv.counter("pg-bell", node)


class Doorbell:
    """When this rank should look in its mailbox: once the count its node's leader read from
    the node's doorbell changed (see the module docstring). ``topology``: this rank's place
    (its node, and whether it is the node's leader)."""

    def __init__(self, rdzv: Rendezvous, seal: Seal, path: str, topology: Topology):
        self.node = topology.node_of(rdzv.rank)
        self.leader = topology.is_node_leader
        self.path, self._rdzv, self._seal = path, rdzv, seal
        self._key = bell_key(rdzv, self.node)
        self._file_key = f"node/{self.node}/pg-bell"
        self._count: int | None = None  # leader: the count last written into the file
        self._raw: bytes | None = None  # the file as this rank last read it
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)

    def relay(self) -> None:
        """The leader's look (one store operation): a new count goes into the node's file,
        whole or not at all (renamed in)."""
        count = self._rdzv.add(self._key, 0)
        if count == self._count:
            return
        self._seal.write_file(self.path, self._file_key, {"count": count})
        self._count = count

    def rang(self) -> bool:
        """The node's file changed since the last look and this run's leader wrote it: a
        request may be waiting (no store operation)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_BELL_FILE_BYTES + 1)
        except FileNotFoundError:
            return False
        if raw == self._raw:
            return False
        self._raw = raw
        try:
            if len(raw) > MAX_BELL_FILE_BYTES:
                raise ProtocolError(f"larger than {MAX_BELL_FILE_BYTES} bytes")
            self._seal.open(self._file_key, raw)
        except ProtocolError as e:  # e.g. left by an earlier run of the job: not ours
            log.debug("mlcheckpoint: ignored %s: %s", self.path, e)
            return False
        return True


class Mailbox:
    """This rank's side of the control channel: requests into peers' mailboxes (each rung on
    its node's doorbell), replies to them, and metadata blobs, all sealed; every wait bounded
    by ``timeout`` seconds."""

    def __init__(self, rdzv: Rendezvous, job_id: str, timeout: float, topology: Topology):
        self.rdzv, self.job_id, self.timeout = rdzv, job_id, timeout
        self.topology = topology  # whose node's doorbell a request to a peer rings
        self.seal = Seal(rdzv.secret(), rdzv.session, rdzv.prefix)

    def post(self, peer: int, msg: dict, nonce: str | None = None) -> tuple[int, str]:
        """Put a request in ``peer``'s mailbox, then ring its node's doorbell; returns its
        (tag, nonce)."""
        tag = self.rdzv.add("pg/tag", 1) % MAX_TAG
        seq = self.rdzv.add(f"pg/seq/{peer}", 1)
        nonce = nonce or secrets.token_hex(16)
        msg = {**msg, "from": self.rdzv.rank, "tag": tag, "nonce": nonce, "job_id": self.job_id}
        key = f"pg/mbox/{peer}/{seq}"
        self.rdzv.store.set(key, self.seal.seal(key, msg))
        self.rdzv.add(bell_key(self.rdzv, self.topology.node_of(peer)), 1)  # after the set: see above
        return tag, nonce

    def take_request(self, seq: int) -> bytes | None:
        """What is in our mailbox slot ``seq`` (removed: read once), or None if nothing yet."""
        key = f"pg/mbox/{self.rdzv.rank}/{seq}"
        if not self.rdzv.store.check([key]):
            return None
        raw = self.rdzv.store.get(key)
        self.rdzv.store.delete_key(key)
        return raw

    def open_request(self, seq: int, raw: bytes) -> dict:
        """The request taken from slot ``seq``; ProtocolError unless a rank of this run sealed
        it for that slot."""
        return self.seal.open(f"pg/mbox/{self.rdzv.rank}/{seq}", raw)

    def reply(self, peer: int, tag: int, nonce: str, msg: dict, phase: str = "r") -> None:
        key = f"pg/reply/{peer}/{tag}/{phase}"
        self.rdzv.store.set(key, self.seal.seal(key, msg, answers=nonce))

    def await_reply(self, tag: int, nonce: str, phase: str = "r") -> dict:
        """The reply to our request (tag, nonce), whatever its status says (the client reads
        it: ``core/transport.py``); ProtocolError if none comes in time or if it is not sealed
        for this request."""
        key = f"pg/reply/{self.rdzv.rank}/{tag}/{phase}"
        try:
            self.rdzv.store.wait([key], timedelta(seconds=self.timeout))
        except RuntimeError as e:  # c10d raises on timeout
            raise ProtocolError(f"no reply within {self.timeout}s: {e}") from None
        raw = self.rdzv.store.get(key)
        self.rdzv.store.delete_key(key)
        try:
            return self.seal.open(key, raw, answers=nonce)
        except ProtocolError as e:
            raise ProtocolError(f"refused a reply: {e}") from None

    def put_blob(self, owner: int, nonce: str, raw: bytes) -> str:
        """Leave ``raw`` in the store for the other side of request ``nonce``; its digest."""
        # c10d stores bytes as they are (its type stub says str; the binding takes bytes too)
        self.rdzv.store.set(f"pg/blob/{owner}/{nonce}", raw)  # type: ignore[arg-type]
        return keys.blob_digest(raw)

    def take_blob(self, owner: int, nonce: str, digest: object) -> bytes:
        """The blob request ``nonce`` names, if it has the digest its sealed message names."""
        key = f"pg/blob/{owner}/{nonce}"
        if not self.rdzv.store.check([key]):  # get() would wait for it until the store's timeout
            raise ProtocolError("the metadata blob its message names is not in the store")
        raw = self.rdzv.store.get(key)
        self.rdzv.store.delete_key(key)
        if not keys.blob_matches(raw, digest):
            raise ProtocolError("metadata blob does not match the digest its message names")
        return raw
