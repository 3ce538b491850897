"""The replication transports facing strangers and broken peers.

- The job's secret never passes through the c10d store (anyone who reaches the master port
  can read and write it): a real torchrun job is probed from outside, as a store client.
- Idle and slow connections (slowloris) to a rank's listener do not stop replication, and do
  not flood its log.
- Malformed requests from a peer that knows the secret get an error reply, to every operation
  of both transports, and the listener keeps serving.
- The process-group transport's control messages in the store are sealed: a stranger's,
  forged or replayed message is refused.

Real processes, sockets, stores and process groups throughout; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from cluster import WORKERS, Cluster
from helpers import WAIT, end_peer, wait_for
from tcp_job import (
    assert_serves,
    connect,
    frames_to_eof,
    half_close,
    make_shard,
    manifest_dict,
)
from typing_extensions import Self

from mlcheckpoint import ConfigError
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.replication.core.keys import Seal
from mlcheckpoint.replication.core.rendezvous import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    Rendezvous,
    configured_secret,
)
from mlcheckpoint.replication.pg.control import MAX_TAG, bell_key
from mlcheckpoint.replication.pg.transport import MAX_PIECE_BYTES, MIN_PIECE_BYTES
from mlcheckpoint.replication.tcp import protocol as p
from mlcheckpoint.store import LocalStore, ManifestItem, MetadataHeader
from mlcheckpoint.store.manifest import encode_metadata

pytestmark = pytest.mark.timeout(400)

STEPS = 4  # steps the attacked job saves while under attack
STEP_TIMEOUT = 30  # how long it waits for each to be protected (never reached when it works)
STEP_PAUSE = 2.0  # between steps: the attack outlasts the listener's 5 s login deadline
MAX_WARNINGS = 20  # log lines the attacked rank may write (thousands before rate limiting)


# =========================================================================== a job under attack
def wait_results(c: Cluster, name: str, count: int, timeout: float) -> dict[int, dict]:
    """Results ``name`` of ``count`` ranks; fails early if a node exits first."""
    def ready():
        res = c.results(name)
        if len(res) >= count:
            return res
        if any(n.proc is not None and n.proc.poll() is not None for n in c.nodes):
            pytest.fail(f"a node exited before reporting {name!r}; logs:\n{c.logs()}")
        return None

    return wait_for(ready, f"{name} from {count} ranks", timeout=timeout, interval=0.1, diag=c.logs)


@pytest.fixture(scope="module")
def attacked_job():
    """A 2-node job that saved and replicated step 0 and waits for ``go`` to save more."""
    with Cluster(2, 1) as c:
        c.start("under_attack.py", str(STEPS), str(STEP_TIMEOUT), str(STEP_PAUSE))
        ready = wait_results(c, "ready", 2, timeout=150)
        c10d = dist.TCPStore("127.0.0.1", ready[0]["master_port"], is_master=False,
                             timeout=timedelta(seconds=30))
        try:
            yield c, ready, c10d
        finally:
            del c10d
            open(os.path.join(c.out_dir, "stop"), "w").close()
            with contextlib.suppress(AssertionError):  # Cluster's exit kills what is left
                c.wait(60)


def store_items(c10d: dist.TCPStore) -> dict[str, bytes]:
    """Every key in the job's c10d store and its value, as any client can read them."""
    out = {}
    for key in c10d.list_keys():
        with contextlib.suppress(Exception):  # a key deleted meanwhile
            if c10d.check([key]):
                out[key] = c10d.get(key)
    return out


