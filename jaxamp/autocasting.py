"""`autocast`: torch.amp's autocast as a JAX function transform (a jaxpr interpreter); tested with jax 0.10.2, 0.11.2.

`autocast(fn, jnp.bfloat16)` runs unchanged float32 JAX code (a linen `model.apply`, NNX or Equinox modules, plain
`jnp`) with its matmuls in half precision and the numerically sensitive ops in float32, following torch.amp's CUDA
autocast op lists (https://pytorch.org/docs/stable/amp.html#autocast-op-reference). On each call it traces `fn` to
a closed jaxpr (`jax.make_jaxpr`, inside any outer jit/grad/vmap trace) and evaluates that jaxpr with an interpreter
that re-binds each primitive under the rules below. It composes with `jax.jit`, `jax.grad`, `jax.vmap`, control
flow, `jax.checkpoint`, custom derivatives and sharded arrays, and a jitted step that calls it traces once. Array
leaves of the arguments (jax and numpy arrays, tracers) become jaxpr inputs; every other leaf (Python bools, ints,
floats, strings, objects, e.g. `deterministic=True`) is static.

Op classes. "Eligible" floats are float32, bfloat16 and float16: float64 and the float8s are never cast, as in
torch.amp. A primitive's class decides the dtype it computes in:

| class | primitives | rule |
| --- | --- | --- |
| matmul | `dot_general`, `conv_general_dilated`, `ragged_dot_general` | eligible operands cast to the compute dtype; result in the compute dtype (float32 for the output head: `float32_results`) |
| float32 | `exp`, `exp2`, `log`, `log1p`, `expm1`, `pow`, `sqrt`, `rsqrt`, `cbrt`, `reciprocal`, `square`, `integer_pow` (exponent other than 0 and 1: torch's `pow`), `tan`, `sinh`, `cosh`, `asin`, `acos`, `erf_inv`, `reduce_sum`, `reduce_prod`, `cumsum`, `cumprod`, `cumlogsumexp` | eligible inputs cast to float32; result float32 |
| widest | `add`, `add_any`, `sub`, `mul`, `div`, `rem`, `max`, `min`, `neg`, `abs`, `sign`, `floor`, `ceil`, `round`, `nextafter`, `atan2`, `tanh`, `logistic`, `sin`, `cos`, `atan`, `asinh`, `acosh`, `atanh`, `erf`, `erfc`, `lgamma`, `digamma`, `igamma`, `igammac`, `igamma_grad_a`, `polygamma`, `zeta`, `bessel_i0e`, `bessel_i1e`, `regularized_incomplete_beta`, `integer_pow` (exponent 0 or 1), `is_finite`, `reduce_precision`, `real`, `imag`, `conj`, `select_n`, `clamp`, `eq`, `ne`, `lt`, `le`, `gt`, `ge`, `eq_to`, `le_to`, `lt_to`, `and`, `or`, `not`, `xor`, `shift_left`, `shift_right_arithmetic`, `shift_right_logical`, `population_count`, `clz`, `concatenate`, `pad`, `gather`, `scatter`, `scatter-add`, `scatter-sub`, `scatter-mul`, `scatter-min`, `scatter-max`, `dynamic_slice`, `dynamic_update_slice`, `slice`, `reshape`, `transpose`, `broadcast_in_dim`, `squeeze`, `rev`, `split`, `tile`, `broadcast_to`, `zeros_like`, `copy`, `iota`, `reduce_max`, `reduce_min`, `reduce_and`, `reduce_or`, `reduce_xor`, `argmax`, `argmin`, `cummax`, `cummin`, `top_k`, `reduce_window_sum`, `reduce_window_max`, `reduce_window_min`, `select_and_scatter_add`, `select_and_gather_add`, `sharding_constraint`, `reshard`, `mesh_cast`, `stop_gradient`, `random_bits`, `random_seed`, `random_wrap`, `random_unwrap`, `random_fold_in`, `random_split`, `random_clone`, `threefry2x32`, `rng_bit_generator`, `rng_uniform`, `axis_index` | eligible inputs cast to the widest floating dtype among them (torch.amp's "promote" rule, and its default for unlisted ops) |
| passthrough | `sort`, `optimization_barrier`, `device_put`, `name` (checkpoint names), `psum`, `pmax`, `pmin`, `psum_invariant`, `all_gather`, `all_gather_invariant`, `all_to_all`, `ppermute`, `pvary`, `pbroadcast`, `reduce_scatter` | operands are independent: bound with their current dtypes |
| explicit cast | `convert_element_type` | as written (see below) |
| original | everything else (below) | inputs cast back to the dtypes of the original jaxpr, original params |

What follows from the classes: softmax, log_softmax, logsumexp, layer/batch norms, means, variances and losses end
in float32 ops, so they come out float32. An elementwise `add`, `sub`, `mul`, `div`, `neg`, `max` or `min` whose
result only float32-class ops read (`autocast_rules.upcast_eqns`) runs in float32 too: softmax's and log_softmax's
`x - max(x)` before the exp, as torch.amp's softmax upcasts its input (the max itself stays in the input's dtype,
where it is exact); other elementwise ops before a float32-class op run in the input's dtype. A square is float32
class, as torch's `pow`, so a variance of float16 inputs above 256 does not overflow. A lookup in a float32 table
stays float32, so its gradient is a float32 scatter-add; `bf16_activation + f32_bias` is float32, so the bias
gradient sums in float32.

Casts and constants:

* Widest: Literals and weak-typed inputs (Python scalars and what JAX derives from them: `x * 0.5`, `max(x, 0.0)`,
  `jnp.where(m, x, 0.0)`) don't widen, as torch's wrapped numbers don't, unless every floating input is one, or a
  constant is finite but outside the narrower dtype's range (`jnp.where(mask, x, -1e9)`, or `finfo(float32).min`,
  under float16): then the op runs in the wider dtype instead of turning the constant into inf.
* `convert_element_type` written in the program (`x.astype(jnp.bfloat16)`, `.astype(jnp.int32)`) stays as written.
  One that only changes weak-typedness (same dtype in and out, inserted by JAX) keeps the value's current dtype. A
  cast that is a no-op in float32 code (`logits.astype(jnp.float32)` on float32 logits) leaves no equation in the
  jaxpr, so what follows it runs by the op classes (a loss still comes out float32 through the float32 class).
* Matmul `preferred_element_type` (the result dtype): `jnp.matmul`, `jnp.dot`, `jnp.einsum` and `x @ w` in float32
  code record `preferred_element_type=float32`, exactly as an explicit `preferred_element_type=jnp.float32` on
  float32 operands does, so a value equal to the operands' own result dtype, or None (`lax.dot_general`'s default),
  is read as the default and becomes the compute dtype. The half-precision result makes the backward matmuls that
  JAX derives run in the compute dtype too (a float32 result would send float32 cotangents into them); accumulation
  is float32 inside the kernel on GPU, TPU and CPU. Any other value (half-precision operands with a float32 result,
  int8 operands with int32) was asked for explicitly and is kept. Operands that are not eligible floats (integers,
  float8, float64) leave the op as the original program wrote it.
* The output head (`float32_results`, default `FLOAT32_RESULTS`: the names `FP8_EXCLUDE` gives the head): its
  `dot_general` takes compute-dtype operands and accumulates in float32 like any matmul, but its default result is
  float32, so logits reach the softmax and the loss unrounded (torch.amp would round them to bfloat16; jaxamp's LM,
  nanoGPT-style float32 logits and Megatron-LM's float32 cross-entropy do not). Its output gradient is rounded to
  the compute dtype once, so its two backward matmuls run in the compute dtype as every other matmul's do. On the
  six outside models of `benchmarks/autocast_models.py` this takes bf16's 40-step loss gap to float32 from 3.26x
  to 1.50x float32's own noise on Hugging Face's GPT-2, from 1.90x to 1.50x on Gemma, from 1.57x to 1.50x on ESM2
  and from 1.36x to 1.15x on lm1b (`benchmarks/results/autocast_models.md`). Cost on a GPU: the logits in float32
  (`f32[tokens, vocab]`, as under the cast policies' `jaxamp.layers.attend`): at GPT-2 124M, batch 32, XLA:GPU's
  compile for an H200 has 6,288 MiB more temporaries (1.02x the bf16 cast policy's, was 0.79x) and 33.8 GiB more
  kernel traffic per step (`benchmarks/results/gpu_compile_autocast_head.md`). `float32_results=()` gives
  torch.amp's bf16 logits.
* A `dot_general` that contracts a one-hot operand over its class axis (`jax.nn.one_hot`'s
  `convert(expand_dims(ids, axis) == iota)`, through casts, transposes and nested jits, contracted over the axis the
  iota counts along: `jax.nn.one_hot(ids, n) @ table`, `table.T @ one_hot(ids).T`, `table.T @ one_hot(ids, n,
  axis=0)`, optax's `ctc_loss`'s gathers of its log-probabilities) is a selection written as
  a matmul: both operands take the other operand's dtype, as torch.amp's gather and embedding keep their input's (a
  float32 table's rows and CTC's loss stay float32); never FP8 (`autocast_rules.selection_rule`).
* A `dot_general` that contracts nothing (`einsum("te,tec->tec", probs, mask)`, Flaxformer's MoE combine weights:
  an elementwise or outer product, no GEMM) takes the widest rule, as torch.amp's `mul`, written as a broadcast
  multiply (its gradient a multiply and a sum; `autocast_rules.product_rule`); the precision audit lists no row
  for it.

Control flow and calls, re-bound through JAX's public API, their inner jaxprs interpreted under the same rules:

* nested `jit` and `closed_call`: inlined; the shardings a nested jit specified for its inputs and outputs become
  `jax.lax.with_sharding_constraint`s. One exception, torch.amp's `scaled_dot_product_attention` rule: the jit of a
  `jaxamp.attention.dot_product_attention` call (`ATTENTION_JIT_NAMES`) without a mask runs as cuDNN's fused
  attention on its query, key and value cast to the compute dtype (its output in that dtype) on a GPU; elsewhere,
  or where cuDNN refuses the shapes, it is inlined like any jit.
* `scan` (`lax.scan`, `lax.map`, `fori_loop` with static bounds, `flax.linen.scan`, `nnx.scan`): `jax.lax.scan`
  over the interpreted body; carries keep their original dtype (the initial carry and the body's new carry are cast
  to it), stacked outputs take the dtypes the body gives them.
* `while`: `jax.lax.while_loop`; carries keep their original dtype.
* `cond`: `jax.lax.switch`; each output is cast to the widest dtype the branches give it.
* `checkpoint` (`jax.checkpoint`, `nn.remat`, `nnx.remat`): re-wrapped with `jax.checkpoint`, same `policy` and
  `prevent_cse` (checkpoint names pass through, so name-based policies keep working).
* `shard_map`: re-wrapped with `jax.shard_map`, same mesh, specs, manual axes and `check_vma`.
* `custom_jvp_call` (`jax.nn.relu`, `jax.nn.silu`, `jnp.logaddexp`, ...): a new `jax.custom_jvp` whose primal
  interprets the primal jaxpr under autocast and whose JVP rule is the user's own, run on the original dtypes: it
  calls `jax.jvp` of the original primitive with its original params on primals and tangents cast to the original
  dtypes, and casts the output tangents to the new primal outputs' dtypes. The rule sees the dtypes it was written
  for.
* `custom_vjp_call` (Flax's FP8 ops, `jaxamp.layers`' functions): opaque, exactly as in the original program
  (inputs cast back to its traced dtypes, its own forward and backward): its backward was written for those dtypes
  and need not be the derivative of its forward (straight-through estimators, FP8 scale updates).

Unknown primitives (linear algebra, FFT, callbacks and `jax.debug.print`, custom calls, `pmap`, `reduce` and
`reduce_window` with a computation, `bitcast_convert_type`, `complex`, `custom_linear_solve`, state/ref primitives,
...) run as the original program ran them: inputs cast back to the dtypes the original jaxpr gave them, bound with
their original params (float32, for float32 code). No rule changes an output's shape, or the dtype of a non-floating
output: a rewrite that cannot be bound, or that would, raises `AutocastError` naming the primitive.

`disabled()` (torch's `autocast(enabled=False)`): ops traced inside `with jaxamp.autocast.disabled():`, or in a
function decorated with `@jaxamp.autocast.disabled()`, run at their original dtypes (values from autocast ops are
cast back to them), including whole nested jits, scans and custom derivatives called in it. It is a marker in the
name stack (`jax.named_scope`), read from each equation, and survives nested jit and scan bodies.

`float32_reference(fn)`: the float32 truth for gradient-fidelity checks. Every floating value is float32, also where
the model asks for half precision itself: its casts to bfloat16/float16 (and float8) cast to float32, half-precision
literals, constants and iotas are float32, matmuls run at `Precision.HIGHEST` with float32 results, loop carries are
float32, custom_jvp rules run in float32 (their JVP is traced at the original dtypes and interpreted in this mode).
`disabled()` has no effect in it.

Source info: each equation is re-bound inside its own `user_context` (traceback and name stack) and equation context,
as `jax.core.eval_jaxpr` does, so a later trace of the rewritten code (`jax.make_jaxpr(jax.grad(autocast(f)))`)
attributes every op, and the casts autocast inserts, to the user's file:line and name scopes.

Known limitations:

* Outside `jax.jit` every call traces `fn` and dispatches op by op: call `autocast(fn)` inside the jitted step.
* Like `jax.jit`, `autocast` is a pure function transform: NNX modules updated inside `fn` (BatchNorm statistics,
  Rngs counts) must be created inside it (`lambda graphdef, state, x: nnx.merge(graphdef, state)(x)`) and their new
  state returned.
* Nested autocasts: the outer one wins, and sees the inner one's casts as casts written in the program.
* float32_reference: a custom_vjp that the model runs in half precision runs as traced (in half precision), as do
  unknown primitives; their outputs are widened to float32.
* Inside `pmap` nothing is rewritten (it runs as the original program did).

Tested with jax 0.10.2, flax 0.12.8 (linen and NNX) and Equinox 0.13 (CI), and with jax 0.11.2 and flax 0.12.10
(the whole test suite on a CPU, 12-04: jax 0.11's scan records its consts and carries as `ft_in`, read here); uses no
API deprecated in jax 0.10.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.extend import source_info_util

from jaxamp import autocast_rules as rules
from jaxamp.attention import ATTENTION_JIT_NAMES, cudnn_attention
from jaxamp.autocast_rules import (
    AutocastError,
    Mode,
    cast,
    dtype_of,
    strong_cast,
    tangent_dtype,
)
from jaxamp.fp8_recipes import FP8_EXCLUDE, get_recipe

__all__ = ["FLOAT32_RESULTS", "FP8_EXCLUDE", "AutocastError", "autocast", "disabled", "float32_reference"]

F = TypeVar("F", bound=Callable[..., Any])

DISABLED_SCOPE = "jaxamp_autocast_disabled"
# The matmuls whose result autocast keeps float32 by default: the output head, by the names FP8 recipes leave out.
FLOAT32_RESULTS = FP8_EXCLUDE
_DTYPE_NAMES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16,
                "f16": jnp.float16, "half": jnp.float16}


# --------------------------------------------------------------------------------------------------------- public API


def autocast(fn: F, dtype: Any, *, fp8: Any = None, fp8_exclude: Sequence[str] = FP8_EXCLUDE,
             float32_results: Sequence[str] = FLOAT32_RESULTS) -> F:
    """`fn` with its matmuls in `dtype` and its sensitive ops in float32 (torch.amp's autocast op lists, CUDA).

    With `fp8`, the weight matmuls (where `fn`'s first positional argument or a `params=` keyword holds arrays, as
    `loss_fn(params, ...)` and `model.apply(variables, ...)` do: a `dot_general` one operand of which comes from
    them, sliced, cast or combined elementwise at its own shape (`w[i]`, `v * g`, `W + A @ B`): Dense,
    Conv1D-as-matmul, einsum projections, an MoE's batched experts `"egcd,edf->egcf"`; so a product of two
    activations, CLIP's similarity matrix or the attention's scores, is not one, and neither is a weight closed
    over beside such an argument: pass the params; where no argument holds params, a `dot_general` without batch
    dimensions) run through `jaxamp.fp8_recipes.fp8_dot_general` under that stateless recipe (`"current"`:
    Transformer Engine's Float8CurrentScaling; `"block"`: DeepSeek-V3's 1x128 / 128x128 tiles; `"mxfp8"`), their
    result in `dtype`, and `lax.ragged_dot`'s grouped experts through `jaxamp.fp8_grouped.fp8_ragged_dot` under
    the per-tensor recipes; the attention's batched matmuls, convolutions and the matmuls `fp8_exclude` names keep
    `dtype`, as Transformer Engine keeps the output head and attention in bf16 by default.

    Args:
      fn: ordinary float32 JAX code: a function of pytrees of arrays and static Python values (a linen
        `model.apply`, a function calling NNX or Equinox modules, plain `jnp`).
      dtype: the compute dtype: `jnp.bfloat16` / `"bfloat16"` / `"bf16"` or `jnp.float16` / `"float16"` / `"fp16"`.
      fp8: None, or a recipe name of `jaxamp.fp8_recipes.RECIPES` (or a `Recipe`) for the weight matmuls.
      fp8_exclude: regular expressions, each searched (`re.search`, case-sensitive: anchor with `^...$` for a
        whole name) in every name on a matmul's name stack, in the path of its param operand, and in the qualified
        name of every function on the call stack that traced it: the Flax modules around it in linen and Hugging
        Face Flax models (`"decoder"`, `"logitdense"`, `"lm_head"`), Equinox's module classes (`"eqx.nn.Linear"`,
        `"eqx.nn.MultiheadAttention"`), any `jax.named_scope` (`jaxamp.layers.attend`'s `"head"`); the weight's
        param path in `fn`'s first argument or its `params=` / `variables=` keyword and each of its prefixes
        (`"blocks"`, `"blocks.0"`, `"blocks.0.up"`, `"blocks.0.up.kernel"`; an NNX model's untied `"head"`, an
        Equinox model's `"lm_head"`); methods and functions (`"Embed.attend"`, NNX's `"Linear.__call__"`, a
        `def head(...)` of the user's). A match keeps `dtype`. Default `FP8_EXCLUDE`: the output head by its usual
        names, whole (`head`, `lm_head`, `logit`, `logits`, `logitdense`, `classifier` (Hugging Face's classification
        heads); `Embed.attend`, the tied-embedding head of linen and NNX; the call of a class whose name ends in `Head`,
        such as `LogitHead.__call__`).

    Returns:
      A function with `fn`'s signature and output structure; outputs keep their shapes, floating ones take the
      dtypes the rules give them (a loss is float32, logits of a final matmul are `dtype`).

    Raises:
      ValueError: `fn` is not callable, or `dtype` is not bfloat16 or float16 (integers, float32/64, float8).
      AutocastError: at call time, a primitive that cannot be rewritten (the message names it).
    """
    compute = _compute_dtype(dtype)
    _check_callable(fn, "autocast")
    mode = Mode(compute, *_fp8_mode(fp8, fp8_exclude), _regexes(float32_results, "float32_results"))

    @functools.wraps(fn)
    def autocast_fn(*args, **kwargs):
        return _run(fn, args, kwargs, mode)

    return autocast_fn  # type: ignore[return-value]


def _fp8_mode(fp8, fp8_exclude) -> tuple:
    """`(Recipe or None, compiled patterns)`; ValueError for an unknown recipe or a pattern that is not a regex."""
    if fp8 is None:
        return None, ()
    return get_recipe(fp8), _regexes(fp8_exclude, "fp8_exclude")


def _regexes(patterns, name: str) -> tuple:
    """`patterns` (one string or a sequence) compiled; ValueError naming `name` for one that is not a regex."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    try:
        return tuple(re.compile(p) for p in patterns)
    except (re.error, TypeError) as err:
        raise ValueError(f"{name} must be regular expressions over module names, got {patterns!r}: {err}") from None


def float32_reference(fn: F) -> F:
    """`fn` with every floating value in float32, overriding the model's own half-precision casts.

    For gradient-fidelity checks: a Flax/HF model built with `dtype=jnp.bfloat16` computes in bfloat16 even with
    float32 params; under this transform its casts to bfloat16/float16 cast to float32, half-precision literals,
    constants and iotas are float32, and matmuls run at `Precision.HIGHEST`. See the module docstring for what
    stays as traced (custom_vjp in half precision, unknown primitives).

    Args:
      fn: any JAX function of pytrees of arrays and static Python values.

    Returns:
      A function with `fn`'s signature; its floating outputs are float32 (float64 stays float64).

    Raises:
      ValueError: `fn` is not callable.
    """
    _check_callable(fn, "float32_reference")

    @functools.wraps(fn)
    def reference_fn(*args, **kwargs):
        return _run(fn, args, kwargs, Mode(None))

    return reference_fn  # type: ignore[return-value]


def disabled():
    """A region of autocast code that keeps its original dtypes (torch's `autocast(enabled=False)`).

    Use `with jaxamp.autocast.disabled():` inside `fn`, or `@jaxamp.autocast.disabled()` on a function it calls.
    The ops traced in it (nested jits, scans and custom derivatives included) run at the dtypes the original
    program gave them; values coming in from autocast ops are cast back to those dtypes. It is a
    `jax.named_scope("jaxamp_autocast_disabled")`, so it has no effect outside autocast. float32_reference ignores it.

    Returns:
      A context manager that also works as a decorator.
    """
    return _disabled_scope()


@contextlib.contextmanager
def _disabled_scope():
    with jax.named_scope(DISABLED_SCOPE):
        yield


autocast.disabled = disabled  # type: ignore[attr-defined]  # jaxamp.autocast.disabled() when it names the function


def _compute_dtype(dtype) -> np.dtype:
    """`dtype` (a dtype or a name) as bfloat16 or float16; raises ValueError naming the fix for anything else."""
    name = _DTYPE_NAMES.get(dtype.lower(), dtype) if isinstance(dtype, str) else dtype
    try:
        resolved = np.dtype(name)
    except TypeError:
        resolved = None
    if resolved not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        raise ValueError(
            f"autocast's dtype must be a half-precision compute dtype: jnp.bfloat16 ('bfloat16'/'bf16') or "
            f"jnp.float16 ('float16'/'fp16'); got {dtype!r}. For float32 call the function without autocast (or "
            f"use float32_reference). For FP8 matmuls in unchanged code, keep bfloat16 and add a stateless recipe: "
            f"autocast(fn, jnp.bfloat16, fp8='current') (or the policies 'fp8-current', 'fp8-block', 'mxfp8').")
    return resolved


def _check_callable(fn, name: str) -> None:
    if not callable(fn):  # ValueError, as for a bad dtype: one kind of error for every bad argument
        raise ValueError(f"{name} needs a function as its first argument (e.g. {name}(model.apply, ...)), got "
                         f"{type(fn).__name__}: {fn!r:.80}")


# ------------------------------------------------------------------------------------------------------- tracing


def _is_dynamic(leaf) -> bool:
    """Whether an argument leaf becomes a jaxpr input (arrays, tracers, numpy values) rather than a static value."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _run(fn, args: tuple, kwargs: dict, mode: Mode):
    """Traces `fn(*args, **kwargs)` to a closed jaxpr and evaluates it under `mode`'s rules."""
    paths, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in paths]
    dynamic = [_is_dynamic(leaf) for leaf in leaves]

    def flat_fn(*dyn):
        it = iter(dyn)
        call_args, call_kwargs = jax.tree.unflatten(treedef, [next(it) if d else x for x, d in zip(leaves, dynamic)])
        return fn(*call_args, **call_kwargs)

    dyn_leaves = [x for x, d in zip(leaves, dynamic) if d]
    names = [_param_path(path) for (path, _), d in zip(paths, dynamic) if d]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_leaves)
    mode = dataclasses.replace(mode, named_params=any(names))
    outs = interpret(closed.jaxpr, closed.consts, dyn_leaves, mode, arg_names=names)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


