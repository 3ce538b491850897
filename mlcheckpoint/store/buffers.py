"""Shard buffers: tmpfs files that stay mapped across checkpoints.

On these machines the first touch of a tmpfs page costs 5-20x a memcpy, and even a fresh
mapping of an already-populated file runs at a third of the warm rate (page-table faults).
So a process keeps every shard file it maps in a cache keyed by inode, and retired shard
files go to a pool instead of being unlinked: the next checkpoint takes one back and copies
into pages (and page tables) that are already there.

A process that only reads a shard (a resume) maps it without populating: the copier's threads
fault its pages in as they read, in parallel. On a tmpfs mounted with huge pages
(``huge=within_size``, see docs/operations.md) a file's pages are 2 MiB and populating the
whole mapping costs under a millisecond per GiB, so it is done up front there.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections import Counter

import numpy as np
import torch

log = logging.getLogger(__name__)

_MAP_FLAGS = mmap.MAP_SHARED
_MADV_POPULATE_READ = 22  # Linux >= 5.14
_MADV_POPULATE_WRITE = 23
# A tmpfs file whose pages are huge reports their size as its st_blksize.
HUGE_PAGE_BYTES = 2 << 20
# cudaHostRegisterPortable: the pages count as page-locked for every device's context.
_REGISTER_PORTABLE = 1
# What the kernel says when a filesystem (or the memory behind it) has no room left.
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFAULT})


def _bind_madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _bind_madvise()


def _populate(address: int, size: int) -> bool:
    """Fault in (allocating if need be) every page of a shared mapping, without the GIL.

    ``mmap(MAP_POPULATE)`` does the same work but Python holds the GIL through it: seconds on
    a fresh 1 GiB file here, during which every other thread of the process stands still.
    Returns False where the kernel cannot do it (before 5.14). Raises OSError where a page
    cannot be had (EFAULT: touching it would SIGBUS, e.g. a full tmpfs; ENOMEM).
    """
    if _MADVISE is None or size == 0:
        return False
    if _MADVISE(address, size, _MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in NO_ROOM:
        raise OSError(err, f"cannot allocate the pages of a {size}-byte buffer: {os.strerror(err)}")
    return False


def on_huge_pages(st: os.stat_result) -> bool:
    """Whether the tmpfs file ``st`` describes gets huge pages (``huge=within_size`` or
    ``always`` on its mount); any other file system, or a kernel without them, says no."""
    return st.st_blksize >= HUGE_PAGE_BYTES


def reserve(fd: int, size: int, offset: int = 0) -> None:
    """Allocate the file's pages in [offset, offset + size) now, growing the file if need be.

    A tmpfs page first touched through a mapping when the filesystem is full kills the process
    with SIGBUS. Reserved here, a full tmpfs is an OSError (ENOSPC) before any byte is written.
    A file with no holes (a recycled buffer) costs one fstat.
    """
    if size <= 0:
        return
    st = os.fstat(fd)
    if offset + size <= st.st_size and st.st_blocks * 512 >= st.st_size:
        return  # every page is there already
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno in NO_ROOM:
            raise
        # A filesystem that cannot reserve (rare: glibc emulates fallocate where the kernel
        # lacks it): populating the mapping still refuses cleanly where a page cannot be had.
        log.debug("cannot reserve %d bytes: %s", size, e)


def _map(fd: int, size: int, flags: int) -> tuple[mmap.mmap | None, np.ndarray]:
    if size == 0:
        # A rank left with no tensor bytes (an empty or non-tensor state dict, or everything
        # de-duplicated to another rank) still commits a shard. mmap cannot map 0 bytes, nor
        # map past the end of an empty file, so there is no mapping: an empty array stands in.
        return None, np.empty(0, dtype=np.uint8)
    mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, np.frombuffer(mm, dtype=np.uint8, count=size)


class MappedFile:
    """One tmpfs file mapped read-write, exposed as a uint8 numpy array and torch tensor.

    ``populate=False`` (a shard about to be read once, by a process that had no mapping of
    it): small pages are left to be faulted in by whoever reads them first; huge ones are
    populated for reading, which is cheap.

    ``holes=True`` (a partial replica: only its items' ranges have pages, reserved by whoever
    made the file): nothing is reserved or populated, so the holes between the items take no
    memory; only the items' ranges may be touched.
    """

    def __init__(self, path: str, size: int, populate: bool = True, holes: bool = False):
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                os.ftruncate(fd, size)
            if not holes:
                reserve(fd, size)  # its pages exist before anything touches them: no SIGBUS
            self.key = (st.st_dev, st.st_ino)
            self.size = size
            self._mm, self.array = _map(fd, size, _MAP_FLAGS)
            self.populated_by = ""  # how the pages were faulted in (tests check it is madvise)
            if size and holes:
                self.populated_by = "on demand"
            elif size and not populate:
                self.populated_by = self._prepare_for_reading(on_huge_pages(st))
            elif size and self._populated():
                self.populated_by = "madvise"
            elif size and self._mm is not None:
                self.array = None  # type: ignore[assignment]  # old kernel: the populating (GIL-holding) mmap instead
                self._mm.close()
                self._mm, self.array = _map(fd, size, _MAP_FLAGS | getattr(mmap, "MAP_POPULATE", 0))
                self.populated_by = "MAP_POPULATE"
            self.base_ptr = self.array.ctypes.data  # address of byte 0 (stable while mapped)
        finally:
            os.close(fd)
        self._tensor: torch.Tensor | None = None
        self._cuda_registered = False
        self._cuda_device = 0  # the device whose context registered it

    def _prepare_for_reading(self, huge: bool) -> str:
        """Populate huge pages now (one call, no faults while copying); leave small ones to
        the readers' faults. Returns how the pages get mapped."""
        address = self.array.ctypes.data
        if huge and _MADVISE is not None and _MADVISE(address, self.size, _MADV_POPULATE_READ) == 0:
            return "madvise (huge pages)"
        return "on demand"

    def _populated(self) -> bool:
        """Populate the fresh mapping (see ``_populate``); unmapped again if that fails."""
        try:
            return _populate(self.array.ctypes.data, self.size)
        except OSError:
            self.array = None  # type: ignore[assignment]
            if self._mm is not None:
                self._mm.close()
            raise

    @property
    def tensor(self) -> torch.Tensor:
        """The mapping as a flat uint8 tensor.

        Made anew when the last one no longer points at the mapping: DCP's PROCESS mode hands
        staged views to its checkpoint process through torch multiprocessing, which moves their
        storage (this tensor's) into new shared memory. Views taken after that would stage the
        next save into that memory instead of the tmpfs file.
        """
        t = self._tensor
        if t is None or t.data_ptr() != self.base_ptr:
            t = self._tensor = torch.from_numpy(self.array)
        return t

    def contains(self, t: torch.Tensor) -> int | None:
        """Byte offset of ``t`` inside this mapping if it is a contiguous CPU view of it."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        ptr = t.data_ptr()
        end = ptr + t.numel() * t.element_size()
        if self.base_ptr <= ptr and end <= self.base_ptr + self.size:
            return ptr - self.base_ptr
        return None

    def register_for_device_copies(self, device: int | None = None) -> None:
        """Page-lock the mapping so device-to-host copies land directly (no bounce buffer).
        Once per mapping (``BufferPool.prewarm`` does it as it prepares a buffer); portable,
        so every device's copies use it. It runs under ``device``'s context (default: the
        calling thread's current device; a library thread passes the rank's, so no context is
        made on device 0), and so does its unregistering, whichever thread releases it.

        A failed registration is no error (copies go through a bounce buffer), but the CUDA
        runtime keeps it as the thread's last error, which the next kernel launch on the
        thread would raise: it is cleared here."""
        if self._cuda_registered or not torch.cuda.is_available() or self.size == 0:
            return
        device = torch.cuda.current_device() if device is None else device
        with torch.cuda.device(device):
            rc = int(torch.cuda.cudart().cudaHostRegister(self.base_ptr, self.size, _REGISTER_PORTABLE))
            if rc != 0:
                _clear_cuda_error(rc)
        if rc == 0:
            self._cuda_registered = True
            self._cuda_device = device
            registrations[threading.current_thread().name] += 1
        else:  # still correct, only slower
            _warn_once(f"cudaHostRegister of a shard buffer failed ({_cuda_error(rc)}); the GPU "
                       "copies of such buffers go through a bounce buffer")

    def release(self) -> None:
        """The cache lets go of this mapping: it is no longer page-locked, and it is unmapped
        once nothing refers to it. Not here: whoever was handed it may still be copying
        through its address on another thread (a peer's read served beside a resume reading
        the same shard), and unmapping it under them is a segfault."""
        if self._cuda_registered:
            with torch.cuda.device(self._cuda_device):
                rc = int(torch.cuda.cudart().cudaHostUnregister(self.base_ptr))
                if rc != 0:
                    _clear_cuda_error(rc)
                    log.debug("cudaHostUnregister failed (%s)", _cuda_error(rc))
            self._cuda_registered = False
        self._tensor = None


# The cudaHostRegister calls that succeeded in this process, by the name of the thread that
# made them (tests and benchmarks: a save that registers a buffer again shows here).
registrations: Counter[str] = Counter()
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """One warning line per distinct failure, not one per buffer."""
    if message not in _warned:
        _warned.add(message)
        log.warning("mlcheckpoint: %s", message)


def _cuda_error(rc: int) -> str:
    try:
        return f"{torch.cuda.cudart().cudaGetErrorString(rc)} ({rc})"
    except (AttributeError, RuntimeError, TypeError):
        return str(rc)


def _bind_cuda_get_last_error():
    """``cudaGetLastError`` of the CUDA runtime library torch loaded, found in this process's
    maps (the same library instance, so the same per-thread error); None where torch's runtime
    is not a shared library of its own (linked in statically)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn
    return None


