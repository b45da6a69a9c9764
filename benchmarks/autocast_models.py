"""Autocast on six public model codebases, their model code unchanged: what runs in half precision, how far the
gradients are from float32, and how 40 training steps compare with float32's own noise.

    python benchmarks/autocast_models.py                      # all six trials, 40 steps
    python benchmarks/autocast_models.py --trials lm1b --steps 3 --out /tmp/m.md   # a test
    python benchmarks/autocast_models.py --audit-only          # the audit's table alone (a minute; traced, not run)

The trials are `tests/outside_models` (Flax lm1b and ImageNet ResNet in linen, Flax's NNX Gemma and the NNX MNIST
tutorial's CNN, ESM2 in Equinox, Hugging Face's Flax GPT-2), built at tiny sizes from the published code
(`python -m tests.outside_models` fetches Flax's example sources once). For each:

- the cast policy `"bf16"`: the precision audit's half-precision share of the matmul FLOPs and its first float32
  fall-back (file:line in the model's code, and the op that made the input float32);
- `"bf16;autocast"` and `"fp16;autocast"` (with a dynamic loss scale): the audit's share; each trainable leaf's
  gradient error against the float32 recomputation (`jaxamp.fidelity.fidelity_report`), counted as within when it
  is at most max(2%, 1.5 x the leaf's noise floor: the float32 gradient at the weights rounded once to bfloat16)
  or its float32 gradient is near zero (marked, not counted); the worst leaf;
- 40 steps of `train_step` (Adam 1e-3, the trial's batches) under the autocast policy against float32, and float32
  from the weights rounded once to bfloat16 (its own noise): the mean |loss difference| over the steps, and their
  ratio (within float32's noise when the ratio is at most 1.5). bfloat16 is the yardstick for both policies.
  A step the float16 run skipped (overflow under the dynamic loss scale) is skipped by the float32 run it is set
  against too (params and Adam state kept), so that the gap measures the arithmetic, not a trajectory one update
  behind; the skipped steps and the gap without that are reported.
- the same yardstick as a spread (`--noise-samples N`, default 5): float32 from N perturbations of the weights as
  large as one rounding to bfloat16 (each weight moved by its rounding error with a random sign, keys 0..N-1), so
  that one mixed run's gap is set against how much one rounding's noise varies, not against one draw of it; and
  the three runs (float32, float32 from the rounded weights, mixed) on `--seeds N` draws of the data (default 5,
  the first the trial's own batches), so that the median mixed gap is set against the median noise, both drawn
  alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the trials (tests/outside_models)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from outside_models import TRIALS, SourceUnavailable, trial_options  # noqa: E402

import jaxamp  # noqa: E402
import jaxamp.nnx as jnnx  # noqa: E402
from benchmarks import harness  # noqa: E402
from jaxamp.fidelity import fidelity_report  # noqa: E402

DEFAULT_OUT = harness.RESULTS / "autocast_models.md"
AUDIT_OUT = harness.RESULTS / "autocast_models_audit.md"
# The options every trial is built with: {"batch": n} under --batch (the trials' own: 4 sequences or images).
TRIAL_OPTIONS: dict = {}
POLICIES = {"bf16;autocast": lambda: jaxamp.NoOpLossScale(), "fp16;autocast": lambda: jaxamp.DynamicLossScale(2.0**15)}


class Runner:
    """One trial under one policy: an optimizer state, a step, the audit and the fidelity report."""

    def __init__(self, name: str, policy: str, loss_scale, rounded_to=None, rounding_key=None):
        self.trial = TRIALS[name](**TRIAL_OPTIONS)
        if rounded_to is not None:
            self._round(rounded_to, rounding_key)
        self.policy, self.tx = policy, optax.adam(1e-3)
        self.batch = self.trial.make_batch(jax.random.key(0))
        with jax.numpy_dtype_promotion("standard"):
            if self.trial.kind == "nnx":
                self.opt = jnnx.Optimizer(self.trial.model, self.tx, policy=policy, loss_scale=loss_scale)
            else:
                self.state = jaxamp.TrainState.create(params=self.trial.params, tx=self.tx, policy=policy,
                                                      loss_scale=loss_scale, rng=jax.random.key(1))
                self.step_fn = jax.jit(jaxamp.train_step, static_argnames="loss_fn")

    def _round(self, dtype, key=None) -> None:
        """The float32 weights rounded once to `dtype` (and kept float32); with `key`, moved by that rounding's error
        with random signs (`signed_rounding`)."""
        def cast(tree):
            leaves, treedef = jax.tree.flatten(tree)
            keys = [None] * len(leaves) if key is None else list(jax.random.split(key, len(leaves)))
            return treedef.unflatten([
                x if not jnp.issubdtype(x.dtype, jnp.floating) else
                x.astype(dtype).astype(x.dtype) if k is None else signed_rounding(x, k) for x, k in zip(leaves, keys)])
        if self.trial.kind == "nnx":
            from flax import nnx

            nnx.update(self.trial.model, cast(nnx.state(self.trial.model, nnx.Param)))
        else:
            self.trial.params = cast(self.trial.params)

    def audit(self):
        with jax.numpy_dtype_promotion("standard"):
            if self.trial.kind == "nnx":
                return jnnx.precision_audit(self.trial.model, self.opt, self.batch, self.trial.loss_fn)
            return jaxamp.precision_audit(self.state, self.batch, self.trial.loss_fn)

    def fidelity(self, seed: int = 0) -> dict:
        """The fidelity report on the trial's batch (`seed` k > 0: `make_batch(key(1000 k))`, the first batch of
        `losses(seed=k)`); noise floors from rounding the weights once to bfloat16 (the issue's yardstick, for the
        float16 policy too)."""
        batch = self.trial.make_batch(jax.random.key(1000 * seed)) if seed else self.batch
        with jax.numpy_dtype_promotion("standard"):
            if self.trial.kind == "nnx":
                report = jnnx.fidelity_report(self.trial.model, self.opt, batch, self.trial.loss_fn,
                                              noise_floor=jnp.bfloat16)
            else:
                report = jax.jit(fidelity_report, static_argnames=("loss_fn", "noise_floor"))(
                    self.state, batch, self.trial.loss_fn, noise_floor=jnp.dtype(jnp.bfloat16))
        return jax.device_get(report)

    def losses(self, steps: int, skip=(), seed: int = 0) -> list[float]:
        """The loss of each of `steps` training steps; `self.skipped`: the steps whose update was skipped (their
        gradients not finite). With `skip`, those steps' updates are dropped as a skipped step drops them (params and
        optimizer state kept, BatchNorm statistics and RNG counts not), so a float32 run can skip what a float16 one
        skipped. Step i's batch is the trial's `make_batch(key(i))`, or with `seed` k > 0 `make_batch(key(1000 k +
        i))`: another draw of the data, the weights at init unchanged."""
        out, batch, self.skipped = [], self.batch, []
        with jax.numpy_dtype_promotion("standard"):
            for i in range(steps):
                key = jax.random.key(1000 * seed + i)
                batch = {**self.trial.make_batch(key), **_carried(batch)} if isinstance(batch, dict) \
                    else self.trial.make_batch(key)
                if self.trial.kind == "nnx":
                    metrics = self._nnx_step(batch, drop=i in skip)
                else:
                    new, metrics = self.step_fn(self.state, batch, self.trial.loss_fn)
                    self.state = new.replace(params=self.state.params, opt_state=self.state.opt_state) \
                        if i in skip else new
                    aux = metrics.get("aux")
                    if isinstance(aux, dict) and "batch_stats" in aux:  # ImageNet's BatchNorm statistics
                        batch = {**batch, "batch_stats": aux["batch_stats"]}
                if not bool(metrics["grads_finite"]):
                    self.skipped.append(i)
                out.append(float(metrics["loss"]))
        return out

    def _nnx_step(self, batch, drop: bool) -> dict:
        from flax import nnx

        # copies: a State holds the live variables, which the step writes its new values into. Only the params and
        # the optax state go back: the step counter advances on a skipped step too.
        kept = jax.tree.map(lambda x: x, (nnx.state(self.trial.model, nnx.Param), nnx.state(self.opt)["opt_state"])) \
            if drop else None
        metrics = jnnx.train_step(self.trial.model, self.opt, batch, self.trial.loss_fn)
        if drop:
            nnx.update(self.trial.model, kept[0])
            nnx.update(self.opt, nnx.State({"opt_state": kept[1]}))
        return metrics


def signed_rounding(x: jax.Array, key: jax.Array) -> jax.Array:
    """f32 `x` moved by its round-to-nearest bfloat16 error with a random sign per element: `x + s * (bf16(x) - x)`,
    `s` = +-1. Every element moves exactly as far as rounding moves it (the result need not be a bfloat16 value):
    a draw from the perturbations of one rounding's size, of which rounding to nearest is the all-plus one."""
    err = x.astype(jnp.bfloat16).astype(x.dtype) - x  # f32[x.shape]
    return x + jnp.where(jax.random.bernoulli(key, 0.5, x.shape), err, -err)