@pytest.mark.slow
def test_secret_is_not_in_the_c10d_store(attacked_job):
    """The replication secret is never readable in the job's c10d store (in any encoding),
    while the listener addresses are published there."""
    c, ready, c10d = attacked_job
    assert ready[0]["protected"] and ready[1]["protected"], c.logs()
    secret = bytes.fromhex(ready[0]["secret"])
    assert ready[1]["secret"] == ready[0]["secret"], "ranks did not agree on one secret"
    items = store_items(c10d)
    prefix = ready[0]["prefix"]
    ours = [k for k in items if k.startswith("mlcheckpoint/")]
    # we are looking at the job's store: the listener addresses are there
    assert any(k.endswith("/tcp/0") for k in ours) and any(k.endswith("/tcp/1") for k in ours), ours
    for key, value in items.items():
        for form in (secret, secret.hex().encode(), secret.hex().upper().encode()):
            assert form not in value, f"the replication secret is readable in the store at {key!r}"
    assert f"{prefix}/tcp/0" in ours and f"{prefix}/tcp/1" in ours, sorted(items)
    assert not [k for k in ours if "//" in k], f"double slash in keys: {ours}"
    job = c.job_id
    for old in (f"mlcheckpoint/{job}/0//secret", f"mlcheckpoint/{job}/0/secret", f"{prefix}/secret"):
        assert not c10d.check([old]), f"{old} exists"


def _secret_guesses(items: dict[str, bytes]) -> set[bytes]:
    """Everything in the store an intruder could try as the secret."""
    guesses = set()
    for value in items.values():
        guesses.add(value)
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            guesses.add(bytes.fromhex(value.decode().strip()))
    return {g for g in guesses if g}


@pytest.mark.slow
def test_nothing_in_the_store_logs_in(attacked_job):
    """No value read from the store logs in to a replication listener; the real secret does."""
    _c, ready, c10d = attacked_job
    items = store_items(c10d)
    host, port = ready[1]["address"].rsplit(":", 1)
    assert ready[1]["address"].encode() in items.values()  # published there for all to read
    guesses = _secret_guesses(items)
    assert len(guesses) >= 3, items
    for guess in guesses:
        with socket.create_connection((host, int(port)), timeout=WAIT) as s, \
                pytest.raises(p.ProtocolError):
            p.client_handshake(s, guess)
    # the listener is up and the real secret does log in: the guesses failed on the secret
    with socket.create_connection((host, int(port)), timeout=WAIT) as s:
        p.client_handshake(s, bytes.fromhex(ready[1]["secret"]))


class Slowloris:
    """``idle`` connections that never say a word and ``slow`` ones that send a random byte a
    tick, to one listener; whichever the server ends is opened again, at most ``pace`` a tick
    (a patient attacker, not a connection flood)."""

    def __init__(self, address: str, idle: int = 200, slow: int = 10, pace: int = 10,
                 tick: float = 0.1):
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.kinds = ["idle"] * idle + ["slow"] * slow
        self.pace, self.tick = pace, tick
        self.conns: list[socket.socket | None] = [None] * len(self.kinds)
        self.opened = self.ended = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="slowloris")

    def __enter__(self) -> Self:
        for i in range(len(self.conns)):
            self._open(i)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for s in self.conns:
            if s is not None:
                s.close()

    def _open(self, i: int) -> None:
        try:
            s = socket.create_connection(self.target, timeout=5)
        except OSError:
            return
        s.setblocking(False)
        self.conns[i] = s
        self.opened += 1

    def _alive(self, s: socket.socket) -> bool:
        try:
            return s.recv(4096) != b""  # the greeting, read and ignored
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            reopen = self.pace
            for i, s in enumerate(self.conns):
                if s is not None and not self._alive(s):
                    s.close()
                    self.conns[i], s = None, None
                    self.ended += 1
                if s is None and reopen:
                    reopen -= 1
                    self._open(i)
                elif s is not None and self.kinds[i] == "slow":
                    with contextlib.suppress(OSError):
                        s.send(os.urandom(1))


def warning_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line and "mlcheckpoint" in line]


