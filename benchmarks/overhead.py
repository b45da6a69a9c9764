"""CPU overhead of jaxamp's `train_step` against hand-written mixed-precision steps on the same LM.

    python benchmarks/overhead.py                       # reference size: 4 layers, 4 heads, width 128, seq 64, batch 12
    python benchmarks/overhead.py --rounds 2 --steps 3 --layers 2 --width 32 --out /tmp/overhead.md   # smoke test

Variants, all jitted with their state donated, all on the same model, loss, optax AdamW and token batches:

  a  jaxamp `train_step`, fp16 policy + jaxamp `DynamicLossScale` (as a user would write it)
  b  hand-written step: jmp policy `p=f32,c=f16,o=f32`, `jmp.StaticLossScale`, `jmp.all_finite`, optax,
     `jmp.select_tree` on the finite flag (the minimal mixed-precision step)
  c  Flax `flax.training.dynamic_scale.DynamicScale` as its docs show: `dynamic_scale.value_and_grad(loss)(params)`,
     then `jnp.where(is_fin, new, old)` over params and optimizer state; its fields given as arrays
  d  jaxamp `train_step`, fp32 policy + `NoOpLossScale`
  e  plain optax fp32 step (`jax.value_and_grad` + `tx.update` + `apply_updates`)

One process; the variants are interleaved round-robin (the starting variant rotates each round) so drifts in machine
load hit them alike. Each round times `--steps` steps of one variant (dispatch of all steps, then
`block_until_ready`); the figures are medians over rounds, and the ratios are also given as the range of per-round
paired ratios. Compile cost is measured twice: first call minus the steady-state step, and `jax.jit(...).trace /
.lower / .compile` on a fresh closure. Compiles over a run are counted both as traces (a Python counter inside each
variant's loss function) and as XLA backend compiles (jax.monitoring events during that variant's calls).

XLA:CPU upcasts float16 dots to float32 internally, so the fp16 figures say nothing about GPU speed; this measures
the bookkeeping jaxamp adds (loss-scale state, finite check, select, metrics) relative to hand-written code.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jmp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.dynamic_scale import DynamicScale  # noqa: E402

from benchmarks import harness  # noqa: E402
from jaxamp import DynamicLossScale, NoOpLossScale, TrainState, get_policy, train_step  # noqa: E402
from jaxamp.lm.model import TransformerConfig, TransformerLM, count_params, cross_entropy_loss  # noqa: E402

DEFAULT_OUT = harness.RESULTS / "overhead.md"
INIT_SCALE = 2.0**15
VARIANTS = {
    "a": "jaxamp train_step, fp16 + DynamicLossScale",
    "b": "hand-written jmp step, fp16 + jmp.StaticLossScale",
    "c": "Flax DynamicScale step, fp16",
    "d": "jaxamp train_step, fp32 + NoOpLossScale",
    "e": "plain optax step, fp32",
}
JMP_POLICY = "p=f32,c=f16,o=f32"


# --------------------------------------------------------------------------------------------------------------------
# The variants. Each factory returns (jitted step, initial carry, call) where `call(step, carry, batch) -> carry`
# runs one step; every factory call builds fresh closures, so its traces and compiles are its own.

def make_loss_fn(model):
    """`loss_fn(params, (inputs, targets), rng)` as `jaxamp.lm.setup.make_loss_fn` writes it (dropout is 0 here).

    Written out so the benchmark does not import the training loop (data, checkpointing, tqdm).
    """

    def loss_fn(params, batch, rng):
        inputs, targets = batch  # i32[batch, seq] each
        rngs = None if rng is None else {"dropout": rng}
        logits = model.apply({"params": params}, inputs, deterministic=rng is None, rngs=rngs)
        return cross_entropy_loss(logits, targets)  # f32[]

    return loss_fn


def _counted(fn, counter: list):
    """Wraps a loss function so that each trace (each call at trace time) increments counter[0]."""

    @functools.wraps(fn)
    def wrapped(*args):
        counter[0] += 1
        return fn(*args)

    return wrapped


def _jaxamp_variant(name, base_loss, params, tx):
    """(a) and (d): jaxamp, exactly as a user writes it."""
    policy, scale = ("fp16", DynamicLossScale(INIT_SCALE)) if name == "a" else ("fp32", NoOpLossScale())
    state = TrainState.create(params=harness.copy_tree(params), tx=tx, policy=get_policy(policy), loss_scale=scale,
                              rng=jax.random.key(0))
    step = jax.jit(functools.partial(train_step, loss_fn=base_loss), donate_argnums=0)
    return step, (state,), lambda f, carry, batch: (f(carry[0], batch)[0],)


def _jmp_variant(base_loss, params, tx):
    """(b): the minimal hand-written jmp step."""
    policy = jmp.get_policy(JMP_POLICY)
    # jmp.StaticLossScale is an *empty* pytree (its array would be jit metadata and unhashable), so it is
    # closed over: the scale is a constant of the compiled step.
    loss_scale = jmp.StaticLossScale(jnp.asarray(INIT_SCALE, jnp.float32))

    def step_b(p, opt_state, batch):
        def scaled_loss(p):
            loss = base_loss(policy.cast_to_compute(p), batch, None)
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(p)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = tx.update(grads, opt_state, p)
        new_p = optax.apply_updates(p, updates)
        p, opt_state = jmp.select_tree(finite, (new_p, new_opt_state), (p, opt_state))
        return p, opt_state, loss, finite

    p0 = harness.copy_tree(params)
    step = jax.jit(step_b, donate_argnums=(0, 1))
    return step, (p0, tx.init(p0)), lambda f, carry, batch: f(carry[0], carry[1], batch)[:2]


def _flax_variant(base_loss, params, tx):
    """(c): Flax DynamicScale, as in its docstring and the Flax ImageNet example."""
    policy = jmp.get_policy(JMP_POLICY)
    dyn = DynamicScale(fin_steps=jnp.zeros((), jnp.int32), scale=jnp.asarray(INIT_SCALE, jnp.float32))

    def step_c(p, opt_state, dynamic_scale, batch):
        def loss(p):
            return base_loss(policy.cast_to_compute(p), batch, None)

        dynamic_scale, is_fin, loss_value, grads = dynamic_scale.value_and_grad(loss)(p)
        updates, new_opt_state = tx.update(grads, opt_state, p)
        new_p = optax.apply_updates(p, updates)
        select = functools.partial(jnp.where, is_fin)
        p = jax.tree.map(select, new_p, p)
        opt_state = jax.tree.map(select, new_opt_state, opt_state)
        return p, opt_state, dynamic_scale, loss_value, is_fin

    p0 = harness.copy_tree(params)
    step = jax.jit(step_c, donate_argnums=(0, 1, 2))
    return step, (p0, tx.init(p0), dyn), lambda f, carry, batch: f(*carry, batch)[:3]


def _optax_variant(base_loss, params, tx):
    """(e): plain optax in fp32."""
    def step_e(p, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: base_loss(p, batch, None))(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    p0 = harness.copy_tree(params)
    step = jax.jit(step_e, donate_argnums=(0, 1))
    return step, (p0, tx.init(p0)), lambda f, carry, batch: f(carry[0], carry[1], batch)[:2]


def make_variant(name: str, model, params, tx, counter: list):
    """Variant `name`'s `(jitted step, initial carry, call)` on `model` and `params`; `counter[0]` counts its traces."""
    base_loss = _counted(make_loss_fn(model), counter)  # loss_fn(params, (inputs, targets), rng) -> f32[]
    if name in ("a", "d"):
        return _jaxamp_variant(name, base_loss, params, tx)
    factories = {"b": _jmp_variant, "c": _flax_variant, "e": _optax_variant}
    if name not in factories:
        raise ValueError(f"unknown variant {name!r}")
    return factories[name](base_loss, params, tx)