PARAM_KWARGS = ("params", "variables")  # keyword arguments that hold params (HF Flax's `model(ids, params=...)`)


def _param_path(path) -> str | None:
    """A param leaf's path inside the params, dotted: a leaf of the first positional argument (the params, as in
    `loss_fn(params, batch)`, `model.apply(variables, x)`, `lambda model, x: model(x)`) or of a `PARAM_KWARGS`
    keyword argument: `"decoder.logitdense.kernel"`, `"params.decoder.logitdense.kernel"` for a linen variables
    dict, `"lm_head.weight"` for an Equinox model, `"head.kernel"` for an NNX model passed whole (its variables'
    `.value` dropped); None for other arguments (the batch) and a bare array."""
    where, keys = path[0].idx, list(path[1:])  # (args, kwargs)
    if not keys or (where == 0 and keys[0].idx != 0) or (where == 1 and keys[0].key not in PARAM_KWARGS):
        return None
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in keys[1:]]
    if parts[-1:] == ["value"] and isinstance(keys[-1], jax.tree_util.GetAttrKey):  # an nnx.Variable's array
        parts = parts[:-1]
    return ".".join(parts) or None


# ---------------------------------------------------------------------------------------------------- interpreter


def interpret(jaxpr, consts: Sequence, args: Sequence, mode: Mode, arg_bounds: Sequence | None = None,
              arg_names: Sequence | None = None, traceback=None, arg_hot: Sequence | None = None) -> list:
    """Evaluates an open `jaxpr` on `consts` and `args` (any dtypes), re-binding each equation under `mode`.

    Each equation is bound inside its own source info (traceback and name stack) and equation context, as
    `jax.core.eval_jaxpr` does. `arg_bounds` (optional, per arg) are the largest magnitudes of args known to be
    constants (see `autocast_rules.widest_dtype`); they are tracked through broadcasts and reshapes. `arg_names`
    (optional, per arg) are the param paths of args (see `_param_path`), tracked through casts, reshapes and
    transposes, into nested jits, scan, while and cond bodies, remat and custom_jvp; a matmul with a named operand
    is bound in a `WEIGHT_SCOPE` name scope (rhs first, then lhs). `arg_hot` (optional, per arg): the class axis of
    an arg that holds a one-hot array (`autocast_rules.one_hot_vars`), else None, carried into nested jits and remat
    so that a one-hot made outside a jitted function is a selection inside it. `traceback` (optional) replaces every
    equation's own traceback. An equation whose own traceback holds no frame outside JAX (in the body of a function
    that JAX jitted, such as `jnp.take`, or a `custom_jvp` such as `jax.nn.relu`: that traceback ends at the jitted
    function) takes the traceback of the equation whose rule interprets this jaxpr, at any depth of nesting.

    Returns:
      The jaxpr's outputs (float32_reference mode: low-precision floating ones widened to float32).
    """
    env: dict = {}
    bound: dict = {}
    named: dict = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    def read_bound(v):
        return rules.const_bound(v.val) if isinstance(v, jex_core.Literal) else bound.get(v)

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val, b, n in zip(jaxpr.invars, args, arg_bounds or [None] * len(args), arg_names or [None] * len(args)):
        env[var], bound[var], named[var] = val, b, n
    seeds = {v: axis for v, axis in zip(jaxpr.invars, arg_hot or ()) if axis is not None}
    one_hot = {} if mode.reference else rules.one_hot_vars(jaxpr, seeds=seeds)
    upcast = set() if mode.reference else rules.upcast_eqns(jaxpr)
    for eqn in jaxpr.eqns:
        vals, bounds = [read(v) for v in eqn.invars], [read_bound(v) for v in eqn.invars]
        names = [None if isinstance(v, jex_core.Literal) else named.get(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        rule, extra = _rule(eqn, mode), {}
        if id(eqn) in upcast and rule is rules.widest_rule:  # only float32 reads it: softmax's x - max(x)
            rule = rules.float32_rule
        if rule in _NAMED_RULES and any(names):
            extra = {"names": names}
        hot = [None if isinstance(v, jex_core.Literal) else one_hot.get(v) for v in eqn.invars] if one_hot else []
        if rule in _HOT_RULES and any(axis is not None for axis in hot):
            extra["hot"] = hot
        if eqn.primitive.name == "dot_general" and any(axis is not None for axis in hot[:2]) and \
                rule is rules.FIRST_ORDER_RULES["dot_general"]:
            selects = rules.selects(eqn, hot[:2])
            if any(selects):
                rule, extra = rules.selection_rule, {"one_hot": selects}
        own = traceback or _traceback(eqn, _ENCLOSING.get())
        with _enclosing(own), source_info_util.user_context(own, name_stack=name_stack), \
                _eqn_context(eqn), \
                _weight_scope(eqn, names):
            outs = rules.check_outputs(eqn, rule(eqn, vals, mode, bounds, **extra), mode)
        for var, out in zip(eqn.outvars, outs):
            if not isinstance(var, jex_core.DropVar):
                env[var] = out
        if eqn.primitive.name in rules.BOUND_PRESERVING and bounds and bounds[0] is not None:
            bound[eqn.outvars[0]] = bounds[0]
        carried = rules.carried_name(eqn, names) if eqn.outvars else None
        if carried is not None:
            named[eqn.outvars[0]] = carried
    outs = [read(v) for v in jaxpr.outvars]
    return [cast(x, rules.F32) if mode.reference and rules.is_low_float(dtype_of(x)) else x for x in outs]


_ENCLOSING = contextvars.ContextVar("jaxamp_autocast_enclosing_traceback", default=None)


@contextlib.contextmanager
def _enclosing(traceback):
    """`traceback` as the one the equations of a sub-jaxpr interpreted inside fall back to (`_traceback`)."""
    token = _ENCLOSING.set(traceback)
    try:
        yield
    finally:
        _ENCLOSING.reset(token)


def _traceback(eqn, fallback):
    """`eqn`'s traceback, or `fallback` where it has no frame outside JAX."""
    own = eqn.source_info.traceback
    if fallback is None or (own is not None and source_info_util.summarize(eqn.source_info)):
        return own
    return fallback  # summarize: "" where no frame is outside JAX


def _weight_scope(eqn, names: list):
    """`jax.named_scope("jaxamp_weight:<path>")` for a matmul with a param operand (rhs, else lhs), else nothing."""
    if eqn.primitive.name not in rules.MATMUL_OPS or not any(names[:2]):
        return contextlib.nullcontext()
    return jax.named_scope(f"{rules.WEIGHT_SCOPE}:{names[1] or names[0]}")


def _eqn_context(eqn):
    ctx = getattr(eqn, "ctx", None)
    return ctx.manager if ctx is not None else contextlib.nullcontext()


def _is_disabled(eqn) -> bool:
    return any(getattr(s, "name", None) == DISABLED_SCOPE for s in eqn.source_info.name_stack.stack)


def _rule(eqn, mode: Mode):
    """The rule for `eqn`: its original form inside `disabled()`, else by primitive (unknown: original)."""
    if not mode.reference and _is_disabled(eqn):
        return rules.original_rule
    name = eqn.primitive.name
    return HIGHER_ORDER_RULES.get(name) or rules.FIRST_ORDER_RULES.get(name) or rules.original_rule


def _closed_fn(closed, mode: Mode, names: Sequence | None = None, hot: Sequence | None = None
               ) -> Callable[..., list]:
    """A ClosedJaxpr as a function of its inputs (their param paths `names`, the class axes of those that are
    one-hot `hot`), interpreted under `mode`."""
    return lambda *xs: interpret(closed.jaxpr, closed.consts, xs, mode, arg_names=names, arg_hot=hot)


# ----------------------------------------------------------------------------------------------- higher-order rules


def _jit_rule(eqn, vals, mode: Mode, bounds=None, names=None, hot=None) -> list:
    """Nested jit: inlined (interpreted in place); specified in/out shardings become sharding constraints.
    `jaxamp.attention.dot_product_attention`'s jit: cuDNN's fused attention in the compute dtype where it applies."""
    params = eqn.params
    fused = _fused_attention(eqn, vals, mode)
    if fused is not None:
        return [fused]
    vals = _constrain(vals, params.get("in_shardings"))
    closed = params["jaxpr"]
    # A jit's body is traced with tracebacks that end at the jitted function; jaxamp.attention's (library code)
    # takes its call's instead (so the audit finds the user's line that called it), as `interpret` gives an equation
    # with no frame outside JAX (`jnp.take`'s gather, the scatter of its gradient) its caller's.
    traceback = eqn.source_info.traceback if params.get("name") in ATTENTION_JIT_NAMES else None
    outs = interpret(closed.jaxpr, closed.consts, vals, mode, bounds, names, traceback=traceback, arg_hot=hot)
    return _constrain(outs, params.get("out_shardings"))


def _fused_attention(eqn, vals, mode: Mode):
    """A `jaxamp.attention` call as torch.amp runs `scaled_dot_product_attention`: query, key and value cast to the
    compute dtype and cuDNN's fused kernel (on a GPU, no mask); None where that does not apply."""
    is_causal = ATTENTION_JIT_NAMES.get(eqn.params.get("name"))
    if is_causal is None or mode.reference or len(vals) != 3:  # vals: query, key, value (a mask would be 4th)
        return None
    if not all(dtype_of(v) in rules.ELIGIBLE for v in vals):
        return None
    return cudnn_attention(*(cast(v, mode.compute) for v in vals), is_causal=is_causal)


def _constrain(vals: list, shardings) -> list:
    if shardings is None:
        return list(vals)
    return [lax.with_sharding_constraint(x, s) if isinstance(s, jax.sharding.Sharding) else x
            for x, s in zip(vals, shardings)]


def _closed_call_rule(eqn, vals, mode: Mode, bounds=None, names=None, hot=None) -> list:
    """closed_call / core_call: inlined."""
    call = eqn.params["call_jaxpr"]
    if isinstance(call, jex_core.ClosedJaxpr):
        return interpret(call.jaxpr, call.consts, vals, mode, bounds, names, arg_hot=hot)
    return interpret(call, [], vals, mode, bounds, names, arg_hot=hot)


def _scan_rule(eqn, vals, mode: Mode, bounds=None, names=None, hot=None) -> list:
    """scan: `lax.scan` over an interpreted body; carries keep their original dtype, stacked outputs the body's.
    Consts and xs keep their param paths in the body (a layer of `nn.scan`'s stacked params is that param), and a
    one-hot among them stays one (a character RNN's `one_hot(tokens)` scanned over time: a slice along the leading
    axis is one-hot along its last)."""
    p = eqn.params
    closed, (n_consts, n_carry) = p["jaxpr"], _scan_counts(p)
    consts, init, xs = vals[:n_consts], vals[n_consts:n_consts + n_carry], vals[n_consts + n_carry:]
    targets = [mode.fixed_dtype(a.dtype) for a in closed.in_avals[n_consts:n_consts + n_carry]]
    if names is not None:
        names = [*names[:n_consts], *[None] * n_carry, *names[n_consts + n_carry:]]
    if hot is not None:  # (an xs slice drops the leading axis: a class axis 0 leaves no one-hot)
        hot = [*hot[:n_consts], *[None] * n_carry,
               *[axis - 1 if axis else None for axis in hot[n_consts + n_carry:]]]
    body_fn = _closed_fn(closed, mode, names, hot)

    def body(carry, x):
        outs = body_fn(*consts, *carry, *x)
        return [strong_cast(c, t) for c, t in zip(outs[:n_carry], targets)], outs[n_carry:]

    init = [strong_cast(c, t) for c, t in zip(init, targets)]
    carry, ys = lax.scan(body, init, list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def _scan_counts(params: dict) -> tuple[int, int]:
    """`(consts, carries)` of a scan equation: jax 0.10's `num_consts` / `num_carry`, or jax 0.11's `ft_in` (the
    consts', carries' and xs' groups)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()  # jax._src.flattree FlatTrees, one leaf per operand
    return len(list(consts.vals)), len(list(carries.vals))


def _while_rule(eqn, vals, mode: Mode, bounds=None, names=None, hot=None) -> list:
    """while: `lax.while_loop` over interpreted cond and body; carries keep their original dtype (the cond's and the
    body's consts keep their param paths, and a one-hot among them stays one)."""
    p = eqn.params
    cond_j, body_j, n_c, n_b = p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = vals[:n_c], vals[n_c:n_c + n_b], vals[n_c + n_b:]
    targets = [mode.fixed_dtype(a.dtype) for a in body_j.in_avals[n_b:]]

    def consts_only(per_arg, start, stop):  # the consts' entries; the carries' None
        return None if per_arg is None else [*per_arg[start:stop], *[None] * len(init)]

    cond_fn = _closed_fn(cond_j, mode, consts_only(names, 0, n_c), consts_only(hot, 0, n_c))
    body_fn = _closed_fn(body_j, mode, consts_only(names, n_c, n_c + n_b), consts_only(hot, n_c, n_c + n_b))

    def body(carry):
        return [strong_cast(c, t) for c, t in zip(body_fn(*body_consts, *carry), targets)]

    init = [strong_cast(c, t) for c, t in zip(init, targets)]
    return list(lax.while_loop(lambda carry: cond_fn(*cond_consts, *carry)[0], body, init))


def _cond_rule(eqn, vals, mode: Mode, bounds=None, names=None, hot=None) -> list:
    """cond: `lax.switch` over interpreted branches; each output cast to the widest dtype the branches give it.

    Each branch is interpreted once (to a jaxpr, whose output dtypes decide the casts); the switch re-traces those
    jaxprs, not the interpreter, so nested conds cost one interpretation each.
    """
    index, *ops = vals
    ops_names = None if names is None else names[1:]
    ops_hot = None if hot is None else hot[1:]
    branches = [jax.make_jaxpr(_closed_fn(branch, mode, ops_names, ops_hot))(*ops)
                for branch in eqn.params["branches"]]
    targets = []
    for i, var in enumerate(eqn.outvars):
        dts = [b.out_avals[i].dtype for b in branches]
        floats = [d for d in dts if d in rules.ELIGIBLE]
        targets.append(rules.widest(floats) if len(floats) == len(dts) else var.aval.dtype)

    def branch_fn(closed):
        fn = jex_core.jaxpr_as_fun(closed)
        return lambda *xs: [strong_cast(o, t) for o, t in zip(fn(*xs), targets)]

    return list(lax.switch(index, [branch_fn(b) for b in branches], *ops))


def _remat_rule(eqn, vals, mode: Mode, bounds=None, names=None, hot=None) -> list:
    """checkpoint/remat: re-wrapped with `jax.checkpoint` (same policy and prevent_cse) over the interpreted body."""
    p = eqn.params
    jaxpr = p["jaxpr"]
    if jaxpr.constvars:
        return rules.original_rule(eqn, vals, mode, bounds)
    fn = jax.checkpoint(lambda *xs: interpret(jaxpr, [], xs, mode, arg_names=names, arg_hot=hot),
                        prevent_cse=p["prevent_cse"],
                        policy=p["policy"])
    return list(fn(*vals))


def _shard_map_rule(eqn, vals, mode: Mode, bounds=None) -> list:
    """shard_map: re-wrapped with `jax.shard_map` (same mesh, specs, manual axes, check_vma) over the body."""
    p = eqn.params
    axes = p.get("newly_manual_axes", p.get("manual_axes"))
    if axes is None:
        raise AutocastError(f"autocast: shard_map params {sorted(p)} (this jax version) are not supported; keep it "
                            f"in its original dtypes with `with jaxamp.autocast.disabled():` around the shard_map")
    jaxpr = p["jaxpr"]
    fn = jax.shard_map(lambda *xs: tuple(interpret(jaxpr, [], xs, mode)), mesh=p["mesh"],
                       in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]), axis_names=set(axes),
                       check_vma=p.get("check_vma", True))
    return list(fn(*vals))


def _custom_jvp_rule(eqn, vals, mode: Mode, bounds=None, names=None, hot=None) -> list:
    """custom_jvp: primal interpreted under `mode`, JVP by the user's rule on the original dtypes.

    Autocast: the rule is `jax.jvp` of the original primitive (original params) on primals and tangents cast to the
    original dtypes; its tangents are cast to the new primal outputs' dtypes. float32_reference: that JVP is traced
    to a jaxpr at the original dtypes and interpreted in float32.
    """
    call = eqn.params["call_jaxpr"]
    primal = _closed_fn(call, mode, names, hot)
    in_avals = [v.aval for v in eqn.invars]

    def primal_fn(*xs):
        return primal(*xs)

    primal_fn.__name__ = getattr(call.jaxpr.debug_info, "func_name", None) or "custom_jvp"
    fn = jax.custom_jvp(primal_fn)

    def jvp(primals, tangents):
        out = primal(*primals)
        if mode.reference:
            out_t = _reference_tangents(eqn, primals, tangents, mode)
        else:
            p0 = [cast(x, a.dtype) for x, a in zip(primals, in_avals)]
            t0 = [_cast_tangent(t, a.dtype) for t, a in zip(tangents, in_avals)]
            _, out_t = jax.jvp(lambda *xs: rules.bind(eqn, xs), p0, t0)
        return out, [_cast_tangent(t, dtype_of(o)) for t, o in zip(out_t, out)]

    fn.defjvp(jvp)
    return list(fn(*vals))


def _cast_tangent(t, primal_dtype):
    dt = tangent_dtype(primal_dtype)
    return t if dt == np.dtype(jax.dtypes.float0) else cast(t, dt)


def _reference_tangents(eqn, primals, tangents, mode: Mode) -> list:
    """The original JVP of a custom_jvp eqn, traced at its original dtypes and interpreted in float32."""
    in_avals = [v.aval for v in eqn.invars]
    diff = [tangent_dtype(a.dtype) != np.dtype(jax.dtypes.float0) for a in in_avals]

    def orig_jvp(ps, ts):
        it = iter(ts)
        full = [next(it) if d else np.zeros(a.shape, jax.dtypes.float0) for a, d in zip(in_avals, diff)]
        return jax.jvp(lambda *xs: rules.bind(eqn, xs), list(ps), full)[1]

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
    closed = jax.make_jaxpr(orig_jvp)(specs, [s for s, d in zip(specs, diff) if d])
    return interpret(closed.jaxpr, closed.consts, [*primals, *(t for t, d in zip(tangents, diff) if d)], mode)


HIGHER_ORDER_RULES: dict[str, Callable[[Any, list, Mode], list]] = {
    jex_core.primitives.jit_p.name: _jit_rule,
    jex_core.primitives.closed_call_p.name: _closed_call_rule,
    jex_core.primitives.call_p.name: _closed_call_rule,
    jex_core.primitives.scan_p.name: _scan_rule,
    jex_core.primitives.while_p.name: _while_rule,
    jex_core.primitives.cond_p.name: _cond_rule,
    jex_core.primitives.remat_p.name: _remat_rule,
    jex_core.primitives.custom_jvp_call_p.name: _custom_jvp_rule,
    jex_core.primitives.custom_vjp_call_p.name: rules.original_rule,
    "shard_map": _shard_map_rule,
}

# The higher-order rules that carry their operands' param paths (`names=`) into their bodies.
_NAMED_RULES = frozenset({_jit_rule, _closed_call_rule, _scan_rule, _while_rule, _cond_rule, _remat_rule,
                          _custom_jvp_rule})
# The higher-order rules that carry which operands are one-hot (`hot=`) into their bodies.
_HOT_RULES = frozenset({_jit_rule, _closed_call_rule, _scan_rule, _while_rule, _cond_rule, _remat_rule,
                        _custom_jvp_rule})