@pytest.mark.slow
def test_replication_survives_a_slowloris(attacked_job):
    """200 idle and 10 slowly-talking connections stay open against rank 1's listener while
    the job saves; every step is still protected (rank 0 pushes its shard and the metadata to
    rank 1 each time), and rank 1 logs a few lines about it, not thousands."""
    c, ready, _ = attacked_job
    with Slowloris(ready[1]["address"]) as attack:
        assert attack.opened == len(attack.kinds), "could not open the attacking connections"
        open(os.path.join(c.out_dir, "go"), "w").close()
        res = wait_results(c, "attacked", 2, timeout=STEPS * STEP_TIMEOUT + 120)
    assert attack.ended > 0, "the listener never ended an idle connection: was it attacked?"
    for rank in (0, 1):
        protected = res[rank]["protected"]
        assert protected == {str(s): True for s in range(1, STEPS + 1)}, \
            f"rank {rank}: steps protected under attack: {protected}; logs:\n{c.logs()}"
    warnings = warning_lines(c.nodes[1].log())
    assert len(warnings) <= MAX_WARNINGS, \
        f"rank 1 logged {len(warnings)} warnings under attack:\n" + "\n".join(warnings[:50])


# =========================================================================== the secret's sources
def test_secret_from_the_environment_and_a_private_file(clean_env, store_dir):
    secret = secrets.token_bytes(32)
    clean_env.setenv(SECRET_ENV, secret.hex())
    assert configured_secret() == secret
    clean_env.setenv(SECRET_ENV, "abcd")  # too short
    with pytest.raises(ConfigError, match="at least"):
        configured_secret()
    clean_env.setenv(SECRET_ENV, "not hex at all, not hex at all, not hex")
    with pytest.raises(ConfigError, match="hex"):
        configured_secret()
    clean_env.delenv(SECRET_ENV)
    assert configured_secret() is None

    path = os.path.join(store_dir, "secret")
    with open(path, "w") as f:
        f.write(secret.hex() + "\n")
    os.chmod(path, 0o600)
    clean_env.setenv(SECRET_FILE_ENV, path)
    assert configured_secret() == secret
    for mode in (0o640, 0o604, 0o644):  # readable by the group or by others: refused
        os.chmod(path, mode)
        with pytest.raises(ConfigError, match="chmod 600"):
            configured_secret()
    clean_env.setenv(SECRET_FILE_ENV, os.path.join(store_dir, "missing"))
    with pytest.raises(ConfigError, match="missing"):
        configured_secret()


def test_a_rendezvous_without_a_secret_refuses_to_make_one(clean_env):
    """Without the launcher's secret or a process group to agree on one, there is no secret,
    rather than one a stranger could read from the store."""
    clean_env.delenv(SECRET_ENV, raising=False)
    clean_env.delenv(SECRET_FILE_ENV, raising=False)
    c10d = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    try:
        with pytest.raises(ConfigError, match=SECRET_ENV):
            Rendezvous(c10d, "job", 0, 2).secret()
    finally:
        del c10d


# =========================================================================== malformed requests (TCP)
@pytest.fixture
def thread_deaths():
    """Exceptions that ended any thread during the test (threading.excepthook)."""
    died: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda a: died.append(f"{a.thread.name}: {a.exc_type.__name__}: {a.exc_value}")
    try:
        yield died
    finally:
        threading.excepthook = previous


BAD_INTS = [None, "5", "../5", -1, 10**30, 1.5, True, [], [5], {}, {"v": 5}]
BAD_STRS = [None, 5, 1.5, [], {}, ["t"], "x" * 5000]
BAD_DICTS = [None, 5, "manifest", [], [{}], {}, {"items": 5}, {"items": {}}]
BAD_RANGES = [None, 5, "0,16", {}, {"0": 16}, [5], [None], [[0]], [[0, 1, 2]], [["0", 16]],
              [[0, None]], [[1.5, 2]], [[-1, 16]], [[0, -16]], [[0, 10**30]], [[10**30, 1]],
              [[4090, 16]], [[0, 16], "x"]]
BAD_FLAGS = [None, 0, 1, "yes", "true", [], {}]
DELETE = object()  # a field left out


