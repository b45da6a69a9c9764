"""One mixed-precision update (`train_step`) and one evaluation (`eval_step`), both pure and jit-able."""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

from jaxamp.grad_stats import underflow_stats
from jaxamp.state import TrainState, merge_fp8, merge_frozen, split_fp8, split_frozen

PyTree = Any
LossFn = Callable[[PyTree, PyTree, Any], Any]


def _split_loss(out) -> tuple[jax.Array, Any]:
    """`loss_fn` returns a scalar loss or `(loss, aux)`; returns `(f32[] loss, aux or None)`."""
    if isinstance(out, tuple) and len(out) != 2 or isinstance(out, (list, dict)) or out is None:
        what = f"a {len(out)}-tuple" if isinstance(out, tuple) else type(out).__name__
        raise ValueError(f"loss_fn must return a scalar loss or a (loss, aux) tuple, got {what}; put everything "
                         "besides the loss into aux, e.g. return loss, {'accuracy': acc}")
    loss, aux = out if isinstance(out, tuple) else (out, None)
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(f"loss_fn must return a scalar loss (or (loss, aux)), got shape {loss.shape}")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"loss_fn must return a real floating-point loss, got {loss.dtype} (an integer loss has no "
                         "gradient; a complex one has no order)")
    return loss.astype(jnp.float32), aux


def select_tree(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leaf by leaf `lax.select(pred, a, b)` for a `bool[]` pred: the unchosen tree's leaves come back bitwise."""
    return jax.tree.map(lambda a, b: jax.lax.select(pred, a, b), on_true, on_false)


def _leaf_check(x) -> tuple[jax.Array, jax.Array]:
    """`(f32[] sum of squares, bool[] all finite)` of one leaf in one pass (a variadic `lax.reduce`)."""
    # A decision and a metric, not part of the update's value: no derivative (JAX's JVP of a variadic reduce with a
    # bool operand fails, so differentiating through `train_step`, e.g. for hypergradients, needs this).
    x = jax.lax.stop_gradient(jnp.asarray(x))
    if not jnp.issubdtype(x.dtype, jnp.floating):  # integer or boolean leaves: finite, no norm
        return jnp.zeros((), jnp.float32), jnp.ones((), jnp.bool_)
    xf = x.astype(jnp.float32)
    return jax.lax.reduce((xf * xf, jnp.isfinite(x)), (jnp.float32(0), jnp.bool_(True)),
                          lambda a, b: (a[0] + b[0], a[1] & b[1]), tuple(range(x.ndim)))


class _Check(NamedTuple):
    finite: jax.Array  # bool[]: every element of every leaf finite (`all_finite`)
    finite_leaves: PyTree  # bool[] per leaf, like the gradients (`finite_leaves`)
    norm: jax.Array  # f32[]: global L2 norm (`optax.tree.norm`); inf or NaN when not finite


def _check_grads(grads: PyTree, fp8: PyTree = None) -> _Check:
    """The finite check and the global norm read each gradient leaf once, not twice (one fused reduction per leaf).

    With FP8 ops the new amax histories count too: FP8 quantization clips the output gradient to e5m2's range, so an
    overflow (inf) there leaves finite, clipped weight gradients, and only its amax (inf) shows it.
    """
    # Flattened, not `tree.map` + `is_leaf=tuple`: params may hold tuples themselves (e.g. `[(W, b), ...]`).
    leaves, treedef = jax.tree.flatten(grads)
    leaf_checks = [_leaf_check(x) for x in leaves]
    sums = [c[0] for c in leaf_checks]
    flags = treedef.unflatten([c[1] for c in leaf_checks])
    finite = jnp.all(jnp.stack(jax.tree.leaves(flags))) if sums else jnp.ones((), jnp.bool_)
    if jax.tree.leaves(fp8):
        finite = finite & jnp.all(jnp.stack([_leaf_check(x)[1] for x in jax.tree.leaves(fp8)]))
    norm = jnp.sqrt(sum(sums, jnp.zeros((), jnp.float32)))
    return _Check(finite, flags, norm)


class _Grads(NamedTuple):
    grads: PyTree  # float32, unscaled, like the trainable params
    loss: jax.Array  # f32[] unscaled mean loss
    aux: Any  # loss_fn's aux (stacked [accum_steps, ...] under accumulation) or None
    stats: Any  # underflow_stats dict (averaged over micro-batches; min headroom) or None
    fp8: Any = None  # the FP8 collection's new values (float32, loss-scale free), or None without FP8 ops
    carry: Any = None  # a stateful loss_fn's state after the step's micro-batches (see `_micro_grads`), or None


def _is_output_grad(path) -> bool:
    """Flax's FP8 entries measured on the output gradient (`output_grad_scale`, `output_grad_amax_history`)."""
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last))).startswith("output_grad")


