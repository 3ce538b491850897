"""What any framework integration needs from the core, in one process: a persistent tier in the
framework's folder layout that recovery weighs against memory and loads once, and a job id
under plain torchrun (TORCHELASTIC_RUN_ID=none) derived from the persistent folder."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch.distributed.checkpoint as dcp
from states import assert_same, make_state, zeros_like_state
from torch.distributed.checkpoint import FileSystemWriter

import mlcheckpoint
from mlcheckpoint import CheckpointManager, ConfigError, PersistentStorage
from mlcheckpoint.collectives import Comm
from mlcheckpoint.persistent import StepNames
from mlcheckpoint.recovery.resume import Recovery
from mlcheckpoint.settings import derived_job_id, resolve_job_id
from mlcheckpoint.store import LocalStore
from mlcheckpoint.store.identity import Lineage
from mlcheckpoint.topology import Topology

JOB = "job-integration-core"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def write_framework_step(folder: str, name: str, step: int) -> None:
    dcp.save(make_state(step), storage_writer=FileSystemWriter(os.path.join(folder, name)))


# ---------------------------------------------------------------- folder layouts

def test_persistent_storage_is_importable_from_the_package():
    """What docs/integration.md and docs/configuration.md tell a framework to pass as
    ``persistent_dir``, from where they say it is."""
    assert "PersistentStorage" in mlcheckpoint.__all__
    assert PersistentStorage.__module__ == "mlcheckpoint.persistent"


def test_step_names_match_only_their_own_format():
    titan = StepNames("step-{step}")
    assert [titan.parse(n) for n in ("step-4", "step-10", "step-0")] == [4, 10, 0]
    assert [titan.parse(n) for n in ("step-04", "step-4.tmp", "xstep-4", "step-")] == [None] * 4
    ours = StepNames()
    assert ours.parse("step-000000000004") == 4 and ours.parse("step-4") is None
    assert titan.name(7) == "step-7" and ours.name(7) == "step-000000000007"
    for bad in ("step", "{step}/x", "a{step}b{step}", "step-{other}"):
        with pytest.raises(ConfigError):
            StepNames(bad)


def test_persistent_tier_lists_a_framework_layout(store_dir):
    folder = os.path.join(store_dir, "titan")
    write_framework_step(folder, "step-4", 4)
    write_framework_step(folder, "step-12", 12)
    os.makedirs(os.path.join(folder, "step-16"))  # still being written: no .metadata yet
    write_framework_step(folder, "step-000000000020", 20)  # not this layout
    assert PersistentStorage(folder, step_format="step-{step}").steps() == [4, 12]
    assert PersistentStorage(folder).steps() == [20]  # the default layout, as before


class CountingFolder(PersistentStorage):
    """A framework's folder whose own loader recovery must call, once, when it is newest."""

    def __init__(self, folder: str):
        super().__init__(folder, step_format="step-{step}")
        self.restored: list[int] = []

    def restore(self, state_dict, step, load):
        self.restored.append(step)
        super().restore(state_dict, step, load)


@pytest.mark.parametrize("memory_step, folder_step, source", [(6, 4, "local"), (2, 4, "persistent")])
def test_resume_loads_the_newest_of_memory_and_framework_folder_once(store_dir, memory_step,
                                                                     folder_step, source):
    folder = CountingFolder(os.path.join(store_dir, "titan"))
    write_framework_step(folder.location, f"step-{folder_step}", folder_step)
    local = os.path.join(store_dir, "local")
    with CheckpointManager(folder, job_id=JOB, local_dir=local, replication="none") as ckpt:
        ckpt.save(make_state(memory_step), memory_step)
    with CheckpointManager(folder, job_id=JOB, local_dir=local, replication="none") as ckpt:
        target = zeros_like_state(make_state())
        info = ckpt.resume(target)
        newest = max(memory_step, folder_step)
        assert (info.step, info.source) == (newest, source)
        assert_same(make_state(newest), target)
        assert folder.restored == ([folder_step] if source == "persistent" else [])
        listed = {(e.step, e.location) for e in ckpt.checkpoints()}
        assert (folder_step, "persistent") in listed


