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


def test_the_warning_says_what_holds_the_push_back():
    """The derived default that backed off because training slowed must not tell the user to
    "raise the budget if the link has room": it says it chose fewer protected saves over a
    slower step, and what an explicit rate would do."""
    from mlcheckpoint.replication.core.budget import Budget, default_bandwidth

    def job_budget(slowed: bool) -> Budget:
        clock = [0.0]
        b = Budget(default_bandwidth(None), None, yielding=True, ceiling=10**9,
                   clock=lambda: clock[0], sleep=lambda s: None)
        b.need(10**8)
        for save in range(1, 15):
            quiet = b.quiet
            clock[0] += 1.0 if quiet or not slowed or save == 1 else 1.5
            if not quiet and save > 1:
                b.take(1 << 16)
            b.note_save()
        return b

    backed_off = LagWarning.advice(4.0, 1.0, 5, job_budget(slowed=True).lag_advice())
    assert backed_off is not None and "backed off" in backed_off and "even if training slows" in backed_off
    kept = LagWarning.advice(4.0, 1.0, 5, job_budget(slowed=False).lag_advice())
    assert kept is not None and "backed off" not in kept and "half the link" in kept
    explicit = LagWarning.advice(4.0, 1.0, 5, Budget(10**7, None).lag_advice())
    assert explicit is not None and "if the link has room" in explicit
    uncapped = LagWarning.advice(4.0, 1.0, 5, Budget(0, None).lag_advice())
    assert uncapped is not None and "no bandwidth cap" in uncapped


def test_warning_is_rate_limited(caplog):
    w = LagWarning()
    with caplog.at_level(logging.WARNING, logger="mlcheckpoint.replication.schedule.status"):
        for _ in range(5):
            w.check(push_seconds=3.0, interval=1.0, lag_steps=4)
        w.check(push_seconds=0.1, interval=1.0, lag_steps=4)
    assert len([r for r in caplog.records if "lags 4 steps" in r.getMessage()]) == 1