def _fp8_in_scaled_units(fp8: PyTree, loss_scale, inverse: bool = False) -> PyTree:
    """The FP8 state is stored loss-scale free; the backward pass sees the scaled output gradient, so its
    output-gradient scales and amax histories are multiplied by the loss scale on the way in and divided on the way
    out (exact for power-of-2 scales: the FP8 values and the state are then bitwise independent of the scale)."""
    if fp8 is None:
        return None
    s = loss_scale.loss_scale

    def convert(path, x):
        if not _is_output_grad(path):
            return x
        return (x / s if inverse else x * s).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(convert, fp8)


def _max_combined(fp8: PyTree) -> PyTree:
    """The FP8 collection as Flax's `fp32_max_grad` ("fm32") dtype: float32 whose cotangents add by maximum. An FP8
    op called more than once in one loss (a weight-shared layer, one op in two layers) then gets the largest of its
    calls' new amax histories and scales as its "gradient", not their sum (which doubles the history every step).
    Flax's ops compute in float32 from it and return the new values in it; one call gives bitwise the same values."""
    if fp8 is None:
        return None
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, fp8_ops.fp32_max_grad), fp8)


def _as_float32_if_fm32(x):
    return jax.lax.convert_element_type(x, jnp.float32) if getattr(x, "dtype", None) == fp8_ops.fp32_max_grad else x


_FP8_TENSORS = ("input", "kernel", "output_grad")


def _keep_uncalled(new: PyTree, old: PyTree) -> PyTree:
    """The FP8 collection's new values, except where the loss did not call the op (an unused layer, a `lax.cond`
    branch not taken, an output under `stop_gradient`): its "gradient" there is 0, which as a new scale would make
    the next call divide by 0. Per op and tensor (input, kernel, output gradient), a new scale of 0 (never a real
    one: scales are amax / format max > 0, or the old scale) keeps the old scale and history."""
    if not hasattr(new, "keys"):
        return new
    if not all(f"{t}_scale" in new for t in _FP8_TENSORS):
        return type(new)({k: _keep_uncalled(new[k], old[k]) for k in new.keys()})
    out = dict(new)
    for t in _FP8_TENSORS:
        called = new[f"{t}_scale"] > 0  # bool[..., 1]: per layer of a stacked (scanned) op
        for name in (f"{t}_scale", f"{t}_amax_history"):
            out[name] = jnp.where(called, new[name], old[name])
    return type(new)(out)


