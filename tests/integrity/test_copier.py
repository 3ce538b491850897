"""Checksums over chunks and the threaded copier: the definitions, and that save and load use
them correctly on items that span many chunks, through a warm mapping and a fresh one. The
copier's tests run with its C loop (``_hashcopy.c``) and with its Python loop."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from helpers import damage_shard
from states import zeros_like_state
from torch.distributed.checkpoint.api import CheckpointException

from mlcheckpoint import (
    CorruptShardError,
    MemoryStorageReader,
    MemoryStorageWriter,
)
from mlcheckpoint.integrity import checksum as cs
from mlcheckpoint.integrity import copier
from mlcheckpoint.store import LocalStore, buffers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CHUNK = cs.CHUNK_BYTES
SIZES = [0, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 77]
C_LOOP_BUILT = cs.native_hash_copy is not None


@pytest.fixture(params=["c", "python"])
def copy_loop(request, monkeypatch):
    """Run the test with the copier's C loop, then with its Python loop."""
    if request.param == "c":
        if not C_LOOP_BUILT:
            pytest.skip("the C copy loop was not built here (no C compiler at install)")
    else:
        monkeypatch.setattr(copier, "native_hash_copy", None)
    return request.param


def reference_checksum(data: bytes) -> int:
    """The format, written out independently of the implementation."""
    if len(data) <= CHUNK:
        return xxhash.xxh3_64_intdigest(data)
    digests = [xxhash.xxh3_64_intdigest(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _another_thread_ran_while_hashing(buf: np.ndarray) -> bool:
    """Checksum ``buf`` in a thread of its own while this thread counts; whether the count
    moved during the checksum (read by the hashing thread just before and just after)."""
    count, started, done, moved = [0], threading.Event(), threading.Event(), []

    def hash_and_watch() -> None:
        started.set()
        before = count[0]
        cs.checksum(buf)
        moved.append(count[0] - before)
        done.set()

    hasher = threading.Thread(target=hash_and_watch)
    hasher.start()
    started.wait()
    while not done.is_set():
        count[0] += 1
        if count[0] % 1000 == 0:
            time.sleep(0)  # lets the hashing thread back in between its chunks
    hasher.join()
    return moved[0] > 0


def test_hashing_lets_other_threads_run():
    """Hashing gives up the GIL while it hashes, so the copier's hashing threads run in
    parallel (xxhash's Python API holds it: they would take turns).

    The switch interval is raised far above the time the whole checksum takes, so a hash that
    holds the GIL lets no other thread run until it is done; one that lets go of it does. A
    busy machine may not run the counting thread during a given checksum, hence a few tries."""
    buf = random_bytes(64 << 20)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        ran = any(_another_thread_ran_while_hashing(buf) for _ in range(20))
    finally:
        sys.setswitchinterval(interval)
    assert ran, "no other thread ran while a buffer was hashed: hashing holds the GIL"


@pytest.mark.parametrize("n", SIZES)
def test_checksum_matches_the_documented_format(n):
    a = random_bytes(n, n)
    assert cs.checksum(a) == cs.checksum(a.tobytes()) == reference_checksum(a.tobytes())


@pytest.mark.parametrize("n", SIZES)
def test_streaming_checksum_equals_one_shot_for_any_pieces(n):
    a = random_bytes(n, n)
    rnd = random.Random(n)
    for _ in range(3):
        s, i = cs.StreamingChecksum(), 0
        while i < n:
            k = rnd.choice([1, 7, 4096, CHUNK - 3, CHUNK, CHUNK + 5])
            s.update(a[i:i + k])
            i += k
        assert s.digest() == reference_checksum(a.tobytes())


@pytest.mark.parametrize("where", [0, CHUNK - 1, CHUNK, 2 * CHUNK + 5, 3 * CHUNK + 76])
def test_a_flip_in_any_chunk_changes_the_checksum(where):
    a = random_bytes(3 * CHUNK + 77)
    before = cs.checksum(a)
    a[where] ^= 0x01
    assert cs.checksum(a) != before


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copier_copies_and_hashes_every_span(threads, copy_loop):
    # around the C loop's piece (8 chunks) and its stream-store threshold (256 KiB) too
    sizes = [0, 5, 3 * CHUNK + 11, 7 << 20, 1000, CHUNK, 8 * CHUNK, 8 * CHUNK + 1,
             17 * CHUNK + 3, (256 << 10) - 1, 256 << 10, (512 << 10) + 63]
    srcs = [torch.from_numpy(random_bytes(n, i)) for i, n in enumerate(sizes)]
    dsts = [np.zeros(n, np.uint8) for n in sizes]
    spans = [copier.Span(src=s.data_ptr(), nbytes=n, dst=d.ctypes.data)
             for s, d, n in zip(srcs, dsts, sizes)]
    digests = copier.process(spans, threads=threads)
    for s, d, digest in zip(srcs, dsts, digests):
        assert d.tobytes() == s.numpy().tobytes()
        assert digest == reference_checksum(d.tobytes())
    # hash-only spans give the same digests and touch nothing
    again = copier.process([copier.Span(src=d.ctypes.data, nbytes=d.nbytes) for d in dsts],
                           threads=threads)
    assert again == digests


def test_copier_handles_unaligned_addresses(copy_loop):
    """Stream stores need 16-byte aligned destinations: odd offsets take the unaligned head
    and tail paths, and nothing outside the destination range is touched."""
    n = 3 * CHUNK + 101
    src = random_bytes(n + 64, 7)
    for s_off, d_off in [(0, 1), (3, 0), (5, 13), (15, 15), (1, 63)]:
        dst = np.full(n + 128, 0xAB, np.uint8)
        [digest] = copier.process([copier.Span(src=src.ctypes.data + s_off, nbytes=n,
                                               dst=dst.ctypes.data + d_off)], threads=2)
        assert dst[d_off:d_off + n].tobytes() == src[s_off:s_off + n].tobytes()
        assert (dst[:d_off] == 0xAB).all() and (dst[d_off + n:] == 0xAB).all()
        assert digest == reference_checksum(src[s_off:s_off + n].tobytes())


@pytest.mark.skipif(not C_LOOP_BUILT, reason="the C copy loop was not built here")
def test_c_loop_rejects_bad_arguments():
    a = random_bytes(16)
    out = np.zeros(1, np.uint64)
    with pytest.raises(ValueError):
        cs.native_hash_copy(a.ctypes.data, 0, -1, CHUNK, out.ctypes.data)
    with pytest.raises(ValueError):
        cs.native_hash_copy(a.ctypes.data, 0, 16, 0, out.ctypes.data)
    with pytest.raises(ValueError):
        cs.native_hash_copy(0, 0, 16, CHUNK, out.ctypes.data)  # no source
    with pytest.raises(ValueError):
        cs.native_hash_copy(a.ctypes.data, 0, 16, CHUNK, 0)  # nowhere for the digest


@pytest.mark.slow
def test_c_loop_can_be_switched_off():
    """MLCHECKPOINT_NATIVE=0 (an escape hatch if the C loop misbehaves somewhere) selects the
    Python loop, and a save still works with it."""
    code = ("import torch, torch.distributed.checkpoint as dcp, sys, tempfile\n"
            "from mlcheckpoint.integrity import checksum, copier\n"
            "from mlcheckpoint import MemoryStorageWriter\nfrom mlcheckpoint.store import LocalStore\n"
            "assert checksum.native_hash_copy is None and copier.native_hash_copy is None\n"
            "store = LocalStore(sys.argv[1], 'job-nat')\n"
            "dcp.save({'w': torch.arange(3 << 20)}, storage_writer=MemoryStorageWriter(1, store))\n"
            "print(store.shards.read_manifest(1, 0).items[0].nbytes)\n")
    with __import__("tempfile").TemporaryDirectory(dir="/dev/shm") as d:
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", code, d], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "MLCHECKPOINT_NATIVE": "0"},
                             check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(8 * (3 << 20))


# ---------------------------------------------------------------- save and load, large items

def big_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(3 * CHUNK // 4 + 5, generator=g),             # 3+ chunks
            "w": torch.randn(1024, 1100, generator=g).to(torch.bfloat16),    # ~1 chunk
            "t": torch.randn(700, 900, generator=g).t(),                     # strided source
            "small": [torch.randn(13, generator=g) for _ in range(50)],
            "step": seed}


def assert_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, list):
        for x, y in zip(a, b):
            assert_equal(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_manifest_checksums_follow_the_format(store_dir, mode, copy_loop):
    store = LocalStore(store_dir, "job-copier")
    try:
        sd = big_state()
        writer = MemoryStorageWriter(1, store)
        if mode == "save":
            dcp.save(sd, storage_writer=writer)
        else:
            dcp.async_save(sd, storage_writer=writer).result(timeout=60)
        m = store.shards.read_manifest(1, 0)
        assert m.algorithm == cs.ALGORITHM
        with open(store.paths.data(1, 0), "rb") as f:
            data = f.read()
        assert any(it.nbytes > CHUNK for it in m.items)
        for it in m.items:
            assert it.checksum == reference_checksum(data[it.offset:it.offset + it.nbytes]), it.key
    finally:
        store.close()


@pytest.mark.parametrize("fresh", [False, True], ids=["mapped", "fresh-mapping"])
def test_load_verifies_every_chunk_of_large_items(store_dir, fresh, copy_loop):
    """A flip in a late chunk of a multi-chunk item fails the load, whether the loading store
    reads through its warm mapping (the saving process) or maps the shard now, unpopulated
    (a fresh process: the copier's threads fault the pages in)."""
    store = LocalStore(store_dir, "job-copier")
    try:
        sd = big_state(1)
        dcp.save(sd, storage_writer=MemoryStorageWriter(1, store))
        reader_store = LocalStore(store_dir, "job-copier") if fresh else store
        out = zeros_like_state(sd)
        dcp.load(out, storage_reader=MemoryStorageReader(1, reader_store))
        assert_equal(sd, out)
        # a fresh store maps the shard without populating it; the writer's store reuses its mapping
        [mapped] = reader_store.mappings._by_key.values()
        assert (mapped.populated_by != "madvise") == fresh  # "madvise": populated for writing
        damage_shard(store, 1, 0, item="emb", at=2 * CHUNK + 9)
        with pytest.raises(CheckpointException) as ei:
            dcp.load(zeros_like_state(sd), storage_reader=MemoryStorageReader(1, reader_store))
        errs = [f[0] if isinstance(f, tuple) else f for f in ei.value.failures.values()]
        assert errs and all(isinstance(e, CorruptShardError) for e in errs)
        assert "'emb'" in str(errs[0])
        if fresh:
            reader_store.close()
    finally:
        store.close()


def test_load_into_resharded_and_cast_targets_through_a_fresh_store(store_dir):
    """Items that cannot be copied raw (another dtype, a strided target) map the shard on demand."""
    store = LocalStore(store_dir, "job-copier")
    fresh = LocalStore(store_dir, "job-copier")
    try:
        sd = big_state(2)
        dcp.save(sd, storage_writer=MemoryStorageWriter(1, store))
        out = zeros_like_state(sd)
        out["w"] = torch.zeros(1024, 1100, dtype=torch.float32)        # cast on load
        out["t"] = torch.zeros(700, 900).t()                            # strided target
        dcp.load(out, storage_reader=MemoryStorageReader(1, fresh))
        assert torch.equal(out["w"], sd["w"].float())
        assert torch.equal(out["t"], sd["t"])
        assert torch.equal(out["emb"], sd["emb"])
    finally:
        fresh.close()
        store.close()


@pytest.fixture
def huge_page_tmpfs(tmp_path):
    """A small tmpfs mounted with huge pages (huge=within_size), unmounted after the test;
    skipped where this process may not mount one (not root) or the kernel lacks them."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            if "[deny]" in f.read():
                pytest.skip("huge pages are denied to every tmpfs on this machine")
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    where = tmp_path / "huge"
    where.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M,huge=within_size,mode=0700",
                                  "tmpfs", str(where)], capture_output=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:  # no mount command
        pytest.skip(f"cannot mount a huge-page tmpfs here: {e}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a huge-page tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_fresh_store_on_a_huge_page_tmpfs_maps_the_shard_populated_and_verifies_it(huge_page_tmpfs):
    """On huge pages, a fresh process populates its mapping of the shard up front (one cheap
    call instead of a fault per page while copying); every item is still verified."""
    store = LocalStore(huge_page_tmpfs, "job-huge")
    fresh = LocalStore(huge_page_tmpfs, "job-huge")
    try:
        sd = big_state(3)
        dcp.save(sd, storage_writer=MemoryStorageWriter(1, store))
        assert buffers.on_huge_pages(os.stat(store.paths.data(1, 0)))
        out = zeros_like_state(sd)
        dcp.load(out, storage_reader=MemoryStorageReader(1, fresh))
        assert_equal(sd, out)
        [mapped] = fresh.mappings._by_key.values()
        assert mapped.populated_by == "madvise (huge pages)"
        damage_shard(store, 1, 0, item="emb", at=CHUNK + 3)
        another = LocalStore(huge_page_tmpfs, "job-huge")  # a fresh process again: no cached mapping
        try:
            with pytest.raises(CheckpointException) as ei:
                dcp.load(zeros_like_state(sd), storage_reader=MemoryStorageReader(1, another))
            assert "'emb'" in str(ei.value)
        finally:
            another.close()
    finally:
        fresh.close()
        store.close()


def test_huge_page_detection_falls_back_to_faults_on_small_pages(store_dir, tmp_path):
    """Files on small pages (a tmpfs without huge pages, a disk) are mapped for reading
    without populating: their pages are faulted in by the copier's threads."""
    for d in (store_dir, str(tmp_path)):
        path = os.path.join(d, "shard")
        data = random_bytes(3 * CHUNK + 5)
        with open(path, "wb") as f:
            f.write(data.tobytes())
        st = os.stat(path)
        assert buffers.on_huge_pages(st) == (st.st_blksize >= 2 << 20)
        cache = buffers.MappingCache()
        try:
            mapped = cache.map(path, data.nbytes, populate=False)
            assert mapped.populated_by == ("madvise (huge pages)" if buffers.on_huge_pages(st) else "on demand")
            dst = np.zeros_like(data)
            [digest] = copier.process([copier.Span(src=mapped.base_ptr, nbytes=data.nbytes,
                                                   dst=dst.ctypes.data)], threads=2)
            assert digest == reference_checksum(data.tobytes()) and np.array_equal(dst, data)
        finally:
            cache.clear()


@pytest.mark.parametrize("value,expected", [("3", 3), (" 1 ", 1), ("0", None), ("two", None), ("-2", None)])
def test_copy_threads_setting(monkeypatch, value, expected):
    from mlcheckpoint import ConfigError
    monkeypatch.setenv("MLCHECKPOINT_COPY_THREADS", value)
    if expected is None:
        with pytest.raises(ConfigError, match="MLCHECKPOINT_COPY_THREADS"):
            copier.default_threads()
    else:
        assert copier.default_threads() == expected
