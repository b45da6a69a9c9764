"""A mixture-of-experts step timed on this machine's device, each policy against bf16 autocast, interleaved.

    python benchmarks/gpu_moe.py                                   # on a GPU: both MoE forms, default sizes
    python benchmarks/gpu_moe.py --tokens 256 --width 64 --hidden 128 --capacity 64 --rounds 2 --out /tmp/moe.md
                                                                   # CPU smoke test

The model is `gpu_compile_moe.py`'s (one top-1 MoE layer of `--experts` GELU experts between an input Dense and a
one-output head, float32 code under jaxamp's autocast policies), in its two forms: `einsum` (Switch-style one-hot
dispatch and combine, the experts as batched einsums over an experts axis) and `ragged_dot` (tokens sorted by
expert, the experts as `lax.ragged_dot` grouped matmuls). `gpu_compile_moe.py` shows what XLA:GPU compiles without
a GPU (the `ragged_dot` form expanded to a dense GEMM over every expert: 7.96x the FLOPs on jax 0.10.2); this
script times it. For each form every policy's jitted `train_step` is compiled first, then `harness.interleaved`
times `--steps` steps of each per round (each step waited for), rotating the order. Reported per form and policy:
the median step time, the median over rounds of its per-round ratio to `bf16;autocast` (above 1: faster), the
FP8 share of the precision audit and the GEMMs with FP8 operands in the compiled program (from its text), and the
device's peak memory where it reports one (`memory_stats()`, GPUs; peaks accumulate over the process, so forms and
policies run in the order given).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import harness  # noqa: E402
from benchmarks.gpu_compile_moe import MOE_SIZES, POLICIES, add_moe_flags, make_net  # noqa: E402
from benchmarks.gpu_step import custom_calls  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_moe.md"
BASELINE = "bf16;autocast"


def build(form: str, policy: str, args):
    """`(step, state, batch, audit, compiled text)` of one form under one policy, on the default device."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxamp

    net = make_net(form, args.experts, args.width, args.hidden, args.capacity)
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(kx, (1, args.tokens, 64)),  # f32[1, tokens, 64]
             "y": jax.random.normal(ky, (1, args.tokens))}  # f32[1, tokens]: a regression's targets

    def loss_fn(params, batch, rng=None):  # f32[]
        return jnp.mean(jnp.square(net.apply({"params": params}, batch["x"])[..., 0] - batch["y"]))

    state = jaxamp.TrainState.create(params=net.init(kp, batch["x"])["params"], tx=optax.adam(1e-3), policy=policy,
                                     loss_scale=jaxamp.NoOpLossScale(), rng=jax.random.key(1))
    audit = jaxamp.precision_audit(state, batch, loss_fn)
    step = jax.jit(jaxamp.train_step, static_argnames="loss_fn")
    text = step.lower(state, batch, loss_fn=loss_fn).compile().as_text()
    return (lambda s, b: step(s, b, loss_fn=loss_fn)), state, batch, audit, text


def _window(step, state, batch):
    """A `harness.interleaved` window: runs len(idx) steps, each waited for; returns their median seconds."""
    import jax

    carry = {"state": state}

    def window(idx: range) -> float:
        times = []
        for _ in idx:
            t = time.perf_counter()
            carry["state"], metrics = step(carry["state"], batch)
            jax.block_until_ready((carry["state"], metrics))
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    return window


def peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def time_form(form: str, policies: list[str], args) -> list[dict]:
    """One row per policy: step times interleaved against the others of the same form."""
    windows, rows = {}, {}
    for policy in policies:
        harness.log(f"{form} {policy}: compiling ...")
        step, state, batch, audit, text = build(form, policy, args)
        windows[policy] = _window(step, state, batch)
        calls = custom_calls(text)
        rows[policy] = {"form": form, "policy": policy, "fp8_share": audit.fp8_fraction,
                        "f8_gemm": calls["f8_gemm"], "gemm": calls["gemm"]}
    _, medians = harness.interleaved(windows, rounds=args.rounds, steps=args.steps, warmup=args.warmup + 1)
    base = medians.get(BASELINE)
    for policy, row in rows.items():
        row["ms"] = 1e3 * statistics.median(medians[policy])
        row["speedup"] = statistics.median(harness.paired_ratios(base, medians[policy])) if base else None
    rows[policies[-1]]["peak"] = peak_bytes()
    return list(rows.values())


def report(rows: list[dict], args, argv) -> str:
    import jax

    lines = ["# A mixture-of-experts step timed on the device, each policy against bf16 autocast", "",
             f"- command: `{harness.command_line(__file__, argv)}`", f"- machine: {harness.machine()}",
             f"- device: {jax.devices()[0].device_kind}", f"- date: {harness.now()}",
             f"- model: {args.tokens} tokens, width {args.width}, {args.experts} experts of hidden size "
             f"{args.hidden}, top-1, capacity {args.capacity} tokens per expert (einsum form)",
             f"- timing: {args.rounds} interleaved rounds of {args.steps} steps after {args.warmup} warm-up steps; "
             f"speed-up: the median over rounds of {BASELINE}'s step time over the policy's (above 1: faster)",
             "- FP8 GEMMs: GEMMs with FP8 operands in the compiled program's text; peak: the device's peak memory "
             "after the form's last policy (GPUs only)", ""]
    table = [[r["form"], r["policy"], f"{r['ms']:.2f}", "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
              f"{100 * r['fp8_share']:.1f}%", f"{r['f8_gemm']} / {r['gemm']}", harness.mib(r.get("peak"))]
             for r in rows]
    lines += harness.table(["form", "policy", "ms/step", "speed-up", "FP8 share (audit)", "FP8 GEMMs / GEMMs",
                            "peak MiB"], table, "llrrrrr")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_moe_flags(parser, POLICIES)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling (default: %(default)s)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the markdown table to write")
    args = parser.parse_args(argv)
    harness.check_sizes(parser, args, (*MOE_SIZES, "rounds", "steps"))
    harness.check_output(parser, "--out", args.out)
    rows = []
    for form in args.forms:
        rows += time_form(form, args.policies, args)
        harness.write_report(args.out, report(rows, args, argv if argv is not None else sys.argv[1:]),
                             echo=form == args.forms[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