def _micro_grads(loss_fn, loss_scale, params_c, batch, rng, carry=None):
    """Scaled loss -> gradients w.r.t. the trainable compute-dtype params (still scaled, in the compute dtype), the
    FP8 collection's new values (loss-scale free) and, for a stateful `loss_fn`, its new state.

    `params_c` is `(trainable, frozen, fp8)`: frozen leaves enter the loss as constants; the FP8 collection (None
    without FP8 ops) is "differentiated" too, since Flax's FP8 ops return its new values as its gradient. With a
    `carry` (a pytree of model state that is not differentiated, e.g. `jaxamp.nnx`'s BatchNorm statistics and RNG
    counts), `loss_fn(params, batch, rng, carry)` returns `(loss | (loss, aux), new_carry)`.
    """
    train_c, frozen_c, fp8 = params_c

    def scaled_loss(train, fp8_scaled, frozen_c, batch, rng, carry, loss_scale):
        params = merge_fp8(merge_frozen(train, frozen_c), _max_combined(fp8_scaled))
        if carry is None:
            out, new_carry = loss_fn(params, batch, rng), None
        else:
            out, new_carry = loss_fn(params, batch, rng, carry)
        loss, aux = _split_loss(out)
        return loss_scale.scale(loss), (loss, aux, new_carry)

    grad_fn = jax.grad(scaled_loss, argnums=(0, 1), has_aux=True)
    if fp8 is not None:
        grad_fn = jax.jit(grad_fn)  # fm32 cotangents add only in compiled code (eager has no rule); inlined under jit
    try:
        (grads_c, fp8_new), (loss, aux, new_carry) = grad_fn(
            train_c, _fp8_in_scaled_units(fp8, loss_scale), frozen_c, batch, rng, carry, loss_scale)
    except TypeError as err:
        if "fp8_meta" not in str(err):
            raise
        raise ValueError("loss_fn used an FP8 scale or amax history as a number, or vmapped an FP8 layer per example: "
                         "inside the step they are Flax's fp32_max_grad dtype, which only FP8 ops compute with (and "
                         "whose amax cannot be combined over a jax.vmap axis); read them outside loss_fn, call the "
                         "layer on the whole batch, or give each mapped slice its own FP8 state (nn.vmap / nnx.vmap "
                         "of the variables)") from None
    # An op in a lax.cond branch not taken gets fm32's zero, -inf: 0, as for an op the loss does not call at all.
    fp8_new = jax.tree.map(lambda x: jnp.where(x == -jnp.inf, jnp.zeros_like(x), x), fp8_new)
    aux = jax.tree.map(_as_float32_if_fm32, aux)  # an FP8 scale returned for monitoring: a plain float32 array
    return grads_c, loss, aux, _fp8_in_scaled_units(fp8_new, loss_scale, inverse=True), new_carry


def _split_micro(batch: PyTree, accum_steps: int) -> PyTree:
    """Every leaf `[batch, ...]` -> `[accum_steps, batch // accum_steps, ...]`; every leaf must share `batch`."""
    shapes = {jax.tree_util.keystr(path): jnp.shape(x) for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]}
    if len({shape[:1] for shape in shapes.values()}) > 1:
        listed = ", ".join(f"batch{name}: {shape}" for name, shape in list(shapes.items())[:6])
        raise ValueError(f"accum_steps={accum_steps} splits every batch leaf along its leading (batch) axis, so every "
                         f"leaf needs the same leading size; got {listed}. Keep per-step constants such as class "
                         "weights out of the batch (e.g. close over them in loss_fn)")
    for name, shape in shapes.items():
        if not shape or shape[0] % accum_steps:
            raise ValueError(f"accum_steps={accum_steps} must divide the batch's leading axis, but batch{name} has "
                             f"shape {shape}")

    def split(x):
        x = jnp.asarray(x)
        # Strided: micro-batch i = rows i, i + accum, ...; so under a batch sharded by rows every device holds its
        # share of every micro-batch and no rows move between devices.
        x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:])  # [micro_batch, accum, ...]
        return jnp.swapaxes(x, 0, 1)  # [accum, micro_batch, ...]

    return jax.tree.map(split, batch)


