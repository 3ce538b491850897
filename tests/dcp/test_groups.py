"""dcp/groups.py: which group a ``dcp.async_save`` runs on, read where the manager's writer
refuses the default one (the refusal itself, on several ranks: tests/jobs/test_native_route.py)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from mlcheckpoint.dcp import MemoryStorageWriter, groups

JOB = "job-groups"


class Recording(MemoryStorageWriter):
    """A writer that notes the ``dcp.async_save`` call its ``stage`` runs in."""

    call: groups.AsyncSaveCall | None = None

    def stage(self, state_dict):
        self.call = groups.async_save_call()
        return super().stage(state_dict)


def test_stage_sees_the_arguments_of_the_async_save_that_calls_it(store):
    """If a torch release moved ``dcp.async_save``'s arguments out of reach, the refusal would
    quietly check nothing: this fails first."""
    group = object()  # never used: no_dist
    w = Recording(1, store)
    dcp.async_save({"a": torch.ones(4)}, storage_writer=w, process_group=group,
                   no_dist=True).result(timeout=60)
    assert w.call == groups.AsyncSaveCall(group, in_process_mode=False, no_dist=True)
    assert not groups.on_default_group(w.call)  # no_dist: no collective at all
    assert groups.async_save_call() is None  # not inside dcp.async_save


def test_without_a_process_group_nothing_is_refused(store):
    w = MemoryStorageWriter(2, store, refuse_default_group=True)
    dcp.async_save({"a": torch.ones(4)}, storage_writer=w).result(timeout=60)
    assert store.inventory.complete_steps() == [2]
