"""The backend keeps what mixed precision assumes of it: half-precision matmuls accumulate in float32.

jaxamp (like torch.amp and jmp) hands the backend bfloat16/float16 operands and trusts it to sum their products in
float32, as cuBLAS and, up to jaxlib 0.11.1, XLA:CPU do. jaxlib 0.11.2 and 0.12.0.1 break this on the CPU for one
common case, measured on this machine: the weight gradient of `x @ w` with `x` of shape [batch, seq, width] (a Dense
layer on a sequence), which XLA's dot decomposer turns into a bfloat16 dot that is neither upcast nor sent to YNNPACK.
Its error over 4,096 tokens is 2.1% against 0.17% (one bfloat16 rounding of the result) on jaxlib 0.11.1 and 0.10.2;
float16 is unaffected (0.021% on all three). pyproject.toml therefore leaves jaxlib 0.11.2 out; this test says so at
once where such a jaxlib is installed anyway, before the fidelity tests fail on it one by one.
"""
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

ROUNDING = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}  # unit roundoff of the result (one rounding)


def _weight_gradient_error(dtype, batch_shape) -> float:
    """Relative error, against float64, of d/dw sum((x @ w) * y) with x: dtype[*batch_shape, 192], w: dtype[192, 64]."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((*batch_shape, 192)), dtype)
    w = jnp.asarray(rng.standard_normal((192, 64)), dtype)
    y = jnp.asarray(rng.standard_normal((*batch_shape, 64)) + 0.5, jnp.float32)
    grad = jax.jit(jax.grad(lambda w, x, y: jnp.sum((x @ w).astype(jnp.float32) * y)))(w, x, y)
    want = np.asarray(x, np.float64).reshape(-1, 192).T @ np.asarray(y.astype(dtype), np.float64).reshape(-1, 64)
    got = np.asarray(grad, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch_shape", [(4096,), (64, 64)], ids=["tokens", "batch-seq"])
def test_a_half_precision_weight_gradient_sums_4096_tokens_in_float32(dtype, batch_shape):
    error = _weight_gradient_error(dtype, batch_shape)
    # one rounding of the float32 sum to `dtype` gives about 0.4 units; a half-precision sum over 4,096 terms ~10x more
    assert 0 < error < 2 * ROUNDING[dtype], (
        f"jaxlib {jaxlib.__version__} on {jax.default_backend()}: the {jnp.dtype(dtype).name} weight gradient over "
        f"{batch_shape} tokens is {error:.2%} off float64, more than one {jnp.dtype(dtype).name} rounding of a float32 "
        "sum: this backend accumulates half-precision matmuls in half precision (XLA:CPU in jaxlib 0.11.2 and "
        "0.12.0.1 does so for bfloat16). jaxamp's precision figures and its fidelity tests assume float32 "
        "accumulation; install jaxlib 0.11.1 or 0.10.2 for CPU runs (GPUs accumulate in float32).")
