"""The mlcheckpoint command line on real checkpoints (run as a subprocess, as users run it)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from mlcheckpoint import CheckpointManager, LocalStore
from mlcheckpoint.cli import (
    EXIT_CORRUPT,
    EXIT_INCOMPLETE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    main,
)


@pytest.fixture
def job():
    root = tempfile.mkdtemp(prefix="mlckpt-cli-", dir="/dev/shm")
    try:
        with CheckpointManager(job_id="clijob", local_dir=root, replication="none", keep=3) as ckpt:
            for step in range(3):
                ckpt.save({"w": torch.arange(1000.0) + step, "meta": {"step": step}}, step)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process (torch is already imported) and capture its output."""
    def run(root, *args):
        code = main(["--local-dir", root, *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


@pytest.mark.slow
def test_console_entry_point_runs_as_a_process(job):
    proc = subprocess.run([sys.executable, "-m", "mlcheckpoint.cli", "--local-dir", job, "ls", "--json"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert json.loads(proc.stdout)[0]["job"] == "clijob"


def test_ls_lists_steps_and_shards(job, cli):
    code, out, _ = cli(job, "ls")
    assert code == 0
    assert "job clijob" in out and "complete" in out
    code, out, _ = cli(job, "ls", "--json")
    data = json.loads(out)
    assert [s["step"] for s in data[0]["steps"]] == [0, 1, 2]
    assert all(s["state"] == "complete" and s["shards_here"] == [0] and s["metadata"] for s in data[0]["steps"])


def test_verify_exit_status_reflects_checksums(job, cli):
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "2")
    assert code == 0 and "OK" in out
    store = LocalStore(job, "clijob", create=False)
    m = store.read_manifest(1, 0)
    item = next(it for it in m.items if it.kind == "tensor")
    with open(store.data_path(1, 0), "r+b") as f:
        f.seek(item.offset + 5)
        b = f.read(1)
        f.seek(item.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "1", "--json")
    assert code == EXIT_CORRUPT == 3
    verdict = json.loads(out)
    assert verdict["verdict"] == "corrupt"
    assert any(r["status"] == "corrupt" and "checksum mismatch" in r["error"] for r in verdict["results"])
    code, _, _ = cli(job, "verify", "--job", "clijob", "--step", "0")
    assert code == 0  # other steps unaffected
    code, _, _ = cli(job, "verify", "--job", "clijob", "--step", "99")
    assert code == EXIT_NOT_FOUND == 2


def test_verify_reports_missing_shards(job, cli):
    store = LocalStore(job, "clijob", create=False)
    os.unlink(store.manifest_path(2, 0))  # the shard is no longer committed here
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "2")
    assert code == EXIT_INCOMPLETE == 1 and "INCOMPLETE" in out


def test_gc_removes_debris_and_old_steps(job, cli):
    store = LocalStore(job, "clijob", create=False)
    debris = store.data_path(2, 5) + ".partial"
    with open(debris, "wb") as f:
        f.write(b"x" * 100)
    code, _, _ = cli(job, "gc", "--job", "clijob", "--min-age", "0", "--keep", "1")
    assert code == 0
    assert not os.path.exists(debris)
    assert store.complete_steps() == [2]
    code, _, _ = cli(job, "gc", "--job", "clijob", "--remove")
    assert code == 0 and not os.path.exists(os.path.join(job, "clijob"))


def test_history_records_saves_and_resume(job, cli):
    with CheckpointManager(job_id="clijob", local_dir=job, replication="none") as ckpt:
        sd = {"w": torch.zeros(1000), "meta": {"step": -1}}
        info = ckpt.resume(sd)
        assert info.step == 2 and torch.equal(sd["w"], torch.arange(1000.0) + 2)
    code, out, _ = cli(job, "history", "--job", "clijob", "--json")
    events = json.loads(out)
    assert [e["event"] for e in events].count("save") == 3
    resume = [e for e in events if e["event"] == "resume"][-1]
    assert resume["step"] == 2 and resume["source"] == "local"
    code, out, _ = cli(job, "history", "--job", "clijob")
    assert code == 0 and "resume" in out


def test_unknown_job_is_a_clear_error(job, cli):
    code, _, err = cli(job, "verify", "--job", "nosuchjob")
    assert code == 2 and "no job 'nosuchjob'" in err


def test_verify_checks_bytes_against_the_step_metadata(job, cli):
    """A flipped data byte whose manifest checksum was rewritten to match still fails: verify
    checks against the checksums the step's metadata recorded, as a resume does."""
    from mlcheckpoint.integrity.checksum import checksum
    from mlcheckpoint.store.manifest import Manifest

    store = LocalStore(job, "clijob", create=False)
    m = store.read_manifest(2, 0)
    item = max(m.items, key=lambda it: it.nbytes)
    with open(store.data_path(2, 0), "r+b") as f:
        f.seek(item.offset + 10)
        b = f.read(1)
        f.seek(item.offset + 10)
        f.write(bytes([b[0] ^ 0x01]))
        f.seek(item.offset)
        forged = checksum(f.read(item.nbytes))
    d = m.to_dict()
    next(i for i in d["items"] if i["key"] == item.key)["checksum"] = forged
    with open(store.manifest_path(2, 0), "wb") as f:
        f.write(Manifest.from_dict(d).to_bytes())
    store.close()
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "2")
    assert code == EXIT_CORRUPT and "CORRUPT" in out and "metadata item" in out, out


def _flip_tensor_byte(store: LocalStore, step: int) -> None:
    m = store.read_manifest(step, 0)
    item = next(it for it in m.items if it.kind == "tensor")
    with open(store.data_path(step, 0), "r+b") as f:
        f.seek(item.offset + 3)
        b = f.read(1)
        f.seek(item.offset + 3)
        f.write(bytes([b[0] ^ 0xFF]))


def test_verify_exit_status_is_the_worst_finding(job, cli):
    """Exit codes rise with severity (ok < incomplete < not found < corrupt), and a step with
    several findings exits with the worst: a corrupt shard beside missing metadata is corrupt."""
    assert EXIT_OK < EXIT_INCOMPLETE < EXIT_NOT_FOUND < EXIT_CORRUPT
    store = LocalStore(job, "clijob", create=False)
    os.unlink(store.metadata_path(1))  # step 1: only the metadata is elsewhere
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "1", "--json")
    assert code == EXIT_INCOMPLETE and json.loads(out)["verdict"] == "incomplete"
    os.unlink(store.metadata_path(2))  # step 2: metadata elsewhere and a corrupt shard here
    _flip_tensor_byte(store, 2)
    store.close()
    code, out, _ = cli(job, "verify", "--job", "clijob", "--step", "2", "--json")
    assert code == EXIT_CORRUPT and json.loads(out)["verdict"] == "corrupt"
    assert cli(job, "verify", "--job", "clijob", "--step", "0")[0] == EXIT_OK


def test_verify_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "0 ok, 1 incomplete on this node (the rest intact), 2 job or step not found, 3 corrupt" in out
