"""FP8 matmuls for Flax NNX: Flax's linen FP8 ops (`Fp8DirectDotGeneralOp`, `Fp8Einsum`) as NNX modules.

Flax 0.12 ships delayed-scaling FP8 for linen only. These modules run the same functions
(`flax.linen.fp8_ops.fp8_scaled_dot_general`) with the same variable names, as `Fp8Meta` variables, the NNX form of
linen's `"_overwrite_with_gradient"` collection (`nnx.bridge` maps one to the other). Plug them into NNX's layers:

    nnx.Linear(784, 256, dot_general=Fp8DotGeneral(), rngs=rngs)
    nnx.Einsum("bsd,dhk->bshk", (768, 12, 64), einsum_op=Fp8Einsum(), rngs=rngs)

and train with `jaxamp.nnx.train_step`, which updates the `Fp8Meta` variables as `jaxamp.train_step` does linen's
collection. The algorithm (per tensor: inputs and kernels in e4m3, output gradients in e5m2):

    scale = max(amax_history) / format_max           (delayed: from earlier steps; unchanged while the history is 0)
    q = saturate(x / scale) in FP8                   (clip to +-448 or +-57344, then round)
    y = dot(q_lhs, q_rhs) * lhs_scale * rhs_scale    (XLA:GPU fuses this into a cuBLASLt FP8 GEMM on Hopper)
    amax_history = roll(amax_history, -1); amax_history[0] = max|x|     (newest at index 0, the one before at -1)

Two switches serve `jaxamp.nnx.fp8_ranges` and `jaxamp.nnx.grad_fidelity`: while `jaxamp.fp8_report` records, each
op reports its operands, variables and output; while FP8 is bypassed (the float32 reference of the fidelity check),
each op computes the plain `lax.dot_general` / `jnp.einsum` in its kernel's dtype.
"""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from flax.nnx import variablelib

from jaxamp import fp8_report
from jaxamp.fp8_collection import FP8_COLLECTION

__all__ = ["Fp8DotGeneral", "Fp8Einsum", "Fp8Meta"]


class Fp8Meta(nnx.Variable):
    """An FP8 scale or amax history (float32): a variable whose "gradient" is its new value.

    The NNX form of linen's `"_overwrite_with_gradient"` collection (registered under that name, so
    `nnx.bridge.ToNNX` maps a linen FP8 op's variables to this type). `jaxamp.nnx.train_step` differentiates these
    variables and takes their "gradient" as their new value, as `jaxamp.train_step` does with the linen collection.
    """


if FP8_COLLECTION not in variablelib.VariableTypeCache:
    nnx.register_variable_name(FP8_COLLECTION, Fp8Meta)
# The FP8 variables: `Fp8Meta`, and whatever type the collection name was registered to before this module ran.
FP8_FILTER = nnx.Any(Fp8Meta, variablelib.variable_type_from_name(FP8_COLLECTION))


