"""How our messages read: counted nouns ("1 step", "2 steps", never "1 steps" nor
"step(s)"), and events a stranger can cause as often as it likes (refused connections,
malformed requests) logged without flooding the log.

``RateLimitedLog``: each kind of event (a short key) logs its first occurrence at once, then
at most one line per ``interval`` seconds; that line says how many like it were left out
meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and ``noun`` in the right number; ``nouns`` when adding "s" is wrong."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


class RateLimitedLog:
    """At most one line per key per ``interval`` seconds on ``logger``."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0):
        self.logger, self.interval = logger, interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # key -> when its last line was logged
        self._left_out: dict[str, int] = {}  # key -> events not logged since that line

    def log(self, level: int, key: str, msg: str, *args: object, **kw) -> bool:
        """Log ``msg % args`` (``kw`` as for ``Logger.log``) unless ``key`` was logged less than
        ``interval`` ago; True if logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._left_out[key] = self._left_out.get(key, 0) + 1
                return False
            self._last[key] = now
            left_out = self._left_out.pop(key, 0)
        if left_out and last is not None:  # events are left out only after a logged one
            msg += " (%d similar events in the last %.0fs not logged)"
            args = (*args, left_out, now - last)
        kw.setdefault("stacklevel", 2)  # the record names our caller, not this module
        self.logger.log(level, msg, *args, **kw)
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args, stacklevel=3)