def _gradients(state, batch, loss_fn, loss_scale, rng, accum_steps: int, with_stats: bool, carry=None) -> _Grads:
    """Float32 unscaled gradients of the trainable params, averaged over `accum_steps` micro-batches (one lax.scan,
    float32 accumulator), and the FP8 collection's new values (over micro-batches: the element-wise maximum, i.e.
    the newest amax history with the largest amax of the micro-batches, and the largest scale). A stateful
    `loss_fn`'s `carry` (see `_micro_grads`) runs through the micro-batches in order."""
    regular, fp8 = split_fp8(state.params)
    train_c, frozen_c = split_frozen(state.policy.cast_to_compute(regular), state.trainable)
    params_c = (train_c, frozen_c, fp8)
    stats_of = underflow_stats if with_stats else (lambda g: None)
    if accum_steps == 1:
        grads_c, loss, aux, fp8_new, carry = _micro_grads(loss_fn, loss_scale, params_c, batch, rng, carry)
        return _Grads(loss_scale.unscale(grads_c), loss, aux, stats_of(grads_c), fp8_new, carry)

    def body(scan_carry, xs):
        acc, loss_sum, stats_acc, fp8_acc, carry = scan_carry
        micro, i = xs
        grads_c, loss, aux, fp8_new, carry = _micro_grads(loss_fn, loss_scale, params_c, micro,
                                                          jax.random.fold_in(rng, i), carry)
        acc = jax.tree.map(jnp.add, acc, loss_scale.unscale(grads_c))
        fp8_acc = jax.tree.map(jnp.maximum, fp8_acc, fp8_new)  # None without FP8 ops
        stats = stats_of(grads_c)
        if stats is not None:
            stats = stats if stats_acc is None else _combine_stats(stats_acc, stats)
        return (acc, loss_sum + loss, stats, fp8_acc, carry), aux

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), state.trainable_params())
    fp8_zeros = jax.tree.map(jnp.zeros_like, fp8)  # scales > 0 and amax >= 0: 0 is the identity of the maximum
    init_stats = None
    if with_stats:  # zero fractions start at 0 (sums), headroom at +inf (minima)
        shapes = jax.eval_shape(underflow_stats, train_c)
        init_stats = {k: jax.tree.map(lambda s, k=k: jnp.full(s.shape, 0.0 if "zero" in k else jnp.inf, s.dtype), v)
                      for k, v in shapes.items()}
    (acc, loss_sum, stats, fp8_new, carry), aux = jax.lax.scan(
        body, (zeros, jnp.zeros((), jnp.float32), init_stats, fp8_zeros, carry),
        (_split_micro(batch, accum_steps), jnp.arange(accum_steps)))
    if stats is not None:
        stats = {k: (jax.tree.map(lambda v: v / accum_steps, v) if "zero" in k else v) for k, v in stats.items()}
    grads = jax.tree.map(lambda g: g / accum_steps, acc)
    return _Grads(grads, loss_sum / accum_steps, aux, stats, fp8_new, carry)


def _combine_stats(acc: dict, new: dict) -> dict:
    """Running sums of zero fractions and minima of headroom over micro-batches."""
    return {k: jax.tree.map(jnp.add if "zero" in k else jnp.minimum, acc[k], new[k]) for k in acc}


def _retry(state, batch, loss_fn, rng, accum_steps, with_stats, max_retries, carry=None):
    """Backs the scale off and recomputes the same batch until the gradients are finite (`lax.while_loop`).

    Every attempt starts from the same `rng` and `carry`, so a retried batch draws the same dropout masks.

    After the first non-finite attempt (with a finite loss) one probe runs at the lowest scale `backoff` can reach:
    if the gradients are not finite even there, the scale is not the cause (e.g. a NaN from `sqrt(0)`'s derivative)
    and no retry runs, so the step costs the scale exactly what a skip costs (one backoff by `adjust`). Returns
    `(loss_scale used, grads, check, retries, nonfinite_at_min_scale)`.
    """

    def attempt(loss_scale):
        g = _gradients(state, batch, loss_fn, loss_scale, rng, accum_steps, with_stats, carry)
        return g, _check_grads(g.grads, g.fp8)

    def can_lower(loss_scale):
        return loss_scale.backoff().loss_scale < loss_scale.loss_scale

    first, check = attempt(state.loss_scale)
    # A non-finite loss comes from the forward pass or the inputs, before the scale: no scale can fix it.
    worth_trying = (~check.finite) & jnp.isfinite(first.loss) & can_lower(state.loss_scale) & (max_retries > 0)
    at_min_finite = jax.lax.cond(worth_trying, lambda: attempt(state.loss_scale.lowest())[1].finite,
                                 lambda: jnp.ones((), jnp.bool_))

    def cond(carry):
        loss_scale, g, check, retries = carry
        return (~check.finite) & jnp.isfinite(g.loss) & (retries < max_retries) & can_lower(loss_scale) \
            & at_min_finite

    def body(carry):
        loss_scale, _, _, retries = carry
        loss_scale = loss_scale.backoff()
        g, check = attempt(loss_scale)
        return loss_scale, g, check, retries + 1

    carry = jax.lax.while_loop(cond, body, (state.loss_scale, first, check, jnp.zeros((), jnp.int32)))
    return (*carry, ~at_min_finite)