def _carried(batch: dict) -> dict:
    return {"batch_stats": batch["batch_stats"]} if "batch_stats" in batch else {}


def gradient_row(report: dict) -> dict:
    """Leaves within max(2%, 1.5 x noise floor), near-zero leaves, the worst leaf (name, error, floor)."""
    within, counted, worst = 0, 0, ("", 0.0, 0.0)
    for name, err in report["rel_err"].items():
        if bool(report["near_zero"][name]):
            continue
        err, floor = float(err), float(report["noise_floor"][name])
        counted += 1
        within += err <= max(0.02, 1.5 * floor)
        if err / max(0.02, 1.5 * floor) > worst[1] / max(0.02, 1.5 * worst[2] if worst[0] else 0.02):
            worst = (name, err, floor)
    near = sum(bool(v) for v in report["near_zero"].values())
    return {"within": within, "counted": counted, "near_zero": near, "worst": worst}


def measure(name: str, steps: int, noise_samples: int, seeds: int) -> dict:
    cast = Runner(name, "bf16", jaxamp.NoOpLossScale()).audit()
    fp32 = Runner(name, "fp32", jaxamp.NoOpLossScale()).losses(steps)
    spread = [loss_gap(Runner(name, "fp32", jaxamp.NoOpLossScale(), rounded_to=jnp.bfloat16,
                              rounding_key=jax.random.key(k)).losses(steps), fp32) for k in range(noise_samples)]
    aligned = {(0, ()): fp32}  # float32 runs skipping the steps a float16 run skipped, by (data seed, skipped steps)

    def reference(seed: int, skipped: list) -> list[float]:
        key = (seed, tuple(skipped))
        if key not in aligned:
            aligned[key] = Runner(name, "fp32", jaxamp.NoOpLossScale()).losses(steps, skip=set(skipped), seed=seed)
        return aligned[key]

    noise = [loss_gap(Runner(name, "fp32", jaxamp.NoOpLossScale(), rounded_to=jnp.bfloat16).losses(steps, seed=k),
                      reference(k, [])) for k in range(max(seeds, 1))]  # float32's own noise, per data seed
    row = {"kind": TRIALS[name]().kind, "cast": cast, "policies": {}, "spread": sorted(spread)}
    for policy, loss_scale in POLICIES.items():
        runner = Runner(name, policy, loss_scale())
        audit, grads = runner.audit(), gradient_row(runner.fidelity())
        grads["per_seed"] = [dict(grads), *(gradient_row(runner.fidelity(seed=k)) for k in range(1, seeds))]
        mixed = runner.losses(steps)
        gaps = [loss_gap(mixed, reference(0, runner.skipped))]
        for k in range(1, seeds):  # the same pair of runs on other draws of the data
            other = Runner(name, policy, loss_scale())
            gaps.append(loss_gap(other.losses(steps, seed=k), reference(k, other.skipped)))
        row["policies"][policy] = {
            "audit": audit, "grads": grads, "gap": gaps[0], "raw_gap": loss_gap(mixed, fp32),
            "skipped": runner.skipped, "noise": noise[0], "seed_gaps": gaps, "seed_noise": noise,
            "last": (mixed[-1], fp32[-1])}
    return row


