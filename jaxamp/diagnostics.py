"""Numerical-range diagnostics: will float16 or bfloat16 hold this model's activations and gradients?

Two tools, both run on the host after a few float32 (reference) forward or backward passes:

- `activation_ranges(model, params, batches)`: per layer (flax module path) the largest |activation| and the
  fractions of activations that float16 / bfloat16 would overflow, flush to zero or hold only as subnormals;
  `recommend_policy(report)` turns that into "fp16" (with dynamic loss scaling) or "bf16" and a one-line reason.
- `gradient_underflow(loss_fn, params, batches, loss_scale=...)`: why loss scaling exists (Micikevicius et al.,
  *Mixed Precision Training*, ICLR 2018, Figure 3). The gradients of the same batches are computed three times: in
  float32 (the reference), in float16 without scaling and in float16 with the loss scale; it reports which share of
  the gradient elements that are nonzero in float32 become exactly zero in float16, for the parameter gradients
  and for the activation gradients (the cotangents of every leaf module's output, Figure 3's quantity), with
  log2-magnitude histograms of the reference.

Rounding is round-to-nearest-even, as on every accelerator, so the thresholds here are exact, not approximate:

| | largest finite | to inf when \\|x\\| >= | smallest normal | smallest subnormal | to 0 when \\|x\\| <= |
| --- | --- | --- | --- | --- | --- |
| float16 | 65504 | 65520 (max + half an ulp) | 2^-14 ~ 6.1e-5 | 2^-24 ~ 5.96e-8 | 2^-25 ~ 2.98e-8 |
| bfloat16 | ~3.39e38 | (2 - 2^-8) 2^127 ~ 3.396e38 | 2^-126 ~ 1.18e-38 | 2^-133 ~ 9.2e-41 | 2^-134 ~ 4.6e-41 |

Values between the flush threshold and the smallest subnormal round up to it (100% relative error at worst); values
below the smallest normal are held as subnormals, with fewer significant bits the smaller they are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxamp.gradients import split_loss
from jaxamp.precision import leaf_path

PyTree = Any

__all__ = [
    "FORMATS",
    "FloatFormat",
    "range_fractions",
    "activation_ranges",
    "recommend_policy",
    "format_activation_table",
    "gradient_underflow",
    "LOG2_BINS",
]


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """The range of a half-precision format, with the exact rounding thresholds of a float32 -> format cast."""

    name: str
    max: float  # largest finite value
    overflow_at: float  # |x| >= this rounds to inf
    smallest_normal: float
    smallest_subnormal: float
    flush_at: float  # 0 < |x| <= this rounds to 0


FORMATS: dict[str, FloatFormat] = {
    "fp16": FloatFormat("float16", 65504.0, 65520.0, 2.0**-14, 2.0**-24, 2.0**-25),
    "bf16": FloatFormat("bfloat16", float(jnp.finfo(jnp.bfloat16).max), (2.0 - 2.0**-8) * 2.0**127, 2.0**-126,
                        2.0**-133, 2.0**-134),
}

_KINDS = ("overflow", "flush_to_zero", "below_normal")


def _host_f32(x) -> np.ndarray:
    """A float32 host copy (exact for float16/bfloat16/float32 inputs)."""
    return np.asarray(jax.device_get(x)).astype(np.float32, copy=False).reshape(-1)


def _range_counts(x) -> dict[str, int]:
    """Element counts behind `range_fractions` (integers, so several arrays can be summed exactly)."""
    a = np.abs(_host_f32(x))
    counts = {"size": int(a.size), "nonfinite": int(np.count_nonzero(~np.isfinite(a))),
              "nonzero": int(np.count_nonzero(a))}
    for key, fmt in FORMATS.items():
        nonzero = a > 0
        counts[f"{key}_overflow"] = int(np.count_nonzero(a >= fmt.overflow_at))  # inf counts; NaN compares False
        counts[f"{key}_flush_to_zero"] = int(np.count_nonzero(nonzero & (a <= fmt.flush_at)))
        counts[f"{key}_below_normal"] = int(np.count_nonzero(nonzero & (a < fmt.smallest_normal)))
    finite = a[np.isfinite(a)]
    counts["max_abs"] = float(finite.max()) if finite.size else 0.0  # type: ignore[assignment]
    return counts


def _fractions(counts: dict) -> dict:
    size = max(counts["size"], 1)
    out = {"size": counts["size"], "max_abs": counts["max_abs"], "nonfinite": counts["nonfinite"] / size}
    for key in FORMATS:
        for kind in _KINDS:
            out[f"{key}_{kind}"] = counts[f"{key}_{kind}"] / size
    return out


def range_fractions(x) -> dict:
    """How `x` (any float array, read as float32) would fare cast to float16 and to bfloat16.

    Fractions are of all elements of `x` (zeros included), for each format `f` in `fp16`, `bf16`:

    - `f_overflow`: would round to inf: |x| >= the format's overflow threshold (65520 for float16, i.e. above 65504
      by at least half an ulp); values already inf count as well;
    - `f_flush_to_zero`: nonzero but would round to exactly 0: 0 < |x| <= half the smallest subnormal;
    - `f_below_normal`: nonzero and below the smallest normal (6.1e-5 for float16): held as a subnormal with reduced
      precision, or flushed (includes `f_flush_to_zero`).

    Also `size` (elements), `max_abs` (largest finite |x|, 0.0 when none) and `nonfinite` (fraction inf or NaN; NaN
    counts nowhere else).
    """
    return _fractions(_range_counts(x))


# ---------------------------------------------------------------------------------------------------------------
# Activation ranges.


def _as_variables(params: PyTree) -> dict:
    """`{"params": params}`, unless `params` already is a variables dict with a "params" collection."""
    if isinstance(params, Mapping) and "params" in params:
        return dict(params)
    return {"params": params}


def _cast_floats(tree: PyTree, dtype) -> PyTree:
    """Floating leaves cast to `dtype`; leaves already in it are returned as they are (no eager op, no compile)."""

    def cast(x):
        x_dtype = jnp.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        if not jnp.issubdtype(x_dtype, jnp.floating) or x_dtype == jnp.dtype(dtype):
            return x
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


def _inputs(batch):
    """A batch is `(inputs, targets)` (jaxamp's LM batches) or the model inputs themselves."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class _CallRecorder:
    """A flax method interceptor that records, per module `__call__`, its path, output shape/dtype and leafness.

    Keys are module paths joined by "/" ("h_0/attn/c_attn"; the root module is "(output)"); a module called again
    gets "#1", "#2", ... Calls whose output is one of their inputs (Dropout when deterministic) and non-floating
    outputs are not recorded. With `perturb` (a dict key -> array), the recorded outputs listed in it come back
    with the array added: the gradient with respect to a zero perturbation is that activation's gradient, in the
    activation's own dtype.
    """

    def __init__(self, perturb: dict | None = None):
        self.perturb = perturb
        self.records: dict[str, dict] = {}  # insertion order = order in which calls completed
        self._stack: list[dict] = []
        self._calls: dict[str, int] = {}

    def __call__(self, next_fun, args, kwargs, context):
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if self._stack:
            self._stack[-1]["leaf"] = False
        frame = {"leaf": True}
        self._stack.append(frame)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            self._stack.pop()
        if not isinstance(out, jax.Array) or not jnp.issubdtype(out.dtype, jnp.floating):
            return out
        if any(out is a for a in args):  # identity (deterministic Dropout): nothing new to report
            return out
        path = "/".join(context.module.path) or "(output)"
        n = self._calls.get(path, 0)
        self._calls[path] = n + 1
        key = path if n == 0 else f"{path}#{n}"
        self.records[key] = {"shape": tuple(out.shape), "dtype": jnp.dtype(out.dtype), "leaf": frame["leaf"],
                             "module": type(context.module).__name__}
        if self.perturb is not None and key in self.perturb:
            out = out + self.perturb[key]
        return out


def _call_records(model: nn.Module, variables: dict, inputs, dtype, apply_kwargs: dict) -> dict[str, dict]:
    """Module call records (see `_CallRecorder`) of one forward pass with float params cast to `dtype` (no FLOPs)."""
    recorder = _CallRecorder()

    def fwd(v, x):
        with nn.intercept_methods(recorder):
            return model.apply(_cast_floats(v, dtype), x, **apply_kwargs)

    jax.eval_shape(fwd, variables, inputs)
    return recorder.records


def _keep_call(mdl, method_name) -> bool:
    return method_name == "__call__" and not isinstance(mdl, nn.Dropout)


@functools.partial(jax.jit, static_argnames=("model", "apply_kwargs"))
def _capture(model, apply_kwargs, variables, inputs):
    """Every non-Dropout submodule's `__call__` output (flax's `intermediates` collection)."""
    _, state = model.apply(variables, inputs, capture_intermediates=_keep_call, mutable=["intermediates"],
                           **dict(apply_kwargs))
    return state["intermediates"]


def activation_ranges(model: nn.Module, params: PyTree, batches: Sequence, *, apply_kwargs: dict | None = None,
                      compute_dtype=jnp.float16) -> list[dict]:
    """Per-layer activation ranges of a flax linen model over a few batches, computed in float32.

    Every submodule's `__call__` output is captured (`model.apply(..., capture_intermediates=..., mutable=
    ["intermediates"])`; Dropout is left out: it is an identity at inference). The float params are cast to float32
    first, so the figures are what the values *would* be before any rounding to half precision.

    Args:
      model: a flax linen module (e.g. `jaxamp.lm.model.TransformerLM`).
      params: its `params` collection (or a full variables dict holding one).
      batches: a non-empty sequence of batches: `(inputs, targets)` pairs (jaxamp's LM batches) or model inputs.
      apply_kwargs: extra keyword arguments for `model.apply` (e.g. `{"deterministic": True}`).
      compute_dtype: the half-precision compute dtype whose contract decides `float32_island` (below).

    Returns:
      One dict per layer, in the order the calls completed (children before parents)

        - `layer`: the module path, "h_0/mlp/c_fc" ("(output)" for the model's own output);
        - `module`: the module's class name; `shape`: one call's output shape; `calls`: number of captured calls;
        - `float32_island`: True when this output stays float32 even with the params cast to `compute_dtype` (the
          model keeps it in float32, e.g. jaxamp's float32 logits); such layers never see half precision and
          `recommend_policy` ignores them;
        - and the keys of `range_fractions` (`size`, `max_abs`, `nonfinite`, `fp16_overflow`, `fp16_flush_to_zero`,
          `fp16_below_normal`, and the same for `bf16`), over all batches and calls.

    Raises:
      ValueError: `batches` is empty.
    """
    if not batches:
        raise ValueError("batches is empty; pass at least one batch (e.g. jaxamp.lm.data.eval_batches(...))")
    apply_kwargs = dict(apply_kwargs or {})
    variables = _cast_floats(_as_variables(params), jnp.float32)
    first = _inputs(batches[0])
    half_records = _call_records(model, variables, first, compute_dtype, apply_kwargs)

    totals: dict[str, dict] = {}
    meta: dict[str, dict] = {}
    for batch in batches:
        inter = _capture(model, tuple(sorted(apply_kwargs.items())), variables, _inputs(batch))
        flat, _ = jax.tree_util.tree_flatten_with_path(inter)
        for path, value in flat:
            names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
            # [..module names.., "__call__", call index]
            cut = names.index("__call__")
            layer = "/".join(str(n) for n in names[:cut]) or "(output)"
            idx = getattr(path[cut + 1], "idx", 0) if len(path) > cut + 1 else 0
            call_key = layer if idx == 0 else f"{layer}#{idx}"
            counts = _range_counts(value)
            if layer not in totals:
                totals[layer] = counts
                meta[layer] = {"shape": tuple(value.shape), "calls": set(), "island": True, "module": ""}
            else:
                acc = totals[layer]
                for k, v in counts.items():
                    acc[k] = max(acc[k], v) if k == "max_abs" else acc[k] + v
            meta[layer]["calls"].add(idx)
            rec = half_records.get(call_key)
            # Unknown to the recorder (unusual call patterns): assume it runs in the compute dtype.
            meta[layer]["island"] &= bool(rec is not None and rec["dtype"] == jnp.dtype(jnp.float32))
            if rec is not None:
                meta[layer]["module"] = rec["module"]
    order = {k.split("#")[0]: i for i, k in reversed(list(enumerate(half_records)))}
    report = []
    for layer in sorted(totals, key=lambda k: (order.get(k, len(order)), k)):
        m = meta[layer]
        report.append({"layer": layer, "module": m["module"], "shape": m["shape"], "calls": len(m["calls"]),
                       "float32_island": m["island"], **_fractions(totals[layer])})
    return report


def recommend_policy(report: Sequence[dict]) -> tuple[str, str]:
    """The precision policy an `activation_ranges` report supports, and a one-line reason.

    "bf16" when float16 would overflow in any layer that computes in half precision (float32 islands are ignored);
    "fp32" when even bfloat16 would overflow there (or the float32 activations already hold inf/NaN); else "fp16",
    to be used with dynamic loss scaling (which keeps the *gradients* in float16's range; activations fit as
    reported).

    Raises:
      ValueError: the report is empty or holds only float32 islands.
    """
    layers = [r for r in report if not r["float32_island"]]
    if not layers:
        raise ValueError("the report holds no layer that computes in half precision; nothing to decide")
    nonfinite = [r for r in layers if r["nonfinite"] > 0]
    if nonfinite:
        return "fp32", (f"{len(nonfinite)} layers already hold inf/NaN in float32 (first: {nonfinite[0]['layer']}); "
                        f"fix the model or its inputs before choosing a half-precision policy")
    worst = max(layers, key=lambda r: r["max_abs"])
    bf16_over = [r for r in layers if r["bf16_overflow"] > 0]
    if bf16_over:
        return "fp32", (f"{len(bf16_over)} layers exceed even bfloat16's range (worst: {worst['layer']}, max |x| = "
                        f"{worst['max_abs']:.3g}); keep float32 compute")
    fp16_over = [r for r in layers if r["fp16_overflow"] > 0]
    if fp16_over:
        share = max(r["fp16_overflow"] for r in fp16_over)
        return "bf16", (f"float16 would overflow in {len(fp16_over)} of {len(layers)} layers (worst: {worst['layer']}, "
                        f"max |x| = {worst['max_abs']:.3g} > 65504; up to {share:.2%} of a layer's values); bfloat16 "
                        f"has float32's range")
    headroom = math.log2(FORMATS["fp16"].max / worst["max_abs"]) if worst["max_abs"] > 0 else math.inf
    below = max(layers, key=lambda r: r["fp16_below_normal"])
    return "fp16", (f"all activations fit float16 (largest |x| = {worst['max_abs']:.3g} in {worst['layer']}, "
                    f"{headroom:.1f} doublings below 65504; at most {below['fp16_below_normal']:.2%} of a layer's "
                    f"values below its smallest normal); use dynamic loss scaling for the gradients")


def format_activation_table(report: Sequence[dict]) -> str:
    """A markdown table of an `activation_ranges` report (percentages of each layer's elements)."""
    lines = ["| layer | module | shape | max \\|x\\| | fp16 overflow | fp16 flush to 0 | fp16 below normal | "
             "bf16 overflow | bf16 flush to 0 | bf16 below normal |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def pct(v: float) -> str:
        return "0" if v == 0 else f"{100 * v:.3g}%"

    for r in report:
        name = r["layer"] + (" (float32 island)" if r["float32_island"] else "")
        lines.append(
            f"| {name} | {r['module']} | {'x'.join(map(str, r['shape']))} | {r['max_abs']:.4g} | "
            f"{pct(r['fp16_overflow'])} | {pct(r['fp16_flush_to_zero'])} | {pct(r['fp16_below_normal'])} | "
            f"{pct(r['bf16_overflow'])} | {pct(r['bf16_flush_to_zero'])} | {pct(r['bf16_below_normal'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Gradient underflow (Micikevicius et al. 2018, Figure 3).

# Histogram bins: bin i holds nonzero |g| in [2^(LOG2_BINS[i]), 2^(LOG2_BINS[i] + 1)); the first and last bins also
# take everything below / above them. float32 reaches 2^-149, but gradients that small are vanishingly rare.
LOG2_BINS = np.arange(-80, 24)


def _log2_bin(a: np.ndarray) -> np.ndarray:
    """Bin index in LOG2_BINS of positive finite magnitudes `a` (exact: floor(log2 a) from the exponent bits)."""
    _, exp = np.frexp(a)  # a = m * 2^exp, m in [0.5, 1)
    return np.clip(exp.astype(np.int64) - 1 - LOG2_BINS[0], 0, len(LOG2_BINS) - 1)


def _stats(ref: list[np.ndarray], unscaled: list[np.ndarray], scaled: list[np.ndarray], names: list[str],
           loss_scale: float, fmt: FloatFormat) -> dict:
    """Flush-to-zero statistics of matching float32-reference / half-precision gradient arrays (host arrays), against
    the thresholds of `fmt` (the compute dtype's format)."""
    nbins = len(LOG2_BINS)
    total = {"size": 0, "nonzero": 0, "flushed_unscaled": 0, "flushed_scaled": 0, "nonfinite_unscaled": 0,
             "nonfinite_scaled": 0, "predicted_unscaled": 0, "predicted_scaled": 0}
    hist = {k: np.zeros(nbins, np.int64) for k in ("reference", "flushed_unscaled", "flushed_scaled")}
    per_leaf, max_abs = [], 0.0
    for name, r, u, s in zip(names, ref, unscaled, scaled):
        a = np.abs(r)
        nz = (a > 0) & np.isfinite(a)
        bins = _log2_bin(a[nz])
        flushed_u, flushed_s = nz & (u == 0), nz & (s == 0)
        counts = {
            "size": a.size, "nonzero": int(np.count_nonzero(nz)),
            "flushed_unscaled": int(np.count_nonzero(flushed_u)), "flushed_scaled": int(np.count_nonzero(flushed_s)),
            "nonfinite_unscaled": int(np.count_nonzero(~np.isfinite(u))),
            "nonfinite_scaled": int(np.count_nonzero(~np.isfinite(s))),
            # What rounding the float32 value itself to the compute dtype would flush (no error upstream).
            "predicted_unscaled": int(np.count_nonzero(nz & (a <= fmt.flush_at))),
            "predicted_scaled": int(np.count_nonzero(nz & (a <= fmt.flush_at / loss_scale))),
        }
        for k, v in counts.items():
            total[k] += v
        hist["reference"] += np.bincount(bins, minlength=nbins)
        hist["flushed_unscaled"] += np.bincount(bins[flushed_u[nz]], minlength=nbins)
        hist["flushed_scaled"] += np.bincount(bins[flushed_s[nz]], minlength=nbins)
        if counts["nonzero"]:
            max_abs = max(max_abs, float(a[nz].max()))
        per_leaf.append({"name": name, "size": counts["size"], "nonzero": counts["nonzero"],
                         "flushed_unscaled": counts["flushed_unscaled"] / max(counts["nonzero"], 1),
                         "flushed_scaled": counts["flushed_scaled"] / max(counts["nonzero"], 1)})
    nz = max(total["nonzero"], 1)
    size = max(total["size"], 1)
    # Largest power-of-two scale that keeps the largest float32 gradient below the compute dtype's max.
    safe = math.floor(math.log2(fmt.max / max_abs)) if max_abs > 0 else None
    return {
        "loss_scale": float(loss_scale),
        "size": total["size"],
        "nonzero_reference": total["nonzero"],
        "flushed_unscaled": total["flushed_unscaled"] / nz,
        "flushed_scaled": total["flushed_scaled"] / nz,
        "predicted_flush_unscaled": total["predicted_unscaled"] / nz,
        "predicted_flush_scaled": total["predicted_scaled"] / nz,
        "nonfinite_unscaled": total["nonfinite_unscaled"] / size,
        "nonfinite_scaled": total["nonfinite_scaled"] / size,
        "max_abs_reference": max_abs,
        "max_safe_log2_scale": safe,
        "log2_bins": LOG2_BINS.copy(),
        "counts_reference": hist["reference"],
        "counts_flushed_unscaled": hist["flushed_unscaled"],
        "counts_flushed_scaled": hist["flushed_scaled"],
        "per_leaf": per_leaf,
    }


def _flat_named(tree: PyTree) -> tuple[list[str], list]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [leaf_path(p) for p, _ in flat], [x for _, x in flat]


@functools.partial(jax.jit, static_argnames=("loss_fn", "dtype"))
def _scaled_grads(loss_fn, dtype, params, zeros, batch, scale, rng):
    """Gradients of `scale * loss_fn(params cast to dtype, batch, rng)` w.r.t. the params and the perturbations."""

    def scaled_loss(p, z):
        with nn.intercept_methods(_CallRecorder(perturb=z)):
            compute = p if dtype == jnp.dtype(jnp.float32) else _cast_floats(p, dtype)
            return split_loss(loss_fn(compute, batch, rng))[0] * scale

    return jax.grad(scaled_loss, argnums=(0, 1))(params, zeros)


def gradient_underflow(loss_fn: Callable, params: PyTree, batches: Sequence, *, loss_scale: float = 2.0**15,
                       compute_dtype=jnp.float16, rng=None) -> dict:
    """How many float32 gradient elements become exactly zero in half precision, without and with a loss scale.

    For each batch, one backward pass each: (a) float32 reference, `loss_fn(params, batch, rng)`; (b) params cast
    to `compute_dtype`, loss scale 1; (c) params cast to `compute_dtype`, loss multiplied by `loss_scale` (as
    `jaxamp.train_step` does). Each pass gives both

    - parameter gradients: with respect to the float32 master params (the float16 cotangent, cast to float32 by the
      cast's transpose, as in `train_step`), and
    - activation gradients: with respect to a zero added to the output of every leaf flax module called inside
      `loss_fn` whose output is in `compute_dtype` in pass (b) (Dense, Embed, LayerNorm, ...: float32 islands and
      identities such as Dropout are skipped). These are the half-precision cotangents the backward pass carries,
      the quantity of Micikevicius et al.'s Figure 3. Empty when `loss_fn` calls no flax module.

    An element counts as flushed when it is nonzero in (a) and exactly zero in (b) or (c); it may have been rounded
    to zero itself or have lost its value upstream in the backward pass.

    Args:
      loss_fn: `loss_fn(params, batch, rng) -> f32[] loss` (or `(loss, aux)`), jaxamp's contract (e.g.
        `jaxamp.lm.setup.make_loss_fn(model)`); it must be deterministic for `rng=None`.
      params: float32 master params.
      batches: a list of batches (each as `loss_fn` takes it); statistics are summed over them.
      loss_scale: the scale of pass (c), e.g. `DynamicLossScale`'s initial 2**15.
      compute_dtype: float16 (default) or bfloat16; the flush and overflow thresholds are that format's.
      rng: passed to `loss_fn` (None: deterministic).

    Returns:
      `{"params": stats, "activations": stats}`; `stats` has `loss_scale`, `size` (elements), `nonzero_reference`
      (nonzero in float32), `flushed_unscaled` and `flushed_scaled` (fractions of the nonzero reference elements
      that are 0 in (b) / (c)), `predicted_flush_unscaled` / `_scaled` (fractions whose float32 value, times the
      scale, is <= the format's flush threshold, 2^-25 for float16 and 2^-134 for bfloat16, i.e. rounds to 0 by
      itself), `nonfinite_unscaled` / `_scaled` (fractions of all elements that are inf/NaN), `max_abs_reference`,
      `max_safe_log2_scale` (largest k with max|g| * 2^k <= the format's max, 65504 for float16: the headroom),
      `log2_bins` (lower edges: bin i holds |g| in [2^bins[i], 2^(bins[i]+1))), `counts_reference` (nonzero
      float32 gradients per bin), `counts_flushed_unscaled` / `_scaled` (of those, flushed in (b) / (c)) and
      `per_leaf` (per parameter / per module output: name, size, nonzero, flushed fractions).

    Raises:
      ValueError: `batches` is not a non-empty list (a bare `(inputs, targets)` pair would be ambiguous: wrap it,
        `[batch]`), `loss_scale` is not finite and > 0, or `compute_dtype` is neither float16 nor bfloat16.
    """
    formats = {jnp.dtype(FORMATS[k].name): FORMATS[k] for k in FORMATS}
    if jnp.dtype(compute_dtype) not in formats:
        raise ValueError(f"compute_dtype must be float16 or bfloat16, got {jnp.dtype(compute_dtype)}")
    fmt = formats[jnp.dtype(compute_dtype)]
    if not isinstance(batches, list) or not batches:
        raise ValueError("batches must be a non-empty list of batches; wrap a single batch as [batch]")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale must be finite and > 0, got {loss_scale!r}")
    params = _cast_floats(params, jnp.float32)

    # Discover the perturbable module outputs once, with the params in the compute dtype (no FLOPs).
    recorder = _CallRecorder()

    def probe(p, batch):
        with nn.intercept_methods(recorder):
            return split_loss(loss_fn(_cast_floats(p, compute_dtype), batch, rng))[0]

    jax.eval_shape(probe, params, batches[0])
    sites = {k: r for k, r in recorder.records.items() if r["leaf"] and r["dtype"] == jnp.dtype(compute_dtype)}

    passes = {"reference": (jnp.dtype(jnp.float32), 1.0), "unscaled": (jnp.dtype(compute_dtype), 1.0),
              "scaled": (jnp.dtype(compute_dtype), float(loss_scale))}
    host: dict[str, dict[str, list]] = {w: {k: [] for k in passes} for w in ("params", "activations")}
    names = {}
    for batch in batches:
        for name, (dtype, scale) in passes.items():
            zeros = {k: np.zeros(r["shape"], dtype) for k, r in sites.items()}  # host arrays: no eager op
            g_params, g_act = _scaled_grads(loss_fn, dtype, params, zeros, batch, np.float32(scale), rng)
            pnames, pleaves = _flat_named(g_params)
            anames = sorted(g_act, key=list(sites).index)
            names = {"params": pnames, "activations": anames}
            host["params"][name].append([_host_f32(x) for x in pleaves])
            host["activations"][name].append([_host_f32(g_act[k]) for k in anames])
    result = {}
    for what in ("params", "activations"):
        per = {k: [np.concatenate(arrs) if arrs else np.zeros(0, np.float32) for arrs in zip(*host[what][k])]
               for k in passes}
        result[what] = _stats(per["reference"], per["unscaled"], per["scaled"], names[what], loss_scale, fmt)
    return result