def _item(**over) -> dict:
    it = {"key": "w", "offset": 0, "nbytes": 64, "checksum": checksum(bytes(64)), "kind": "bytes",
          "dtype": None, "shape": None}
    return {**it, **over}


def _manifests(job_id: str, step: int, owner: int) -> dict[str, object]:
    """Manifests of (step, owner), each wrong in one way."""
    base = manifest_dict(job_id, step, owner)
    cases: dict[str, object] = {f"manifest={v!r}"[:60]: v for v in BAD_DICTS}
    bad_fields = {
        "job_id": [DELETE, None, 5, [], {}, "../x"], "step": [DELETE, None, "5", -1, [], 10**30, step + 1],
        "rank": [DELETE, None, "1", -1, [], owner + 1], "items": [DELETE, None, "x", 5, {}],
        "data_bytes": [DELETE, None, "64", -1, [], 10**30, 32], "format": [DELETE, None, "1", 2],
        "algorithm": [DELETE, None, 5, "md5"], "created": [None, "5", [], {}],
        "world_size": [None, "1", []], "save_id": [None, 5, "x" * 100], "run_id": [None, 5, []],
        "partial": [None, "yes", 1, []],  # a partial replica's mark: true or false, nothing else
    }
    for field, values in bad_fields.items():
        for v in values:
            m = dict(base)
            if v is DELETE:
                del m[field]
            else:
                m[field] = v
            cases[f"manifest.{field}={'missing' if v is DELETE else repr(v)}"[:60]] = m
    item_cases = [[1], ["w"], [None], [{}], [_item(key=5)], [_item(offset="0")], [_item(nbytes=-1)],
                  [_item(offset=10**30)], [_item(checksum="abc")], [_item(kind=[])],
                  [_item(dtype=5)], [_item(shape="3x4")], [_item(shape=["a"])], [_item(extra=1)]]
    for items in item_cases:
        cases[f"manifest.items={items!r}"[:60]] = {**base, "items": items}
    cases["manifest.extra_field"] = {**base, "evil": 1}
    cases["manifest.partial_of_nothing"] = {**base, "partial": True, "items": []}
    cases["manifest.partial_item_past_the_shard"] = {**base, "partial": True, "items": [
        _item(offset=base["data_bytes"] - 8, nbytes=64)]}
    cases["manifest_over_max_shard"] = manifest_dict(job_id, step, owner, 1 << 50,
                                                     [ManifestItem("w", 0, 64, 0)])
    return cases


def _metadata_blobs(job_id: str, step: int) -> dict[str, bytes]:
    """Metadata files a peer might send that are wrong in one way each."""
    payload = b"not really DCP metadata"
    good = {"job_id": job_id, "step": step, "world_size": 2, "ranks": [0, 1], "total_bytes": 64,
                "payload_bytes": len(payload), "checksum": checksum(payload)}

    def blob(**over) -> bytes:
        fields = {**good, **over}
        fields = {k: v for k, v in fields.items() if v is not DELETE}
        return json.dumps(fields).encode() + b"\n" + payload

    cases = {"no_header_line": b"x" * 64, "header_not_json": b"{nope\n" + payload,
             "header_a_list": b"[1, 2]\n" + payload, "header_not_utf8": b"\xff\xfe\xfd\n" + payload,
             "header_empty_object": b"{}\n" + payload, "header_extra_field": blob(evil=1),
             "checksum_mismatch": blob(checksum=checksum(b"other")),
             "truncated_payload": blob()[:-3], "other_step": blob(step=step + 1),
             "other_job": blob(job_id="../x")}
    for field in ("job_id", "step", "world_size", "ranks", "total_bytes", "payload_bytes", "checksum"):
        for v in (DELETE, None, "5", {"a": 1}, 1.5, ["a"]):
            cases[f"{field}={'missing' if v is DELETE else repr(v)}"] = blob(**{field: v})
    for v in (None, "dp-copies", [5], ["x" * 100]):  # each node's copies mode: short words
        cases[f"copy_modes={v!r}"[:60]] = blob(copy_modes=v)
    return cases


