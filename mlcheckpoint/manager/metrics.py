"""The figures a training loop logs beside its loss: ``CheckpointManager.stats()``.

One flat dict of numbers, keys prefixed ``mlcheckpoint/`` (TensorBoard and W&B group them
under that name). A figure not known yet (no save, nothing protected, no resume) is left out
rather than given as None, which most loggers refuse.
"""

from __future__ import annotations

from ..dcp.copies import DEDUP, DP_COPIES
from ..recovery import ResumeInfo
from ..replication.schedule.status import ProtectionStatus
from .saving import SaveResult

PREFIX = "mlcheckpoint/"


def stats(save: SaveResult | None, protection: ProtectionStatus,
          resume: ResumeInfo | None, *, guard_longest_wait: float = 0.0,
          copy_modes: tuple[str, ...] = (), skipped_bytes: int | None = None,
          save_failures: int = 0, save_failures_in_a_row: int = 0,
          replication: dict[str, float] | None = None) -> dict[str, float]:
    """The last published save, the replication lag and the last resume, as numbers;
    ``guard_longest_wait``: the longest a guard held the training thread (seconds); with data
    parallelism's copies (``dcp/copies.py``), how many nodes keep them (``dp_copies_nodes``)
    or had too little room (``dedup_nodes``), and the shard bytes replication did not send
    because they were covered (``replication_skipped_bytes``, None: replication off); the
    in-memory saves of this run that failed (``failed_saves``) and how many of them since
    the last that succeeded (``failed_saves_in_a_row``: 0 while saves succeed);
    ``replication``: where replication's time went in this process so far (``Replicator.
    profile``: bytes sent, seconds sending and held back by the budget; replicas received,
    their bytes, seconds receiving, verifying, committing), each as ``replication_<key>``."""
    out: dict[str, float | int | None] = {"failed_saves": save_failures,
                                          "failed_saves_in_a_row": save_failures_in_a_row}
    if copy_modes:
        out.update(dp_copies_nodes=copy_modes.count(DP_COPIES),
                   dedup_nodes=copy_modes.count(DEDUP))
    if skipped_bytes is not None:
        out.update(replication_skipped_bytes=skipped_bytes)
    if save is not None:
        out.update(save_step=save.step, save_seconds=save.seconds,
                   save_blocking_seconds=save.blocking_seconds, save_bytes=save.bytes,
                   save_overlapped_bytes=save.overlapped_bytes,
                   save_staged_bytes=save.staged_bytes, save_host_bytes=save.host_bytes)
        out.update({f"save_{phase}_seconds": s for phase, s in save.phases.items()})
    out.update(guard_longest_wait_seconds=guard_longest_wait)
    out.update(protected_step=protection.newest_protected,
               protection_lag_steps=protection.lag_steps,
               protection_age_seconds=protection.age_seconds,
               replication_bytes_per_second=protection.rate_bytes_per_s,
               superseded_saves=protection.superseded)
    if replication is not None:
        out.update({f"replication_{k}": v for k, v in replication.items()})
    if resume is not None:
        out.update(resume_step=resume.step, resume_seconds=resume.seconds,
                   resume_bytes_fetched=resume.bytes_fetched,
                   resume_refused_copies=resume.refused_copies)
        out.update({f"resume_{phase}_seconds": s for phase, s in resume.phases.items()})
    return {PREFIX + k: float(v) for k, v in out.items() if v is not None}