def measure_audit(name: str) -> dict:
    """The audits alone (`--audit-only`): the cast policy's and each autocast policy's, traced, nothing run."""
    return {"kind": TRIALS[name]().kind, "cast": Runner(name, "bf16", jaxamp.NoOpLossScale()).audit(),
            "policies": {p: {"audit": Runner(name, p, scale()).audit()} for p, scale in POLICIES.items()}}


def loss_gap(losses, reference) -> float:
    """The mean |difference| of two runs' per-step losses."""
    return float(np.mean(np.abs(np.subtract(losses, reference))))


def worst_cell(grads: dict) -> str:
    """`gradient_row`'s worst leaf as "name error% (floor floor%)", or "-"."""
    name, err, floor = grads["worst"]
    return f"{name} {100 * err:.2f}% (floor {100 * floor:.2f}%)" if name else "-"


def noise_cells(gap: float, noise: float) -> list[str]:
    """The loss gap over float32's own noise, and whether it is within (<= 1.5)."""
    ratio = gap / noise if noise > 0 else float("inf")
    return [f"{ratio:.3f}", "yes" if ratio <= 1.5 else "no"]


def batch_words() -> str:
    """The batches the runs took, for a report's header: the trials' own, or `--batch`'s."""
    words = "the trials' own batches (4 sequences or images)" if "batch" not in TRIAL_OPTIONS else \
        f"batches of {TRIAL_OPTIONS['batch']} sequences or images (--batch; the trials' own: 4)"
    return words + (f"; dropout {TRIAL_OPTIONS['dropout']} (--dropout)" if "dropout" in TRIAL_OPTIONS else "")