def train_step(
    state: TrainState,
    batch: PyTree,
    loss_fn: LossFn,
    *,
    accum_steps: int = 1,
    on_overflow: str = "skip",
    max_retries: int = 4,
    underflow_stats: bool = False,
) -> tuple[TrainState, dict]:
    """One mixed-precision optimizer step, pure: `jax.jit(train_step, static_argnames="loss_fn", donate_argnums=0)`.

    The keyword options are static too: under `jax.jit` name those you pass, e.g.
    `jax.jit(train_step, static_argnames=("loss_fn", "accum_steps", "on_overflow"), donate_argnums=0)`.

    Order of operations (Micikevicius et al., 2018; torch.amp's autocast + GradScaler; jmp):

    1. cast the master params to the policy's compute dtype (`policy.cast_to_compute`);
    2. loss in float32: `loss_fn(compute_params, batch, rng)`, its result cast to float32;
    3. multiply the float32 loss by the loss scale;
    4. gradient with respect to the compute-dtype params (a float16 overflow arrives as inf);
    5. unscale in float32 (divide by the scale); with `accum_steps` > 1, steps 2-5 run per micro-batch and the
       float32 gradients are averaged;
    6. one finite check over every gradient leaf (`all_finite`), once per optimizer step; the same pass over the
       gradients also sums their squares for the `grad_norm` metric;
    7. optax update on the unscaled gradients, so clipping and weight decay inside `tx` never see the scale (the
       unscaled loss goes along as `value=`, for transformations that take it, e.g. `reduce_on_plateau`);
    8. apply, then select new or old `params` and `opt_state` by the finite flag: on overflow both come back bitwise
       unchanged (optax's count and any LR schedule do not advance);
    9. adjust the loss scale once (backoff or growth); advance `step` (also on a skipped step).

    FP8 (Flax's `Fp8DirectDotGeneralOp`/`Fp8Einsum`, e.g. `jaxamp.layers.Dense(fp8=True)`): `state.params` is then
    the model's variables dict and its `"_overwrite_with_gradient"` collection holds per-tensor scales and amax
    histories whose "gradient" is their new value. That collection is not cast (float32), takes no part in
    `grad_norm`, clipping, weight decay or the optax update, and is never unscaled as a gradient: it is stored
    loss-scale free (its output-gradient entries are multiplied by the loss scale going in and divided coming out,
    exact for power-of-2 scales, so the FP8 state does not depend on the scale). Its new amax values do count in the
    finite check (FP8 clips an overflowed output gradient to e5m2's range, so only its amax shows it). Under
    accumulation, and over several calls of one op in a loss (it enters the loss as Flax's `fp32_max_grad` dtype),
    new values combine by element-wise maximum (one history entry per optimizer step, holding the largest amax). An
    op the loss does not call keeps its values. On a skipped step it stays bitwise unchanged, like the params.

    Args:
      state: the `TrainState`. Donating it is safe.
      batch: any pytree; passed to `loss_fn` as is (cast float inputs there with `policy.cast_to_compute` if wanted).
        With `accum_steps` > 1 every leaf's leading axis is split into `accum_steps` micro-batches, so every leaf
        needs the same leading (batch) size.
      loss_fn: `loss_fn(params, batch, rng) -> loss | (loss, aux)`: `params` already in the compute dtype, `rng` a
        `u32[2]` key for this step, `jax.random.fold_in(state.rng, state.step)` (folded again with the micro-batch
        index under accumulation). Static under jit (hashable).
      accum_steps: micro-batches per optimizer step (gradient accumulation in float32). Static.
      on_overflow: `"skip"` (torch.amp, jmp: drop the update, back the scale off) or `"retry"`: back the scale off
        (`loss_scale.backoff()`, ignoring hysteresis) and recompute the same batch inside this call, up to
        `max_retries` times, so no batch is lost to a too-high scale; it falls back to a skip when retries run out,
        the scale cannot go lower, the loss itself is not finite (a forward-pass or input problem that no scale
        fixes: skipped at once, one backoff), or the gradients are not finite even at the lowest scale (one probe
        there after the first overflow: then the scale is not the cause, no retry runs, and the step costs the
        scale one backoff, as a skip does). Static.
      max_retries: retries per step for `"retry"`. Static. (`"skip"` steps are differentiable, e.g. for
        hypergradients; `"retry"` runs a `lax.while_loop`, which reverse-mode differentiation does not support.)
      underflow_stats: add gradient underflow and headroom statistics to the metrics (`grad_stats.underflow_stats`).
        Static.

    Returns:
      `(new_state, metrics)`; metrics hold `loss` (f32[], unscaled), `loss_finite` (bool[]: False points at the
      forward pass or the inputs rather than a gradient overflow), `grad_norm` (f32[], global L2 norm of the
      unscaled gradients before clipping; inf or NaN on overflow), `loss_scale` (f32[], the scale the gradients
      were finally computed with), `grads_finite` (bool[]), `grads_finite_leaves` (a tree of bool[] like the params:
      which leaves overflowed; None at frozen leaves), `retries` (i32[]), `nonfinite_at_min_scale` (bool[], retry
      mode only: the probe at the lowest scale overflowed too, so the scale was not the cause), `aux` when `loss_fn`
      returns one, and `underflow` when asked.

    Raises:
      ValueError: `loss_fn` returned something other than a float scalar or a `(loss, aux)` pair, the batch leaves
        differ in leading size or `accum_steps` does not divide it, a bad `on_overflow`/`accum_steps`/`max_retries`,
        or a traced (non-static) option under `jax.jit`.
    """
    new_state, metrics, _ = train_step_with_carry(state, batch, loss_fn, None, accum_steps=accum_steps,
                                                  on_overflow=on_overflow, max_retries=max_retries,
                                                  underflow_stats=underflow_stats)
    return new_state, metrics


