"""GPU paths: staging from device memory straight into tmpfs, and replication over NCCL; and
the GPU path correct by construction (issue 46): a resume ordered after the kernels queued
before it, a failed page-locking that leaves no CUDA error behind, the device memory the
checksum and a cast resume add, no page-locking again at each save, snapshots ordered after
the producers on every device, a failed snapshot that waits for its device copies.

Skipped without CUDA (CI has no GPU); run on a machine with one (two for NCCL and for the
tests of a second device). benchmarks/device_check.sh runs them first.
"""

import shutil
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cluster import Cluster

from mlcheckpoint import CheckpointManager


def cuda(test):
    """A test that needs a CUDA device (``-m gpu`` selects it; skipped without one)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@cuda
def test_async_save_stages_device_tensors_straight_into_tmpfs():
    root = tempfile.mkdtemp(prefix="mlckpt-gpu-", dir="/dev/shm")
    try:
        with CheckpointManager(job_id="gpu", local_dir=root, replication="none") as ckpt:
            sd = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(77, device="cuda").to(torch.bfloat16)}
            expected = {k: v.cpu().clone() for k, v in sd.items()}
            fut = ckpt.async_save(sd, 1)
            for v in sd.values():  # training goes on on the device: the staged copy is taken
                v.zero_()
            fut.result()
            writer = ckpt.storage_writer(2)
            staged = writer.stage(expected)
            assert all(t.device.type == "cpu" for t in staged.values())
            writer.close()
            out = {k: torch.zeros_like(v, device="cuda") for k, v in expected.items()}
            dcp.load(out, storage_reader=ckpt.storage_reader(1))
            for k, v in expected.items():
                assert torch.equal(out[k].cpu(), v)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL replication needs two GPUs")
def test_replication_over_dedicated_nccl_group():
    """Replication over a dedicated NCCL group between two GPUs protects the step and both
    nodes hold both shards; a broken NCCL transport fails."""
    with Cluster(2, 1) as c:
        c.run("gpu_nccl.py", timeout=300)
        res = c.results("nccl")
        assert all(r["protected"] for r in res.values()), res
        assert all(r["held"] == [0, 1] for r in res.values()), res


def _mixed_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256).to(torch.bfloat16)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _cuda_step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(i)
    optim.zero_grad()
    h = model[1](model[0](torch.randn(32, 64, device="cuda", generator=g)))
    model[2](h.to(torch.bfloat16)).float().square().mean().backward()
    optim.step()


def _host_copy(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.cpu().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(optim.state.values()):
        out.update({f"optim.{i}.{k}": v.cpu().clone() for k, v in st.items()})
    return out


@cuda
def test_cuda_adamw_round_trip_through_guard_and_dcp_thread_async_save_is_bit_exact():
    """bf16 and fp32 parameters with AdamW state on the device: an overlapped save (the guard
    waits in ``optimizer.step()``) and a DCP-native ``async_save`` in THREAD mode with our
    writer (each its own job), each resumed by a fresh manager straight into CUDA tensors,
    bit for bit."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    root = tempfile.mkdtemp(prefix="mlckpt-gpu-", dir="/dev/shm")
    try:
        model, optim = _mixed_model()
        _cuda_step(model, optim, 0)
        expected = {}
        with CheckpointManager(job_id="guarded", local_dir=root, replication="none") as ckpt:
            ckpt.guard(optim)
            expected["guarded"] = _host_copy(model, optim)
            fut = ckpt.async_save({"model": model.state_dict(), "optim": optim.state_dict()}, 1)
            _cuda_step(model, optim, 1)  # the guard waits for the snapshot in step()
            assert fut.result().overlapped_bytes > 0
        with CheckpointManager(job_id="thread", local_dir=root, replication="none") as ckpt:
            ckpt.guard(optim)  # our writer then stages in the background: an AsyncSaveResponse
            expected["thread"] = _host_copy(model, optim)
            resp = dcp.async_save({"model": model.state_dict(), "optim": optim.state_dict()},
                                  storage_writer=ckpt.storage_writer(1), no_dist=True,
                                  async_checkpointer_type=AsyncCheckpointerType.THREAD)
            resp.staging_completion.result()
            _cuda_step(model, optim, 2)
            resp.upload_completion.result()
        assert not torch.equal(model[0].weight.cpu(), expected["thread"]["model.0.weight"])
        for job, want in expected.items():
            with CheckpointManager(job_id=job, local_dir=root, replication="none") as fresh:
                new_model, new_optim = _mixed_model()
                _cuda_step(new_model, new_optim, 99)  # AdamW state to load into
                target = {"model": new_model.state_dict(), "optim": new_optim.state_dict()}
                assert fresh.resume(target).step == 1
                new_optim.load_state_dict(target["optim"])
                assert all(p.is_cuda for p in new_model.parameters())
                got = _host_copy(new_model, new_optim)
                assert got.keys() == want.keys()
                for k, v in want.items():
                    assert got[k].dtype == v.dtype, (job, k)
                    assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                                       v.reshape(-1).view(torch.uint8)), (job, k)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------- the GPU path by construction
