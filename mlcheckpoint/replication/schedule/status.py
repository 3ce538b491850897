"""Protection: which saves are on 1 + ``replicas`` nodes, and how far replication lags behind
the saves. The status users read (``ProtectionStatus``), what retention asks (``Protection``,
answered by the ``Replicator``), and a warning when the link cannot carry every checkpoint.
Job-wide, protection is counted in the c10d store per save (``rounds.protected_in_store``)."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ..._messages import RateLimitedLog
from ...store.inventory import StepState
from ..core.budget import RAISE_THE_BUDGET

log = logging.getLogger(__name__)
WARN_EVERY_S = 600.0  # the lag warning, at most this often


@dataclass(frozen=True)
class ProtectionStatus:
    """What ``CheckpointManager.protection()`` returns.

    Attributes:
        newest_protected: the newest step every shard and the metadata of which are on
            1 + ``replicas`` nodes (None: none yet). Losing any ``replicas`` nodes now resumes
            from it or newer.
        newest_saved: the newest step saved (its metadata is on this node).
        lag_steps: ``newest_saved - newest_protected`` (None when nothing is protected).
        age_seconds: seconds since the newest protected step was saved (None likewise): the
            training a node loss now would cost, at most.
        rate_bytes_per_s: this rank's replication throughput over its recent pushes.
        superseded: this rank's saves that were never replicated because a newer one came
            first (replication skips steps when the link cannot carry every checkpoint);
            counts the saves made through this manager or its storage writers in this process.
    """

    newest_protected: int | None
    newest_saved: int | None
    lag_steps: int | None
    age_seconds: float | None
    rate_bytes_per_s: float | None
    superseded: int


class Protection(Protocol):
    """What retention asks about protection (``retention.Retention``): which steps are on
    two nodes, job-wide, and which one is being replicated (the ``Replicator`` answers)."""

    def newest_protected(self, ask: bool = True) -> int | None: ...

    def round_step(self) -> int | None: ...


def status(newest_protected: int | None, saves: dict[int, float], rate: float | None,
           superseded: int, now: float | None = None) -> ProtectionStatus:
    """The status from the steps saved here (step -> save time) and what is protected."""
    now = time.time() if now is None else now
    newest_saved = max(saves, default=None)
    lag = age = None
    if newest_protected is not None:
        lag = None if newest_saved is None else max(0, newest_saved - newest_protected)
        saved_at = saves.get(newest_protected)
        age = None if saved_at is None else max(0.0, now - saved_at)
    return ProtectionStatus(newest_protected, newest_saved, lag, age, rate, superseded)


def save_times(inventory: Mapping[int, StepState]) -> dict[int, float]:
    """When each step whose metadata is in ``inventory`` was saved (the coordinator's clock)."""
    return {s: st.created for s, st in inventory.items() if st.has_metadata}


def save_interval(saves: dict[int, float]) -> float | None:
    """The median time between the recent saves (None with fewer than three)."""
    times = sorted(saves.values())[-9:]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return gaps[len(gaps) // 2] if len(gaps) >= 2 else None


class LagWarning:
    """Warns, at most every ``WARN_EVERY_S`` seconds, when pushing one checkpoint takes longer
    than the interval between saves: replication then protects only every n-th save, and
    naming the interval that would fit is the useful advice."""

    def __init__(self) -> None:
        self._log = RateLimitedLog(log, interval=WARN_EVERY_S)

    @staticmethod
    def advice(push_seconds: float, interval: float, lag_steps: int,
               why: str = RAISE_THE_BUDGET) -> str | None:
        """The warning's text, or None while replication keeps up. ``why``: what holds the
        push back and what to do, from the budget (``Budget.lag_advice``)."""
        if lag_steps < 2 or push_seconds <= interval:
            return None
        every = math.ceil(push_seconds / interval)
        return (f"mlcheckpoint: replication lags {lag_steps} steps behind the saves: pushing "
                f"one checkpoint takes {push_seconds:.1f} s and saves come every {interval:.1f} s, "
                f"so about one save in {every} is protected on two nodes. To protect every save, "
                f"save at most every {push_seconds:.1f} s; {why}")

    def check(self, push_seconds: float, interval: float | None, lag_steps: int | None,
              why: str = RAISE_THE_BUDGET) -> None:
        if interval is None or lag_steps is None:
            return
        text = self.advice(push_seconds, interval, lag_steps, why)
        if text is not None:
            self._log.warning("lag", "%s", text)
