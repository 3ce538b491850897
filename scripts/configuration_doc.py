"""Rewrite the generated tables of docs/configuration.md from mlcheckpoint.settings' declaration.

    python scripts/configuration_doc.py          # rewrite them
    python scripts/configuration_doc.py --check  # exit 1 when they are not current

A table sits between ``<!-- settings:NAME -->`` and ``<!-- /settings:NAME -->``; tests import
``render_doc`` to check the doc is current.
"""

from __future__ import annotations

import argparse
import os
import sys

from mlcheckpoint.settings import SETTINGS, Setting

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "configuration.md")
# The manager's arguments that are not one setting but a group of them.
GROUPS = [("replication", "`ReplicationOptions()`",
           ("how shards reach partner nodes: a `ReplicationOptions` (fields below), or only "
            'its `mode` as a string (`replication="none"`)')),
          ("options", "`None`", ("every setting above in one `Options(job_id=..., ..., "
                                 "replication=ReplicationOptions(...))`, instead of the keywords"))]


def code(value: object) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def argument_cell(s: Setting) -> str:
    """The default as the tables of arguments and fields show it."""
    return f"`${s.env}` or {code(s.default)}" if s.env else code(s.default)


def variable_cell(s: Setting) -> str:
    """The default as the table of variables shows it."""
    if s.shown is not None:
        return s.shown
    return "unset" if s.default is None else f"`{s.default}`"


def where(s: Setting) -> str | None:
    """Where the setting is given in code (None: only as a variable)."""
    if s.keyword:
        return f"`{s.name}`"
    return f"`ReplicationOptions.{s.attribute}`" if s.group == "replication" else None


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def doc_tables() -> dict[str, str]:
    """The tables of docs/configuration.md that the declaration makes, by marker name."""
    arguments = [_row("argument", "default", "meaning"), "|---|---|---|"] + [
        _row(f"`{s.name}`", argument_cell(s), s.doc) for s in SETTINGS if s.keyword] + [
        _row(f"`{name}`", shown, doc) for name, shown, doc in GROUPS]
    replication = [_row("field", "default", "meaning"), "|---|---|---|"] + [
        _row(f"`{s.attribute}`", argument_cell(s), s.doc) for s in SETTINGS
        if s.group == "replication"]
    variables = [_row("variable", "default", "meaning"), "|---|---|---|"]
    for s in SETTINGS:
        if s.env:
            meaning, given = s.doc, where(s)
            if given:
                meaning = f"default for {given}" + (f": {s.env_doc}" if s.env_doc else "")
            variables.append(_row(f"`{s.env}`", variable_cell(s), meaning))
    timeouts = [_row("timeout", "default", "meaning"), "|---|---|---|"] + [
        _row(f"`{s.name}`", code(s.default), s.doc) for s in SETTINGS if s.group == "timeouts"]
    return {"arguments": "\n".join(arguments), "replication": "\n".join(replication),
            "variables": "\n".join(variables), "timeouts": "\n".join(timeouts)}


def render_doc(text: str) -> str:
    """``text`` (docs/configuration.md) with each generated table replaced by the current one."""
    for name, table in doc_tables().items():
        begin, end = f"<!-- settings:{name} -->", f"<!-- /settings:{name} -->"
        head, found, rest = text.partition(begin)
        if not found:
            raise ValueError(f"no {begin} marker")
        _, _, tail = rest.partition(end)
        text = f"{head}{begin}\n{table}\n{end}{tail}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only say whether they are current")
    args = ap.parse_args()
    with open(DOC) as f:
        current = f.read()
    wanted = render_doc(current)
    if args.check:
        if wanted != current:
            print(f"{DOC} is not current: run python {sys.argv[0]}", file=sys.stderr)
            return 1
        return 0
    with open(DOC, "w") as f:
        f.write(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