# (issue 46: stream order, sticky errors, memory, devices of threads, registrations, events of
# every device, error paths). Each fails on the code before it; run at once by device_check.sh.

def _sleep_kernel(seconds: float) -> None:
    """Enqueue a kernel that spins about ``seconds`` on the current stream."""
    rate = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0)  # kHz
    torch.cuda._sleep(int(seconds * (rate or 2_000_000) * 1000))


def _shm_root() -> str:
    return tempfile.mkdtemp(prefix="mlckpt-gpu-", dir="/dev/shm")


# What docs/performance.md states the device checksum may add, for items of at most 1 GiB
# (``wsum.scratch_bytes``; a literal here so that the code before it fails on the figure).
DIGEST_BOUND = 72 << 20


class _Registrations:
    """Counts the buffers page-locked while it is open, by thread name, by wrapping
    ``MappedFile.register_for_device_copies`` (so it counts the code before issue 46 too)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        import threading
        from collections import Counter

        from mlcheckpoint.store import buffers

        self.by_thread: Counter[str] = Counter()
        original = buffers.MappedFile.register_for_device_copies

        def counting(mapped, *args, **kwargs):
            before = mapped._cuda_registered
            original(mapped, *args, **kwargs)
            if not before and mapped._cuda_registered:
                self.by_thread[threading.current_thread().name] += 1

        monkeypatch.setattr(buffers.MappedFile, "register_for_device_copies", counting)

    def on_save_paths(self) -> int:
        """Registrations on any thread but the buffer warmer's."""
        return sum(n for name, n in self.by_thread.items() if name != "mlckpt-prepare")


@cuda
def test_a_resume_lands_after_the_kernels_queued_before_it():
    """``to_empty`` -> ``init_weights()`` -> ``dcp.load``: the initialisation still queued on
    the caller's stream must not land after the ring's copies (and after the device checksum,
    which would then have passed for bytes about to be overwritten). No collective syncs the
    stream here (``no_dist``)."""
    root = _shm_root()
    try:
        with CheckpointManager(job_id="order", local_dir=root, replication="none") as ckpt:
            g = torch.Generator(device="cuda").manual_seed(0)
            saved = {"whole": torch.randn(16 << 20, device="cuda", generator=g),
                     "cast": torch.randn(2048, 1024, device="cuda", generator=g)}
            ckpt.save(saved, 1)
            target = {"whole": torch.empty_like(saved["whole"]),
                      "cast": torch.empty(1024, 2048, dtype=torch.float64, device="cuda").t()}
            torch.cuda.synchronize()
            _sleep_kernel(1.0)
            for t in target.values():
                t.fill_(7)  # the model's initialisation, still queued behind the sleep
            dcp.load(target, storage_reader=ckpt.storage_reader(1), no_dist=True)
            torch.cuda.synchronize()
            assert torch.equal(target["whole"], saved["whole"])
            assert torch.equal(target["cast"], saved["cast"].double())
    finally:
        shutil.rmtree(root, ignore_errors=True)


@cuda
def test_a_failed_registration_leaves_no_cuda_error_for_the_next_launch():
    """cudaHostRegister of a range already registered fails; the buffer falls back to a
    bounce buffer, and the thread's next kernel launch must not raise that error."""
    from mlcheckpoint.store import buffers

    root = _shm_root()
    try:
        path = f"{root}/buf"
        with open(path, "wb") as f:
            f.truncate(4 << 20)
        mapped = buffers.MappedFile(path, 4 << 20)
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(mapped.base_ptr, mapped.size, 0)) == 0  # someone else's
        try:
            mapped.register_for_device_copies()  # already registered: refused
            assert not mapped._cuda_registered
            x = torch.ones(1024, device="cuda") + 1  # a launch, and its check
            torch.cuda.synchronize()
            assert x.sum().item() == 2048
        finally:
            cudart.cudaHostUnregister(mapped.base_ptr)
            mapped.release()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@cuda
