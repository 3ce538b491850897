"""Pushing one shard over several TCP streams: it lands whole and verified, a bad stripe or a
dead sender leaves nothing behind, and a connection cannot join a transfer it was not given.

Real TcpTransports over loopback (in this process or in one of their own), as in
test_replication_faults.py (tcp_job.py has the job they share).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from helpers import flip_byte, wait_for
from tcp_job import connect, debris, frames_to_eof, make_shard, manifest_dict

from mlcheckpoint import ConfigError, ShardNotFoundError, settings
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.replication import ReplicationError
from mlcheckpoint.replication.tcp import protocol as p
from mlcheckpoint.replication.tcp import striping
from mlcheckpoint.replication.tcp.striping import stripes
from mlcheckpoint.replication.tcp.transport import TcpTransport
from mlcheckpoint.store import ManifestItem

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20


def striped_pair(job, streams: int = 4):
    receiver = job.endpoint(0)
    sender = job.endpoint(1, streams=streams, min_stripe_bytes=MiB)
    return receiver, sender


def same_bytes(a: TcpTransport, b: TcpTransport, step: int, owner: int, nbytes: int) -> bool:
    with open(a.store.paths.data(step, owner), "rb") as x, open(b.store.paths.data(step, owner), "rb") as y:
        return x.read(nbytes) == y.read(nbytes)


@pytest.mark.parametrize("nbytes", [8 * MiB + 7, 3 * MiB, 2 * MiB - 1])
def test_striped_push_lands_whole_and_verified(make_job, nbytes):
    job = make_job()
    receiver, sender = striped_pair(job, streams=4)
    m = make_shard(sender.store, 3, 1, nbytes, seed=5, nitems=7)
    assert sender.push_shard(0, 3, 1) == nbytes
    got = receiver.store.verify_shard(3, 1)
    assert [(i.offset, i.nbytes, i.checksum) for i in got.items] == \
        [(i.offset, i.nbytes, i.checksum) for i in m.items]
    assert same_bytes(receiver, sender, 3, 1, nbytes)
    expected = max(1, min(4, nbytes // MiB))
    assert receiver.server.stripes.landed() == ({expected: 1} if expected > 1 else {})
    assert len(receiver.server.stripes) == 0  # no transfer left open
    assert debris(receiver.store) == []
    # a second push of the same shard is a no-op ("have")
    assert sender.push_shard(0, 3, 1) == 0


def test_corrupt_stripe_is_refused_and_nothing_is_committed(make_job, tcp_warnings):
    job = make_job()
    receiver, sender = striped_pair(job, streams=3)
    nbytes = 6 * MiB
    make_shard(sender.store, 4, 1, nbytes, seed=2)
    # a bit flips in the sender's copy after commit, in the last stripe
    flip_byte(sender.store.paths.data(4, 1), stripes(nbytes, 3)[2][0] + 1234)
    with pytest.raises(ReplicationError, match="checksum mismatch"):
        sender.push_shard(0, 4, 1)
    with pytest.raises(ShardNotFoundError):
        receiver.store.shards.read_manifest(4, 1)
    wait_for(lambda: debris(receiver.store) == [], "the refused buffer to be dropped")
    assert len(receiver.server.stripes) == 0
    # the listener still takes a good striped push
    make_shard(sender.store, 5, 1, nbytes, seed=3)
    assert sender.push_shard(0, 5, 1) == nbytes
    receiver.store.verify_shard(5, 1)


@pytest.mark.parametrize("token", ["unknown", "not-a-string", "reused"])
def test_stripe_for_a_transfer_not_open_is_refused(make_job, tcp_warnings, token):
    """Knowing the job secret is not enough to write into another transfer's buffer."""
    job = make_job()
    receiver, sender = striped_pair(job)
    if token == "reused":  # the token of a transfer that has finished
        make_shard(sender.store, 2, 1, 4 * MiB, seed=1)
        seen = []
        real = striping.StripedReceive.__init__

        def remember(self, *a, **kw):
            real(self, *a, **kw)
            seen.append(self.token)

        striping.StripedReceive.__init__ = remember
        try:
            sender.push_shard(0, 2, 1)
        finally:
            striping.StripedReceive.__init__ = real
        value = seen[0]
    else:
        value = 12345 if token == "not-a-string" else "f" * 32
    before = receiver.store.inventory.steps()
    with connect(receiver) as s:
        p.client_handshake(s, receiver.secret)
        p.send_frame(s, {"op": "put_part", "job_id": job.job_id, "step": 2, "owner": 1,
                         "token": value, "index": 1})
        frames = frames_to_eof(s, on_ready=lambda: s.sendall(bytes(4096)))
    assert all(f.get("status") != "ready" for f in frames), frames
    wait_for(lambda: any("not open" in m for m in tcp_warnings()), "a warning about the stripe")
    assert receiver.store.inventory.steps() == before
    make_shard(sender.store, 6, 1, 4 * MiB, seed=6)
    assert sender.push_shard(0, 6, 1) == 4 * MiB


