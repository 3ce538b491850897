"""Rewrite the generated tables of docs/configuration.md from mlcheckpoint/settings.py.

    python scripts/configuration_doc.py          # rewrite them
    python scripts/configuration_doc.py --check  # exit 1 when they are not current
"""

from __future__ import annotations

import argparse
import os
import sys

from mlcheckpoint.settings import render_doc

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "configuration.md")


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