def train_step_with_carry(state: TrainState, batch: PyTree, loss_fn: Callable, carry: PyTree, *,
                          accum_steps: int = 1, on_overflow: str = "skip", max_retries: int = 4,
                          underflow_stats: bool = False) -> tuple[TrainState, dict, PyTree]:
    """`train_step` for a stateful loss: the model state that is not differentiated runs through the step.

    The building block of `jaxamp.nnx.train_step` (BatchNorm statistics, RNG counts). `loss_fn(params, batch, rng,
    carry)` returns `(loss | (loss, aux), new_carry)` with `new_carry` shaped like `carry`. The micro-batches of
    `accum_steps` run in order, each from the previous one's carry; every attempt of `on_overflow="retry"` starts
    from the given carry (so a retried batch draws the same randomness). The carry is returned whatever the finite
    flag says: what to keep on a skipped step is the caller's decision. With `carry=None` this is `train_step`
    (`loss_fn(params, batch, rng)`, no carry returned: None).

    Returns:
      `(new_state, metrics, new_carry)`: as `train_step`, plus the carry after the step's (last attempt's) pass.

    Raises:
      ValueError: as `train_step`.
    """
    check_options(loss_fn, accum_steps, max_retries=max_retries, on_overflow=on_overflow,
                  underflow_stats=underflow_stats)
    rng = jax.random.fold_in(state.rng, state.step)
    if on_overflow == "retry":
        loss_scale, g, check, retries, futile = _retry(state, batch, loss_fn, rng, accum_steps, underflow_stats,
                                                       max_retries, carry)
    else:
        loss_scale, retries = state.loss_scale, jnp.zeros((), jnp.int32)
        g = _gradients(state, batch, loss_fn, loss_scale, rng, accum_steps, underflow_stats, carry)
        check = _check_grads(g.grads, g.fp8)  # the one finite check and the norm metric, one pass over the gradients
    grads_finite = check.finite
    regular, fp8 = split_fp8(state.params)
    train_params, frozen = split_frozen(regular, state.trainable)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats with i32 counts; all float32 here
        # `value`: the unscaled float32 loss, for transformations that use it (optax.contrib.reduce_on_plateau,
        # optax.polyak_sgd); plain GradientTransformations ignore it (`with_extra_args_support`).
        updates, new_opt_state = optax.with_extra_args_support(state.tx).update(
            g.grads, state.opt_state, train_params, value=g.loss)
        new_params = optax.apply_updates(train_params, updates)  # cast back to the params' dtypes
    # Master weights in float16/bfloat16 (a jmp string such as "float16"): the float32 gradients promote optax's
    # moments; every leaf keeps the dtype it has in the state, so state dtypes never drift.
    old = (train_params, state.opt_state)
    new = jax.tree.map(lambda x, o: x.astype(o.dtype), (new_params, new_opt_state), old)
    train_params, opt_state = select_tree(grads_finite, new, old)
    # The FP8 scales and histories: the new values on an applied step; on a skipped step the old ones (the step did
    # not happen; an overflowed step's inf amax would otherwise sit in the history for its whole length).
    fp8 = select_tree(grads_finite, _keep_uncalled(g.fp8, fp8), fp8)
    params = merge_fp8(merge_frozen(train_params, frozen), fp8)  # frozen leaves: the very arrays they were
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              loss_scale=loss_scale.adjust(grads_finite))
    metrics = {
        "loss": g.loss,
        "loss_finite": jnp.isfinite(g.loss),
        "grad_norm": check.norm,
        "loss_scale": jnp.copy(loss_scale.loss_scale),  # a new buffer: the state's own is donated next step
        "grads_finite": grads_finite,
        "grads_finite_leaves": check.finite_leaves,
        "retries": retries,
    }
    if on_overflow == "retry":
        metrics["nonfinite_at_min_scale"] = futile
    if g.aux is not None:
        metrics["aux"] = g.aux
    if g.stats is not None:
        metrics["underflow"] = g.stats
    return new_state, metrics, g.carry


