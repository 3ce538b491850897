"""Every key derived from the job's replication secret, and everything proved or sealed with
one: the one module that holds HMAC.

- the TCP handshake's proofs (``proof``, ``proves``; ``tcp/protocol.py``);
- the names of the job's counters in the c10d store (``counter_key``; ``Rendezvous.counter``);
- the fingerprint that tells whether two ranks hold the same secret (``fingerprint``);
- ``Seal``: control messages and node-local files sealed under a key of this run's session
  (the pg transport's mailbox and doorbell, the replication rounds);
- ``blob_digest``, ``blob_matches``: a blob in the store is accepted only with the digest its
  sealed message names.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from ...errors import ProtocolError
from ...store.layout import TMP


def _derive(secret: bytes, purpose: bytes) -> bytes:
    """A key (or name) for one ``purpose`` of the secret; none reveals the secret or another."""
    return hmac.new(secret, purpose, hashlib.sha256).digest()


def proof(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    """One side's proof in the TCP handshake that it knows the secret (``label``: whose)."""
    return _derive(secret, label + a + b)


def proves(got: bytes, expected: bytes) -> bool:
    """Whether a proof or MAC received is the one expected (in constant time)."""
    return hmac.compare_digest(got, expected)


def counter_key(secret: bytes, session: bytes, name: bytes) -> str:
    """The store key of the job-wide counter ``name``: a stranger who can reach the store
    cannot find it without the secret."""
    return "c/" + hmac.new(secret, session + name, hashlib.sha256).hexdigest()[:32]


def fingerprint(secret: bytes) -> str:
    """Tells whether two ranks hold the same secret without revealing it."""
    return hmac.new(secret, b"mlcheckpoint secret fingerprint", hashlib.sha256).hexdigest()[:16]


def blob_digest(raw: bytes) -> str:
    """The digest a sealed message names for a blob it leaves in the store."""
    return hashlib.sha256(raw).hexdigest()


def blob_matches(raw: bytes, digest: object) -> bool:
    """Whether ``raw`` is the blob a sealed message named by ``digest``."""
    return isinstance(digest, str) and hmac.compare_digest(blob_digest(raw), digest)


class Seal:
    """Seals messages in the c10d store (and node-local files) under a key of the secret and
    this run's session: an HMAC over the message, the key it was written to and, for a reply,
    the nonce of the request it answers (why: ``pg/control.py``'s docstring)."""

    def __init__(self, secret: bytes, session: bytes, prefix: str):
        self._key = _derive(secret, b"mlcheckpoint pg control\0" + session)
        self._prefix = prefix

    def _mac(self, key: str, answers: str, body: str) -> str:
        text = f"{self._prefix}/{key}\0{answers}\0{body}".encode()
        return hmac.new(self._key, text, hashlib.sha256).hexdigest()

    def seal(self, key: str, msg: dict, answers: str = "") -> str:
        """``msg`` as stored at ``key`` (a reply names the nonce of the request it ``answers``)."""
        body = json.dumps(msg, separators=(",", ":"))
        return json.dumps({"body": body, "mac": self._mac(key, answers, body)})

    def open(self, key: str, raw: bytes, answers: str = "") -> dict:
        """The message stored at ``key``; ProtocolError unless we sealed it for that key."""
        try:
            outer = json.loads(raw)
            body, mac = outer["body"], outer["mac"]
            if not isinstance(body, str) or not isinstance(mac, str):
                raise TypeError("body and mac must be strings")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
            raise ProtocolError(f"control message at {key} is malformed: {e}") from None
        if not hmac.compare_digest(mac, self._mac(key, answers, body)):
            raise ProtocolError(f"control message at {key} failed authentication")
        try:
            msg = json.loads(body)
        except ValueError as e:
            raise ProtocolError(f"control message at {key} is malformed: {e}") from None
        if not isinstance(msg, dict):
            raise ProtocolError(f"control message at {key} is not an object")
        return msg

    def write_file(self, path: str, key: str, msg: dict) -> None:
        """``msg`` sealed for ``key`` into the node-local file ``path`` (0600, in the 0700 job
        directory), whole or not at all: written aside, then renamed in."""
        tmp = path + TMP
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self.seal(key, msg).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