def malformed_requests(job_id: str) -> dict[str, tuple[dict, bytes | None]]:
    """name -> (request, payload sent once the server says "ready"), each malformed once."""
    put = {"op": "put_shard", "job_id": job_id, "step": 5, "owner": 1,
           "manifest": manifest_dict(job_id, 5, 1)}
    bases = {
        "put_shard": put,
        "put_part": {"op": "put_part", "job_id": job_id, "step": 5, "owner": 1,
                     "token": secrets.token_hex(16), "index": 1},
        "read_items": {"op": "read_items", "job_id": job_id, "step": 5, "owner": 1, "ranges": [[0, 16]]},
        "put_metadata": {"op": "put_metadata", "job_id": job_id, "step": 5, "nbytes": 64, "checksum": 1},
        "get_metadata": {"op": "get_metadata", "job_id": job_id, "step": 5},
    }
    fields = {"step": BAD_INTS, "owner": BAD_INTS, "index": BAD_INTS + [0, 16], "token": BAD_STRS,
              "nbytes": BAD_INTS + [0], "ranges": BAD_RANGES, "streams": BAD_INTS + [0, 17],
              "job_id": BAD_STRS + ["../x", "other-job"], "op": [None, 5, [], {}, ["put_shard"], "rm", "get_shard"],
              "paced": BAD_FLAGS}
    # Fields a request may leave out: only their wrong values are tried.
    optional = {"streams": ("put_shard",), "paced": ("read_items", "get_metadata")}
    cases: dict[str, tuple[dict, bytes | None]] = {}
    for op, base in bases.items():
        for field, values in fields.items():
            if field not in base and op not in optional.get(field, ()):
                continue
            for v in [DELETE, *values]:
                req = dict(base)
                if v is DELETE:
                    if field in optional:
                        continue
                    del req[field]
                else:
                    req[field] = v
                cases[f"{op}.{field}={'missing' if v is DELETE else repr(v)}"[:80]] = (req, bytes(64))
    for name, m in _manifests(job_id, 5, 1).items():
        cases[f"put_shard.{name}"] = ({**put, "manifest": m}, bytes(64))
    for name, blob in _metadata_blobs(job_id, 5).items():
        req = {"op": "put_metadata", "job_id": job_id, "step": 5, "nbytes": len(blob), "checksum": 1}
        cases[f"put_metadata.body.{name}"] = (req, blob)
    return cases


def test_malformed_requests_get_an_error_reply(make_job, thread_deaths, caplog):
    """Every operation, every field wrong in every way: an error frame back, nothing written,
    no thread dies, and the listener then serves a real push."""
    caplog.set_level(logging.WARNING, logger="mlcheckpoint")
    job = make_job()
    receiver, sender = job.endpoint(0), job.endpoint(1)
    make_shard(receiver.store, 5, 1, 4096)  # something real for read_items to find
    cases = malformed_requests(job.job_id)
    assert len(cases) > 250
    wrong = {}
    for name, (req, payload) in cases.items():
        with connect(receiver) as s:
            s.settimeout(30)  # generous: a listener thread that died leaves us no answer
            p.client_handshake(s, receiver.secret)
            p.send_frame(s, req)

            def on_ready(s=s, payload=payload):
                s.sendall(payload or b"")
                half_close(s)

            try:
                frames = frames_to_eof(s, on_ready=on_ready)
            except OSError as e:
                wrong[name] = f"no answer: {e!r}"
                continue
        statuses = [f.get("status") for f in frames]
        if not statuses or statuses[-1] != "error" or set(statuses) - {"ready", "error"}:
            wrong[name] = statuses
    assert not wrong, f"{len(wrong)} malformed requests not answered with an error: {wrong}"
    assert thread_deaths == []
    bad_records = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert bad_records == [], [r.getMessage() for r in bad_records]
    assert receiver.store.inventory.steps() == [5] and receiver.store.inventory.step_state(5).committed_ranks == {1}
    assert not os.path.exists(receiver.store.paths.metadata(5))
    assert_serves(job, receiver, sender, step=7)


