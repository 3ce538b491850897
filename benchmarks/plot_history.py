"""Plot a job's checkpoint history: save, replication, persistent and resume times per step.

    python benchmarks/plot_history.py --job JOB [--local-dir DIR] [--out history.png]

Reads ``<local_dir>/<job>/history.jsonl`` (what ``mlcheckpoint history`` shows). Needs
matplotlib: ``pip install -e ".[plot]"``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlcheckpoint import history
from mlcheckpoint.settings import resolve_local_dir

SERIES = {"save": "save (until committed)", "replicate": "replication (until acknowledged)",
          "persistent": "persistent write", "resume": "resume"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True)
    ap.add_argument("--local-dir", default=None)
    ap.add_argument("--out", default="history.png")
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install -e '.[plot]'", file=sys.stderr)
        return 2
    events = history.read(os.path.join(resolve_local_dir(args.local_dir), args.job))
    if not events:
        print(f"no history for job {args.job}", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for kind, label in SERIES.items():
        pts = [(e["step"], e["seconds"]) for e in events
               if e.get("event") == kind and e.get("step") is not None and e.get("seconds") is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "o" if kind == "resume" else ".-", label=label, markersize=8 if kind == "resume" else 4)
    blocking = [(e["step"], e["blocking_seconds"]) for e in events if e.get("event") == "save"
                and e.get("blocking_seconds") is not None]
    if blocking:
        xs, ys = zip(*blocking)
        ax.plot(xs, ys, "--", label="time training was blocked (staging)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.set_title(f"mlcheckpoint history of job {args.job}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
