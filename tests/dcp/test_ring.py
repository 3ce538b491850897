"""The resume ring (dcp/ring.py) with CPU tensors standing in for device memory: items cut into
pieces, copied in order, slots refilled only once their copy has read them, every item
verified (wsum64 on the "device", xxh3 by the host as it fills), a bad byte named by item;
and a whole ``dcp.load`` through the reader's ring branch."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import damage_shard
from torch.distributed.checkpoint.api import CheckpointException

from mlcheckpoint import CheckpointManager, CorruptShardError, MemoryStorageReader
from mlcheckpoint.dcp import ring
from mlcheckpoint.integrity import digests
from mlcheckpoint.integrity.checksum import CHUNK_BYTES
from mlcheckpoint.integrity.verify import digest_item

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

JOB = "ring"
SLOT = 2 * CHUNK_BYTES
SIZES = [0, 1, 7, CHUNK_BYTES - 1, CHUNK_BYTES, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT + 4097]


def make_reads(sizes: list[int], algorithms: list[str], seed: int = 0) -> list[ring.RingRead]:
    rng = np.random.default_rng(seed)
    reads = []
    for k, n in enumerate(sizes):
        source = rng.integers(0, 256, n, dtype=np.uint8)
        algorithm = algorithms[k % len(algorithms)]
        reads.append(ring.RingRead(source, torch.zeros(n, dtype=torch.uint8), algorithm,
                                   digest_item(source, algorithm)))
    return reads


def pieces(sizes: list[int]) -> int:
    return sum(-(-n // SLOT) for n in sizes)


def fills(sizes: list[int]) -> int:
    """Slot fills when consecutive pieces share a slot while they fit."""
    count, at = 0, SLOT
    for n in sizes:
        for begin in range(0, n, SLOT):
            size = min(SLOT, n - begin)
            if at + size > SLOT:
                count, at = count + 1, 0
            at += -(-size // ring.PIECE_ALIGN) * ring.PIECE_ALIGN
    return count


@pytest.mark.parametrize("algorithms", [[digests.WSUM], [digests.XXH3], [digests.XXH3, digests.WSUM]])
def test_every_item_lands_whole_and_verified(algorithms):
    reads = make_reads(SIZES, algorithms)
    loader = ring.Ring(ring.HostMover(), slots=2, slot_bytes=SLOT)
    assert loader.load(reads) == []
    for r in reads:
        assert np.array_equal(r.target.numpy(), r.source)
    assert loader.pieces_copied == pieces(SIZES)
    assert loader.fills == fills(SIZES) < pieces(SIZES)  # small items shared slots


def test_thousands_of_small_items_take_a_few_slot_fills():
    sizes = [4 * (k % 50) + 1 for k in range(3000)]  # about 300 KiB in all
    reads = make_reads(sizes, [digests.XXH3, digests.WSUM], seed=4)
    loader = ring.Ring(ring.HostMover(), slots=2, slot_bytes=SLOT)
    assert loader.load(reads) == []
    assert loader.fills == 1 and loader.pieces_copied == 3000
    reads[1234].source[0] ^= 1
    assert ring.Ring(ring.HostMover(), slots=2, slot_bytes=SLOT).load(reads) == [1234]


@pytest.mark.parametrize("algorithm", [digests.WSUM, digests.XXH3])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_bad_byte_names_its_item(algorithm, where):
    reads = make_reads(SIZES, [algorithm], seed=1)
    bad = SIZES.index(3 * SLOT + 4097)
    at = 5 if where == "first" else reads[bad].source.size - 2  # in its first or last piece
    reads[bad].source[at] ^= 0x40
    assert ring.Ring(ring.HostMover(), slots=2, slot_bytes=SLOT).load(reads) == [bad]
    reads[2].source[0] ^= 1
    assert ring.Ring(ring.HostMover(), slots=3, slot_bytes=SLOT).load(reads) == [2, bad]


class LateMover(ring.HostMover):
    """Copies that complete later, on another thread, as a DMA engine's would: each checks that
    its slot still holds what it held when the copy was issued, and that copies run in the
    order they were issued; a fence completes after the copies before it."""

    def __init__(self, delay: float = 0.002):
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.delay = delay
        self.errors: list[str] = []
        self.order: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()
        self._issued = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        snapshot = src.clone()
        with self._lock:
            n = self._issued
            self._issued += 1

        def later() -> None:
            time.sleep(self.delay)
            if not torch.equal(src, snapshot):
                self.errors.append(f"copy {n}: its slot was refilled before it ran")
            dst.copy_(src)
            self.order.append(n)
        self.pool.submit(later)

    def fence(self):
        with self._lock:
            self.in_flight += 1  # slot fills whose copies have not all run
            self.most_in_flight = max(self.most_in_flight, self.in_flight)

        def passed() -> None:
            with self._lock:
                self.in_flight -= 1
        return self.pool.submit(passed)  # runs after the copies submitted before it

    def wait(self, token) -> None:
        token.result()


@pytest.mark.parametrize("slots", [2, 3])
def test_a_slot_is_refilled_only_after_its_copy_has_read_it(slots):
    mover = LateMover()
    reads = make_reads(SIZES, [digests.WSUM, digests.XXH3], seed=2)
    assert ring.Ring(mover, slots=slots, slot_bytes=SLOT).load(reads) == []
    assert mover.errors == []
    assert mover.order == list(range(pieces(SIZES)))
    assert 1 < mover.most_in_flight <= slots  # copies overlapped the next fills, no more
    for r in reads:
        assert np.array_equal(r.target.numpy(), r.source)
    mover.pool.shutdown()


def test_the_ring_tells_time_spent_filling_from_time_spent_waiting_for_the_device():
    """``ring.times`` sums each load's host fills and its waits for the device: a slow device
    (each copy 0.2 s here, one at a time) shows as waiting, not as filling. What tells a
    host-bound resume from a device-bound one on a GPU (``bench_gpu.py``'s resume)."""
    mover = LateMover(delay=0.2)
    reads = make_reads([SLOT] * 4, [digests.XXH3], seed=7)
    before = dataclasses.replace(ring.times)
    assert ring.Ring(mover, slots=2, slot_bytes=SLOT).load(reads) == []
    after = ring.times
    assert after.loads == before.loads + 1 and after.bytes == before.bytes + 4 * SLOT
    # 4 copies of 0.2 s in a row, the first started after the first fill: the waits take the
    # rest of them (at least the last three, 0.6 s); the fills are host copies of 16 MiB
    assert after.wait - before.wait >= 0.55 > after.fill - before.fill > 0
    mover.pool.shutdown()


class FailingMover(LateMover):
    """A LateMover whose ``fail_at``-th copy raises, as a device error surfacing there would,
    while the copies before it are still in flight."""

    def __init__(self, fail_at: int):
        super().__init__(delay=0.05)
        self.fail_at = fail_at

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._issued == self.fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().copy(dst, src)


def test_a_failed_load_returns_only_once_its_copies_have_completed():
    """A load that fails leaves no copy running: the slots are the process's, and a retry
    would refill them while a late copy still reads them (into a target the retry writes)."""
    mover = FailingMover(fail_at=3)
    reads = make_reads([SLOT] * 5, [digests.WSUM], seed=6)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ring.Ring(mover, slots=3, slot_bytes=SLOT).load(reads)
    assert len(mover.order) == 3, "the load raised while copies it started were still running"
    assert mover.errors == []
    mover.pool.shutdown()


def test_a_ring_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="2 slots or more"):
        ring.Ring(ring.HostMover(), slots=1, slot_bytes=SLOT)
    with pytest.raises(ValueError, match="whole"):
        ring.Ring(ring.HostMover(), slots=2, slot_bytes=SLOT + 1)
    loader = ring.Ring(ring.HostMover(), slots=2, slot_bytes=SLOT)
    read = make_reads([100], [digests.WSUM])[0]
    with pytest.raises(ValueError, match="ring target of 99 bytes"):
        loader.load([ring.RingRead(read.source, torch.zeros(99, dtype=torch.uint8), digests.WSUM, 0)])
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        loader.load([ring.RingRead(read.source, read.target, "crc7", 0)])