# =========================================================================== the pg mailbox
class PgPeer:
    """A PgTransport in a process of its own (tests/workers/pg_mailbox.py), whose store mailbox
    this test writes to: as an authenticated peer (it knows the secret and the run's session)
    or as a stranger."""

    def __init__(self, root: str):
        self.root = root
        self.job_id = f"pgsec-{secrets.token_hex(5)}"
        self.secret = secrets.token_bytes(32)
        self.c10d = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        self.dir = os.path.join(root, "node0")
        os.makedirs(self.dir, mode=0o700)
        self.log_path = os.path.join(root, "pg.log")
        cfg = {"host": "127.0.0.1", "port": self.c10d.port, "job": self.job_id, "dir": self.dir, "status_dir": root}
        env = {**os.environ, "OMP_NUM_THREADS": "1", SECRET_ENV: self.secret.hex()}
        with open(self.log_path, "w") as logf:
            self.proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, "pg_mailbox.py"),
                                          json.dumps(cfg)], env=env, stdin=subprocess.PIPE,
                                         stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        ready = os.path.join(self.root, "ready")
        wait_for(lambda: os.path.exists(ready) or self.proc.poll() is not None, "the pg worker",
                 diag=self.log)
        assert self.proc.poll() is None, self.log()
        with open(ready) as f:
            info = json.load(f)
        self.prefix, self.session = info["prefix"], bytes.fromhex(info["session"])
        self.seal = Seal(self.secret, self.session, self.prefix)
        self.store = dist.PrefixStore(self.prefix, self.c10d)
        # its node's doorbell (a node of one rank), which a peer rings after each request
        self.bell = bell_key(Rendezvous(self.c10d, self.job_id, 0, 1, secret=self.secret,
                                        session=self.session), 0)
        self.local = LocalStore(self.dir, self.job_id, create=False)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def next_slot(self) -> str:
        return f"pg/mbox/0/{self.store.add('pg/seq/0', 1)}"

    def request(self, over: dict, *, sealer: Seal | None = None, raw: bytes | None = None,
                blob: bytes | None = None) -> tuple[int, str, bytes]:
        """Post a request (``over`` replaces or, with DELETE, drops fields) in the next mailbox
        slot, sealed (by default as an authenticated peer would) or ``raw``; returns its tag,
        nonce and what was stored."""
        tag = self.store.add("pg/tag", 1) % MAX_TAG
        nonce = secrets.token_hex(16)
        msg = {"from": 0, "tag": tag, "nonce": nonce, "job_id": self.job_id, **over}
        msg = {k: v for k, v in msg.items() if v is not DELETE}
        if blob is not None:
            self.store.set(f"pg/blob/0/{nonce}", blob)
        slot = self.next_slot()
        value = raw if raw is not None else (sealer or self.seal).seal(slot, msg).encode()
        self.store.set(slot, value)
        self.store.add(self.bell, 1)
        return tag, nonce, value

    def reply(self, tag: int, nonce: str, phase: str = "r") -> dict:
        key = f"pg/reply/0/{tag}/{phase}"
        self.store.wait([key], timedelta(seconds=WAIT))
        msg = self.seal.open(key, self.store.get(key), answers=nonce)
        self.store.delete_key(key)
        return msg

    def settled(self) -> None:
        """Everything posted so far has been handled: a request after it got its answer."""
        tag, nonce, _ = self.request({"op": "get_metadata", "step": 999})
        assert self.reply(tag, nonce)["status"] == "missing"

    def replies_left(self) -> list[str]:
        return [k for k in self.c10d.list_keys() if k.startswith(f"{self.prefix}/pg/reply/")]

    def close(self) -> None:
        end_peer(self.proc)
        self.__dict__.pop("store", None)
        del self.c10d