_cuda_get_last_error: list = []  # [the bound function or None], bound on first use


def _clear_cuda_error(rc: int) -> None:
    """Reset the calling thread's CUDA error left by a failed runtime call (``rc``), so that
    torch's next launch check does not raise it (the device is current). Through the runtime
    library's ``cudaGetLastError``; where that library cannot be found, a one-element launch,
    whose check reads (and so resets) the error, raising it, caught here."""
    if not _cuda_get_last_error:
        _cuda_get_last_error.append(_bind_cuda_get_last_error())
    get_last_error = _cuda_get_last_error[0]
    if get_last_error is not None:
        get_last_error()
        return
    try:
        torch.empty(1, dtype=torch.uint8, device="cuda").fill_(0)
    except RuntimeError as e:
        log.debug("cleared the CUDA error of a failed call (%s): %s", _cuda_error(rc), e)


class MappingCache:
    """Per-process cache of MappedFile by inode, so recycled files are mapped once.

    A file has at most two: the first one made (the writer's, page-locked for device copies
    when the rank saves from device memory) and, when a reader needs more of the file than it
    covers (a whole-file reader of a committed shard, whose byte items were appended past the
    staged region), a wider one beside it. The wider one never replaces the first: replacing
    it would unregister it, and the next save of the recycled buffer would page-lock it again
    on the training thread (with replication, whose sender reads every shard whole: each save).

    A mapping the cache lets go of (replaced, ``forget``, ``clear``) is unmapped when its last
    holder drops it, never under a thread still reading through it. Two threads that miss at
    once (a resume reading a shard while serving a peer's read of it) share the first one's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[int, int], MappedFile] = {}
        self._wider: dict[tuple[int, int], MappedFile] = {}

    # Mappings belong to one process: a pickled cache (DCP's PROCESS mode sends the store, with
    # its parts that share this cache, to another process) arrives empty, still shared.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def map(self, path: str, size: int, populate: bool = True, holes: bool = False) -> MappedFile:
        """This process's mapping of the file at ``path`` (its first ``size`` bytes), mapped
        now if need be; ``populate``, ``holes``: see MappedFile."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            held = self._covering(key, size) if st.st_size >= size else None
        if held is not None:
            return held
        # Map outside the lock: populating a fresh file's pages can take seconds, and another
        # thread's save must not wait behind a buffer being prepared in the background.
        new = MappedFile(path, size, populate, holes)
        with self._lock:
            held = self._covering(key, size)  # another thread mapped it meanwhile: theirs
            if held is not None:              # (one mapping per file; ours goes unused)
                return held
            first = self._by_key.get(key)
            if first is not None and first.size < size:  # kept: a wider one beside it
                old = self._wider.get(key)
                self._wider[key] = new
            else:
                old = first
                self._by_key[key] = new
        if old is not None:
            old.release()
        return new

    def _covering(self, key: tuple[int, int], size: int) -> MappedFile | None:
        """(Under the lock) a cached mapping of ``key`` covering its first ``size`` bytes."""
        for mf in (self._by_key.get(key), self._wider.get(key)):
            if mf is not None and mf.size >= size:
                return mf if mf.size == size else _SubMapping(mf, size)
        return None

    def lookup(self, st: os.stat_result) -> MappedFile | None:
        """This process's mapping of the file ``st`` describes, if any (it may cover only the
        file's first bytes: byte items are appended past the mapped region)."""
        with self._lock:
            mf = self._by_key.get((st.st_dev, st.st_ino))
        return mf if mf is not None and mf.size <= st.st_size else None

    def page_locked(self, st: os.stat_result) -> bool:
        """Whether this process page-locked (registered for device copies) a mapping of the
        file ``st`` describes."""
        key = (st.st_dev, st.st_ino)
        with self._lock:
            return any(mf is not None and mf._cuda_registered
                       for mf in (self._by_key.get(key), self._wider.get(key)))

    def unpin_beyond(self, path: str, end: int) -> None:
        """Before ``path`` is truncated to ``end`` bytes: drop (unregistering) its page-locked
        mappings that reach past ``end``. Pages the device registration holds stay allocated
        past the end of a truncated file, where no room check sees them."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        key = (st.st_dev, st.st_ino)
        dropped = []
        with self._lock:
            for cache in (self._by_key, self._wider):
                mf = cache.get(key)
                if mf is not None and mf.size > end and mf._cuda_registered:
                    dropped.append(cache.pop(key))
        for mf in dropped:
            mf.release()

    def forget(self, path: str) -> None:
        """Drop the mappings of a file about to be deleted, so its pages can be freed."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        key = (st.st_dev, st.st_ino)
        with self._lock:
            dropped = [cache.pop(key, None) for cache in (self._by_key, self._wider)]
        for mf in dropped:
            if mf is not None:
                mf.release()

    def clear(self) -> None:
        with self._lock:
            mapped = [*self._by_key.values(), *self._wider.values()]
            self._by_key, self._wider = {}, {}
        for mf in mapped:
            mf.release()


class _SubMapping(MappedFile):
    """The first ``size`` bytes of a cached, larger mapping (a recycled buffer with slack)."""

    def __init__(self, parent: MappedFile, size: int):  # shares the parent's mapping: no super()
        self.key = parent.key
        self.size = size
        self._parent = parent
        self.array = parent.array[:size]
        self.base_ptr = parent.base_ptr

    @property
    def tensor(self) -> torch.Tensor:
        return self._parent.tensor[:self.size]

    @property
    def _cuda_registered(self) -> bool:  # type: ignore[override]
        return self._parent._cuda_registered

    def register_for_device_copies(self, device: int | None = None) -> None:
        self._parent.register_for_device_copies(device)

    def release(self) -> None:
        pass