@pytest.mark.parametrize("case", ["512 MiB contiguous", "2048 items of 256 KiB", "512 MiB transposed"])
def test_the_device_digest_adds_at_most_its_stated_scratch(case):
    """``max_memory_allocated`` while the device checksums a state: a fixed scratch (the bound
    docs/performance.md states), not a copy of a strided tensor nor two packing blocks."""
    from mlcheckpoint.integrity import wsum

    items = {"512 MiB contiguous": lambda: [torch.randn(128 << 20, device="cuda")],
             "2048 items of 256 KiB": lambda: [torch.randn(64 << 10, device="cuda") for _ in range(2048)],
             "512 MiB transposed": lambda: [torch.randn(8192, 16384, device="cuda").t()]}[case]()
    wsum.tensor_digests(items[:1])  # the weight tables: made once per device
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    wsum.tensor_digests(items)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= DIGEST_BOUND, f"{case}: {extra / 2**20:.1f} MiB"
    assert extra <= wsum.scratch_bytes(items), f"{case}: {extra / 2**20:.1f} MiB"


@cuda
def test_a_resharded_resume_takes_one_items_buffer_at_a_time():
    """Cast items come through a device buffer each, loaded one after the other: the resume
    adds one stored item's bytes (and the checksum's scratch), not every such item's."""
    root = _shm_root()
    item = 128 << 20
    try:
        with CheckpointManager(job_id="cast", local_dir=root, replication="none") as ckpt:
            saved = {f"w{i}": torch.randn(item // 4, device="cuda") for i in range(4)}
            ckpt.save(saved, 1)
            target = {k: torch.zeros(item // 4, dtype=torch.float64, device="cuda") for k in saved}
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            dcp.load(target, storage_reader=ckpt.storage_reader(1), no_dist=True)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
            assert all(torch.equal(target[k], v.double()) for k, v in saved.items())
        bound = item + DIGEST_BOUND
        assert extra <= bound, f"{extra / 2**20:.0f} MiB for 4 cast items of {item >> 20} MiB"
    finally:
        shutil.rmtree(root, ignore_errors=True)


@cuda
def test_whole_file_reads_leave_saves_nothing_to_page_lock_again(monkeypatch):
    """Each committed shard is read whole after its save (as the pg replication sender and
    ``verify_shard`` do): once the buffers are made, a save registers none again."""
    root = _shm_root()
    counted = _Registrations(monkeypatch)
    try:
        with CheckpointManager(job_id="pinned", local_dir=root, replication="none", keep=2) as ckpt:
            store = ckpt.storage_reader(0).store
            state = {"w": torch.randn(8 << 20, device="cuda"), "meta": {"lr": 0.1, "note": "x" * 5000}}
            per_save = []
            for step in range(8):
                state["w"].add_(1)
                before = counted.on_save_paths()
                ckpt.save(state, step)
                store.verify_shard(step, 0)  # maps the whole file: byte items lie past the region
                per_save.append(counted.on_save_paths() - before)
            assert sum(per_save[4:]) == 0, per_save
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_overlapped_snapshot_waits_for_the_producers_on_every_device():
    """A tensor on cuda:1 while cuda:0 is current: its copy on cuda:1's side stream waits for
    the kernels queued on cuda:1's stream at the call, not only for cuda:0's."""
    from mlcheckpoint.dcp import staging

    torch.cuda.set_device(0)
    x = torch.zeros(4 << 20, device="cuda:1")
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        _sleep_kernel(1.0)
        x.fill_(5)  # queued behind the sleep on cuda:1
    buffer = torch.empty(x.numel() * 4, dtype=torch.uint8, pin_memory=True)
    layout = staging.stage_into({"x": x}, buffer, defer=lambda t: True)
    staging.copy_deferred(layout)
    assert torch.equal(layout.staged["x"], torch.full((x.numel(),), 5.0))


@cuda
def test_a_failed_snapshot_waits_for_its_device_copies_before_the_buffer_goes_back(monkeypatch):
    """The staging thread's copy fails after its device copies were enqueued: before the error
    reaches the commit (which gives the buffer back for the next save) the device has stopped
    writing into the buffer."""
    from mlcheckpoint.dcp import device_staging, staging

    x = torch.randn(64 << 20, device="cuda")
    buffer = torch.empty(x.numel() * 4 + 4096, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    _sleep_kernel(1.0)  # the call's stream: the side stream's copies wait for it
    layout = staging.stage_into({"x": x, "host": torch.ones(1024)}, buffer, defer=lambda t: True)

    def fails(spans):
        raise RuntimeError("the copier failed")

    monkeypatch.setattr(staging.copier, "process", fails)
    with pytest.raises(RuntimeError, match="the copier failed"):
        staging.copy_deferred(layout)
    assert device_staging.side_stream(x.device).query(), "device copies still write the buffer"
