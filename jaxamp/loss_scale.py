"""Loss scales: keep float16 gradients inside float16's range (Micikevicius et al., *Mixed Precision Training*, 2018).

Three jit-able pytrees with jmp's interface (`loss_scale`, `scale`, `unscale`, `adjust`):

- `NoOpLossScale`: scale 1, never changes (float32 and bfloat16 training).
- `StaticLossScale`: a fixed scale.
- `DynamicLossScale`: backs off on overflow, grows after a run of finite steps (torch.amp's GradScaler, with
  hysteresis over consecutive overflows and both bounds).

Unlike jmp 0.0.4's `DynamicLossScale`, every field survives `jax.jit`, `jax.tree.map`, `jax.eval_shape` and an orbax
save/restore: the state that changes per step (scale, counters) is array leaves with explicit dtypes; the
hyperparameters are static metadata, part of the pytree structure.
"""

from __future__ import annotations

import math
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

__all__ = ["DynamicLossScale", "LOSS_SCALES", "LossScale", "NoOpLossScale", "StaticLossScale", "describe",
           "from_description"]
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, ~1.2e-38
_F32_MAX = float(np.finfo(np.float32).max)


def _unscale_leaf(x, loss_scale):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(jnp.float32) / loss_scale


def _concrete_float(value, name: str) -> float | None:
    """Returns `value` as a Python float, or None when it is traced (no check possible)."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - objects that are not numbers (tree.map placeholders)
        return None
    if arr.shape != () or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{name} must be a real scalar, got {value!r}")
    return float(arr)


def _check_scale(value, name: str, lo: float = _F32_TINY, hi: float = _F32_MAX) -> None:
    v = _concrete_float(value, name)
    if v is None:
        return
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must lie in [{lo:g}, {hi:g}], got {v:g}")


class LossScale:
    """Interface shared by the three loss scales (jmp's): `loss_scale`, `scale`, `unscale`, `adjust`."""

    @property
    def loss_scale(self) -> jax.Array:
        raise NotImplementedError

    def scale(self, tree: PyTree) -> PyTree:
        """Multiplies every leaf by the loss scale (cast to the leaf's dtype)."""
        s = self.loss_scale
        return jax.tree.map(lambda x: x * s.astype(jnp.asarray(x).dtype), tree)

    def unscale(self, tree: PyTree) -> PyTree:
        """Divides every floating leaf by the loss scale in float32; returns float32 leaves."""
        s = self.loss_scale
        return jax.tree.map(lambda x: _unscale_leaf(x, s), tree)

    def adjust(self, grads_finite: jax.Array) -> LossScale:
        """Returns the loss scale for the next step, given whether this step's gradients were finite."""
        raise NotImplementedError

    def backoff(self) -> LossScale:
        """The scale to retry an overflowed step with (`on_overflow="retry"`); fixed scales return themselves."""
        return self

    def lowest(self) -> LossScale:
        """The lowest scale `backoff` can reach (`on_overflow="retry"` probes it: gradients that are not finite even
        there do not overflow because of the scale); fixed scales return themselves."""
        return self

    def config(self) -> dict:
        """The hyperparameters as a JSON-ready dict (for checkpoints and logs); {} for the fixed scales."""
        return {}

    @classmethod
    def from_config(cls, config: dict) -> LossScale:
        """A loss scale of this type with these hyperparameters (`config()`), its values placeholders: the shape of
        a restore target, whose values come from the checkpoint."""
        del config
        return cls()


@jax.tree_util.register_pytree_with_keys_class
class NoOpLossScale(LossScale):
    """A loss scale of 1 that never changes: the NoOp object that lets float32 and bfloat16 share the code path.

    It has no leaves. `unscale` still casts floating leaves to float32, like the other scales.
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: PyTree) -> PyTree:
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        del grads_finite
        return self

    def tree_flatten_with_keys(self):
        return (), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux, children
        return cls()

    def __repr__(self) -> str:
        return "NoOpLossScale()"


@jax.tree_util.register_pytree_with_keys_class
class StaticLossScale(LossScale):
    """A fixed loss scale (jmp.StaticLossScale).

    Attributes:
      loss_scale: f32[] the scale, > 0 and finite.

    Raises:
      ValueError: `loss_scale` is not finite or not > 0.
    """

    def __init__(self, loss_scale: float | jax.Array):
        _check_scale(loss_scale, "loss_scale")
        self._loss_scale = jnp.asarray(loss_scale, jnp.float32)

    @property
    def loss_scale(self) -> jax.Array:
        return self._loss_scale

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        del grads_finite
        return self

    @classmethod
    def from_config(cls, config: dict) -> StaticLossScale:
        del config
        return cls(1.0)

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("loss_scale"), self._loss_scale),), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        obj = object.__new__(cls)
        (obj._loss_scale,) = children
        return obj

    def __repr__(self) -> str:
        return f"StaticLossScale(loss_scale={self._loss_scale!r})"


_DYNAMIC_STATIC_FIELDS = (
    "growth_interval", "growth_factor", "backoff_factor", "min_loss_scale", "max_loss_scale", "hysteresis")


@jax.tree_util.register_pytree_with_keys_class
class DynamicLossScale(LossScale):
    """A loss scale that backs off on overflow and grows after a run of finite steps.

    Semantics follow torch.amp's `GradScaler` (growth on the `growth_interval`-th consecutive finite step, as jmp too),
    with hysteresis over *consecutive* overflows (DeepSpeed's `consecutive_hysteresis=True`; Megatron-LM and
    DeepSpeed's default instead restore their hysteresis budget only when the scale grows) and a floor and a ceiling
    so the scale is never 0, subnormal, inf or NaN. With `hysteresis` > 1 a finite step forgives earlier overflows,
    so overflows on every other step never back off (each one is skipped): keep the default 1 (torch.amp, jmp)
    unless overflows come as isolated spikes. With the default floor `min_loss_scale=1.0`, a loss whose unscaled
    float16 gradients overflow (e.g. a sum over a large batch) is skipped at every step (`grads_finite` stays
    False); lower the floor or average the loss. The algorithm, applied by `adjust(grads_finite)` once per optimizer
    step::

        if grads_finite:
            overflow_counter = 0
            growth_counter += 1
            if growth_counter == growth_interval:
                loss_scale = min(loss_scale * growth_factor, max_loss_scale)
                growth_counter = 0
        else:
            growth_counter = 0
            overflow_counter = min(overflow_counter + 1, hysteresis)
            if overflow_counter == hysteresis:          # hysteresis consecutive overflows (and every one after)
                loss_scale = max(loss_scale * backoff_factor, min_loss_scale)

    Leaves (they change per step and cross `jax.jit` as arrays: a new value never recompiles):
      loss_scale: f32[] the current scale.
      growth_counter: i32[] consecutive finite steps since the last growth or overflow, in [0, growth_interval).
      overflow_counter: i32[] consecutive non-finite steps, in [0, hysteresis].

    Static fields (part of the pytree structure, so they survive jit, tree.map and eval_shape):
      growth_interval: steps; growth_factor, backoff_factor: ratios; min_loss_scale, max_loss_scale: bounds;
      hysteresis: steps.

    Raises:
      ValueError: growth_factor <= 1, backoff_factor outside (0, 1), min_loss_scale > max_loss_scale, a bound that
        is not a finite positive normal float32, growth_interval < 1, hysteresis < 1, or a loss_scale that is not
        finite, not > 0 or outside [min_loss_scale, max_loss_scale]. The message names the argument.
    """

    def __init__(
        self,
        loss_scale: float | jax.Array = 2.0**15,
        *,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = 2.0**24,
        hysteresis: int = 1,
    ):
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (steps), got {value!r}")
        for name, value in (("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"{name} must be a real number, got {value!r}")
        if not (math.isfinite(growth_factor) and growth_factor > 1):
            raise ValueError(f"growth_factor must be finite and > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must lie in (0, 1), got {backoff_factor!r}")
        _check_scale(min_loss_scale, "min_loss_scale")
        _check_scale(max_loss_scale, "max_loss_scale")
        if min_loss_scale > max_loss_scale:
            raise ValueError(f"min_loss_scale ({min_loss_scale:g}) must be <= max_loss_scale ({max_loss_scale:g})")
        _check_scale(loss_scale, "loss_scale", float(min_loss_scale), float(max_loss_scale))
        self.growth_interval = int(growth_interval)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.min_loss_scale = float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self.hysteresis = int(hysteresis)
        self._loss_scale = jnp.asarray(loss_scale, jnp.float32)
        self.growth_counter = jnp.zeros((), jnp.int32)
        self.overflow_counter = jnp.zeros((), jnp.int32)

    @property
    def loss_scale(self) -> jax.Array:
        return self._loss_scale

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """Returns the next state (see the class docstring); `grads_finite` is a `bool[]`.

        Raises:
          ValueError: `grads_finite` is not a scalar (use `all_finite(grads)`, not `finite_leaves`).
        """
        finite = jnp.asarray(grads_finite, jnp.bool_)
        if finite.shape != ():
            raise ValueError(f"grads_finite must be a bool[] scalar such as all_finite(grads), got shape "
                             f"{finite.shape}")
        growth_counter = jnp.where(finite, self.growth_counter + 1, 0)
        grow = growth_counter >= self.growth_interval
        overflow_counter = jnp.where(finite, 0, jnp.minimum(self.overflow_counter + 1, self.hysteresis))
        back_off = overflow_counter >= self.hysteresis
        scale = self._loss_scale
        grown = jnp.minimum(scale * self.growth_factor, self.max_loss_scale)
        backed_off = jnp.maximum(scale * self.backoff_factor, self.min_loss_scale)
        new_scale = jnp.where(finite, jnp.where(grow, grown, scale), jnp.where(back_off, backed_off, scale))
        return self._with(
            loss_scale=new_scale.astype(jnp.float32),
            growth_counter=jnp.where(grow, 0, growth_counter).astype(jnp.int32),
            overflow_counter=overflow_counter.astype(jnp.int32),
        )

    def backoff(self) -> DynamicLossScale:
        """The scale times `backoff_factor` (floored at `min_loss_scale`), counters reset, hysteresis ignored: the
        scale to retry an overflowed step with inside the same `train_step` (`on_overflow="retry"`)."""
        zero = jnp.zeros((), jnp.int32)
        scale = jnp.maximum(self._loss_scale * self.backoff_factor, self.min_loss_scale).astype(jnp.float32)
        return self._with(loss_scale=scale, growth_counter=zero, overflow_counter=zero)

    def lowest(self) -> DynamicLossScale:
        """The scale at `min_loss_scale`, counters reset: the floor `backoff` reaches."""
        zero = jnp.zeros((), jnp.int32)
        return self._with(loss_scale=jnp.full((), self.min_loss_scale, jnp.float32), growth_counter=zero,
                          overflow_counter=zero)

    def _with(self, *, loss_scale, growth_counter, overflow_counter) -> DynamicLossScale:
        return DynamicLossScale.tree_unflatten(self._static(), (loss_scale, growth_counter, overflow_counter))

    def _static(self) -> tuple:
        return tuple(getattr(self, name) for name in _DYNAMIC_STATIC_FIELDS)

    def config(self) -> dict:
        """The hyperparameters as a JSON-ready dict (for checkpoints and logs)."""
        return dict(zip(_DYNAMIC_STATIC_FIELDS, self._static()))

    @classmethod
    def from_config(cls, config: dict) -> DynamicLossScale:
        return cls(config["min_loss_scale"], **config)

    def tree_flatten_with_keys(self):
        key = jax.tree_util.GetAttrKey
        children = (
            (key("loss_scale"), self._loss_scale),
            (key("growth_counter"), self.growth_counter),
            (key("overflow_counter"), self.overflow_counter),
        )
        return children, self._static()

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for name, value in zip(_DYNAMIC_STATIC_FIELDS, aux):
            setattr(obj, name, value)
        obj._loss_scale, obj.growth_counter, obj.overflow_counter = children
        return obj

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return (f"DynamicLossScale(loss_scale={self._loss_scale!r}, growth_counter={self.growth_counter!r}, "
                f"overflow_counter={self.overflow_counter!r}, {fields})")


# The registry: every loss-scale type by name, the one list of them (checkpoint records name the type).
LOSS_SCALES: dict[str, type[LossScale]] = {cls.__name__: cls for cls in (NoOpLossScale, StaticLossScale,
                                                                         DynamicLossScale)}


def describe(loss_scale: LossScale) -> dict:
    """`{"type": class name, "config": hyperparameters}`: what a checkpoint records of a loss scale."""
    return {"type": type(loss_scale).__name__, "config": loss_scale.config()}


def from_description(description: dict) -> LossScale:
    """The loss scale `describe` wrote (its values placeholders: a restore target).

    Raises:
      ValueError: a type that is not in `LOSS_SCALES`.
    """
    kind = description.get("type")
    if kind not in LOSS_SCALES:
        raise ValueError(f"unknown loss scale type {kind!r}; known: {sorted(LOSS_SCALES)}")
    return LOSS_SCALES[kind].from_config(description.get("config") or {})


# --------------------------------------------------------------------------------------------------------------------
# Flax serialization (`flax.serialization.to_state_dict`, `to_bytes`/`from_bytes` of a `TrainState`): the leaves by
# name; the static hyperparameters come from the target, as they do for orbax restores.


def _to_state_dict(loss_scale: LossScale) -> dict:
    children, _ = loss_scale.tree_flatten_with_keys()
    return {key.name: flax.serialization.to_state_dict(value) for key, value in children}


def _from_state_dict(target: LossScale, state: dict) -> LossScale:
    children, aux = target.tree_flatten_with_keys()
    names = [key.name for key, _ in children]
    if not isinstance(state, dict) or sorted(state) != sorted(names):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state for {type(target).__name__} must have the fields {names}, got {got}")
    dtypes = [value.dtype if hasattr(value, "dtype") else jnp.asarray(value).dtype for _, value in children]
    values = [jnp.asarray(state[name], dtype) for name, dtype in zip(names, dtypes)]
    return type(target).tree_unflatten(aux, values)


for _cls in LOSS_SCALES.values():
    flax.serialization.register_serialization_state(_cls, _to_state_dict, _from_state_dict)