def check_options(loss_fn, accum_steps: int, *, max_retries: int = 0, on_overflow: str = "skip",
                  underflow_stats: bool = False, caller: str = "train_step") -> None:
    """`train_step`'s checks of its static arguments, shared with `jaxamp.fidelity` (`caller` names the function
    in the messages).

    Raises:
      ValueError: in one line, naming the argument and the fix.
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function loss_fn(params, batch, rng) -> loss | (loss, aux), got "
                         f"{type(loss_fn).__name__}")
    donate = ", donate_argnums=0" if caller == "train_step" else ""
    for name, value in (("accum_steps", accum_steps), ("max_retries", max_retries),
                        ("underflow_stats", underflow_stats)):
        if isinstance(value, jax.core.Tracer):
            raise ValueError(f"{name} must be a static Python value: under jax.jit name it in static_argnames, e.g. "
                             f"jax.jit({caller}, static_argnames=('loss_fn', '{name}'){donate})")
    if on_overflow not in ("skip", "retry"):
        raise ValueError(f'on_overflow must be "skip" or "retry", got {on_overflow!r}')
    for name, value in (("accum_steps", accum_steps), ("max_retries", max_retries)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1 (micro-batches per step), got {accum_steps}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")


def eval_step(state: TrainState, batch: PyTree, loss_fn: LossFn) -> dict:
    """The loss on `batch` with the params cast to the compute dtype and no RNG (dropout off).

    Args:
      state: the `TrainState`.
      batch: as for `train_step`.
      loss_fn: as for `train_step`; it receives `rng=None` and must run deterministically then.

    Returns:
      `{"loss": f32[]}`, plus `"aux"` when `loss_fn` returns one.
    """
    loss, aux = _split_loss(loss_fn(state.compute_params(), batch, None))
    return {"loss": loss} if aux is None else {"loss": loss, "aux": aux}
