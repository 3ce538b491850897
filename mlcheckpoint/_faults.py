"""Crash points for tests: SIGKILL this process at a named stage of a save.

Set MLCHECKPOINT_CRASH_AT="<point>" or "<point>@<step>" (optionally "...#<rank>") in a test's
environment. Unset, each check costs one dict lookup. Points: before_data, mid_data,
before_manifest, mid_commit, before_metadata, replica_mid_recv, replica_mid_send (a push,
once one of its streams has sent half its bytes).
"""

from __future__ import annotations

import os
import signal

_ENV = "MLCHECKPOINT_CRASH_AT"


def crash_point(name: str, step: int | None = None, rank: int | None = None) -> None:
    spec = os.environ.get(_ENV)
    if not spec:
        return
    point, _, rest = spec.partition("@")
    want_step, _, want_rank = rest.partition("#")
    if point != name:
        return
    if want_step and step is not None and int(want_step) != step:
        return
    if want_rank and rank is not None and int(want_rank) != rank:
        return
    os.kill(os.getpid(), signal.SIGKILL)
