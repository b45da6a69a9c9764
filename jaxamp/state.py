"""TrainState: what a mixed-precision run is at one instant."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.core
import flax.struct
import jax
import jax.numpy as jnp
import jmp
import optax

from jaxamp.fp8_collection import check_policy as _check_fp8_policy
from jaxamp.fp8_collection import merge_fp8, split_fp8
from jaxamp.loss_scale import LossScale
from jaxamp.opt_state import low_precision_state
from jaxamp.precision import get_policy, keep_matches, leaf_path, opt_state_dtype
from jaxamp.trainable import split_frozen, trainable_mask

PyTree = Any

__all__ = ["TrainState"]


def _raw_key(rng: jax.Array) -> jax.Array:
    """Returns `u32[2]` raw key data for a raw or typed PRNG key (raw keys save and restore as plain arrays)."""
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(rng))
        if "threefry" not in impl:
            raise ValueError(f"rng must be a threefry2x32 PRNG key (jax.random.key(seed) with JAX's default "
                             f"implementation), got a {impl} key")
        rng = jax.random.key_data(rng)
    if rng.dtype != jnp.uint32 or rng.shape != (2,):
        raise ValueError(f"rng must be a PRNG key (jax.random.key(seed) or PRNGKey(seed)), got {rng.dtype}{rng.shape}")
    return rng


def _float_array(path, leaf) -> jax.Array:
    """A params leaf as a float array (Python floats become float32 arrays, not weakly typed); names a bad leaf."""
    try:
        dtype = jnp.result_type(leaf)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"params{jax.tree_util.keystr(path)} is {dtype or type(leaf).__name__}: master weights "
                         "must be float arrays (keep integer state such as counters outside params)")
    return leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf, dtype=jnp.dtype(dtype))


def _buffers(x: jax.Array) -> set:
    """The device buffers behind an array (two `jax.Array` objects may share them, e.g. after `device_put`)."""
    try:
        return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}
    except Exception:  # noqa: BLE001 - a backend without raw pointers: the object itself stands for its buffers
        return {("object", id(x))}


def _unalias(tree: PyTree) -> PyTree:
    """Copies every array whose buffers appear earlier in `tree` (tied initial weights, `LookaheadParams.init_synced`,
    an optimizer state that holds the params themselves): a donated state must not hold one buffer twice."""
    seen: set = set()

    def once(x):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        buffers = _buffers(x)
        if buffers & seen:
            return jnp.copy(x)
        seen.update(buffers)
        return x

    return jax.tree.map(once, tree)


@flax.struct.dataclass
class TrainState:
    """The state of a mixed-precision run: master weights, optimizer state, loss scale, step and RNG.

    A pytree: the array fields cross `jax.jit` as arrays (a new loss-scale value never recompiles); `tx` and
    `policy` are static, part of the structure. Build it with `TrainState.create`.

    Attributes:
      step: i32[] `train_step` calls so far = batches consumed (skipped steps included). The one step counter: it
        drives the data order, per-step dropout keys and checkpoint labels.
      params: the master weights, in the policy's param dtype (float32 under the presets). A model with Flax FP8 ops
        keeps its whole variables dict here, `{"params": ..., "_overwrite_with_gradient": ...}` (as Flax's own
        TrainState does): the FP8 scales and amax histories stay float32 and are updated by `train_step` (see it).
      opt_state: the optax state of `tx` for the trainable params (`trainable_params()`; float32 under the
        presets). Its own count advances only on applied updates, so LR schedules skip overflowed steps.
      loss_scale: a `NoOpLossScale`, `StaticLossScale` or `DynamicLossScale`.
      rng: u32[2] raw PRNG key; step s uses `jax.random.fold_in(rng, s)`.
      tx: the optax transformation (static).
      policy: the `jmp.Policy` (static).
      trainable: None (every params leaf trains) or a tuple of bools, one per params leaf in
        `jax.tree.leaves(params)` order (static; `TrainState.create` builds it from its `trainable` argument). Frozen
        leaves are not differentiated, hold no optimizer state and come back bitwise unchanged.
      model_state: the model's mutable collections that are not trained (BatchNorm's `batch_stats`), or None:
        `loss_fn(params, batch, rng, model_state)` returns `(loss | (loss, aux), new_model_state)` and `train_step`
        keeps the new one (see it). Checkpointed with the rest.
      consecutive_skips: i32[] steps skipped in a row so far (0 after an applied step), or None for a state built
        by hand without it (then `train_step` reports the count from 0 and does not store it).
    """

    step: jax.Array
    params: PyTree
    opt_state: optax.OptState
    loss_scale: LossScale
    rng: jax.Array
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    policy: jmp.Policy = flax.struct.field(pytree_node=False)
    trainable: tuple[bool, ...] | None = flax.struct.field(pytree_node=False, default=None)
    model_state: PyTree = None
    consecutive_skips: jax.Array | None = None

    def trainable_params(self, params: PyTree | None = None) -> PyTree:
        """`params` (default: `self.params`) without the FP8 collection and with every frozen leaf replaced by None:
        the tree the optimizer sees."""
        return split_frozen(split_fp8(self.params if params is None else params)[0], self.trainable)[0]

    def compute_params(self) -> PyTree:
        """The params as `loss_fn` receives them: cast by the policy (`cast_to_compute`), the FP8 collection (if
        any) as it is, float32."""
        regular, fp8 = split_fp8(self.params)
        return merge_fp8(self.policy.cast_to_compute(regular), fp8)

    def with_policy(self, policy: jmp.Policy | str, loss_scale: LossScale) -> TrainState:
        """The same run (master weights, optimizer state, step, RNG) under another precision policy and loss scale.

        The way to switch precision mid-run, e.g. from fp16 to bf16 after repeated overflows, on resume or not: the
        master weights and optimizer state carry over unchanged, the loss scale is the one given (a fresh
        `DynamicLossScale` for fp16, `NoOpLossScale()` for bf16 or fp32). To resume a checkpoint under another
        policy, restore it into an abstract state built with the saved policy and loss scale, then call this.

        Raises:
          ValueError: the new policy keeps the master weights in another dtype (the optimizer state was made for
            these ones), or `loss_scale` is not a jaxamp loss scale.
        """
        policy = _check_policy(policy)
        if not isinstance(loss_scale, LossScale):
            raise ValueError(f"loss_scale must be a jaxamp loss scale, got {type(loss_scale).__name__}")
        old, new = jnp.dtype(self.policy.param_dtype), jnp.dtype(policy.param_dtype)
        if old != new:
            raise ValueError(
                f"the master weights are {old.name} but the new policy keeps them in {new.name}: the optimizer state "
                f"was made for {old.name} weights; switch to a policy with {old.name} master weights (the presets "
                f"fp32, bf16 and fp16 all keep float32), or start a new run from the weights")
        if opt_state_dtype(policy) != opt_state_dtype(self.policy):
            raise ValueError(f"the optimizer state is stored in {opt_state_dtype(self.policy) or 'float32'} but the "
                             f"new policy stores it in {opt_state_dtype(policy) or 'float32'} (its optax "
                             "transformation differs): keep the ';opt_state=' rule of the state's policy")
        _check_fp8_policy(policy, self.params)
        _check_keep_float32(policy, split_fp8(self.params)[0])
        return self.replace(policy=policy, loss_scale=loss_scale)

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation,
        policy: jmp.Policy | str,
        loss_scale: LossScale,
        rng: jax.Array,
        trainable: PyTree | Callable[[tuple, jax.Array], bool] | None = None,
        model_state: PyTree = None,
    ) -> TrainState:
        """Casts `params` to the policy's param dtype, initialises `tx` on the trainable ones, and sets `step` to 0.

        Leaves already in the param dtype are not copied: once a step with the state donated has run (the usual
        `jax.jit(train_step, donate_argnums=0)`), the arrays passed as `params` are deleted. Pass
        `jax.tree.map(jnp.copy, params)` to keep them. An array that appears twice in the params or the optimizer
        state (tied initial weights) is copied, since one buffer cannot be donated twice; Python float leaves become
        float32 arrays.

        Args:
          params: the initial weights, every leaf a float array (any float dtype).
          tx: an optax transformation (clipping, schedules and weight decay inside it see unscaled gradients).
            A policy with `";opt_state=bf16"` wraps it in `jaxamp.opt_state.low_precision_state` (bf16 moments).
          policy: a `jmp.Policy`, e.g. `jaxamp.get_policy("fp16")`, or a spec `get_policy` accepts ("fp16").
          loss_scale: a `NoOpLossScale`, `StaticLossScale` or `DynamicLossScale`.
          rng: a PRNG key, typed (`jax.random.key`) or raw (`jax.random.PRNGKey`), threefry2x32 (JAX's default);
            stored raw, `u32[2]`.
          trainable: which params train (fine-tuning with frozen parts; the FP8 collection is not among them: it
            is always updated). None = all. Either a pytree of bools shaped
            like `params` or a prefix of it (`{"encoder": False, "head": True}`), or a callable
            `(path, leaf) -> bool` over `jax.tree_util.tree_flatten_with_path(params)` paths
            (`jaxamp.precision.leaf_path(path)` gives `"encoder/kernel"`). Frozen leaves are not differentiated (no
            backward work for their weight gradients), take no part in the finite check, `grad_norm` or clipping,
            hold no optimizer state (`tx.init` sees None there) and come back bitwise unchanged. (A plain
            `optax.multi_transform` with `set_to_zero` still differentiates them: a non-finite gradient of a frozen
            leaf then skips every step.)

        Raises:
          ValueError: `rng` is not a threefry PRNG key, `loss_scale` is not a jaxamp loss scale, `policy` is neither
            a `jmp.Policy` nor a known spec, `tx` is not an optax transformation, a `params` leaf is not a float
            array or scalar (names the leaf), `trainable` does not fit `params`, is not boolean, or freezes
            every leaf, or an FP8 policy (`"fp8"`, `"fp16;fp8"`) meets params without the FP8 collection.
        """
        if not isinstance(loss_scale, LossScale):
            raise ValueError(
                f"loss_scale must be a jaxamp NoOpLossScale, StaticLossScale or DynamicLossScale, got "
                f"{type(loss_scale).__name__} (jmp's own DynamicLossScale loses min_loss_scale under jit)")
        policy = _check_policy(policy)
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise ValueError(f"tx must be an optax GradientTransformation, e.g. optax.adamw(1e-3), got "
                             f"{type(tx).__name__}")
        if opt_state_dtype(policy):  # ";opt_state=bf16": the moments stored narrow, updated in float32
            tx = low_precision_state(tx, opt_state_dtype(policy))
        regular, fp8 = split_fp8(jax.tree_util.tree_map_with_path(_float_array, params))
        _check_fp8_policy(policy, params)
        regular = policy.cast_to_param(regular)  # the FP8 scales and histories stay float32
        _check_keep_float32(policy, regular)
        mask = trainable_mask(trainable, regular)
        params = merge_fp8(regular, fp8)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and i32 counts (all float32 here)
            opt_state = tx.init(split_frozen(regular, mask)[0])
        params, opt_state, model_state = _unalias((params, opt_state, model_state))
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale,
            rng=_raw_key(rng),
            tx=tx,
            policy=policy,
            trainable=mask,
            model_state=model_state,
            consecutive_skips=jnp.zeros((), jnp.int32),
        )


def _check_policy(policy) -> jmp.Policy:
    if isinstance(policy, str):
        policy = get_policy(policy)
    if not isinstance(policy, jmp.Policy):
        raise ValueError(f"policy must be a jmp.Policy or a spec such as 'fp16', got {type(policy).__name__}")
    return policy


def _check_keep_float32(policy: jmp.Policy, params: PyTree) -> None:
    """Raises when one of the policy's `keep_float32` patterns matches no leaf of `params`: a typo, or a pattern
    written for another layout (e.g. `"wte/embedding"` for a variables dict, whose paths are `"params/wte/..."`),
    would otherwise leave that leaf in the compute dtype without a word. The message suggests a pattern that
    matches the leaves the pattern was probably meant for."""
    paths = [leaf_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for pattern in getattr(policy, "keep_float32", ()):
        if any(keep_matches(path, (pattern,)) for path in paths):
            continue
        tail = pattern.rsplit("/", 1)[-1].strip("*")
        near = [p.removesuffix("/value") for p in paths if tail and tail in p][:3]
        example = near[0] if near else (paths[0].removesuffix("/value") if paths else "")
        hint = f"; {'*/' + example.rsplit('/', 1)[-1]!r} would match {example!r}" if example else ""
        raise ValueError(f"keep_float32 pattern {pattern!r} matches no params leaf, so no leaf stays float32 by it; "
                         f"patterns match whole paths such as {near or paths[:3]}{hint}: fix or drop it")