def header(argv) -> list[str]:
    return ["# Autocast on six outside model codebases (model code unchanged)", "",
            f"- command: `{harness.command_line(__file__, argv)}`", f"- machine: {harness.machine()}",
            f"- date: {harness.now()}"]


def audit_lines(rows: dict) -> list[str]:
    """The audit's table: each trial's half-precision share under the cast policy, its first float32 fall-back
    (where and why), and the share under each autocast policy."""
    lines = ["## What runs in half precision (the precision audit, forward and backward)", ""]
    table = []
    for name, r in rows.items():
        first = r["cast"].fallbacks[0] if r["cast"].fallbacks else None
        table.append([name, r["kind"], f"{100 * r['cast'].half_fraction:.1f}%",
                      f"{first['source']}: {first['cause']}" if first else "-",
                      *(f"{100 * p['audit'].half_fraction:.1f}%" for p in r["policies"].values())])
    return lines + harness.table(["model", "kind", "cast policy bf16", "its first float32 fall-back",
                                  *(f"{p}" for p in POLICIES)], table, "llrlrr")


def report(rows: dict, steps: int, argv) -> str:
    n_spread = max((len(r["spread"]) for r in rows.values()), default=0)
    n_seeds = max((len(p["seed_gaps"]) for r in rows.values() for p in r["policies"].values()), default=0)
    lines = [*header(argv), f"- {steps} training steps per run; Adam 1e-3; {batch_words()}", "",
             *audit_lines(rows)]
    lines += ["", "## Gradients against float32", ""]
    table = [[name, policy, f"{p['grads']['within']}/{p['grads']['counted']}", str(p["grads"]["near_zero"]),
              worst_cell(p["grads"]), seed_counts(p["grads"])]
             for name, r in rows.items() for policy, p in r["policies"].items()]
    lines += harness.table(["model", "policy", "leaves within max(2%, 1.5x floor)", "near-zero leaves",
                            "worst leaf (error / its noise floor)", "leaves within, per data seed"], table,
                           "llrrlr")
    lines += ["", "The noise floor of a leaf: its float32 gradient at the weights rounded once to bfloat16, "
              "against the float32 gradient. On the trials' tiny batches (4 sequences or images) per-leaf errors of "
              "ill-conditioned models (BatchNorm at init) are large even for float32 rounding. The last "
              f"column: the same count on {n_seeds} batches (seed 0 the trial's own, seed k the first batch of data "
              "draw k below), each with its own noise floors.",
              "", f"## {steps} steps against float32's own noise", ""]
    table = [[name, policy, skipped_cell(p), f"{p['gap']:.2e}", f"{p['noise']:.2e}", *noise_cells(p["gap"], p["noise"]),
              *spread_cells(p["gap"], r["spread"]), *seed_cells(p["seed_gaps"], p["seed_noise"])]
             for name, r in rows.items() for policy, p in r["policies"].items()]
    lines += harness.table(["model", "policy", "skipped steps (overflow)", "loss gap to fp32 (mean abs)",
                            "fp32's own noise", "ratio", "within noise (<= 1.5)",
                            "fp32's noise, signed roundings (min / median / max)", "ratio to median",
                            "within 1.5x median", "data seeds: gap / fp32's noise, per seed",
                            "their median", "within 1.5x", "median gap / median noise"], table, "llrrrrlrrlrrlr")
    lines += ["", "Loss gap: the mean |difference| of the per-step losses from float32's. A step that the float16 "
              "run skipped (its gradients overflowed under the dynamic loss scale, which starts at 2^15) is skipped "
              "by the float32 run it is compared with as well (params and Adam state kept, BatchNorm statistics "
              "not, as a skipped step keeps them): a skipped step shifts the whole trajectory by one update, which "
              "is the loss scale's doing, not the arithmetic's; the gap to the float32 run that skips nothing is "
              "in the skipped-steps column. float32's own noise: the float32 run from the weights rounded once to "
              "bfloat16, against the float32 run."
              f" The signed-rounding columns: float32 from {n_spread} perturbations of the weights as large as one "
              "rounding to bfloat16 (each weight moved by its rounding error with a random sign, keys 0..N-1), each "
              "against the float32 run: how much the one-rounding yardstick itself varies. The last three: the "
              f"same three runs (float32, float32 from the rounded weights, mixed) on {n_seeds} draws of the data "
              "(seed 0: the batches above; seed k: step i's batch from key 1000 k + i; the weights at init the "
              "same), each draw's mixed gap over its own float32 noise (paired: both runs on the same data), the "
              "median of those ratios and whether it is at most 1.5; the last column, unpaired, the median gap over "
              "the median noise (one draw whose float32 noise stays tiny moves it far)."]
    return "\n".join(lines) + "\n"


