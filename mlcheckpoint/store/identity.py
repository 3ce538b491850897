"""Which save a checkpoint's bytes belong to, and which runs of the job came before this one.

A step number alone does not name a checkpoint. A job resumed from step 3 saves steps 4, 5...
again under numbers the failed run also used; a job whose machines were all replaced starts
over at step 0 while a returning node may still hold the old run's memory; a step can be saved
twice. So every save gets a fresh ``save_id`` (made once by DCP's coordinator and named by the
step's metadata and by every shard's manifest), and every run of the job gets a ``run_id`` and
a lineage: the runs it resumed from, each with the newest step it built on.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from .manifest import MAX_LINEAGE

# The run of saves made outside a CheckpointManager (a bare MemoryStorageWriter).
ANONYMOUS_RUN = ""


def new_id() -> str:
    """A fresh run or save id: 64 random bits, never reused across runs or machines."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Lineage:
    """A run and the history it descends from (oldest ancestor first)."""

    run_id: str = ANONYMOUS_RUN
    ancestors: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    @classmethod
    def from_header(cls, run_id: str, ancestors: list) -> Lineage:
        return cls(run_id, tuple((str(r), int(s)) for r, s in ancestors))

    def admits(self, run_id: str, step: int) -> bool:
        """Whether a save of ``step`` by run ``run_id`` belongs to this history: made by this
        run, or by an ancestor at or before the step this history took from it."""
        return run_id == self.run_id or any(run_id == r and step <= upto
                                            for r, upto in self.ancestors)

    def resumed(self, loaded: Lineage, step: int) -> Lineage:
        """This run, after loading ``step`` of the run ``loaded`` describes."""
        if loaded.run_id == self.run_id:
            return self  # a run that reloads its own step has no new ancestor
        chain = (*loaded.ancestors, (loaded.run_id, step))
        return Lineage(self.run_id, tuple(chain[-MAX_LINEAGE:]))

    def header_fields(self) -> dict:
        return {"run_id": self.run_id, "lineage": [list(a) for a in self.ancestors]}