class Window:
    """A variant's step and carry as a `harness.interleaved` window: runs the steps of `idx` on `batches` (cycled),
    then blocks; XLA compile events during its calls count towards `name` (with `count_events`)."""

    def __init__(self, name: str, variant: tuple, batches: list, count_events: bool = True):
        self.name, (self.step, self.carry, self.call), self.batches = name, variant, batches
        self.label = name if count_events else None

    def __call__(self, idx: range) -> None:
        with harness.compile_events().attribute(self.label):
            carry = self.carry
            for i in idx:
                carry = self.call(self.step, carry, self.batches[i % len(self.batches)])
            self.carry = jax.block_until_ready(carry)


def setup(layers: int, heads: int, width: int, seq_len: int, batch_size: int, vocab: int):
    """The LM at this size, its initial params and 8 random-token batches: `(cfg, model, params, batches)`."""
    cfg = TransformerConfig(vocab_size=vocab, seq_len=seq_len, num_layers=layers, num_heads=heads, width=width,
                            dropout=0.0)
    model = TransformerLM(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(8):
        tokens = rng.integers(0, vocab, size=(batch_size, seq_len + 1), dtype=np.int32)
        batches.append((jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])))  # i32[batch, seq] each
    return cfg, model, params, batches


def run_interleaved(windows: dict, *, rounds: int, steps: int, warmup: int) -> dict:
    """`harness.interleaved` over the windows, the first call and `warmup` untimed steps first.

    Returns:
      `{"per_round": {name: [s/step]}, "first_call": {name: s}}`.
    """
    first, seconds = harness.interleaved(windows, rounds=rounds, steps=steps, warmup=warmup + 1)
    return {"per_round": {n: [s / steps for s in v] for n, v in seconds.items()}, "first_call": first}


