"""What a cast policy leaves in float32: the matmuls of a trial's gradient program, by operand dtype.

`matmul_dtypes(trial, policy)` casts the trial's float32 params with `policy.cast_to_compute` (what
`jaxamp.train_step` does before calling the loss), traces `jax.grad` of the loss (taken as float32, as jaxamp takes
it) with `jax.make_jaxpr`, walks every equation (sub-jaxprs of jit, scan, cond, remat, custom_vjp/jvp included) and
counts the `dot_general` and `conv_general_dilated` equations by the dtypes of their two operands: "float32" (both),
"bfloat16" (both), "float16" (both), else "mixed". It asserts nothing: silent float32 fall-backs are the finding.

The trace runs first under `jax_numpy_dtype_promotion="strict"` (the test suite's setting) and, where that raises
(a bf16 param meeting a float32 input or constant inside the model), again under "standard", a user's default; the
result says which (`promotion`) and why strict failed (`strict_error`).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jex_core

MATMULS = ("dot_general", "conv_general_dilated")


def _sub_jaxprs(value):
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def iter_eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside its equations' params, depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from iter_eqns(sub)


def count_matmuls(closed_jaxpr) -> dict:
    """{"float32": n, "bfloat16": n, "float16": n, "mixed": n, "total": n, "by_primitive": {...}}."""
    counts = collections.Counter()
    by_prim = collections.Counter()
    for eqn in iter_eqns(closed_jaxpr.jaxpr):
        if eqn.primitive.name not in MATMULS:
            continue
        a, b = (v.aval.dtype for v in eqn.invars[:2])
        kind = str(a) if a == b and str(a) in ("float32", "bfloat16", "float16") else "mixed"
        counts[kind] += 1
        by_prim[f"{eqn.primitive.name}:{kind}"] += 1
    out = {k: counts.get(k, 0) for k in ("float32", "bfloat16", "float16", "mixed")}
    out["total"] = sum(counts.values())
    out["by_primitive"] = dict(sorted(by_prim.items()))
    return out


def _loss_only(out):
    loss = out[0] if isinstance(out, tuple) else out
    return jnp.asarray(loss, jnp.float32)


def grad_jaxpr(trial, policy, key=None):
    """`jax.make_jaxpr(jax.grad(loss))` at the params cast by `policy.cast_to_compute`."""
    key = jax.random.key(0) if key is None else key
    batch = trial.make_batch(key)
    rng = jax.random.key_data(jax.random.key(1))
    if trial.kind == "nnx":
        graphdef, params, rest = nnx.split(trial.model, nnx.Param, ...)
        # plain arrays, merged into a fresh model inside the traced function (as jaxamp.nnx does), so the model's
        # in-place updates (BatchNorm statistics) happen at the trace that owns its variables
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

        def loss(p):
            return _loss_only(trial.loss_fn(nnx.merge(graphdef, p, rest), batch))
    else:
        params = trial.params

        def loss(p):
            return _loss_only(trial.loss_fn(p, batch, rng))

    return jax.make_jaxpr(jax.grad(loss))(policy.cast_to_compute(params))


def matmul_dtypes(trial, policy) -> dict:
    """`count_matmuls` of the trial's gradient program under `policy`, plus the promotion mode it traced under."""
    try:
        with jax.numpy_dtype_promotion("strict"):
            result = count_matmuls(grad_jaxpr(trial, policy))
        result.update(promotion="strict", strict_error="")
    except Exception as err:  # noqa: BLE001 -- TypePromotionError and kin: record and retrace as a user would
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        with jax.numpy_dtype_promotion("standard"):
            result = count_matmuls(grad_jaxpr(trial, policy))
        result.update(promotion="standard", strict_error=f"{type(err).__name__}: {first[:160]}")
    return result


def markdown_table(results: dict[str, dict]) -> str:
    """One row per trial: float32 / bf16 / mixed matmul counts."""
    lines = ["| model | kind | matmuls | float32 | bfloat16 | mixed | traced under |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, (kind, r) in results.items():
        lines.append(f"| {name} | {kind} | {r['total']} | {r['float32']} | {r['bfloat16']} | {r['mixed']} | "
                     f"{r['promotion']} |")
    return "\n".join(lines)