def seed_counts(grads: dict) -> str:
    """The leaves within their bound on each data seed's batch (`gradient_row`s), e.g. "26 14 16"; as "within/counted"
    each ("9/10 12/14") where the leaves counted differ between the batches (which leaves are near zero moves)."""
    rows = grads.get("per_seed", [])
    if len({r["counted"] for r in rows}) <= 1:
        return " ".join(str(r["within"]) for r in rows) or "-"
    return " ".join(f"{r['within']}/{r['counted']}" for r in rows)


def skipped_cell(p: dict) -> str:
    """The skipped steps and, when any, the gap to the float32 run that skipped none."""
    if not p["skipped"]:
        return "0"
    return f"{len(p['skipped'])} (step {', '.join(map(str, p['skipped']))}; gap without skipping {p['raw_gap']:.2e})"


def seed_cells(gaps: list[float], noise: list[float]) -> list[str]:
    """Each data seed's gap over its own float32 noise, their median, whether it is <= 1.5, and (unpaired) the median
    gap over the median noise."""
    if len(gaps) < 2:
        return ["-", "-", "-", "-"]
    ratios = [g / n if n > 0 else float("inf") for g, n in zip(gaps, noise)]
    median, unpaired = float(np.median(ratios)), float(np.median(gaps)) / float(np.median(noise))
    return [" ".join(f"{r:.2f}" for r in ratios), f"{median:.3f}", "yes" if median <= 1.5 else "no",
            f"{unpaired:.3f}"]


def spread_cells(gap: float, spread: list[float]) -> list[str]:
    """min / median / max of the signed-rounding noise, the gap over their median, and whether <= 1.5."""
    if not spread:
        return ["-", "-", "-"]
    median = float(np.median(spread))
    ratio = gap / median if median > 0 else float("inf")
    return [f"{spread[0]:.2e} / {median:.2e} / {spread[-1]:.2e}", f"{ratio:.3f}", "yes" if ratio <= 1.5 else "no"]