# --------------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_timing_flags(p, rounds=7, steps=50, warmup=3, first_call_included=False)
    harness.add_model_flags(p)
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size (default: %(default)s)")
    p.add_argument("--flax-default-check", action=argparse.BooleanOptionalAction, default=True,
                   help="also count the traces of Flax DynamicScale() with its default Python-scalar fields over "
                   "3 steps (two extra compiles; default: on)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown table to write (default: %(default)s)")
    args = p.parse_args(argv)
    harness.check_sizes(p, args, ("steps", "rounds", "layers", "heads", "width", "seq_len", "batch_size", "vocab"),
                        ("warmup",))
    harness.check_output(p, "--out", args.out)
    return args
def run(args) -> dict:
    """Every variant, interleaved; compile counts, XLA's cost model, and the Flax-defaults check. The report's input."""
    machine = harness.machine(when="at start")  # before the load this process adds
    cfg, model, params, batches = setup(args.layers, args.heads, args.width, args.seq_len, args.batch_size,
                                        args.vocab)
    tx = optax.adamw(learning_rate=1e-3, weight_decay=0.1)
    names = list(VARIANTS)
    traces = {n: [0] for n in names}
    windows = {n: Window(n, make_variant(n, model, params, tx, traces[n]), batches) for n in names}
    res = run_interleaved(windows, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    events = harness.compile_events()
    res.update(machine=machine, cfg=cfg, n_params=count_params(params),
               total_steps=1 + args.warmup + args.rounds * args.steps,
               traces={n: traces[n][0] for n in names}, compiles={n: events.count(n) for n in names},
               secs={n: {k: events.secs(n, k) for k in ("trace", "lower", "compile")} for n in names})
    res["median"] = {n: statistics.median(v) for n, v in res["per_round"].items()}
    res["cost"] = {n: _cost_analysis(w.step, w.carry, batches[0]) for n, w in windows.items()}  # after the counts
    res["skipped"] = _skipped(windows)
    res["flax_default_traces"] = _check_flax_defaults(model, params, batches) if args.flax_default_check else None
    return res


def _skipped(windows: dict) -> dict:
    """Skipped updates: the loss-scale state says whether an overflow happened (a, c); b's flag is not carried."""
    a_scale = float(windows["a"].carry[0].loss_scale.loss_scale)
    c_scale = float(windows["c"].carry[2].scale)
    return {"a": "0" if a_scale == INIT_SCALE else f"scale now {a_scale:g}",
            "c": "0" if c_scale == INIT_SCALE else f"scale now {c_scale:g}"}


def _cost_analysis(step, carry, batch) -> dict:
    """XLA's static cost model of the compiled step: `{"flops": ..., "bytes": ...}` (bytes accessed by all ops).

    Deterministic, unlike wall-clock time: what extra memory traffic the bookkeeping adds, free of machine noise.
    """
    analysis = step.lower(*carry, batch).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis  # older jax: one dict per device
    return {"flops": float(analysis.get("flops", 0.0)), "bytes": float(analysis.get("bytes accessed", 0.0))}


def _check_flax_defaults(model, params, batches) -> int:
    """Traces of a step with Flax `DynamicScale()`'s default (Python scalar, weakly typed) fields over 3 steps."""
    traces = [0]
    base_loss = _counted(make_loss_fn(model), traces)
    policy = jmp.get_policy(JMP_POLICY)

    @jax.jit
    def flax_default_step(p, dynamic_scale, batch):
        ds, is_fin, loss, grads = dynamic_scale.value_and_grad(
            lambda q: base_loss(policy.cast_to_compute(q), batch, None))(p)
        return jax.tree.map(functools.partial(jnp.where, is_fin), jax.tree.map(lambda x, g: x - 1e-3 * g, p, grads),
                            p), ds

    p, ds = harness.copy_tree(params), DynamicScale()
    for i in range(3):
        p, ds = flax_default_step(p, ds, batches[i])
    jax.block_until_ready(p)
    return traces[0]


def _ratio(res, x: str, y: str) -> str:
    """Ratio of medians (bold), of the fastest rounds, and the median and range of the per-round paired ratios."""
    rx, ry = res["per_round"][x], res["per_round"][y]
    cx, cy = res["cost"][x], res["cost"][y]
    medians, paired = harness.ratio_cells(rx, ry).split(" | ")
    return (f"{medians} | {min(rx) / min(ry):.3f}x | {paired} | {cx['bytes'] / cy['bytes']:.3f}x | "
            f"{cx['flops'] / cy['flops']:.3f}x")


def _header(args, res, argv) -> list[str]:
    cfg, tokens = res["cfg"], args.batch_size * args.seq_len
    return [
        "# jaxamp overhead on CPU",
        "",
        f"- command: `{harness.command_line(__file__, argv)}`",
        f"- machine: {res['machine']}",
        f"- date: {harness.now()}",
        f"- model: {cfg.num_layers} layers, {cfg.num_heads} heads, width {cfg.width}, seq {cfg.seq_len}, "
        f"vocab {cfg.vocab_size}, batch {args.batch_size} ({tokens} tokens/step), {res['n_params']:,} params; "
        f"optax.adamw; random token batches",
        f"- protocol: {args.rounds} interleaved rounds x {args.steps} steps per variant (start rotates per round), "
        f"after a first call and {args.warmup} warmup steps; all steps jitted with the state donated",
        "- CPU timings on a shared 2-core machine with other jobs running: small differences (a few %) are within "
        "noise; XLA:CPU upcasts float16 dots to float32, so fp16 vs fp32 here says nothing about GPU speed.",
        "",
    ]


def _variant_rows(args, res) -> list[str]:
    tokens = args.batch_size * args.seq_len
    lines = harness.table(["variant", "median ms/step", "min-max ms/step over rounds", "tokens/s (median)",
                           "first call s", "first call - steady s", "trace s", "lower s", "XLA compile s",
                           "traces in run", "XLA compiles in run", "XLA bytes accessed MB", "XLA GFLOP"])
    for n, desc in VARIANTS.items():
        med, rounds, sec = res["median"][n], res["per_round"][n], res["secs"][n]
        lines.append(
            f"| ({n}) {desc} | {med * 1e3:.2f} | {harness.spread(rounds, 1e3, '.2f')} | "
            f"{tokens / med:,.0f} | {res['first_call'][n]:.2f} | {res['first_call'][n] - med:.2f} | "
            f"{sec['trace']:.2f} | {sec['lower']:.2f} | {sec['compile']:.2f} | {res['traces'][n]} | "
            f"{res['compiles'][n]} | {res['cost'][n]['bytes'] / 1e6:.1f} | {res['cost'][n]['flops'] / 1e9:.3f} |")
    return lines


def report(args, res, argv=None) -> str:
    """The markdown report of `run`'s results."""
    lines = [
        *_header(args, res, argv),
        *_variant_rows(args, res),
        "",
        f"Each variant ran {res['total_steps']} steps in one process. \"first call\" is the cold first step (trace, "
        "lower, compile, run); trace/lower/XLA compile seconds are the durations jax.monitoring reports for that "
        "variant's calls (summed if it compiled more than once); \"traces in run\" counts calls of its loss function "
        "at trace time, \"XLA compiles in run\" the backend compile events during its calls. \"XLA bytes accessed\" "
        "and \"XLA GFLOP\" are XLA's static cost model of the compiled step (`compiled.cost_analysis()`): "
        "deterministic, so they show the memory traffic the bookkeeping adds without the machine's noise.",
        "",
        "| ratio | of medians | of fastest rounds | per-round paired: median (min-max) | XLA bytes accessed | "
        "XLA flops |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| (a)/(b) jaxamp fp16 dynamic vs hand-written jmp static | {_ratio(res, 'a', 'b')} |",
        f"| (a)/(c) jaxamp fp16 dynamic vs Flax DynamicScale | {_ratio(res, 'a', 'c')} |",
        f"| (d)/(e) jaxamp fp32 NoOp vs plain optax fp32 | {_ratio(res, 'd', 'e')} |",
        "",
        "Notes:",
        "",
        "- (a) does more per step than (b): a dynamic scale (counter and growth/backoff update) instead of a "
        "constant one, the global gradient norm metric (summed in the same pass over the gradients as the finite "
        "check), per-leaf finite flags, `fold_in` of a per-step RNG key, and the step counter. (b) closes over "
        "`jmp.StaticLossScale`, which is an empty pytree (its scale is baked into the compiled step as a constant).",
        "- (d) against (e) is mostly the guard that (e) lacks: selecting new or old params and optimizer state by "
        "the finite flag reads the old state once more (about 3 passes over params-sized arrays in XLA's cost "
        "model), the price of leaving the state bitwise unchanged on a non-finite step.",
        f"- Overflowed (skipped) steps during the run: (a) {res['skipped']['a']}, (c) {res['skipped']['c']} "
        "(read back from the final loss-scale state).",
    ]
    if res["flax_default_traces"] is not None:
        lines.append(
            f"- Flax `DynamicScale()` with its default Python-scalar fields (weakly typed) traced "
            f"{res['flax_default_traces']} time(s) over 3 jitted steps; (c) above uses arrays with explicit dtypes "
            f"and traced {res['traces']['c']} time(s) over {res['total_steps']} steps.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.write_report(args.out, report(args, run(args), argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
