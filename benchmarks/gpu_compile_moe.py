"""What XLA:GPU compiles for a mixture-of-experts step on an H200, on a machine without a GPU (deviceless AOT compile).

    pip install "jax[cuda13]==$(python -c 'import jax; print(jax.__version__)')"   # XLA's GPU compiler (the plugin)
    python benchmarks/gpu_compile_moe.py                       # both MoE forms, bf16 autocast and the FP8 recipes
    python benchmarks/gpu_compile_moe.py --tokens 512 --width 128 --hidden 512 --out /tmp/moe.md   # quick

One MoE layer (top-1 routing to `--experts` experts, each a GELU MLP of width `--width` and hidden size `--hidden`)
between an input Dense and a one-output head, float32 code under jaxamp's autocast policies, in the two forms MoE
code takes in JAX:

* `einsum`: Switch-Transformer dispatch (one-hot dispatch and combine tensors, `--capacity` tokens per expert), the
  experts as batched einsums over an experts axis (Flaxformer's, MaxText's dense path);
* `ragged_dot`: the tokens sorted by expert and the experts as `lax.ragged_dot` grouped matmuls (MaxText's GPU
  path).

For each form and policy the jitted train step is lowered on abstract arrays placed on a deviceless H200 topology
(`gpu_compile.py`'s) and compiled by the JAX CUDA plugin's XLA:GPU compiler: nothing runs. Reported: the GEMMs with
FP8 operands and all GEMMs (counted in the program text), the FLOPs of the compiled program's dots against the
FLOPs the precision audit counts for the step (a ratio above 1: XLA computes more than the model asks, as a
`ragged_dot` expanded to a dense GEMM over every expert's weights does), and `memory_analysis()`'s temporary bytes.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import harness  # noqa: E402
from benchmarks.gpu_compile import h200_sharding, traced_as_on_a_gpu  # noqa: E402
from benchmarks.gpu_step import custom_calls  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_compile_moe.md"
FORMS = ("einsum", "ragged_dot")
POLICIES = ("bf16;autocast", "fp8-current", "fp8-current-pow2", "fp8-block")


def make_net(form: str, experts: int, width: int, hidden: int, capacity: int):
    """The model: Dense(width) -> LayerNorm -> MoE (residual) -> Dense(1) named `head`, float32 code."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class EinsumMoE(nn.Module):
        @nn.compact
        def __call__(self, x):  # f32[1, tokens, width]
            probs = jax.nn.softmax(nn.Dense(experts, use_bias=False, name="router")(x), -1)  # [g, s, e]
            mask = jax.nn.one_hot(jnp.argmax(probs, -1), experts)  # [g, s, e]
            slot = jnp.cumsum(mask, axis=1) * mask - 1.0  # each token's place in its expert's buffer
            mask = mask * (slot < capacity).astype(mask.dtype)
            slot = jax.nn.one_hot(jnp.sum(slot * mask, -1).astype(jnp.int32), capacity)  # [g, s, c]
            dispatch = mask[..., None] * slot[:, :, None, :]  # [g, s, e, c]
            combine = dispatch * jnp.sum(probs * mask, -1)[..., None, None]
            w_in = self.param("w_in", nn.initializers.lecun_normal(), (experts, width, hidden))
            w_out = self.param("w_out", nn.initializers.lecun_normal(), (experts, hidden, width))
            h = nn.gelu(jnp.einsum("egcd,edf->egcf", jnp.einsum("gsec,gsd->egcd", dispatch, x), w_in))
            return x + jnp.einsum("gsec,egcd->gsd", combine, jnp.einsum("egcf,efd->egcd", h, w_out))

    class RaggedMoE(nn.Module):
        @nn.compact
        def __call__(self, x):  # f32[1, tokens, width]
            x = x[0]
            gate, chosen = jax.lax.top_k(nn.Dense(experts, use_bias=False, name="router")(x), 1)  # [t, 1]
            order = jnp.argsort(chosen[:, 0])  # the tokens grouped by expert
            sizes = jnp.bincount(chosen[:, 0], length=experts).astype(jnp.int32)
            w_in = self.param("w_in", nn.initializers.lecun_normal(), (experts, width, hidden))
            w_out = self.param("w_out", nn.initializers.lecun_normal(), (experts, hidden, width))
            h = nn.gelu(jax.lax.ragged_dot(x[order], w_in, sizes))  # [t, hidden]
            y = jax.lax.ragged_dot(h, w_out, sizes) * jax.nn.sigmoid(gate[order])
            return (x + jnp.zeros_like(x).at[order].add(y))[None]

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):  # f32[1, tokens, 64] -> f32[1, tokens, 1]
            x = nn.Dense(width, name="up")(x)
            moe = EinsumMoE(name="moe") if form == "einsum" else RaggedMoE(name="moe")
            return nn.Dense(1, name="head")(moe(nn.LayerNorm()(x)))

    return Net()


_COMPUTATION = re.compile(r"^(?:%\S+|ENTRY \S+) \((.*)\) -> ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]")
_DOT = re.compile(r"= \w+\[([\d,]*)\]\S* dot\(%([^,\s]+), %[^,)\s]+\).*?lhs_contracting_dims=\{([\d,]*)\}")


