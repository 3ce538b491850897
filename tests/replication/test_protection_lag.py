"""Protection lag as users read it (``CheckpointManager.protection()``, replication/schedule/status.py):
the status from the steps saved and the newest protected one, and the warning that names the
save interval replication can keep up with. The job-level checks are in test_whole_step.py."""

from __future__ import annotations

import logging

from mlcheckpoint.replication.schedule.status import LagWarning, save_interval, status


def test_status_counts_lag_from_the_newest_save_and_age_from_the_protected_ones_save():
    saves = {10: 100.0, 11: 101.0, 12: 102.0, 13: 103.5}
    st = status(11, saves, rate=2e9, superseded=3, now=110.0)
    assert (st.newest_protected, st.newest_saved, st.lag_steps) == (11, 13, 2)
    assert st.age_seconds == 9.0 and st.rate_bytes_per_s == 2e9 and st.superseded == 3
    nothing = status(None, saves, None, 0, now=110.0)
    assert nothing.newest_saved == 13 and nothing.lag_steps is None and nothing.age_seconds is None
    assert status(None, {}, None, 0).newest_saved is None


def test_save_interval_is_the_median_gap_of_the_recent_saves():
    assert save_interval({1: 0.0, 2: 1.0}) is None  # one gap says little
    assert save_interval({1: 0.0, 2: 1.0, 3: 2.0, 4: 9.0, 5: 10.0}) == 1.0
    many = {s: float(s) * 2 for s in range(100)}
    assert save_interval(many) == 2.0


def test_warning_names_the_interval_that_fits_only_when_the_link_cannot_keep_up():
    assert LagWarning.advice(push_seconds=0.5, interval=1.0, lag_steps=5) is None  # keeps up
    assert LagWarning.advice(push_seconds=5.0, interval=1.0, lag_steps=1) is None  # no lag yet
    text = LagWarning.advice(push_seconds=4.2, interval=1.0, lag_steps=5)
    assert text is not None
    assert "every 4.2 s" in text and "one save in 5" in text and "replication_bandwidth" in text


def test_warning_is_rate_limited(caplog):
    w = LagWarning()
    with caplog.at_level(logging.WARNING, logger="mlcheckpoint.replication.schedule.status"):
        for _ in range(5):
            w.check(push_seconds=3.0, interval=1.0, lag_steps=4)
        w.check(push_seconds=0.1, interval=1.0, lag_steps=4)
    assert len([r for r in caplog.records if "lags 4 steps" in r.getMessage()]) == 1
