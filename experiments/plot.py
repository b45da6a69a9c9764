"""Plot the training curves of one or more runs (loss, loss scale, gradient norm, tokens/s) into one PNG.

    python experiments/plot.py runs/fp32 runs/bf16 runs/fp16 --out runs/compare.png

Each RUN is a workdir written by `experiments/train_lm.py` (metrics.jsonl, optionally summary.json).
Exit status 2 with a one-line message for a missing directory or an empty metrics file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out", default="plot.png", help="PNG to write (default: %(default)s)")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="one legend label per run (default: the summary's precision, else the directory name)")
    args = parser.parse_args(argv)

    from jaxamp.lm.plotting import PlotError, plot_runs

    try:
        out = plot_runs(args.runs, args.out, labels=args.labels)
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