@pytest.fixture
def pg_peer(store_dir):
    peer = PgPeer(store_dir)
    try:
        peer.wait_ready()
        yield peer
    finally:
        peer.close()


def installed_metadata(peer: PgPeer, step: int) -> bytes | None:
    """The metadata file of ``step`` in the peer's store, if any."""
    try:
        with open(peer.local.paths.metadata(step), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def metadata_blob(job_id: str, step: int) -> bytes:
    payload = b"step metadata"
    return encode_metadata(MetadataHeader(job_id=job_id, step=step, world_size=1, ranks=[0],
                                          total_bytes=64, payload_bytes=len(payload),
                                          checksum=checksum(payload), created=1.0), payload)


def put_metadata(peer: PgPeer, step: int, blob: bytes | None = None, **kw) -> tuple[int, str, bytes]:
    blob = blob if blob is not None else metadata_blob(peer.job_id, step)
    return peer.request({"op": "put_metadata", "step": step, "sha256": hashlib.sha256(blob).hexdigest()},
                        blob=blob, **kw)


@pytest.mark.slow
def test_pg_control_messages_from_strangers_are_refused(pg_peer):
    """A stranger who can write the store cannot make the rank act: unsealed, wrongly sealed,
    moved (replayed at another slot) and other-run messages are all refused, unanswered."""
    peer = pg_peer
    tag, nonce, sealed = put_metadata(peer, 7)  # an authenticated peer's request works
    assert peer.reply(tag, nonce)["status"] == "ok"
    assert installed_metadata(peer, 7) == metadata_blob(peer.job_id, 7)

    blob = metadata_blob(peer.job_id, 8)
    msg = {"op": "put_metadata", "step": 8, "sha256": hashlib.sha256(blob).hexdigest()}
    full = {"from": 0, "tag": 1, "nonce": "n", "job_id": peer.job_id, **msg}
    forged = {
        "unsealed": {"raw": json.dumps(full).encode()},
        "wrong_secret": {"sealer": Seal(b"x" * 32, peer.session, peer.prefix)},
        "other_run": {"sealer": Seal(peer.secret, b"old session", peer.prefix)},
        "other_prefix": {"sealer": Seal(peer.secret, peer.session, "mlcheckpoint/x/0")},
        "sealed_for_another_slot": {"raw": peer.seal.seal("pg/mbox/0/999999", full).encode()},
        "mac_of_another_body": {"raw": json.dumps(
            {"body": json.dumps(full), "mac": json.loads(peer.seal.seal("x", {}))["mac"]}).encode()},
        "not_json": {"raw": b"\xff{"},
    }
    for name, how in forged.items():
        peer.request(msg, blob=blob, **how)
        peer.settled()
        assert peer.replies_left() == [], f"{name}: answered"
        assert installed_metadata(peer, 8) is None, f"{name}: obeyed"

    # a genuine request replayed: the very bytes of step 7's request, at a later slot
    os.unlink(peer.local.paths.metadata(7))
    peer.store.set(f"pg/blob/0/{nonce}", metadata_blob(peer.job_id, 7))
    peer.store.set(peer.next_slot(), sealed)
    peer.settled()
    assert installed_metadata(peer, 7) is None, "a replayed request was obeyed"
    assert peer.replies_left() == []
    log = peer.log()
    assert "refused a request" in log, log
    assert "Traceback" not in log and " ERROR " not in log, log


# An authenticated request with each field wrong: the first group cannot even say where to
# reply (dropped, with a warning), every other one gets an error reply.
NO_RETURN_ADDRESS = {**{f"from={v!r}": {"from": v} for v in [DELETE, None, "0", -1, 1, 1.5, []]},
                     **{f"tag={v!r}": {"tag": v} for v in [DELETE, None, "1", -1, 1 << 40, []]},
                     **{f"nonce={v!r}": {"nonce": v} for v in [DELETE, None, 5, [], "n" * 65]}}


def _pg_cases(job_id: str) -> dict[str, tuple[dict, bytes | None]]:
    cases: dict[str, tuple[dict, bytes | None]] = {}
    for v in [DELETE, None, 5, [], {}, "rm", "get_shard"]:  # (get_shard: served no more)
        cases[f"op={v!r}"] = ({"op": v, "step": 5}, None)
    for v in [DELETE, None, 5, [], "other-job"]:
        cases[f"job_id={v!r}"] = ({"op": "get_metadata", "job_id": v, "step": 5}, None)
    for op in ("put_shard", "read_items", "put_metadata", "get_metadata"):
        for v in [DELETE, *BAD_INTS]:
            cases[f"{op}.step={v!r}"] = ({"op": op, "step": v, "owner": 0, "ranges": [[0, 16]]}, None)
    for op in ("put_shard", "read_items"):
        for v in [DELETE, *BAD_INTS, 1 << 21]:
            cases[f"{op}.owner={v!r}"] = ({"op": op, "step": 5, "owner": v, "ranges": [[0, 16]]}, None)
    for name, m in _manifests(job_id, 5, 0).items():
        cases[f"put_shard.{name}"] = ({"op": "put_shard", "step": 5, "owner": 0, "manifest": m}, None)
    for v in [DELETE, *BAD_RANGES]:
        read = {"op": "read_items", "step": 5, "owner": 0, "ranges": v}
        cases[f"read_items.ranges={v!r}"[:80]] = (read, None)
    for v in BAD_FLAGS:
        cases[f"read_items.paced={v!r}"] = ({"op": "read_items", "step": 5, "owner": 0,
                                             "ranges": [[0, 16]], "paced": v}, None)
    for v in [*BAD_INTS, 1, MIN_PIECE_BYTES - 1, MAX_PIECE_BYTES + 1]:
        cases[f"put_shard.piece={v!r}"[:80]] = ({"op": "put_shard", "step": 5, "owner": 0,
                                                 "manifest": manifest_dict(job_id, 5, 0),
                                                 "piece": v}, None)
    for name, blob in _metadata_blobs(job_id, 5).items():
        cases[f"put_metadata.blob.{name}"] = ({"op": "put_metadata", "step": 5}, blob)
    cases["put_metadata.no_blob"] = ({"op": "put_metadata", "step": 5, "sha256": "0" * 64}, None)
    cases["put_metadata.wrong_digest"] = ({"op": "put_metadata", "step": 5, "sha256": "0" * 64},
                                          metadata_blob(job_id, 5))
    for v in [DELETE, None, 5, []]:
        cases[f"put_metadata.sha256={v!r}"] = ({"op": "put_metadata", "step": 5, "sha256": v},
                                               metadata_blob(job_id, 5))
    return cases


@pytest.mark.slow
def test_pg_malformed_requests_get_an_error_reply(pg_peer):
    """Malformed process-group requests are answered with an error (or dropped when they
    name no return address); the rank keeps serving, with no traceback."""
    peer = pg_peer
    wrong = {}
    for name, (over, blob) in _pg_cases(peer.job_id).items():
        if blob is not None and "sha256" not in over:
            over = {**over, "sha256": hashlib.sha256(blob).hexdigest()}
        tag, nonce, _ = peer.request(over, blob=blob)
        status = peer.reply(tag, nonce).get("status")
        if status != "error":
            wrong[name] = status
    assert not wrong, f"malformed requests not answered with an error: {wrong}"
    for name, over in NO_RETURN_ADDRESS.items():
        peer.request({"op": "get_metadata", "step": 5, **over})
        peer.settled()  # the rank still serves
        assert peer.replies_left() == [], name
    assert installed_metadata(peer, 5) is None
    tag, nonce, _ = put_metadata(peer, 5)  # and a real request still works
    assert peer.reply(tag, nonce)["status"] == "ok"
    assert installed_metadata(peer, 5) == metadata_blob(peer.job_id, 5)
    log = peer.log()
    assert "Traceback" not in log and " ERROR " not in log, log
