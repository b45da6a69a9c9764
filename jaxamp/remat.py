"""A rematerialisation policy for mixed-precision blocks: recompute the elementwise ops, save everything else.

Under `jax.checkpoint` (`nn.remat`, `nnx.remat`, `eqx.filter_checkpoint`) a policy decides which values the forward
pass saves for the backward; the others are recomputed there from what was saved. Inside a `lax.scan` (`nn.scan`,
`--scan-layers`) that choice is the whole story: the scan stacks every saved value per layer and XLA cannot fuse
the backward's use of a value into its producer as it does in an unrolled program.

Without a policy, JAX saves the elementwise intermediates too, and under `jaxamp.autocast` they are float32 (a
half-precision matmul's output plus a float32 bias is float32 by the widest-type rule): GELU's float32 input and
its tanh/erf terms, the float32 q, k, v before the attention's cast. Measured on GPT-2 XL's block (width 1600,
8 x 1024 tokens, scanned; XLA:GPU's memory analysis for an H200, `benchmarks/gpu_compile.py`), the temporaries
grow per layer by 935 MiB under the bf16 cast policy, 1,352 MiB under `bf16;autocast`, 1,235 MiB under `fp8-current`.

`recompute_elementwise` saves the outputs of every op but the cheap ones: matmul outputs (in the compute dtype
under autocast), attention kernels and their statistics, reductions (norm statistics, FP8 amaxes), gathers, and
FP8 GEMM outputs once scaled and narrowed (`FP8_OUTPUT_NAME`); it recomputes elementwise arithmetic, every convert
(the FP8 quantization of an operand included: a multiply and a cast of a recomputed value by its saved amax),
comparisons, selects and data movement (reshape, transpose, broadcast, slice, split, concatenate), also inside a
custom_jvp / custom_vjp made of nothing else (`jaxamp.layers.add_bias`, `jax.nn.relu`). No matmul or attention
kernel runs twice. It is `jax.checkpoint_policies.dots_saveable` widened to every non-elementwise op: `dots_saveable`
recomputes the attention kernel (a custom call, not a dot) and under `fp8-current` saves the float32 output of each
`f8 . f8` dot. At 8 scanned GPT-2 XL layers (compiled for an H200) it holds temp bf16 5,617 MiB, bf16-autocast 4,485,
fp8-current 6,448 with 3 cuDNN attention calls where this policy holds 5,824, 4,617 and 4,457 with 2.

Check what a policy saves with `jax.ad_checkpoint.print_saved_residuals(fn, *args)`, or compare
`jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes` with and without it.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["ELEMENTWISE", "FP8_OUTPUT_NAME", "recompute_elementwise"]

# `jax.ad_checkpoint.checkpoint_name` of an FP8 matmul's output after its scales and its cast to the compute dtype
# (`jaxamp.fp8_recipes`): saved instead of the `f8 . f8 -> f32` dot before them, at a half or quarter of its bytes.
FP8_OUTPUT_NAME = "jaxamp_fp8_output"

# Primitives recomputed in the backward pass: elementwise arithmetic and functions, converts, comparisons and
# selects, and data movement. Everything else (dot_general, conv, reductions, gathers, scatters, sorts, custom
# calls, loops) is saved.
ELEMENTWISE = frozenset({
    "abs", "add", "add_any", "and", "atan2", "broadcast_in_dim", "cbrt", "ceil", "clamp", "concatenate",
    "convert_element_type", "copy", "copy_p", "cos", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
    "expand_dims", "expm1", "floor", "ge", "gt", "integer_pow", "iota", "is_finite", "le", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pad", "pow", "reduce_precision",
    "rem", "reshape", "rev", "round", "rsqrt", "select_n", "sign", "sin", "slice", "split", "sqrt", "square",
    "squeeze", "stop_gradient", "sub", "tan", "tanh", "transpose", "xor",
})

_CUSTOM_CALLS = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def recompute_elementwise(prim, *avals, **params) -> bool:
    """A `jax.checkpoint` policy: whether the output of `prim` is saved for the backward pass.

    Saved: everything but the elementwise ops, converts and data movement of `ELEMENTWISE` (and custom_jvp /
    custom_vjp calls made of them only); in particular matmul outputs, attention, reductions and values named
    `FP8_OUTPUT_NAME`. Not saved: an `f8 . f8 -> float32` dot_general, whose scaled, narrowed output
    `jaxamp.fp8_recipes` names `FP8_OUTPUT_NAME` (it is not recomputed: the backward reads the named value).

    Use: `jax.checkpoint(block, policy=recompute_elementwise)`, `nn.remat(Block, policy=recompute_elementwise)`
    (inside `nn.scan`, `prevent_cse=False` is safe: the loop already keeps XLA from merging the recomputation into
    the forward pass), `nnx.remat`, `eqx.filter_checkpoint`, the LM's `--remat elementwise`.

    Args:
      prim: the primitive; avals: its inputs' abstract values; params: its parameters (JAX's policy signature).

    Returns:
      True to save the output, False to recompute it.
    """
    name = prim.name
    if name == "name":
        return params.get("name") == FP8_OUTPUT_NAME
    if name == "dot_general":
        return not (all(jnp.dtype(a.dtype).itemsize == 1 for a in avals)
                    and jnp.dtype(params.get("preferred_element_type") or avals[0].dtype) == jnp.float32)
    if name in _CUSTOM_CALLS:
        return not _all_elementwise(params.get("call_jaxpr") or params.get("fun_jaxpr"))
    return name not in ELEMENTWISE


def _all_elementwise(jaxpr) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's jaxpr
    return jaxpr is not None and all(e.primitive.name in ELEMENTWISE for e in jaxpr.eqns)