def each_trial(names, measure_one) -> dict:
    """`{name: measure_one(name)}` over the trials, skipping (with a line) one whose source cannot be fetched."""
    rows = {}
    for name in names:
        try:
            rows[name] = measure_one(name)
        except SourceUnavailable as err:
            harness.log(f"{name}: skipped ({err})")
        harness.log(f"{name} done")
        jax.clear_caches()  # each trial's runs compile their own steps: without this, memory grows trial by trial
    return rows


def _loss_scale_for(policy: str):
    """A dynamic loss scale from 2^15 for a float16 policy (as `POLICIES`' own), none otherwise."""
    fp16 = jaxamp.get_policy(policy).compute_dtype == jnp.float16
    return (lambda: jaxamp.DynamicLossScale(2.0**15)) if fp16 else (lambda: jaxamp.NoOpLossScale())


def set_batch(parser, batch: int | None) -> None:
    """`--batch`: every trial built with `batch` sequences or images (a positive int); None keeps the trials' own."""
    if batch is not None and batch < 1:
        parser.error(f"--batch {batch}: give a positive number of sequences or images per batch")
    TRIAL_OPTIONS.clear()
    TRIAL_OPTIONS.update({} if batch is None else {"batch": batch})


def set_dropout(parser, trials, dropout: float | None) -> None:
    """`--dropout`: the trials built with that dropout rate; each of `trials` must take one (GPT-2 does)."""
    if dropout is None:
        return
    if not 0.0 <= dropout < 1.0:
        parser.error(f"--dropout {dropout}: give a rate in [0, 1)")
    lacking = [n for n in trials if "dropout" not in trial_options(n)]
    if lacking:
        parser.error(f"--dropout: {', '.join(lacking)} take no dropout rate; run --trials gpt2_hf with it")
    TRIAL_OPTIONS["dropout"] = dropout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", nargs="*", default=list(TRIALS), choices=list(TRIALS))
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default: %(default)s)")
    parser.add_argument("--noise-samples", type=int, default=5,
                        help="float32 runs from signed roundings of the weights to bfloat16 (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=5,
                        help="draws of the data for the paired float32 / mixed runs, the trial's own first "
                             "(default: %(default)s)")
    parser.add_argument("--policies", nargs="*", default=None,
                        help="the mixed policies to run instead of bf16;autocast and fp16;autocast (a float16 one with "
                             "a dynamic loss scale from 2^15), e.g. 'bf16;autocast;float32_results=.'")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences or images per batch, for every trial (default: the trials' own, 4)")
    parser.add_argument("--dropout", type=float, default=None,
                        help="the dropout rate of the trials that take one (GPT-2: resid/embd/attn pdrop; default: "
                             "their own, 0.1): 0 makes float32 and mixed runs the same trajectory up to rounding")
    parser.add_argument("--audit-only", action="store_true",
                        help=f"only the audit's table (traced, nothing run), to {AUDIT_OUT.name} by default")
    parser.add_argument("--out", default=None, help=f"markdown file (default: {DEFAULT_OUT.name})")
    args = parser.parse_args(argv)
    args.out = args.out or str(AUDIT_OUT if args.audit_only else DEFAULT_OUT)
    set_batch(parser, args.batch)
    set_dropout(parser, args.trials, args.dropout)
    harness.check_output(parser, "--out", args.out)
    if args.policies:
        POLICIES.clear()
        POLICIES.update({p: _loss_scale_for(p) for p in args.policies})
    argv = argv if argv is not None else sys.argv[1:]
    if args.audit_only:
        rows = each_trial(args.trials, measure_audit)
        harness.write_report(args.out, "\n".join([*header(argv), "", *audit_lines(rows)]) + "\n")
        return 0
    rows = each_trial(args.trials, lambda name: measure(name, args.steps, args.noise_samples, args.seeds))
    harness.write_report(args.out, report(rows, args.steps, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
