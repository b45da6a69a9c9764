"""Where bf16 autocast's distance from float32 comes from: the same outside models under autocast as it is and under
three numerics-only variants of its matmul rule that round less.

    python benchmarks/autocast_variants.py                       # the six outside models, 40 steps
    python benchmarks/autocast_variants.py --trials lm1b --steps 2 --out /tmp/v.md   # a test

`autocast_models.py` finds bf16 autocast outside two of the autocast issue's yardsticks on some models: lm1b's
attention query kernel 2.1% off float32 (26 of 29 leaves within max(2%, 1.5x its noise floor)), the ResNet's
BatchNorm scales (6 of 10), and the 40-step losses of Gemma, ESM2 and GPT-2 about 1.5x further from float32 than
float32 started from weights rounded once to bfloat16 (1.6-3.3x with bfloat16 logits, before the float32 head).
Under `bf16;autocast` (the policy of `autocast_models.py`, the same batches, Adam, steps and yardsticks), each row
swaps the rule of `dot_general` and `conv_general_dilated`:

- `autocast`: as jaxamp ships it (torch.amp's rule but for the output head's float32 logits): operands and result
  in bfloat16, float32 accumulation; the gradients of the operands come out of the backward GEMMs in bfloat16;
- `f32-grads`: the same forward; the gradient of each operand that autocast narrowed from float32 (weights, and
  activations after a LayerNorm or softmax) comes out of its backward GEMM in float32, unrounded, as Transformer
  Engine's `main_grad` takes weight gradients and flash attention keeps dP;
- `f32-results`: also each matmul's result in float32 (as flash attention keeps the scores S = QK^T): only the
  operands are rounded to bfloat16; the backward GEMMs still take bfloat16 operands (the output gradient rounded to
  bfloat16);
- `operands-only`: only the forward GEMMs' operands rounded to bfloat16; the output gradient stays float32, so the
  backward GEMMs see only the forward's rounded operands: the least rounding any scheme that runs the matmuls and
  convolutions on bfloat16 operands can do (an amount of rounding, not a scheme a bfloat16 backward GEMM can run,
  as its output gradient would be rounded too). On ill-conditioned tiny batches a leaf's error is not monotone in
  the rounding, so it is not a floor leaf by leaf.

The output head keeps the shipped rule in every row (`float32_results`: float32 logits, bfloat16 backward GEMMs), so
the rows differ only in the other matmuls. The variants are numerics only: their backward computes the
float32-output GEMMs as float32 dots of bfloat16-valued operands (on a CPU the same numbers; on a GPU that form would
be a float32 GEMM), and they are applied by swapping `jaxamp.autocast_rules.FIRST_ORDER_RULES`' matmul entries inside
this process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the trials (tests/outside_models)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jaxamp  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.autocast_models import (  # noqa: E402
    Runner,
    batch_words,
    each_trial,
    gradient_row,
    loss_gap,
    noise_cells,
    seed_cells,
    seed_counts,
    set_batch,
    worst_cell,
)
from jaxamp import autocast_rules  # noqa: E402

DEFAULT_OUT = harness.RESULTS / "autocast_variants.md"
TRIAL_NAMES = ["lm1b", "gemma_nnx", "esm2_equinox", "gpt2_hf", "imagenet_resnet", "mnist_cnn_nnx"]
OPS = ("dot_general", "conv_general_dilated")
VARIANTS = {"autocast": None, "f32-grads": ("bfloat16", True), "f32-results": ("float32", True),
            "operands-only": ("float32", False)}  # variant: (its matmul result dtype, output gradient rounded)
POLICY = "bf16;autocast"
F32 = np.dtype(np.float32)


class _Op:
    """A matmul primitive and its params (but the result dtype and precision), bound by `__call__`; hashed by
    identity (a custom_vjp static argument)."""

    def __init__(self, eqn):
        self.primitive = eqn.primitive
        self.params = {k: v for k, v in eqn.params.items() if k not in ("preferred_element_type", "precision")}

    def __call__(self, a, b, out_dtype=None, precision=None):
        return self.primitive.bind(a, b, preferred_element_type=out_dtype, precision=precision, **self.params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _matmul(x, w, op, out_dtype, wide, round_g):
    """`op` on `x`, `w` rounded to bfloat16, result in `out_dtype`; `wide[i]`: operand i's gradient in float32 (it
    was float32 before the rounding); `round_g`: the output gradient rounded to bfloat16 (a bfloat16 GEMM operand)
    before the backward GEMMs."""
    return _matmul_fwd(x, w, op, out_dtype, wide, round_g)[0]


def _matmul_fwd(x, w, op, out_dtype, wide, round_g):
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    return op(xb, wb, out_dtype), (xb, wb)


def _matmul_bwd(op, out_dtype, wide, round_g, residuals, g):
    xb, wb = residuals
    if round_g:
        g = g.astype(jnp.bfloat16).astype(F32)  # the output gradient as a bfloat16 GEMM operand
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    _, vjp = jax.vjp(lambda a, b: op(a, b, None, highest), xb.astype(F32), wb.astype(F32))
    grads = vjp(g)  # bfloat16-valued operands, float32 sums
    return tuple(d if keep else d.astype(jnp.bfloat16).astype(p.dtype) for d, keep, p in zip(grads, wide, (xb, wb)))


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def variant_rule(out_dtype: str, round_g: bool):
    """A matmul rule: float32/bfloat16 operands with at least one float32 go through `_matmul`; the rest as
    autocast does."""
    shipped = autocast_rules.matmul_rule

    def rule(eqn, vals, mode, bounds=None):
        dtypes = [autocast_rules.dtype_of(v) for v in vals[:2]]
        if (mode.reference or autocast_rules.fp8_applies(eqn, mode) or np.dtype(mode.compute) != jnp.bfloat16
                or autocast_rules.float32_result_applies(eqn, mode)  # the output head: the shipped rule
                or not set(dtypes) <= {F32, np.dtype(jnp.bfloat16)} or F32 not in dtypes
                or eqn.params.get("preferred_element_type") not in (None, F32, np.dtype(jnp.bfloat16))):
            return shipped(eqn, vals, mode, bounds)
        wide = tuple(d == F32 for d in dtypes)
        return [_matmul(vals[0], vals[1], _Op(eqn), np.dtype(out_dtype), wide, round_g)]

    return rule


@contextlib.contextmanager
def variant(name: str):
    """Autocast's matmul rules (`OPS`) swapped for `name`'s inside the block (traces cleared on entry and exit)."""
    shipped = {op: autocast_rules.FIRST_ORDER_RULES[op] for op in OPS}
    if VARIANTS[name] is not None:
        autocast_rules.FIRST_ORDER_RULES.update(dict.fromkeys(OPS, variant_rule(*VARIANTS[name])))
    jax.clear_caches()
    try:
        yield
    finally:
        autocast_rules.FIRST_ORDER_RULES.update(shipped)
        jax.clear_caches()


def measure(name: str, steps: int, seeds: int) -> dict:
    """Each rule's gradients on `seeds` batches and its `steps`-step loss gap to float32 on `seeds` draws of the
    data, each draw's gap over that draw's own float32 noise (autocast_models.py's paired statistic)."""
    draws = range(max(seeds, 1))
    fp32 = [Runner(name, "fp32", jaxamp.NoOpLossScale()).losses(steps, seed=k) for k in draws]
    noise = [loss_gap(Runner(name, "fp32", jaxamp.NoOpLossScale(), rounded_to=jnp.bfloat16).losses(steps, seed=k),
                      fp32[k]) for k in draws]
    rows = {}
    for v in VARIANTS:
        with variant(v):
            runner = Runner(name, POLICY, jaxamp.NoOpLossScale())
            fidelity = runner.fidelity()
            per_seed = [gradient_row(fidelity), *(gradient_row(runner.fidelity(seed=k)) for k in range(1, seeds))]
            gaps = [loss_gap((runner if k == 0 else Runner(name, POLICY, jaxamp.NoOpLossScale())).losses(
                steps, seed=k), fp32[k]) for k in draws]  # each draw from the weights at init
        rows[v] = {"grads": gradient_row(fidelity), "gap": gaps[0], "noise": noise[0],
                   "leaves": leaf_errors(fidelity), "per_seed": per_seed, "seed_gaps": gaps, "seed_noise": noise}
    return rows


def leaf_errors(fidelity: dict) -> dict:
    """{leaf: (error, its bound max(2%, 1.5 x floor))} for the leaves not near zero."""
    return {name: (float(err), max(0.02, 1.5 * float(fidelity["noise_floor"][name])))
            for name, err in fidelity["rel_err"].items() if not bool(fidelity["near_zero"][name])}


def outside_lines(rows: dict) -> list[str]:
    """One line per leaf outside its bound under `autocast`: its error under each rule."""
    lines = []
    for name, variants in rows.items():
        for leaf, (err, bound) in variants["autocast"]["leaves"].items():
            if err > bound:
                errors = ", ".join(f"{v} {100 * p['leaves'][leaf][0]:.2f}%" for v, p in variants.items())
                lines.append(f"- {name} `{leaf}` (bound {100 * bound:.2f}%): {errors}")
    return lines


def report(rows: dict, steps: int, argv) -> str:
    lines = ["# bf16 autocast and three matmul rules that round less (numerics only)", "",
             f"- command: `{harness.command_line(__file__, argv)}`", f"- machine: {harness.machine()}",
             f"- date: {harness.now()}", f"- policy {POLICY}; {steps} training steps per run; Adam 1e-3; "
             f"{batch_words()} (autocast_models.py's yardsticks)", ""]
    table = []
    for name, variants in rows.items():
        for v, p in variants.items():
            g = p["grads"]
            table.append([name, v, f"{g['within']}/{g['counted']}", seed_counts({"per_seed": p["per_seed"]}),
                          worst_cell(g), f"{p['gap']:.2e}", f"{p['noise']:.2e}", *noise_cells(p["gap"], p["noise"]),
                          *seed_cells(p["seed_gaps"], p["seed_noise"])[:3]])
    lines += harness.table(["model", "matmul rule", "leaves within max(2%, 1.5x floor)", "per data seed",
                            "worst leaf (error / its noise floor)", "loss gap to fp32 (mean abs)", "fp32's own noise",
                            "ratio", "within noise (<= 1.5)", "data seeds: gap / fp32's noise, per seed",
                            "paired median", "within (<= 1.5)"], table, "llrrlrrrllrl")
    lines += ["", "`autocast`: jaxamp's rule (bfloat16 results and gradients); `f32-grads`: the gradients of operands "
              "narrowed from float32 out of their GEMMs in float32; `f32-results`: also the matmul results in "
              "float32; `operands-only`: only the forward GEMMs' operands rounded to bfloat16, everything else "
              "float32 (the backward GEMMs too, on the same rounded operands): the least rounding any scheme that "
              "runs the matmuls and convolutions on bfloat16 operands can do (an amount of rounding, not a scheme a "
              "bfloat16 backward GEMM can run; per leaf on these tiny batches not a floor: a leaf's error is not "
              "monotone in the rounding). Yardsticks as in autocast_models.md "
              "(fp32's own noise: float32 from the weights rounded once to bfloat16). Per data seed: the leaves within "
              "on the first batch of each of autocast_models.py's data draws (seed 0: the trial's own batch), each "
              "with its own noise floors. Data seeds: each rule's loss gap on each draw over that draw's own float32 "
              "noise, and their median (autocast_models.py's paired statistic; seed 0: the ratio column).", "",
              "The leaves outside their bound (max(2%, 1.5x floor)) under `autocast`, and their error under each "
              "rule:", "", *(outside_lines(rows) or ["- none"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", nargs="*", default=TRIAL_NAMES, choices=TRIAL_NAMES)
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=5,
                        help="batches the per-leaf count is taken on and draws of the data the loss gap is taken "
                             "on, the trial's own first (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences or images per batch, for every trial (default: the trials' own, 4)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    harness.check_output(parser, "--out", args.out)
    set_batch(parser, args.batch)
    rows = each_trial(args.trials, lambda name: measure(name, args.steps, args.seeds))
    harness.write_report(args.out, report(rows, args.steps, argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
