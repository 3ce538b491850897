"""End-to-end save/restart/resume with real torchrun jobs (1 simulated node x 2 ranks).

Kills during a save, and damaged copies, are in test_scenarios.py."""

from __future__ import annotations

import os

import pytest
import torch
from cluster import Cluster

from mlcheckpoint.store import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NPROC = 2
LAUNCH_TIMEOUT = 120


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


MODES = ["sync", "async", "dcp", "dcp_async", "dcp_async_process"]


@pytest.fixture(scope="module")
def modes_run():
    """One job per save mode, all in the same two launches: save steps 0..3, then a restart
    (new processes) that only resumes. Yields what each job reported and left on the node."""
    with Cluster(1, NPROC) as c:
        jobs = {m: f"{c.job_id}-{m}" for m in MODES}
        specs = [f"{jobs[m]}:{m}" for m in MODES]
        out: dict[str, dict] = {m: {} for m in MODES}

        c.run("multi_job.py", "0", "3", *specs, timeout=LAUNCH_TIMEOUT)
        for m in MODES:
            out[m]["first_resume"] = c.results(f"resume-{jobs[m]}")
            out[m]["first_listing"] = c.results(f"listing-{jobs[m]}")
            store = LocalStore(c.nodes[0].local_dir, jobs[m], create=False)
            try:
                out[m]["inventory"] = {s: (st.complete, sorted(st.committed_ranks))
                                       for s, st in store.inventory.all().items()}
            finally:
                store.close()

        c.clear_results(*(f"{k}-{jobs[m]}" for m in MODES for k in ("resume", "listing")))
        c.run("multi_job.py", "4", "3", *specs, timeout=LAUNCH_TIMEOUT)
        for m in MODES:
            out[m]["resume"] = c.results(f"resume-{jobs[m]}")
            out[m]["listing"] = c.results(f"listing-{jobs[m]}")
            out[m]["logs"] = c.logs()
        yield out


def memory_entries(listing: dict) -> list[tuple[int, str, list[int]]]:
    return [(e["step"], e["state"], e["ranks"]) for e in listing["entries"] if e["location"] == "memory"]


@pytest.mark.parametrize("mode", MODES)
def test_save_restart_resume(modes_run, mode):
    """Per save mode, 1 node x 2 ranks: retention keeps the newest steps, a restart resumes
    the newest from tmpfs bit-exactly, and resuming retires nothing."""
    run = modes_run[mode]
    assert sorted(run["first_resume"]) == [0, 1] and sorted(run["resume"]) == [0, 1], run
    assert all(r["step"] is None and r["source"] is None for r in run["first_resume"].values())

    # keep=2 (the default). CheckpointManager.save/async_save retire after each commit, so
    # steps 2 and 3 remain. DCP-native saves (storage_writer) retire when the next writer is
    # made, so the step before the kept ones may still be there: at most keep + 1.
    allowed = {2, 3} if mode in ("sync", "async") else {1, 2, 3}
    for rank in range(NPROC):
        listing = memory_entries(run["first_listing"][rank])
        complete = {s for s, st, _ in listing if st == "complete"}
        assert {2, 3} <= complete <= allowed, listing
        assert all(r == [0, 1] for s, st, r in listing if st == "complete"), listing
        # Each rank retires its own shards: a rank listing right after its last save may
        # still see an older step the other rank has not retired yet, as incomplete.
        assert all(s < 2 for s, st, _ in listing if st != "complete"), listing
    # Once the job is over, no half-retired step is left.
    inv = run["inventory"]
    assert {2, 3} <= set(inv) <= allowed, inv
    assert all(v == (True, [0, 1]) for v in inv.values()), inv

    # The restart resumes the newest step from tmpfs, bit-exact on every rank.
    for rank, r in run["resume"].items():
        assert (r["step"], r["source"]) == (3, "local"), (rank, r, run["logs"])
        assert r["match"] and not r["mismatch"], (rank, r)
        assert r["reason"] is None, r
    # Resuming neither consumes nor retires anything.
    for rank in range(NPROC):
        assert memory_entries(run["listing"][rank]) == [(s, "complete", [0, 1]) for s in sorted(inv)]


def test_fsdp2_async_save_and_resume():
    """FSDP2 async_save snapshots before the live parameters change, and a restart trains on
    with identical losses and bit-identical model and optimizer state."""
    with Cluster(1, NPROC) as c:
        c.run("fsdp_train.py", "save", timeout=LAUNCH_TIMEOUT)
        saved = c.results("fsdp_save")
        assert sorted(saved) == [0, 1], c.logs()
        assert all(r["saved_step"] == 2 and r["bytes"] > 0 for r in saved.values()), saved
        # The worker overwrote the live model (through get_state_dict's tensors) mid-save.
        assert all(r["scribbled_live_params"] for r in saved.values()), saved

        c.run("fsdp_train.py", "resume", timeout=LAUNCH_TIMEOUT)
        res = c.results("fsdp_resume")
        assert sorted(res) == [0, 1], c.logs()
        for rank, r in res.items():
            assert (r["step"], r["source"]) == (2, "local"), (rank, r)
            # The same two training steps after the restart: identical losses, bit for bit
            # (the first checks the parameters, the second the optimizer state too).
            assert r["losses"] == saved[rank]["losses"], (rank, r["losses"], saved[rank]["losses"])

        expected = torch.load(os.path.join(c.out_dir, "fsdp_expected.pt"))
        got = torch.load(os.path.join(c.out_dir, "fsdp_resumed.pt"))
        assert got.keys() == expected.keys()
        assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in expected)
        assert any(k.startswith("model.") for k in expected)
        bad = [k for k in expected if not bitwise_equal(expected[k], got[k])]
        assert not bad, f"differ after resume: {bad}"


# ---------------------------------------------------------------------------- resume, then save
@pytest.mark.parametrize("variant,resumed,saved", [("fresh", None, 1), ("resave", 2, 4)],
                         ids=["fresh", "resave"])
def test_async_save_right_after_resume(variant, resumed, saved):
    """A training loop saves as soon as resume returns, with no barrier in between.

    fresh: nothing to resume, steps 0 and 1 are saved at once. resave: the run resumes step 2
    while step 3 is left over from the failed run, and saves steps 3 and 4 at once. Either
    way every save must succeed and a further resume must find the newest step exactly.
    The ranks of a node finish resume and start saving concurrently: rank 0 is held right
    after resume's last collective until rank 1 has staged its first save into tmpfs, the
    order in which node-wide cleanup after that collective would delete rank 1's new files.
    """
    with Cluster(1, NPROC) as c:
        staged = os.path.join(c.out_dir, "staged")
        c.start("resume_resave.py", variant, env={"MLCHECKPOINT_PAUSE_AT": f"resume_agreed#0={staged}"})
        codes = c.wait(LAUNCH_TIMEOUT)
        errors = [line for line in c.nodes[0].log().splitlines()
                  if "dropped steps" in line or ("Error" in line and "No such file" in line)][:8]
        assert codes == [0], "\n".join(errors) + "\n" + c.logs()[-3000:]
        assert os.path.exists(staged)  # rank 1 saved while rank 0 was held
        res = c.results("resumed")
        assert sorted(res) == [0, 1], res
        for rank, r in res.items():
            first, second = r["first"], r["second"]
            assert first["step"] == resumed and first["match"], (rank, r)
            assert (second["step"], second["source"], second["match"]) == (saved, "local", True), (rank, r)