@dataclasses.dataclass(frozen=True)
class CountingComm(Comm):
    """The checkpoint group's gather, each object gathered kept (one process: no group)."""

    gathered: list = dataclasses.field(default_factory=list)

    def all_gather(self, obj):
        self.gathered.append(obj)
        return super().all_gather(obj)


def test_a_resume_from_memory_agrees_in_three_gathers(store_dir):
    """Every gather of a resume waits for the slowest rank of the job: one for the inventory,
    one for the problems the metadata's fetch and its check found (together: the node's leader
    does both), one for the outcome. A fourth (the check's own) was one wait too many."""
    local = os.path.join(store_dir, "local")
    with CheckpointManager(job_id=JOB, local_dir=local, replication="none") as ckpt:
        ckpt.save(make_state(3), 3)
    comm = CountingComm(None)
    target = zeros_like_state(make_state())
    recovery = Recovery(LocalStore(local, JOB), Topology(), comm, lineage=Lineage("this-run"),
                        group=None)
    resumed = recovery.run(target)
    assert (resumed.info.step, resumed.info.source) == (3, "local")
    assert_same(make_state(3), target)
    assert len(comm.gathered) == 3, comm.gathered
    assert comm.gathered[1] == []  # the problems: none


# ---------------------------------------------------------------- job id under plain torchrun

def test_plain_torchrun_job_id_derives_from_the_persistent_folder(clean_env, store_dir, caplog,
                                                                  monkeypatch):
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    with caplog.at_level(logging.INFO, logger="mlcheckpoint.settings"):
        job = resolve_job_id(derive_from="/nfs/run42")
    assert job.startswith("dir-") and "/nfs/run42" in caplog.text and job in caplog.text
    assert resolve_job_id(derive_from="/nfs/run42/") == job  # the same folder, the same id
    assert resolve_job_id(derive_from="/nfs/run43") != job
    monkeypatch.chdir(store_dir)
    assert resolve_job_id(derive_from="run42") == derived_job_id(os.path.abspath("run42"))
    clean_env.setenv("MLCHECKPOINT_JOB_ID", "named")  # a job id that is set still wins
    assert resolve_job_id(derive_from="/nfs/run42") == "named"
    clean_env.delenv("MLCHECKPOINT_JOB_ID")
    with pytest.raises(ConfigError, match="MLCHECKPOINT_JOB_ID"):
        resolve_job_id()


def test_manager_without_job_id_uses_its_persistent_folder(clean_env, store_dir):
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    folder = os.path.join(store_dir, "persistent")
    local = os.path.join(store_dir, "local")
    with CheckpointManager(folder, local_dir=local, replication="none") as first:
        first.save(make_state(3), 3)
    with CheckpointManager(folder, local_dir=local, replication="none") as restarted:
        assert restarted.job_id == first.job_id == derived_job_id(folder)
        assert restarted.resume(zeros_like_state(make_state())).step == 3  # the restart finds its checkpoints
    with pytest.raises(ConfigError, match="TORCHELASTIC_RUN_ID"):
        CheckpointManager(local_dir=local, replication="none")


# ---------------------------------------------------------------- close on an error path

def test_close_while_an_error_is_handled_does_not_wait_for_other_ranks(store_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="mlcheckpoint.manager"):
        ckpt = CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none")
        ckpt.close()
        assert "closing after an error" not in caplog.text
        for failing in ("except", "with"):
            if failing == "except":
                ckpt = CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none")
                try:
                    raise RuntimeError("a training step failed")
                except RuntimeError:
                    ckpt.close()
            else:
                with pytest.raises(RuntimeError), \
                        CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none"):
                    raise RuntimeError("a training step failed")
            assert caplog.text.count("closing after an error") == (1 if failing == "except" else 2)