def dot_flops(hlo_text: str) -> int:
    """2 x output elements x contracted size, summed over the `dot` instructions of the compiled text (each
    computation once)."""
    shapes, total = {}, 0
    dims = lambda s: [int(d) for d in s.split(",") if d]  # noqa: E731
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            shapes = {n: dims(s) for n, s in re.findall(r"(\S+): \w+\[([\d,]*)\]", header.group(1))}
            continue
        m = _INSTR.match(line)
        if m:
            shapes[m.group(1)] = dims(m.group(2))
        d = _DOT.search(line)
        if d:
            lhs = shapes.get(d.group(2), [])
            total += 2 * math.prod(dims(d.group(1))) * math.prod(lhs[i] for i in dims(d.group(3)) if i < len(lhs))
    return total


def compile_one(form: str, policy: str, args, sharding) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import jaxamp

    net = make_net(form, args.experts, args.width, args.hidden, args.capacity)
    x = jax.ShapeDtypeStruct((1, args.tokens, 64), jnp.float32)
    batch = {"x": x, "y": jax.ShapeDtypeStruct((1, args.tokens), jnp.float32)}

    def loss_fn(params, batch, rng=None):  # a regression: f32[]
        return jnp.mean(jnp.square(net.apply({"params": params}, batch["x"])[..., 0] - batch["y"]))

    def make_state(params):
        return jaxamp.TrainState.create(params=params, tx=optax.adam(1e-3), policy=policy,
                                        loss_scale=jaxamp.NoOpLossScale(), rng=jax.random.PRNGKey(0))

    placed = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    with traced_as_on_a_gpu():
        state = jax.eval_shape(make_state, jax.eval_shape(net.init, jax.random.key(0), x)["params"])
        audit = jaxamp.precision_audit(state, batch, loss_fn)
        t0 = time.perf_counter()
        compiled = jax.jit(jaxamp.train_step, static_argnames="loss_fn").lower(
            placed(state), placed(batch), loss_fn=loss_fn).compile()
        compile_s = time.perf_counter() - t0
    text, mem = compiled.as_text(), compiled.memory_analysis()
    return {"form": form, "policy": policy, "calls": custom_calls(text), "dot_flops": dot_flops(text),
            "audit_flops": sum(r["flops"] for r in audit.rows), "fp8_share": audit.fp8_fraction,
            "temp": None if mem is None else mem.temp_size_in_bytes, "compile_s": compile_s}


def report(rows: list[dict], args, argv) -> str:
    lines = ["# What XLA:GPU compiles for an MoE step on an H200 (deviceless: compiled, not run)", "",
             f"- command: `{harness.command_line(__file__, argv)}`", f"- machine: {harness.machine(backend=False)}",
             f"- date: {harness.now()}",
             f"- model: {args.tokens} tokens, width {args.width}, {args.experts} experts of hidden size "
             f"{args.hidden}, top-1, capacity {args.capacity} tokens per expert (einsum form)",
             "- GEMMs counted in the compiled program's text; FLOPs: the compiled dots' against the precision "
             "audit's (the model's matmuls, forward and backward); temp from `memory_analysis()`", ""]
    table = [[r["form"], r["policy"], f"{100 * r['fp8_share']:.1f}%", str(r["calls"]["f8_gemm"]),
              str(r["calls"]["gemm"]), f"{r['dot_flops'] / 1e9:,.1f}", f"{r['audit_flops'] / 1e9:,.1f}",
              f"{r['dot_flops'] / r['audit_flops']:.2f}", harness.mib(r["temp"]), f"{r['compile_s']:.1f}"]
             for r in rows]
    lines += harness.table(["form", "policy", "FP8 share (audit)", "FP8 GEMMs", "GEMMs", "compiled GFLOP",
                            "audit GFLOP", "compiled / audit", "temp MiB", "compile s"], table, "llrrrrrrrr")
    return "\n".join(lines) + "\n"


MOE_SIZES = ("tokens", "width", "hidden", "experts", "capacity")


def add_moe_flags(parser: argparse.ArgumentParser, policies: tuple[str, ...]) -> None:
    """The model's flags (`--forms`, `--policies` among `policies`, the MoE layer's sizes: `MOE_SIZES`), shared
    with `gpu_moe.py`."""
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--policies", nargs="+", choices=policies, default=list(policies))
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (default: %(default)s)")
    parser.add_argument("--width", type=int, default=1024, help="model width (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=4096, help="each expert's hidden size (default: %(default)s)")
    parser.add_argument("--experts", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--capacity", type=int, default=1024,
                        help="tokens per expert, einsum form (default: %(default)s: 2x an even share of 4096)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_moe_flags(parser, POLICIES)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the markdown table to write")
    args = parser.parse_args(argv)
    harness.check_sizes(parser, args, MOE_SIZES)
    harness.check_output(parser, "--out", args.out)
    try:
        sharding = h200_sharding()
    except RuntimeError as e:
        parser.exit(2, f"{parser.prog}: {e}\n")
    rows = []
    for form in args.forms:
        for policy in args.policies:
            harness.log(f"{form} {policy} ...")
            rows.append(compile_one(form, policy, args, sharding))
            harness.write_report(args.out, report(rows, args, argv if argv is not None else sys.argv[1:]),
                                 echo=(form, policy) == (args.forms[-1], args.policies[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