class RingReader(MemoryStorageReader):
    """The reader with CPU targets taking its device branch (the ring, ``HostMover``)."""

    def _through_ring(self, target: torch.Tensor) -> bool:
        return True


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(3 * SLOT // 4 + 13, generator=g),             # several pieces
            "bf16": torch.randn(1000, 1100, generator=g).bfloat16(),
            "small": [torch.randn(7, generator=g) for _ in range(20)],
            "empty": torch.zeros(0),
            "step": seed}


def test_a_resume_through_the_ring_loads_whole_cast_and_strided_targets(store_dir, monkeypatch):
    monkeypatch.setattr(ring, "SLOT_BYTES", SLOT)
    want = state(0)
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none") as ckpt:
        ckpt.save(want, 3)
        target = state(1)
        target["bf16"] = torch.zeros(1100, 1000, dtype=torch.float32).t()  # cast, strided
        target["big"] = target["big"].double()  # cast: through a buffer of its own
        store = ckpt.storage_reader(3).store
        dcp.load(target, storage_reader=RingReader(3, store), no_dist=True)
        assert torch.equal(target["bf16"], want["bf16"].float())
        assert torch.equal(target["big"], want["big"].double())
        assert all(torch.equal(a, b) for a, b in zip(target["small"], want["small"]))
        assert target["step"] == 0
        damage_shard(store, 3, 0, item="bf16")
        with pytest.raises(CheckpointException) as e:
            dcp.load(state(2), storage_reader=RingReader(3, store), no_dist=True)
        errors = [f[0] if isinstance(f, tuple) else f for f in e.value.failures.values()]
        assert isinstance(errors[0], CorruptShardError)
        assert "checksum mismatch in item 'bf16'" in str(errors[0])


def test_a_resume_casts_one_item_at_a_time_through_a_buffer_of_its_own(store_dir, monkeypatch):
    """Resharded or cast items each take a device buffer of the stored item's size: they are
    loaded one after the other, each buffer freed before the next is made, so the resume adds
    one item's bytes beside the ring's slots, not every such item's at once (measured with
    torch's allocator's own accounting, CPU tensors standing in for device memory)."""
    from helpers import peak_cpu_allocation

    monkeypatch.setattr(ring, "SLOT_BYTES", SLOT)
    item = 8 << 20
    g = torch.Generator().manual_seed(4)
    want = {f"w{i}": torch.randn(item // 4, generator=g) for i in range(6)}
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none") as ckpt:
        ckpt.save(want, 5)
        target = {k: torch.zeros(item // 4, dtype=torch.float64) for k in want}  # cast
        reader = RingReader(5, ckpt.storage_reader(5).store)
        extra = peak_cpu_allocation(lambda: dcp.load(target, storage_reader=reader, no_dist=True))
        assert all(torch.equal(target[k], v.double()) for k, v in want.items())
    slots = ring.SLOTS * SLOT
    assert extra <= slots + item + (2 << 20), \
        f"{extra / 2**20:.1f} MiB for {len(want)} cast items of {item >> 20} MiB (one at a time: " \
        f"{(slots + item) / 2**20:.0f} MiB)"
