"""The per-primitive rules of `jaxamp.autocast`: op classes, casts and the first-order re-binding rules.

`jaxamp.autocasting`'s module docstring states the rules for users; this module implements those that re-bind one
first-order primitive (no inner jaxpr). The higher-order rules (jit, scan, while, cond, remat, custom_jvp,
custom_vjp, shard_map) call back into the interpreter and live in `jaxamp.autocasting`.

Every rule has the signature `rule(eqn, vals, mode, bounds) -> list` where `eqn` is the original `JaxprEqn`, `vals`
are the rewritten input values (tracers or arrays, whose dtypes may differ from `eqn.invars`' avals), `mode` is a
`Mode` and `bounds` gives, per input, the largest finite magnitude of an input known to be a constant (a Literal, or
a broadcast of one), else None. It returns one value per `eqn.outvars`.

The op classes follow torch.amp's CUDA autocast op lists
(https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float16): "lower precision" ops are the
matmul class here, "float32" ops the float32 class, "promote to the widest input type" (and torch's default for
unlisted ops, which run in their inputs' promoted type) the widest class.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core
from jax.extend import source_info_util

from jaxamp import fp8_grouped
from jaxamp.fp8_recipes import fp8_dot_general

__all__ = [
    "FLOAT32_OPS",
    "MATMUL_OPS",
    "PASSTHROUGH_OPS",
    "WIDEST_OPS",
    "AutocastError",
    "Mode",
    "WEIGHT_SCOPE",
    "contracts_nothing",
    "exclusion_names",
    "frame_names",
    "moved_axis",
    "scope_names",
    "selects",
    "weight_path",
]

F32 = np.dtype(jnp.float32)
BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)
ELIGIBLE = frozenset({F32, BF16, F16})  # torch.amp's "eligible" floats: float64 and the float8s are never autocast

# Matmul class: floating operands cast to the compute dtype, result in the compute dtype.
MATMUL_OPS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})

# Float32 class: floating inputs cast to float32, result float32 (torch.amp's "autocast to float32" list, as far as it
# maps to JAX primitives, plus sqrt/cbrt/exp2/cumlogsumexp). `square` and integer_pow with an exponent other than 0
# and 1 join it, as torch's `pow` and `reciprocal` (a float16 square overflows from |x| = 256: a BatchNorm or RMSNorm
# variance of inputs above 256 would be inf).
FLOAT32_OPS = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "pow", "sqrt", "rsqrt", "cbrt", "reciprocal", "tan", "sinh", "cosh",
    "asin", "acos", "erf_inv", "square", "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
})

# Widest class: floating inputs that must agree are cast to the widest floating dtype among them (torch.amp's
# "promote" rule; Literals, weak-typed values and scalars don't widen, see `widest_dtype`).
WIDEST_OPS = frozenset({
    # elementwise arithmetic and functions
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "floor", "ceil", "round",
    "nextafter", "atan2", "tanh", "logistic", "sin", "cos", "atan", "asinh", "acosh", "atanh", "erf", "erfc",
    "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta", "bessel_i0e", "bessel_i1e",
    "regularized_incomplete_beta", "integer_pow", "is_finite", "reduce_precision", "real", "imag", "conj",
    # selection and comparison
    "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to", "lt_to",
    "and", "or", "not", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical", "population_count", "clz",
    # structural
    "concatenate", "pad", "gather", "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
    "scatter-max", "dynamic_slice", "dynamic_update_slice", "slice", "reshape", "transpose", "broadcast_in_dim",
    "squeeze", "rev", "split", "tile", "broadcast_to", "zeros_like", "copy", "iota",
    # reductions, scans, sorting (except reduce_sum/prod, cumsum/prod: float32 class)
    "reduce_max", "reduce_min", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin", "cummax", "cummin",
    "top_k", "reduce_window_sum", "reduce_window_max", "reduce_window_min", "select_and_scatter_add",
    "select_and_gather_add",
    # sharding, gradients, random bits
    "sharding_constraint", "reshard", "mesh_cast", "stop_gradient", "random_bits", "random_seed", "random_wrap",
    "random_unwrap", "random_fold_in", "random_split", "random_clone", "threefry2x32", "rng_bit_generator",
    "rng_uniform", "axis_index",
})

# Elementwise arithmetic that runs in float32 where only float32-class ops read its result (`upcast_eqns`): the
# shift of a softmax or log-softmax by its max (`x - max(x)` before the exp), a scale before an exp, as torch.amp's
# softmax and log_softmax upcast their input before they shift it.
UPCAST_OPS = frozenset({"add", "sub", "mul", "div", "neg", "max", "min"})

# Passthrough: operands are independent (no agreement needed): re-bound with their current dtypes, no casts.
PASSTHROUGH_OPS = frozenset({
    "sort", "optimization_barrier", "device_put", "name", "psum", "pmax", "pmin", "psum_invariant", "all_gather",
    "all_gather_invariant", "all_to_all", "ppermute", "pvary", "pbroadcast", "reduce_scatter",
})

_SCATTERS = frozenset({"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"})


class AutocastError(RuntimeError):
    """A primitive that autocast (or float32_reference) could not rewrite; the message names it and its source."""


@dataclasses.dataclass(frozen=True)
class Mode:
    """What the interpreter rewrites to.

    Attributes:
      compute: the half-precision compute dtype (bfloat16 or float16) of `autocast`; None in `float32_reference`
        mode, where every floating value is float32 and matmuls run at `Precision.HIGHEST`.
      fp8: a `jaxamp.fp8_recipes.Recipe` for the weight matmuls (`fp8_applies`), or None.
      fp8_exclude: compiled regular expressions; a matmul with a name on its name stack (a Flax module's name, a
        `jax.named_scope`) that one matches keeps the compute dtype.
      float32_results: compiled regular expressions over the same names (`exclusion_names`); a `dot_general` that one
        matches (the output head) takes compute-dtype operands and writes its result in float32
        (`float32_result_dot`).
      named_params: the function's first positional argument (or `params=`) holds arrays (`loss_fn(params, ...)`,
        `model.apply(variables, ...)`; `autocasting._param_path` names their leaves): an FP8 weight matmul must then
        have an operand carrying such a name (`WEIGHT_SCOPE`, `carried_name`), so a product of two activations (a
        contrastive similarity matrix) keeps the compute dtype.
    """

    compute: np.dtype | None
    fp8: Any = None
    fp8_exclude: tuple = ()
    float32_results: tuple = ()
    named_params: bool = False

    @property
    def reference(self) -> bool:
        return self.compute is None

    def fixed_dtype(self, dtype) -> np.dtype:
        """The dtype a value that keeps its original dtype (a loop carry, an opaque op's input) has in this mode."""
        return F32 if self.reference and is_low_float(dtype) else dtype


# ----------------------------------------------------------------------------------------------------- dtype helpers


def dtype_of(x):
    """The dtype JAX gives `x` (a tracer, array, numpy value or Python scalar; x64-canonicalised; keys' too)."""
    return jax.typeof(x).dtype


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def is_low_float(dtype) -> bool:
    """A floating dtype narrower than float32 (bfloat16, float16, the float8s/float4s): float32_reference widens it."""
    return is_float(dtype) and np.dtype(dtype).itemsize < 4


def cast(x, dtype):
    """`x` as `dtype` (unchanged when it already has it); a `convert_element_type` in the current trace."""
    return x if dtype_of(x) == dtype else lax.convert_element_type(x, dtype)


def strong_cast(x, dtype):
    """`cast` that also makes a weak-typed `x` strong: loop carries must keep one exact type."""
    if dtype_of(x) == dtype and not jax.typeof(x).weak_type:
        return x
    return lax.convert_element_type(x, dtype)


def tangent_dtype(dtype) -> np.dtype:
    """The tangent dtype of a primal dtype (float0 for integers, booleans and keys)."""
    return np.dtype(dtype) if jnp.issubdtype(dtype, jnp.inexact) else np.dtype(jax.dtypes.float0)


def widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The widest of some eligible floats: float32 if any is float32, or if bfloat16 meets float16."""
    kinds = set(dtypes)
    return next(iter(kinds)) if len(kinds) == 1 else F32


def _is_weak(var, x) -> bool:
    """A Literal or a weak-typed value (Python scalars and what JAX derives from them): it does not widen an op."""
    return isinstance(var, jex_core.Literal) or jax.typeof(x).weak_type


_TRACER = getattr(jax.core, "Tracer", None) or jax._src.core.Tracer


def const_bound(x) -> float | None:
    """The largest finite magnitude of a known (non-traced, small) constant value, else None."""
    if isinstance(x, _TRACER) or np.size(x) > 64 or not is_float(dtype_of(x)):
        return None
    value = np.abs(np.asarray(x, dtype=np.float64))
    return float(np.max(value[np.isfinite(value)], initial=0.0))


# The ops whose output holds the values of their (first) input: a constant's bound carries through them.
BOUND_PRESERVING = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "transpose", "copy"})

# Ops whose output is a view of their first input's values (a param cast, transposed or resharded is still that
# param; so is a target network's `lax.stop_gradient(params)`, DQN's or BYOL's): the interpreter carries an input's
# param path through them to the matmul that uses it.
NAME_PRESERVING = BOUND_PRESERVING | {"sharding_constraint", "reshard", "mesh_cast", "pvary", "device_put",
                                      "stop_gradient"}

# Ops that take a slice of their first input (a layer's weights out of a stack: `w[i]`, `fori_loop`'s
# `dynamic_slice`): still that param, for the matmul that uses it.
NAME_SLICING = frozenset({"slice", "dynamic_slice"})
# Elementwise ops whose result, of a named input's own shape, is that param transformed (weight normalisation's
# `v * g / |v|`, LoRA's `W + A @ B`, a weight mask).
NAME_COMBINING = frozenset({"add", "add_any", "sub", "mul", "div"})


def carried_name(eqn, names: Sequence) -> str | None:
    """The param path `eqn`'s first output carries from its inputs' (`names`, per input), or None: through
    `NAME_PRESERVING` and `NAME_SLICING` ops from the first input (a `broadcast_in_dim` only where it adds size-1
    dims, not where it copies the param onto a batch), through `NAME_COMBINING` ops from an input of the
    output's shape (not a bias or a scale broadcast onto an activation), through a `concatenate` of params only
    (Flax's `OptimizedLSTMCell` joins its four gates' kernels; a fused QKV) as their paths joined by `+`."""
    name = eqn.primitive.name
    if not names:
        return None
    if name == "concatenate":
        return "+".join(names) if all(names) else None
    if name == "broadcast_in_dim" and eqn.outvars[0].aval.size != eqn.invars[0].aval.size:
        return None  # a param copied onto a batch (DETR's, a Perceiver's learned queries) is an activation
    if name in NAME_PRESERVING or name in NAME_SLICING:
        return names[0]
    if name in NAME_COMBINING:
        shape = eqn.outvars[0].aval.shape
        return next((n for n, v in zip(names, eqn.invars) if n is not None and v.aval.shape == shape), None)
    return None


# The name-stack entry `jaxamp.autocast` puts around a matmul whose operand is a param argument:
# `jaxamp_weight:<path>` (`"head.kernel"`, `"params.decoder.logitdense.kernel"`, `"lm_head.weight"`). JAX keeps it
# on the backward matmuls it derives, so the audit and `fp8_exclude` see the weight in both passes.
WEIGHT_SCOPE = "jaxamp_weight"


def widest_dtype(eqn, vals, bounds=None) -> np.dtype | None:
    """The dtype an op of the widest class computes in: the widest eligible floating dtype among its inputs.

    Literals and weak-typed inputs (Python scalars, `jnp.where(m, x, 0.0)`'s 0.0) don't widen, as torch's wrapped
    numbers don't, unless every floating input is one, or a constant one would overflow the narrower dtype
    (`jnp.where(m, x, -1e9)` or `finfo(float32).min` in float16): then it counts.

    Returns:
      The dtype, or None when the op has no eligible floating input.
    """
    bounds = bounds or [None] * len(vals)
    floats = [(var, x, dtype_of(x), b) for var, x, b in zip(eqn.invars, vals, bounds) if dtype_of(x) in ELIGIBLE]
    if not floats:
        return None
    strong = [d for var, x, d, _ in floats if not _is_weak(var, x)]
    target = widest(strong or [d for _, _, d, _ in floats])
    limit = float(jnp.finfo(target).max)
    big = [d for var, x, d, b in floats if _is_weak(var, x) and ((const_bound(x) if b is None else b) or 0.0) > limit]
    return widest([target, *big])


# ---------------------------------------------------------------------------------------------------- binding helpers


def bind(eqn, vals, params: dict | None = None) -> list:
    """Binds `eqn`'s primitive on `vals` with `params` (default: the eqn's own), as `jax.core.eval_jaxpr` does."""
    prim = eqn.primitive
    out = prim.bind(*vals, **prim.get_bind_params(eqn.params if params is None else params))
    return list(out) if prim.multiple_results else [out]


def checked_bind(eqn, vals, params: dict | None = None) -> list:
    """`bind`, re-raising a failure of the rewritten op as an AutocastError that names the primitive."""
    try:
        return bind(eqn, vals, params)
    except (TypeError, ValueError) as err:
        in_types = ", ".join(str(jax.typeof(x).str_short()) for x in vals)
        raise AutocastError(
            f"autocast could not re-bind primitive '{eqn.primitive.name}' ({_where(eqn)}) on ({in_types}), "
            f"originally ({', '.join(v.aval.str_short() for v in eqn.invars)}): {err}. Keep this op float32 with "
            f"`with jaxamp.autocast.disabled():` around it.") from err


def _where(eqn) -> str:
    return source_info_util.summarize(eqn.source_info)


def original_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """Runs `eqn` exactly as the original program did: inputs cast back to its dtypes, its own params.

    The rule of every primitive outside the known lists (linear algebra, FFT, callbacks, custom calls, reduce with a
    jaxpr, bitcasts, ...) and of custom_vjp; in `float32_reference` mode its low-precision outputs are then widened.
    """
    vals = [cast(x, var.aval.dtype) if _has_dtype(var) else x for var, x in zip(eqn.invars, vals)]
    return bind(eqn, vals)


def _has_dtype(var) -> bool:
    return hasattr(var.aval, "dtype")


def _cast_floats(vals, dtype, which: Callable[[np.dtype], bool]) -> list:
    return [cast(x, dtype) if which(dtype_of(x)) else x for x in vals]


def _ref_float(d) -> bool:
    return d in ELIGIBLE or is_low_float(d)


# -------------------------------------------------------------------------------------------------- first-order rules


def matmul_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """dot_general / conv_general_dilated / ragged_dot_general: operands in the compute dtype, result too.

    `preferred_element_type` (the result dtype): `jnp.matmul`/`einsum`/`dot` in float32 code record it as float32,
    exactly as an explicit `preferred_element_type=jnp.float32` would, so a value equal to the operands' own result
    dtype (or None) counts as the default and becomes the compute dtype. Any other value (bf16 operands with a float32
    result, int8 operands with int32) was asked for explicitly and is kept. An integer operand beside an eligible
    float one (`int_batch @ w`: JAX passes the mixed operands to one dot_general, its result float) is converted with
    it, as the float32 code's promotion would have made it float32 first. Other operands that are not eligible floats
    (integers on both sides, float8, float64) leave the op as it was (`original_rule`). In float32_reference mode
    operands and a low-precision result dtype become float32, and `precision` becomes HIGHEST.
    """
    n = 2  # lhs, rhs; ragged_dot_general's third operand is the int32 group sizes
    if contracts_nothing(eqn) and not mode.reference:
        return product_rule(eqn, vals, mode, bounds)
    orig = [eqn.invars[i].aval.dtype for i in range(n)]
    floats = [dtype_of(x) in ELIGIBLE or (mode.reference and is_low_float(dtype_of(x))) for x in vals[:n]]
    integers = [np.issubdtype(dtype_of(x), np.integer) or dtype_of(x) == np.bool_ for x in vals[:n]]
    if not all(f or (i and any(floats)) for f, i in zip(floats, integers)):
        return original_rule(eqn, vals, mode, bounds)
    orig = [o for o, f in zip(orig, floats) if f]  # (the float operands give the default result dtype)
    params = dict(eqn.params)
    pet = params.get("preferred_element_type")
    if mode.reference:
        target = F32
        if pet is not None and is_low_float(pet):
            params["preferred_element_type"] = F32
        params["precision"] = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    else:
        target = mode.compute
        if pet is None or np.dtype(pet) == widest(orig):
            params["preferred_element_type"] = target
        if fp8_applies(eqn, mode):
            return [fp8_dot(eqn, [cast(x, target) for x in vals[:n]] + list(vals[n:]), params, mode)]
        if np.dtype(params["preferred_element_type"]) == target and float32_result_applies(eqn, mode):
            return [float32_result_dot(eqn, [cast(x, target) for x in vals[:n]], params)]
    return checked_bind(eqn, [cast(x, target) for x in vals[:n]] + list(vals[n:]), params)


def scope_names(eqn) -> list[str]:
    """The names on the matmul's name stack, outermost first: the enclosing ones (the interpreter re-binds each
    equation inside its own name stack, so the current one holds the scopes around a nested jit such as
    `jnp.einsum`'s) and the equation's own; Flax modules' names (`"decoder"`, `"logitdense"`, `"lm_head"`) and
    `jax.named_scope`s."""
    stack = list(getattr(source_info_util.current_name_stack(), "stack", ())) or \
        list(getattr(eqn.source_info.name_stack, "stack", ()))
    return [str(getattr(entry, "name", entry)) for entry in stack]


def frame_names(eqn) -> list[str]:
    """The qualified names of the functions on the call stack that traced the matmul (`"Embed.attend"`,
    `"Linear.__call__"`, a user's `"head"`), innermost first: what names an NNX or plain-`jnp` model's layers, which
    put no names on the name stack."""
    traceback = eqn.source_info.traceback
    return [str(frame.function_name) for frame in (traceback.frames if traceback is not None else ())]


def weight_path(names: Sequence[str]) -> str:
    """The param path in a `WEIGHT_SCOPE` entry among `names` (`"head.kernel"`), or ""."""
    return next((n[len(WEIGHT_SCOPE) + 1:] for n in names if n.startswith(WEIGHT_SCOPE + ":")), "")


def exclusion_names(eqn, scopes=None) -> list[str]:
    """Every name an `fp8_exclude` pattern is searched in: the name stack's (`scope_names`, or `scopes`), with a
    `WEIGHT_SCOPE` entry read as each prefix of the weight's param path (`"blocks"`, `"blocks.0"`, `"blocks.0.up"`,
    `"blocks.0.up.kernel"`, as a linen name stack holds each enclosing module: how an NNX or Equinox model names
    its layers, an untied `lm_head` called from its own `__call__` too), then the functions on the call stack
    (`frame_names`)."""
    names = []
    for name in scope_names(eqn) if scopes is None else scopes:
        path = weight_path([name])
        if not path:
            names.append(name)
            continue
        for joined in dict.fromkeys([path, *path.split("+")]):  # params concatenated (`a+b`): each one's too
            parts = joined.split(".")
            names += [".".join(parts[:i + 1]) for i in range(len(parts))]
    return [*names, *frame_names(eqn)]


def fp8_applies(eqn, mode: Mode) -> bool:
    """Whether the FP8 recipe takes this matmul: a weight matmul, as Transformer Engine's Linear and grouped
    (MoE) layers quantize theirs: where the function's arguments hold params (`mode.named_params`), a `dot_general`
    with a param operand (CLIP's image x text similarity and the attention's score and value matmuls keep the
    compute dtype), with batch dimensions only where they lead both operands (an MoE's experts, `"egcd,edf->egcf"`
    or a vmap over them: one scale per expert; a per-head relative-position term `"bhld,hmd"` keeps the compute
    dtype); elsewhere a `dot_general` without batch dimensions (the attention's are batched); `lax.ragged_dot`'s
    own form under the per-tensor recipes; not excluded by name, and of sizes the recipe takes (MXFP8: multiples of
    32)."""
    if mode.fp8 is None or eqn.primitive.name not in ("dot_general", "ragged_dot_general"):
        return False
    scopes = scope_names(eqn)
    if mode.named_params and not weight_path(scopes):
        return False
    ragged = eqn.primitive.name == "ragged_dot_general"
    if ragged:  # an MoE's grouped experts: lax.ragged_dot's own form only
        takes = (fp8_grouped.is_ragged_dot(eqn.params["ragged_dot_dimension_numbers"])
                 and eqn.params.get("group_offset") is None and eqn.invars[0].aval.ndim == 2
                 and fp8_grouped.takes_recipe(mode.fp8))
    else:  # batch dims: experts first on both sides (`"egcd,edf"`, a vmap over experts), not per-head terms
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        takes = (mode.named_params or not lb) and tuple(lb) == tuple(range(len(lb))) \
            and tuple(rb) == tuple(range(len(rb)))
    if not takes or any(p.search(name) for p in mode.fp8_exclude for name in exclusion_names(eqn, scopes)):
        return False
    if ragged or mode.fp8.multiple is None:
        return True
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    k = int(np.prod([lhs[d] for d in lc]))
    m = int(np.prod([s for d, s in enumerate(lhs) if d not in lc and d not in lb]))
    n_ = int(np.prod([s for d, s in enumerate(rhs) if d not in rc and d not in rb]))
    return all(size % mode.fp8.multiple == 0 for size in (k, m, n_))


def fp8_dot(eqn, operands: list, params: dict, mode: Mode):
    """The matmul through `jaxamp.fp8_recipes.fp8_dot_general` (or `jaxamp.fp8_grouped.fp8_ragged_dot`) under
    `mode.fp8` (stateless scaling)."""
    if eqn.primitive.name == "ragged_dot_general":
        lhs, rhs, group_sizes = operands
        return fp8_grouped.fp8_ragged_dot(lhs, rhs, group_sizes, recipe=mode.fp8, compute_dtype=mode.compute,
                                          preferred_element_type=params["preferred_element_type"])
    lhs, rhs = operands
    return fp8_dot_general(lhs, rhs, params["dimension_numbers"], preferred_element_type=params[
        "preferred_element_type"], recipe=mode.fp8, compute_dtype=mode.compute)


def float32_result_applies(eqn, mode: Mode) -> bool:
    """Whether this matmul writes a float32 result: a `dot_general` or a convolution (a segmentation network's 1x1
    head) with a name (`exclusion_names`) that one of `mode.float32_results` matches."""
    if not mode.float32_results or eqn.primitive.name not in ("dot_general", "conv_general_dilated"):
        return False
    return any(p.search(name) for p in mode.float32_results for name in exclusion_names(eqn))


class _DotOp:
    """`eqn`'s dot_general with its params but the result dtype, bound by `__call__`; a custom_vjp static argument
    (hashed by identity: one per traced equation)."""

    def __init__(self, eqn, params: dict):
        self.eqn, self.params = eqn, {k: v for k, v in params.items() if k != "preferred_element_type"}

    def __call__(self, lhs, rhs, out_dtype):
        return bind(self.eqn, [lhs, rhs], {**self.params, "preferred_element_type": out_dtype})[0]


def float32_result_dot(eqn, operands: list, params: dict):
    """A `dot_general` (or convolution) on compute-dtype `operands` with float32 accumulation and a float32 result
    (logits that reach the loss unrounded, as `jaxamp.layers.attend` computes them); the result's gradient is rounded
    to the compute dtype once, so both backward matmuls still take compute-dtype operands and accumulate in float32,
    their results in the compute dtype (as under the plain matmul rule)."""
    return _float32_result(operands[0], operands[1], _DotOp(eqn, params))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _float32_result(lhs, rhs, op):
    return op(lhs, rhs, F32)


def _float32_result_fwd(lhs, rhs, op):
    # symbolic_zeros: an operand nothing differentiates (a raw input batch) gets no gradient matmul at all.
    needs = tuple(() if p.perturbed else None for p in (lhs, rhs))  # () / None: static in the residuals' structure
    return op(lhs.value, rhs.value, F32), (lhs.value, rhs.value, needs)


def _float32_result_bwd(op, residuals, g):
    lhs, rhs, (need_lhs, need_rhs) = residuals
    if isinstance(g, SymbolicZero):
        return None, None
    g = g.astype(lhs.dtype)  # the float32 output gradient rounded to the compute dtype once
    # linear_transpose, not vjp: no forward matmul in the backward's jaxpr (the precision audit counts every one).
    d_lhs = None if need_lhs is None else jax.linear_transpose(lambda a: op(a, rhs, lhs.dtype), lhs)(g)[0]
    d_rhs = None if need_rhs is None else jax.linear_transpose(lambda b: op(lhs, b, rhs.dtype), rhs)(g)[0]
    return d_lhs, d_rhs


_float32_result.defvjp(_float32_result_fwd, _float32_result_bwd, symbolic_zeros=True)


_CALL_PRIMITIVES = ("jit", "pjit", "closed_call", "core_call")


def moved_axis(eqn, axis: int) -> int | None:
    """Where a shape op or cast `eqn` puts its input's `axis` in its output (the class axis of a one-hot, the
    counting axis of an iota), or None where it does not keep that axis whole: casts and copies keep it, transposes
    and broadcasts move it, a squeeze drops others, and a reshape keeps only a last axis that stays whole and last
    (`lax.reshape(x, shape, dimensions=...)`, which transposes first, none)."""
    name, before, after = eqn.primitive.name, eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if name in ("convert_element_type", "copy"):
        return axis
    if name == "transpose":
        return list(eqn.params["permutation"]).index(axis)
    if name == "broadcast_in_dim":
        return eqn.params["broadcast_dimensions"][axis]
    if name == "squeeze":
        dropped = [d % len(before) for d in eqn.params["dimensions"]]
        return None if axis in dropped else axis - sum(d < axis for d in dropped)
    if name in ("reshape", "expand_dims") and axis == len(before) - 1 and before[-1:] == after[-1:] and \
            eqn.params.get("dimensions") is None:
        return len(after) - 1
    return None


def _iota_axis(var, makers: dict) -> int | None:
    """The axis along which `var` counts, where it is an `iota` (through `broadcast_in_dim`, which moves its axis,
    and `convert_element_type`), else None."""
    chain = []
    for _ in range(4):
        maker = makers.get(var)
        if maker is None:
            return None
        if maker.primitive.name == "iota":
            axis = maker.params["dimension"]
            for step in reversed(chain):  # (broadcasts after the iota, innermost first)
                axis = moved_axis(step, axis)
            return axis
        if maker.primitive.name not in ("broadcast_in_dim", "convert_element_type") or \
                isinstance(maker.invars[0], jex_core.Literal):
            return None
        chain.append(maker)
        var = maker.invars[0]
    return None


def one_hot_vars(jaxpr, depth: int = 3, seeds: dict | None = None) -> dict:
    """`{variable: class axis}` for the variables of `jaxpr` that hold a one-hot array, as `jax.nn.one_hot(ids, n,
    axis=a)` makes it: `convert_element_type(expand_dims(ids, a) == iota)` with the iota counting along the class
    axis, through casts, transposes (`one_hot(ids).T`: the axis moves), reshapes that keep a last class axis whole
    and last (`moved_axis`), and the outputs of a call that returns one (`jax.nn.one_hot` is a jit), at most `depth`
    calls deep. A mask or an adjacency matrix (a boolean from any other comparison) is not one. `seeds`: variables
    known to hold one (a jitted, scanned or looped body's inputs that were one-hot where it was called) with their
    class axes, and what the ops above make of them."""
    found, makers, hot = dict(seeds or {}), {}, {}
    for eqn in jaxpr.eqns:
        for out in eqn.outvars:
            makers[out] = eqn
        name = eqn.primitive.name
        ins = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        if name == "eq" and len(ins) == 2:
            axes = [a for a in (_iota_axis(v, makers) for v in ins) if a is not None]
            if axes:
                hot[eqn.outvars[0]] = axes[0]
        elif name == "convert_element_type" and ins and (ins[0] in hot or ins[0] in found):
            found[eqn.outvars[0]] = hot[ins[0]] if ins[0] in hot else found[ins[0]]
        elif name in ("transpose", "reshape", "copy") and ins and ins[0] in found:
            axis = moved_axis(eqn, found[ins[0]])
            if axis is not None:
                found[eqn.outvars[0]] = axis
        elif name in _CALL_PRIMITIVES and depth > 1:
            body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            body = getattr(body, "jaxpr", body)
            if hasattr(body, "eqns"):
                inner = one_hot_vars(body, depth - 1)
                found.update((o, inner[i]) for o, i in zip(eqn.outvars, body.outvars)
                             if not isinstance(i, jex_core.Literal) and i in inner)
    return found


def selects(eqn, one_hot: Sequence[int | None]) -> list[bool]:
    """Per operand of a `dot_general`: a one-hot operand (its class axis `one_hot[i]`, `one_hot_vars`; None where it
    is none) contracted over its class axis, so the product picks rows of the other operand: a selection
    (`one_hot(ids) @ table`, `table.T @ one_hot(ids).T`). A one-hot contracted over another axis sums (a segment sum
    over a graph's edges, a VQ codebook's per-code sums `x.T @ one_hot(ids)`)."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    return [axis is not None and axis in contracting for axis, contracting in zip(one_hot, (lc, rc))]


def contracts_nothing(eqn) -> bool:
    """A `dot_general` without contracting dims (`einsum("te,tec->tec")`): an elementwise or outer product, no GEMM:
    `product_rule` runs it, and the precision audit lists no row for it."""
    return eqn.primitive.name == "dot_general" and not eqn.params["dimension_numbers"][0][0]


def product_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """A `dot_general` that contracts nothing (`einsum("te,tec->tec", probs, mask)`, an MoE's combine weights: an
    elementwise or outer product, no GEMM): as an elementwise op, torch.amp's `mul`, in the widest floating type of
    its operands (a boolean or integer operand converted to it), so float32 router probabilities are not rounded to
    the compute dtype. Written as a broadcast multiply, so its gradient is a multiply and a sum, not a matmul with a
    mask operand."""
    floats = [i for i in range(2) if dtype_of(vals[i]) in ELIGIBLE]
    if not floats:
        return original_rule(eqn, vals, mode, bounds)
    target = widest([dtype_of(vals[i]) for i in floats])
    pet = eqn.params.get("preferred_element_type")
    explicit = pet is not None and np.dtype(pet) != widest([eqn.invars[i].aval.dtype for i in floats])
    (_, _), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (cast(x, target) if i in floats else lax.convert_element_type(x, target)
                for i, x in enumerate(vals[:2]))
    lfree = [d for d in range(lhs.ndim) if d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rb]
    lhs = lax.expand_dims(lax.transpose(lhs, (*lb, *lfree)), range(lhs.ndim, lhs.ndim + len(rfree)))  # [b, l, 1]
    rhs = lax.expand_dims(lax.transpose(rhs, (*rb, *rfree)), range(len(lb), len(lb) + len(lfree)))  # [b, 1, r]
    return [cast(lhs * rhs, np.dtype(pet) if explicit else target)]  # dot_general's order: batch, lhs, rhs


def selection_rule(eqn, vals, mode: Mode, bounds=None, one_hot=(False, False)) -> list:
    """A `dot_general` that selects with a one-hot operand (`one_hot[i]`, `selects`): a gather written as a matmul
    (optax's `ctc_loss` gathers its log-probabilities so, a TPU-style embedding `one_hot(ids) @ table`), in the dtype
    of the other operand, as torch.amp's gather and embedding keep their input's (the widest rule): a lookup in a
    float32 table stays float32, and so do log-probabilities. Never FP8. Other operands (integers, both one-hot):
    as `matmul_rule`."""
    others = [dtype_of(x) for x, hot in zip(vals[:2], one_hot) if not hot]
    if len(others) != 1 or others[0] not in ELIGIBLE or mode.reference:
        return matmul_rule(eqn, vals, mode, bounds)
    target, params = others[0], dict(eqn.params)
    pet = params.get("preferred_element_type")
    if pet is None or np.dtype(pet) == widest([eqn.invars[0].aval.dtype, eqn.invars[1].aval.dtype]):
        params["preferred_element_type"] = target
    return checked_bind(eqn, [cast(x, target) for x in vals[:2]] + list(vals[2:]), params)


def float32_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """exp, log, pow, rsqrt, reduce_sum, cumsum, ...: floating inputs cast to float32, result float32."""
    which = _ref_float if mode.reference else (lambda d: d in ELIGIBLE)
    return checked_bind(eqn, _cast_floats(vals, F32, which))


def integer_pow_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """x ** n: float32 class (torch's `pow` and `reciprocal`) except for n = 0 and 1 (widest class)."""
    return (float32_rule if _float32_class(eqn) else widest_rule)(eqn, vals, mode, bounds)


def _float32_class(eqn) -> bool:
    """Whether `eqn` computes in float32 whatever its inputs: `FLOAT32_OPS`, and `integer_pow` but for n = 0, 1."""
    name = eqn.primitive.name
    return name in FLOAT32_OPS or (name == "integer_pow" and eqn.params["y"] not in (0, 1))


def upcast_eqns(jaxpr) -> set[int]:
    """The `UPCAST_OPS` equations of `jaxpr` (their ids) whose results only float32 reads: each result is read, and
    every equation reading it is float32 class (`FLOAT32_OPS`), another such equation, or an elementwise op with an
    operand that a float32-class op wrote (so it computes in float32 anyway: log_softmax's `shifted - log(sum)`).

    Autocast runs these in float32 (`float32_rule`): softmax's `x - max(x)` on bfloat16 scores rounded the shifted
    scores to bfloat16 before the exp, which raised the softmax's error by half at unit-scale scores (L1 per row 6.4e-3
    against 4.1e-3 for the rounded scores alone). No float32 array is materialised that the float32 op after it
    would not have made (XLA fuses the casts into the elementwise ops). A jaxpr's outputs are not float32 reads.
    """
    readers: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                readers.setdefault(v, []).append(eqn)
    outputs = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    float32_written = {v for eqn in jaxpr.eqns if eqn.primitive.name in FLOAT32_OPS for v in eqn.outvars}
    chosen: set[int] = set()

    def reads_float32(eqn) -> bool:
        if _float32_class(eqn) or id(eqn) in chosen:
            return True
        return eqn.primitive.name in UPCAST_OPS and any(v in float32_written for v in eqn.invars
                                                         if not isinstance(v, jex_core.Literal))

    for eqn in reversed(jaxpr.eqns):  # readers come after: a chain is decided from its end
        if eqn.primitive.name not in UPCAST_OPS or not all(is_float(v.aval.dtype) for v in eqn.outvars):
            continue
        if all(v not in outputs and readers.get(v) and all(map(reads_float32, readers[v])) for v in eqn.outvars):
            chosen.add(id(eqn))
    return chosen


def widest_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """Elementwise/structural ops: floating inputs cast to the widest floating dtype among them (`widest_dtype`).

    Float32_reference mode casts every low-precision floating input to float32. Scatters whose dtype changes get an
    update computation (`update_jaxpr`) re-traced for the new dtype.
    """
    if mode.reference:
        target = F32 if any(_ref_float(dtype_of(x)) for x in vals) else None
    else:
        target = widest_dtype(eqn, vals, bounds)
    if target is None:
        return checked_bind(eqn, vals)
    vals = _cast_floats(vals, target, _ref_float if mode.reference else (lambda d: d in ELIGIBLE))
    params = eqn.params
    if eqn.primitive.name in _SCATTERS and eqn.invars[0].aval.dtype != target:
        params = _scatter_params(eqn, target)
    return checked_bind(eqn, vals, params)


def _scatter_params(eqn, dtype) -> dict:
    """A scatter's params with its update computation (a scalar jaxpr in the original dtype) re-traced for `dtype`.

    The new computation casts to the original dtype, applies the original one, and casts the result to `dtype`.
    """
    params = dict(eqn.params)
    update = params.get("update_jaxpr")
    if update is None:
        return params
    orig = eqn.invars[0].aval.dtype
    fn = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(update, list(params["update_consts"])))
    scalar = jax.ShapeDtypeStruct((), dtype)
    closed = jax.make_jaxpr(lambda a, b: [cast(o, dtype) for o in fn(cast(a, orig), cast(b, orig))])(scalar, scalar)
    params["update_jaxpr"], params["update_consts"] = closed.jaxpr, tuple(closed.consts)
    return params


def passthrough_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """sort, optimization_barrier, collectives, checkpoint names: operands independent, bound as they are.

    Float32_reference mode widens low-precision operands to float32 first.
    """
    if mode.reference:
        vals = _cast_floats(vals, F32, is_low_float)
    return checked_bind(eqn, vals)


def convert_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """convert_element_type: an explicit cast stays as written.

    A convert whose original input and output dtypes are equal only changes weak-typedness (JAX inserts them, e.g.
    in `jnp.where(m, x, -1e9)`): it keeps the value's current dtype, and a weak value stays weak (so the constant
    follows `x`'s dtype in the select, see `widest_dtype`). In float32_reference mode a cast to a low-precision float
    (the model's `dtype=jnp.bfloat16`) casts to float32 instead.
    """
    (x,) = vals
    params = dict(eqn.params)
    new = params["new_dtype"]
    if is_float(new) and eqn.invars[0].aval.dtype == new:
        if jax.typeof(x).weak_type and not mode.reference:
            return [x]  # a weak constant made strong for an op: it stays weak, so it follows that op's other inputs
        params["new_dtype"] = dtype_of(x)
    elif mode.reference and is_low_float(new):
        params["new_dtype"] = F32
    return checked_bind(eqn, [x], params)


def iota_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """iota: as written; a low-precision float iota is float32 in float32_reference mode."""
    params = dict(eqn.params)
    if mode.reference and is_low_float(params["dtype"]):
        params["dtype"] = F32
    return checked_bind(eqn, vals, params)


FIRST_ORDER_RULES: dict[str, Callable[[Any, list, Mode], list]] = {
    **{name: matmul_rule for name in MATMUL_OPS},
    **{name: float32_rule for name in FLOAT32_OPS},
    **{name: widest_rule for name in WIDEST_OPS},
    **{name: passthrough_rule for name in PASSTHROUGH_OPS},
    "integer_pow": integer_pow_rule,
    "convert_element_type": convert_rule,
    "iota": iota_rule,
}


def check_outputs(eqn, outs: list, mode: Mode) -> list:
    """Checks a rule's outputs against the original eqn; in float32_reference mode widens low-precision ones.

    Shapes must match; a non-floating output keeps its dtype; a floating one stays floating.

    Raises:
      AutocastError: naming the primitive, when a rule broke one of those.
    """
    if len(outs) != len(eqn.outvars):
        raise AutocastError(f"autocast: primitive '{eqn.primitive.name}' ({_where(eqn)}) gave {len(outs)} outputs, "
                            f"expected {len(eqn.outvars)}")
    checked = []
    for var, out in zip(eqn.outvars, outs):
        aval = var.aval
        if hasattr(aval, "dtype"):
            got = jax.typeof(out)
            same_kind = is_float(got.dtype) if is_float(aval.dtype) else got.dtype == aval.dtype
            if got.shape != aval.shape or not same_kind:
                raise AutocastError(f"autocast: the rewritten primitive '{eqn.primitive.name}' ({_where(eqn)}) gave "
                                    f"{got.str_short()} where the original gave {aval.str_short()}")
            if mode.reference and is_low_float(got.dtype):
                out = cast(out, F32)
        checked.append(out)
    return checked
