"""The cyclic garbage collector is held off while a checkpoint is saved or loaded, and given
back afterwards exactly as it was (mlcheckpoint/_gc.py).

The integration tests set the young-generation threshold to 1, so that with the collector on
every allocation of a tracked object starts a collection, and count the collections that begin
while DCP's save or load (or our writer or reader) is on the stack of the thread running it.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typing_extensions import Self

from mlcheckpoint import CheckpointManager, _gc
from mlcheckpoint._gc import gc_paused

JOB = "gc-pause"


@pytest.fixture(autouse=True)
def collector_on(monkeypatch):
    """Every test starts with the collector on and the pause switched on, and leaves it on."""
    monkeypatch.delenv("MLCHECKPOINT_PAUSE_GC", raising=False)
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        assert _gc._depth == 0, "a pause was left open"
        (gc.enable if was else gc.disable)()


def test_pause_nests_and_gives_the_collector_back():
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause is still open
    assert gc.isenabled()


def test_collector_comes_back_after_an_error():
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_program_stays_off():
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("MLCHECKPOINT_PAUSE_GC", "0")
    with gc_paused():
        assert gc.isenabled()


def test_pauses_overlapping_on_two_threads():
    """The collector stays off until the last of the overlapping pauses ends."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with gc_paused():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with gc_paused():
            b_in.set()
            a_out.wait(10)
            seen["after a left"] = gc.isenabled()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after a left": False}
    assert gc.isenabled()


def test_a_long_pause_gives_the_collector_back(monkeypatch):
    """A save stuck on a lost peer must not keep the whole process's collector off."""
    monkeypatch.setattr(_gc, "MAX_PAUSE_S", 0.2)
    with gc_paused():
        assert not gc.isenabled()
        deadline = time.monotonic() + 10
        while not gc.isenabled():
            assert time.monotonic() < deadline, "the collector was not given back"
            time.sleep(0.02)
        with gc_paused():  # a pause inside an overlong one does not take it away again
            assert gc.isenabled()
    assert gc.isenabled()
    with gc_paused():  # and the next save pauses as usual
        assert not gc.isenabled()
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_pause_has_its_collector():
    r, w = os.pipe()
    with gc_paused():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only reports
            pid = os.fork()
        if pid == 0:
            try:
                with gc_paused():
                    inside = gc.isenabled()
                os.write(w, bytes([gc.isenabled(), inside]))
            finally:
                os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 2)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got == bytes([True, False])  # on after, off inside its own pause


# ------------------------------------------------------------------------ in real saves and loads
class Collections:
    """Counts collections that start while one of ``functions`` (file, name) is on the stack
    of the thread whose allocation started them."""

    def __init__(self, *functions: tuple[str, str]):
        self.functions = functions
        self.inside = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase != "start":
            return
        f = sys._getframe(1)
        while f is not None:
            code = f.f_code
            if any(code.co_filename.endswith(path) and code.co_name == name
                   for path, name in self.functions):
                self.inside += 1
                return
            f = f.f_back

    def __enter__(self) -> Self:
        self.threshold = gc.get_threshold()
        gc.set_threshold(1, 10, 10)
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)
        gc.set_threshold(*self.threshold)


DCP = os.path.join("torch", "distributed", "checkpoint")
MANAGER_CALLS = [  # what CheckpointManager pauses: all of DCP's save and load, and staging
    (os.path.join(DCP, "state_dict_saver.py"), "save"),
    (os.path.join(DCP, "state_dict_saver.py"), "_stateful_to_state_dict"),
    (os.path.join(DCP, "state_dict_loader.py"), "load"),
]
WRITER = os.path.join("mlcheckpoint", "dcp", "writer.py")
READER = os.path.join("mlcheckpoint", "dcp", "reader.py")
STORAGE_CALLS = [  # what the writer and reader pause when DCP is called directly
    (WRITER, "stage"), (WRITER, "write_data"), (WRITER, "finish"),
    (READER, "read_metadata"), (READER, "set_up_storage_reader"), (READER, "read_data"),
]


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.w": torch.randn(64, generator=g) for i in range(40)},
            "step": seed, "note": ["a", {"b": seed}]}


@pytest.fixture
def ckpt(store_dir):
    with CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none") as m:
        yield m


@pytest.mark.parametrize("pause", ["1", "0"])
def test_manager_saves_and_loads_without_collections(ckpt, monkeypatch, pause):
    """With the pause (the default) no collection starts inside DCP's save or load; with
    MLCHECKPOINT_PAUSE_GC=0 the same calls start many (so the counting works)."""
    monkeypatch.setenv("MLCHECKPOINT_PAUSE_GC", pause)
    ckpt.save(state(0), 0)  # buffers and first-use imports out of the way
    with Collections(*MANAGER_CALLS) as seen:
        ckpt.save(state(1), 1)
        ckpt.async_save(state(2), 2).result(timeout=60)
        target = state(9)
        info = ckpt.resume(target)
    assert info.step == 2 and torch.equal(target["model"]["layer3.w"], state(2)["model"]["layer3.w"])
    assert gc.isenabled()
    if pause == "1":
        assert seen.inside == 0, f"{seen.inside} collections inside a save or load"
    else:
        assert seen.inside > 1000, seen.inside


@pytest.mark.parametrize("pause", ["1", "0"])
def test_writer_and_reader_pause_for_direct_dcp_calls(ckpt, monkeypatch, pause):
    """Users calling dcp.save/dcp.load themselves: our writer's and reader's own work runs
    with the collector paused."""
    monkeypatch.setenv("MLCHECKPOINT_PAUSE_GC", pause)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
        dcp.save(state(0), storage_writer=ckpt.storage_writer(0))
        with Collections(*STORAGE_CALLS) as seen:
            dcp.save(state(1), storage_writer=ckpt.storage_writer(1))
            dcp.async_save(state(2), storage_writer=ckpt.storage_writer(2)).result(timeout=60)
            target = state(9)
            dcp.load(target, storage_reader=ckpt.storage_reader(2))
    assert torch.equal(target["model"]["layer5.w"], state(2)["model"]["layer5.w"])
    assert gc.isenabled()
    if pause == "1":
        assert seen.inside == 0, f"{seen.inside} collections inside our writer or reader"
    else:
        assert seen.inside > 500, seen.inside
