"""Precision policies: which dtype each tensor is stored, computed and returned in.

A policy is a `jmp.Policy` (params, compute and output dtypes). jaxamp adds three presets that name the usual
mixed-precision set-ups; every jmp policy string is accepted as well.

| preset | params (master weights) | compute | output |
| --- | --- | --- | --- |
| `"fp32"` | float32 | float32 | float32 |
| `"bf16"` | float32 | bfloat16 | float32 |
| `"fp16"` | float32 | float16 | float32 |
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jmp

Policy = jmp.Policy

PRESETS: dict[str, Policy] = {
    "fp32": jmp.Policy(jnp.float32, jnp.float32, jnp.float32),
    "bf16": jmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    "fp16": jmp.Policy(jnp.float32, jnp.float16, jnp.float32),
}

_JMP_FORMS = ('"params=float32,compute=float16,output=float32"', '"p=f32,c=bf16"', 'a dtype name such as "float32"')


def get_policy(spec: str | Policy) -> Policy:
    """Returns the precision policy named by `spec`.

    Args:
      spec: a preset (`"fp32"`, `"bf16"`, `"fp16"`), `"auto"` (see `auto_precision`), any policy string that `jmp.get_policy` parses (e.g.
        `"params=float32,compute=float16,output=float32"` or `"p=f32,c=bf16"`; jmp's rule applies: an unnamed output
        dtype follows the compute dtype), or a `jmp.Policy`, returned as is.

    Returns:
      A `jmp.Policy` whose `cast_to_compute` casts the float32 master weights to the compute dtype.

    Raises:
      ValueError: the name is neither a preset nor a jmp policy string; the message lists the accepted forms.
    """
    if isinstance(spec, jmp.Policy):
        return spec
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return PRESETS[auto_precision()[0]]
    if not isinstance(spec, str):
        raise ValueError(f"precision policy must be a string or jmp.Policy, got {type(spec).__name__}")
    name = spec.strip()
    if name.lower() in PRESETS:
        return PRESETS[name.lower()]
    try:
        return jmp.get_policy(name)
    except (ValueError, KeyError) as err:
        accepted = ", ".join(f'"{p}"' for p in (*PRESETS, "auto"))
        raise ValueError(
            f"unknown precision policy {spec!r} ({err}); accepted: the presets {accepted}, or a jmp policy string "
            f"({'; '.join(_JMP_FORMS)})"
        ) from None


def policy_name(policy: Policy) -> str:
    """Returns the preset name of `policy` if it is one, else jmp's short form (e.g. `"p=f32,c=f16,o=f16"` for
    `get_policy("float16")`; jmp writes float32 as `full` in some forms). `get_policy(policy_name(p)) == p`."""
    for name, preset in PRESETS.items():
        if preset == policy:
            return name
    return str(policy)


def needs_loss_scaling(policy: Policy) -> bool:
    """True when the compute dtype is float16, whose narrow exponent range makes gradients underflow unscaled.

    bfloat16 shares float32's exponent range, so bf16 and fp32 policies train without a loss scale
    (Micikevicius et al., 2018; torch.amp recommends GradScaler for float16 only).
    """
    return jnp.dtype(policy.compute_dtype) == jnp.dtype(jnp.float16)


def _capability(device) -> tuple[int, int] | None:
    """A CUDA device's compute capability as `(major, minor)`, or None where the device does not say."""
    try:
        major, _, minor = str(getattr(device, "compute_capability", "")).partition(".")
        return int(major), int(minor or 0)
    except ValueError:
        return None


def auto_precision(device: jax.Device | None = None) -> tuple[str, str]:
    """Picks a preset for `device` (default: the first device) and says why.

    - bf16 where half precision is fast and needs no loss scale: GPUs of compute capability >= 8.0 (Ampere and
      newer), TPUs.
    - fp16 with dynamic loss scaling where only float16 is fast: compute capability 7.x (Volta and Turing tensor
      cores), and 6.0, 6.2 and 5.3 (P100 and Jetson chips: float16 at twice the float32 rate).
    - fp32 elsewhere: other Pascal and older GPUs (6.1's float16 runs at 1/64 of the float32 rate), GPUs that do not
      report a compute capability (e.g. ROCm; choose `--precision` yourself), and CPUs (XLA:CPU computes
      half-precision dots in float32, so there is nothing to gain).

    Returns:
      `(preset name, reason)`, e.g. `("fp32", "cpu: no fast half-precision matmuls")`.
    """
    device = device or jax.devices()[0]
    if device.platform == "tpu":
        return "bf16", f"{device.device_kind}: TPUs compute in bfloat16 natively"
    if device.platform == "gpu":
        cc = _capability(device)
        where = f"{device.device_kind} (compute capability {'.'.join(map(str, cc)) if cc else 'unknown'})"
        if cc is None:
            return "fp32", f"{where}: choose --precision bf16 or fp16 yourself if it has fast half precision"
        if cc >= (8, 0):
            return "bf16", f"{where}: bfloat16 tensor cores"
        if cc >= (7, 0) or cc in ((6, 0), (6, 2), (5, 3)):
            return "fp16", f"{where}: fast float16 only, dynamic loss scale"
        return "fp32", f"{where}: no fast half-precision arithmetic"
    return "fp32", f"{device.platform}: no fast half-precision matmuls"
