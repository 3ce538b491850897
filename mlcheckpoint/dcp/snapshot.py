"""Overlapped snapshots: the tensor copy of a save runs while the next step computes.

A save captures everything that is not a tensor (Stateful objects' ``state_dict()``, python
scalars, deep-copied leaves) on the training thread, at call time. The tensor bytes are
copied into the tmpfs buffer on the staging thread afterwards, and only for tensors that
nothing changes before a guard point: the parameters and the optimizer state of an optimizer
passed to ``guard``, which only ``optimizer.step()`` changes. Every other tensor (BatchNorm
running statistics that the next forward updates, loose tensors) is copied at call time; they
are small. ``Snapshotter`` owns the staging thread, the guards and the failure of a copy;
``dcp/staging.py`` does the copies.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..errors import StagingError
from ..integrity.copier import raw_copyable
from .plans import PlanCache

log = logging.getLogger(__name__)


def storage_ptr(t: torch.Tensor) -> int:
    """The address of the storage behind ``t`` (a DTensor's local shard): equal for every
    view of one parameter, e.g. ``param`` and ``model.state_dict()[name]``. 0 for a tensor
    without raw bytes of its own (a subclass): its copy is never deferred."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr() if raw_copyable(local) else 0


def optimizer_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    """Storages that ``optimizer.step()`` changes: its parameters and its state tensors."""
    ptrs = {storage_ptr(p) for group in optimizer.param_groups for p in group["params"]}
    for state in optimizer.state.values():
        ptrs.update(storage_ptr(v) for v in state.values() if isinstance(v, torch.Tensor))
    ptrs.discard(0)  # empty tensors: nothing to copy, and 0 would match every other empty one
    return ptrs


class Snapshotter:
    """The staging thread of one CheckpointManager, the guards that wait for it, and the
    failure of a copy, which it raises at this rank's next guard point.

    One staging runs at a time, in submission order. A staging that fails here is raised at
    this rank's next guard point (``wait``), once, unless the next staging starts first. The
    save it belonged to fails on every rank, with this error, through its commit (the failed
    stage fails DCP's planning: ``MemoryStorageWriter.prepare_local_plan``); every rank's
    future of that save reports it.
    """

    def __init__(self, predict_plans: bool = True) -> None:
        """``predict_plans``: whether stages follow a prediction of DCP's plan (``PlanCache``);
        False where a rank saves alone."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlckpt-stage")
        self._lock = threading.Lock()
        self._handles: list[GuardHandle] = []  # one per guard() call still in place
        self._in_flight: Future[None] | None = None
        self._failure: BaseException | None = None  # raised at the next guard point
        self._aborted = False  # closed without waiting: stagings in flight fail
        self.longest_wait_s = 0.0  # the longest time a guard point held the training thread
        # which tensors this rank's saves wrote (dcp/plans.py)
        self.plans = PlanCache(predicting=predict_plans)

    # ---------------------------------------------------------------- guards
    def guard(self, optimizer: torch.optim.Optimizer) -> GuardHandle:
        """Wait for the staging in flight before every ``optimizer.step()``."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"guard() takes a torch.optim.Optimizer, not {type(optimizer).__name__}")
        hook = optimizer.register_step_pre_hook(lambda *_: self.wait())
        handle = GuardHandle(hook, self, optimizer)
        with self._lock:
            self._handles.append(handle)
        return handle

    def _unguard(self, handle: GuardHandle) -> None:
        with self._lock:
            self._handles = [h for h in self._handles if h is not handle]

    @property
    def guarded(self) -> bool:
        """Whether some optimizer is guarded (saves then overlap by default)."""
        with self._lock:
            return bool(self._handles)

    def deferrable(self) -> set[int]:
        """Storages whose copy may wait for the staging thread: those only a guarded
        ``optimizer.step()`` changes. Taken at call time (optimizer state appears lazily)."""
        with self._lock:
            optimizers = {id(h.optimizer): h.optimizer for h in self._handles}
        return set().union(*(optimizer_storages(o) for o in optimizers.values()))

    # ---------------------------------------------------------------- staging
    def submit(self, copy: Callable[[Callable[[], None]], None], label: int) -> Future[None]:
        """Run ``copy(copied)`` on the staging thread, after the stagings before it; ``copy``
        calls ``copied()`` once the sources may change (guards wait for that, not for the
        hashing after it). ``label`` (the step) names it in errors. The returned Future
        completes when ``copy`` returns."""
        return self._submit(copy, label, held=False)[0]

    def submit_held(self, copy: Callable[[Callable[[], None]], None], label: int
                    ) -> tuple[Future[None], Callable[[], None]]:
        """``submit``, but the guards go on waiting after ``copy`` until the returned release
        is called (or the copy fails): for a stage that left tensors out, which the commit
        may still have to copy from their sources. The caller must release on every path."""
        return self._submit(copy, label, held=True)

    def _submit(self, copy: Callable[[Callable[[], None]], None], label: int, held: bool
                ) -> tuple[Future[None], Callable[[], None]]:
        copied: Future[None] = Future()

        def run() -> None:
            ok = False
            try:
                self._check_open(label)
                copy((lambda: None) if held else (lambda: _settle(copied)))
                self._check_open(label)  # a close that did not wait: the copy may be torn
                ok = True
            except BaseException as e:
                log.error("mlcheckpoint: background staging of step %d failed: %r", label, e)
                with self._lock:
                    self._failure = e
                raise  # wait() raises it, not ``copied``
            finally:
                if not (held and ok):
                    _settle(copied)

        with self._lock:
            self._in_flight = copied
            self._failure = None  # an earlier save's: its future reported it
        return self._executor.submit(run), lambda: _settle(copied)

    def _check_open(self, label: int) -> None:
        if self._aborted:
            raise StagingError(f"the checkpoint manager was closed while the snapshot of step "
                               f"{label} was being taken; the step is not saved")

    def wait(self) -> None:
        """Wait until the staging in flight has copied every byte; raise its failure (once)."""
        with self._lock:
            fut = self._in_flight
        if fut is not None and not fut.done():
            t0 = time.perf_counter()
            fut.result()
            self.longest_wait_s = max(self.longest_wait_s, time.perf_counter() - t0)
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def close(self, wait: bool = True) -> None:
        """Stop the staging thread. Without ``wait``, a staging in flight fails (StagingError)
        instead of committing a snapshot that training may be changing."""
        if not wait:
            self._aborted = True
        with self._lock:
            handles = list(self._handles)
        for handle in handles:  # training may go on without the manager: nothing to wait for
            handle.remove()
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        with self._lock:
            if self._in_flight is not None:
                _settle(self._in_flight)  # a cancelled staging must not hold a guard forever


class GuardHandle:
    """What ``guard`` returns: ``remove()`` takes the hook off (also as a context manager)."""

    def __init__(self, hook: RemovableHandle, snapshots: Snapshotter,
                 optimizer: torch.optim.Optimizer):
        self._hook, self._snapshots, self.optimizer = hook, snapshots, optimizer

    def remove(self) -> None:
        self._hook.remove()
        self._snapshots._unguard(self)

    def __enter__(self) -> GuardHandle:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _settle(fut: Future[None]) -> None:
    """Mark ``fut`` done unless it is (two threads may race to)."""
    with contextlib.suppress(InvalidStateError):
        fut.set_result(None)
