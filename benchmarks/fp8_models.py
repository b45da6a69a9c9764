"""The stateless FP8 recipes on six public model codebases, their model code unchanged: what runs in FP8, what the
default exclusions keep in bf16, and how far 20 training steps land from bf16 autocast.

    python benchmarks/fp8_models.py                                  # all six trials, 20 steps
    python benchmarks/fp8_models.py --trials gpt2_hf --steps 2 --out /tmp/f.md   # a test

The trials are `tests/outside_models`, as in `autocast_models.py` (Flax lm1b and ImageNet ResNet in linen, Flax's
NNX Gemma and the NNX MNIST tutorial's CNN, ESM2 in Equinox, Hugging Face's Flax GPT-2; `python -m
tests.outside_models` fetches Flax's example sources once). For each recipe policy (`fp8-current`, `fp8-block`): the
precision audit's half-precision and FP8 shares of the matmul FLOPs (forward and backward), the matmuls the default
`fp8_exclude` kept in bf16 (their `scope`), the weight matmuls left in bf16 for another reason, and the mean
|loss - bf16 autocast's loss| over `--steps` steps of `train_step` (Adam 1e-3, the trial's batches), relative to
bf16's mean loss. Convolutions and the attention's batched matmuls stay bf16 by design (docs/guide/fp8.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the trials (tests/outside_models)

import numpy as np  # noqa: E402
from outside_models import TRIALS  # noqa: E402

import jaxamp  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.autocast_models import Runner, each_trial  # noqa: E402

DEFAULT_OUT = harness.RESULTS / "fp8_models.md"
RECIPES = ("fp8-current", "fp8-current-pow2", "fp8-block")


def audit_row(report) -> dict:
    """The audit's shares, the excluded weights (with the name that kept each out) and the other bf16 weight
    matmuls (forward pass)."""
    forward = [r for r in report.rows if r["pass"] == "forward"]
    excluded = sorted({f"{r['weight'] or r['scope'] or r['source']} ({r['fp8_excluded_name']})" for r in forward
                       if r.get("fp8_excluded_by")})  # the weight, and the name a default pattern matched
    others = sorted({r["scope"] or r["source"] for r in forward if r["primitive"] == "dot_general"
                     and not r["lhs"].startswith("float8") and not r.get("fp8_excluded_by")
                     and "," not in (r["scope"] or "").rsplit("/", 1)[-1]})  # (an einsum's spec: batched)
    return {"half": report.half_fraction, "fp8": report.fp8_fraction, "excluded": excluded, "others": others}


def measure(name: str, steps: int, recipes) -> dict:
    """bf16 autocast's losses, then each recipe's audit and losses, for one trial."""
    bf16 = Runner(name, "bf16;autocast", jaxamp.NoOpLossScale()).losses(steps)
    out = {"kind": TRIALS[name]().kind, "bf16_loss": float(np.mean(bf16)), "recipes": {}}
    for recipe in recipes:
        runner = Runner(name, recipe, jaxamp.NoOpLossScale())
        row = audit_row(runner.audit())
        losses = runner.losses(steps)
        row["gap"] = float(np.mean(np.abs(np.subtract(losses, bf16)))) / out["bf16_loss"]
        out["recipes"][recipe] = row
    return out


def report(rows: dict, steps: int, argv) -> str:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        "# The stateless FP8 recipes on six outside models, their code unchanged",
        "",
        f"- command: `{harness.command_line(__file__, argv)}`",
        f"- date: {harness.now()}; machine: {harness.machine()}",
        f"- shares: of the matmul FLOPs, forward and backward (the precision audit); loss gap: mean over {steps} "
        "steps of |loss - bf16 autocast's loss|, over bf16's mean loss; excluded: the weights of the matmuls the "
        "default `fp8_exclude` (the head's usual whole names) kept in bf16, each with the name a pattern matched "
        "(a tied head's weight is the embedding table)",
        "",
        *harness.table(["model", "kind", "policy", "half precision", "FP8", "excluded by default",
                        "other bf16 weight matmuls", f"loss gap to bf16 ({steps} steps)"]),
    ]
    for name, r in rows.items():
        for recipe, row in r["recipes"].items():
            lines.append(harness.row([name, r["kind"], recipe, pct(row["half"]), pct(row["fp8"]),
                                      ", ".join(row["excluded"]) or "-", ", ".join(row["others"]) or "-",
                                      f"{100 * row['gap']:.2f}%"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", nargs="*", default=list(TRIALS), choices=list(TRIALS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default: %(default)s)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    harness.check_sizes(parser, args, ("steps",))
    harness.check_output(parser, "--out", args.out)
    rows = each_trial(args.trials, lambda name: measure(name, args.steps, args.recipes))
    harness.write_report(args.out, report(rows, args.steps, argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