def test_stream_settings_are_checked(make_job, monkeypatch):
    job = make_job()
    job.endpoint(0)
    with pytest.raises(ConfigError, match="streams"):
        job.endpoint(1, streams=0)
    streams = settings.BY_NAME["replication_streams"]
    monkeypatch.setenv("MLCHECKPOINT_TCP_STREAMS", "lots")
    with pytest.raises(ConfigError, match="MLCHECKPOINT_TCP_STREAMS"):
        streams.resolve()
    monkeypatch.setenv("MLCHECKPOINT_TCP_STREAMS", "2")
    assert streams.resolve() == 2
    monkeypatch.setenv("MLCHECKPOINT_TCP_MIN_STRIPE", "0")
    with pytest.raises(ConfigError, match="MLCHECKPOINT_TCP_MIN_STRIPE"):
        settings.tuning()
    monkeypatch.setenv("MLCHECKPOINT_TCP_MIN_STRIPE", "4096")
    assert job.endpoint(1).min_stripe_bytes == 4096


def test_stripes_cover_the_shard_exactly():
    for nbytes in (0, 1, 63, 64, 1000, 96 * MiB + 5):
        for k in range(1, 9):
            parts = stripes(nbytes, k)
            assert len(parts) == k
            assert parts[0][0] == 0 and sum(n for _, n in parts) == nbytes
            assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(parts))
            assert all(a % 64 == 0 for a, _ in parts)


def test_read_items_over_several_streams(make_job):
    """Recovery reads ranges of a peer's shard over several streams: every range lands whole,
    and it is reported once, only after all of its bytes are in place."""
    job = make_job()
    holder, reader = striped_pair(job, streams=4)
    nbytes = 9 * MiB + 123
    make_shard(holder.store, 8, 0, nbytes, seed=8)
    with open(holder.store.paths.data(8, 0), "rb") as f:
        data = f.read(nbytes)
    ranges = [(0, 5 * MiB), (5 * MiB, 0), (5 * MiB, 100), (5 * MiB + 100, 4 * MiB), (nbytes - 23, 23)]
    sinks = [np.zeros(n, np.uint8) for _, n in ranges]
    reported: list[int] = []
    complete_when_reported: list[bool] = []

    def on_range(i: int) -> None:
        off, n = ranges[i]
        complete_when_reported.append(sinks[i].tobytes() == data[off:off + n])
        reported.append(i)

    assert reader.read_items(0, 8, 0, ranges, sinks, on_range) == sum(n for _, n in ranges)
    assert reader.reads_by_streams() == {4: 1}
    assert sorted(reported) == list(range(len(ranges)))
    assert all(complete_when_reported)
    for (off, n), sink in zip(ranges, sinks):
        assert sink.tobytes() == data[off:off + n]
    with pytest.raises(ShardNotFoundError):
        reader.read_items(0, 9, 0, ranges, sinks)
    assert reader.reads_by_streams() == {4: 1}  # a failed read is not counted


def test_missing_stripe_times_out_and_commits_nothing(make_job, tcp_warnings):
    """An offer whose other stripes never come: the receiver gives up after its timeout, drops
    the buffer and keeps serving."""
    job = make_job()
    receiver = job.endpoint(0, timeout=2)
    sender = job.endpoint(1, streams=2, min_stripe_bytes=MiB)
    nbytes = 2 * MiB
    data = os.urandom(nbytes)
    offer = {"op": "put_shard", "job_id": job.job_id, "step": 3, "owner": 1, "streams": 2,
             "manifest": manifest_dict(job.job_id, 3, 1, nbytes,
                                       [ManifestItem("w", 0, nbytes, checksum(data))])}
    with connect(receiver) as s:
        p.client_handshake(s, receiver.secret)
        p.send_frame(s, offer)
        ready = p.recv_frame(s)
        assert ready["status"] == "ready" and isinstance(ready["token"], str)
        first, _ = stripes(nbytes, 2)
        s.sendall(data[:first[1]])  # stripe 0 only; stripe 1 never comes
        frames = frames_to_eof(s)
    assert all(f.get("status") != "ok" for f in frames), frames
    wait_for(lambda: any("did not arrive" in m for m in tcp_warnings()), "the stripe timeout")
    with pytest.raises(ShardNotFoundError):
        receiver.store.shards.read_manifest(3, 1)
    wait_for(lambda: debris(receiver.store) == [] and len(receiver.server.stripes) == 0, "the buffer to go")
    make_shard(sender.store, 4, 1, nbytes, seed=4)
    assert sender.push_shard(0, 4, 1) == nbytes
    receiver.store.verify_shard(4, 1)
