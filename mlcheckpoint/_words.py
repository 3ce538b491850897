"""Counted nouns in messages: "1 step", "2 steps" (never "1 steps" nor "step(s)")."""

from __future__ import annotations


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and ``noun`` in the right number; ``nouns`` when adding "s" is wrong."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"