class Fp8Op(nnx.Module):
    """The FP8 state of one op (three tensors: input, kernel, output gradient) and its scaled dot_general."""

    def __init__(self, amax_history_length: int = 1024):
        """Zero histories and unit scales.

        Args:
          amax_history_length: steps of amax history per tensor (1024, as the linen ops and Transformer Engine).

        Raises:
          ValueError: `amax_history_length` is not a positive int.
        """
        if isinstance(amax_history_length, bool) or not isinstance(amax_history_length, int) or \
                amax_history_length < 1:
            raise ValueError(f"amax_history_length must be a positive int (steps of amax history), got "
                             f"{amax_history_length!r}")
        for tensor in ("input", "kernel", "output_grad"):
            setattr(self, f"{tensor}_amax_history", Fp8Meta(jnp.zeros((amax_history_length,), jnp.float32)))
            setattr(self, f"{tensor}_scale", Fp8Meta(jnp.ones((1,), jnp.float32)))

    def _dot_general(self, dtype, swapped: bool = False):
        """A `dot_general(x, y, dimension_numbers, ...)` through FP8 with this op's variables, quantizing and
        accumulating in `dtype`: x takes the input's scale and history, y the kernel's, or the other way round when
        `swapped` (`jnp.einsum` contracts `(rhs, lhs)` when that saves a transpose: `fp8_report.einsum_swaps`)."""
        inputs = (self.input_scale[...], self.input_amax_history[...])
        kernel = (self.kernel_scale[...], self.kernel_amax_history[...])
        (x_scale, x_history), (y_scale, y_history) = (kernel, inputs) if swapped else (inputs, kernel)

        def dot(x, y, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
            del precision, preferred_element_type, kwargs  # the FP8 matmul fixes them
            return fp8_ops.fp8_scaled_dot_general(
                x, y, dimension_numbers, preferred_element_type=dtype, lhs_scale=x_scale, rhs_scale=y_scale,
                grad_scale=self.output_grad_scale[...], lhs_amax_history=x_history, rhs_amax_history=y_history,
                grad_amax_history=self.output_grad_amax_history[...], quantize_compute_type=dtype)

        return dot

    def _run(self, lhs: jax.Array, rhs: jax.Array, compute, swapped: bool = False,
             eqn: str | None = None) -> jax.Array:
        """`compute(lhs, kernel, dot_general)` in `rhs`'s dtype: through FP8 (float32 under float16 compute, which
        cannot hold the sum of FP8 products before dequantization, up to 448^2 per term), or plain while bypassed."""
        lhs = jnp.asarray(lhs, rhs.dtype)
        if fp8_report.bypassed():
            return fp8_report.record_nnx_op(self, lhs, rhs, compute(lhs, rhs, jax.lax.dot_general), eqn)
        dtype = jnp.float32 if rhs.dtype == jnp.float16 else rhs.dtype  # the dtype the FP8 op runs in
        x, k = lhs.astype(dtype), rhs.astype(dtype)
        out = compute(x, k, self._dot_general(dtype, swapped)).astype(rhs.dtype)
        return fp8_report.record_nnx_op(self, lhs, rhs, out, eqn)


class Fp8DotGeneral(Fp8Op):
    """Flax's `Fp8DirectDotGeneralOp` as an NNX module: a `dot_general` in FP8 with delayed per-tensor scaling.

    Inputs and kernels are quantized to e4m3 and output gradients to e5m2, each with a scale from its amax history
    (the module docstring gives the algorithm). As `jaxamp.layers.Dense(fp8=True)` does, float16 compute quantizes
    and accumulates in float32 and casts the result back. Give each layer its own (a layer called several times in
    one loss is fine: `train_step` keeps the largest amax of its calls):

        nnx.Linear(784, 256, dot_general=Fp8DotGeneral(), rngs=rngs)

    Attributes:
      input_scale, kernel_scale, output_grad_scale: `Fp8Meta` of f32[1], initially 1.
      input_amax_history, kernel_amax_history, output_grad_amax_history: `Fp8Meta` of f32[amax_history_length],
        initially 0; the newest amax at index 0, the step before's at index -1, then -2, ... (Flax rolls by -1).
    """

    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs) -> jax.Array:
        """`lax.dot_general(lhs, rhs, dimension_numbers)` through FP8, in `rhs`'s (the kernel's) dtype.

        Args:
          lhs: the inputs, any float dtype (cast to `rhs.dtype`, as the linen op does).
          rhs: the kernel, in the compute dtype (e.g. bf16[in, out]).
          dimension_numbers: as for `lax.dot_general`.
          precision, preferred_element_type, kwargs: ignored, as by the linen op (the FP8 matmul fixes them; the
            output is in the compute dtype).

        Returns:
          The product in `rhs.dtype`.
        """
        del precision, preferred_element_type, kwargs
        return self._run(lhs, rhs, lambda x, k, dot: dot(x, k, dimension_numbers))


class Fp8Einsum(Fp8Op):
    """Flax's linen `Fp8Einsum` as an NNX module: an einsum of two operands (inputs, kernel) in FP8 with delayed
    per-tensor scaling, for `nnx.Einsum`'s `einsum_op` (attention projections with head axes, MoE experts):

        nnx.Einsum("bsd,dhk->bshk", (768, 12, 64), einsum_op=Fp8Einsum(), rngs=rngs)

    The einsum's contraction runs as one FP8 `dot_general` (`jnp.einsum`'s `_dot_general`), as in the linen op,
    with one difference: where `jnp.einsum` contracts the kernel first (`"bi,io->ob"`), the linen op quantizes the
    kernel with the input's variables and the inputs with the kernel's; here each tensor keeps its own names.
    Attributes as `Fp8DotGeneral`'s.
    """

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision=None, preferred_element_type=None,
                 **kwargs) -> jax.Array:
        """`jnp.einsum(eqn, lhs, rhs)` through FP8, in `rhs`'s (the kernel's) dtype.

        Args:
          eqn: an einsum equation of two operands, e.g. `"bsd,dhk->bshk"`.
          lhs: the inputs, any float dtype (cast to `rhs.dtype`).
          rhs: the kernel, in the compute dtype.
          precision, preferred_element_type, kwargs: ignored (`nnx.Einsum` passes `out_sharding`: the FP8 matmul's
            output follows its operands' sharding).

        Returns:
          The einsum in `rhs.dtype`.
        """
        del precision, preferred_element_type, kwargs
        lhs = jnp.asarray(lhs)
        return self._run(lhs, rhs, lambda x, k, dot: jnp.einsum(eqn, x, k, _dot_general=dot),
                         swapped=fp8_report.einsum_swaps(eqn, lhs.shape, rhs.shape), eqn=eqn)
