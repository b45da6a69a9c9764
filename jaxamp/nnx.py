"""Flax NNX models under jaxamp: an `Optimizer` that holds the optax state and the loss scale, and an in-place
`train_step(model, opt, batch, loss_fn)` built on the functional `jaxamp.train_step`::

    from flax import nnx
    from jaxamp import DynamicLossScale
    from jaxamp.nnx import Optimizer, train_step

    opt = Optimizer(model, optax.adamw(1e-3), policy="fp16", loss_scale=DynamicLossScale())
    for batch in batches:
        metrics = train_step(model, opt, batch, loss_fn)  # loss_fn(model, batch) -> loss | (loss, aux); compiled

    @nnx.jit(donate_argnames=("model", "opt"))           # or inside a jitted function of your own
    def step(model, opt, batch):
        return train_step(model, opt, batch, loss_fn)

How it sits on the functional core. Inside the traced step the model is split into its `wrt` variables (the
master weights, `TrainState.params`) and everything else (BatchNorm statistics, RNG keys and counts, Params outside
`wrt`, any other `nnx.Variable`). The optimizer's fields and those params make a `TrainState`, and
`jaxamp.step.train_step_with_carry` runs the step of `jaxamp.train_step`: same order of operations, same metrics,
with the non-`wrt` state as a carry that `loss_fn` may change. Its `loss_fn(params, batch, rng, carry)` merges the
compute-dtype params with the carry into a fresh model (`nnx.merge`, inside the differentiated function, so NNX's
mutations happen at the trace that owns the variables) and calls the user's `loss_fn(model, batch)`. The new params,
optimizer state, loss scale and step go back into `opt`, the new params and carry into `model`.

FP8: `Fp8DotGeneral` (`nnx.Linear(..., dot_general=Fp8DotGeneral())`) and `Fp8Einsum`
(`nnx.Einsum(..., einsum_op=Fp8Einsum())`) are Flax's linen FP8 ops as NNX modules (`jaxamp.nnx_fp8`): their scales
and amax histories are `Fp8Meta` variables, the NNX form of linen's `"_overwrite_with_gradient"` collection (the
bridge maps one to the other). The step puts them into the `TrainState`'s params under that collection's name,
beside the `wrt` variables, so the functional core's FP8 handling applies unchanged (see `jaxamp.train_step`).

Diagnostics: `grad_fidelity(model, opt, batch, loss_fn)` and `fp8_ranges(model, opt, batch, loss_fn)` are
`jaxamp.fidelity.grad_fidelity` and `jaxamp.fp8_report.fp8_ranges` for an NNX model, on the same functional form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.errors
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import jmp
import optax
from flax.nnx.training.optimizer import OptArray, OptState, to_opt_state

from jaxamp import audit, fidelity, fp8_report
from jaxamp import fp8_collection as fp8c
from jaxamp.fp8_collection import FP8_COLLECTION, split_fp8
from jaxamp.gradients import compute_loss, split_loss
from jaxamp.loss_scale import LossScale
from jaxamp.nnx_fp8 import FP8_FILTER as _FP8
from jaxamp.nnx_fp8 import Fp8DotGeneral, Fp8Einsum, Fp8Meta, Fp8Op
from jaxamp.state import TrainState
from jaxamp.step import check_loss_args, check_options, train_step_with_carry

__all__ = ["Fp8DotGeneral", "Fp8Einsum", "Fp8Meta", "Optimizer", "eval_step", "fidelity_report", "fp8_ranges",
           "grad_fidelity", "precision_audit", "train_step"]

PyTree = Any
_RNG = (2,)  # TrainState.rng's shape: unused here (randomness comes from the model's nnx.Rngs), kept constant


# ---------------------------------------------------------------------------------------------------------------------
# The optimizer.


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _values(tree: PyTree) -> PyTree:
    """`tree` with every `nnx.Variable` replaced by its value (`nnx.as_pure`)."""
    return nnx.as_pure(tree)


def _pure(state: nnx.State) -> dict:
    """An `nnx.State` as nested dicts of arrays, keyed like the model's attributes (`{"l1": {"kernel": ...}}`)."""
    return nnx.to_pure_dict(state)


def _assign(variables: PyTree, values: PyTree) -> None:
    """Sets each `nnx.Variable` of `variables` to the array at the same place in `values`."""
    jax.tree.map(lambda var, x: var.set_value(x), variables, values, is_leaf=_is_variable)


def _check_model(model) -> None:
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a flax.nnx Module, got {type(model).__name__}; for a linen model use "
                         "jaxamp.TrainState.create and jaxamp.train_step")


def _check_call(model, opt, loss_fn) -> None:
    """The arguments of `train_step` and the diagnostics: an NNX model, its `jaxamp.nnx.Optimizer`, a function."""
    _check_model(model)
    if not isinstance(opt, Optimizer):
        raise ValueError(f"opt must be a jaxamp.nnx.Optimizer(model, tx, policy=..., loss_scale=...), got "
                         f"{type(opt).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function loss_fn(model, batch), got {type(loss_fn).__name__}")
    check_loss_args(loss_fn, ("model", "batch"), "jaxamp.nnx")


class Optimizer(nnx.Pytree):
    """The optax state, the loss scale and the step counter of an NNX model's mixed-precision training.

    Like `nnx.Optimizer` (it does not hold the model; `train_step` takes both), with jaxamp's policy and loss
    scale. Every array is an `nnx.Variable` (`OptState`/`OptArray`, Flax's optimizer variable types), so
    `nnx.state(opt)` holds the whole optimizer (save it with orbax, restore with `nnx.update(opt, restored)`), and
    `nnx.jit` carries its updates out of a jitted step.

    Attributes:
      step: an `OptState` of i32[]: `train_step` calls so far (skipped steps included), as `TrainState.step`.
      consecutive_skips: an `OptState` of i32[]: steps skipped in a row, as `TrainState.consecutive_skips`.
      opt_state: the optax state of `tx` for the trainable `wrt` variables (leaves wrapped in `OptArray`).
      loss_scale: the loss scale, its array leaves wrapped in `OptArray` (`train_state(model).loss_scale` gives
        the plain one).
      tx, policy, wrt, trainable: static: the optax transformation, the `jmp.Policy`, the filter of the
        variables this optimizer trains, and the trainable mask (None, or one bool per `wrt` leaf).
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, policy: jmp.Policy | str,
                 loss_scale: LossScale, wrt: Any = nnx.Param,
                 trainable: PyTree | Callable[[tuple, jax.Array], bool] | None = None):
        """Initialises `tx` on the model's `wrt` variables and makes them master weights in the policy's dtype.

        Args:
          model: the `nnx.Module`. Its `wrt` variables are cast to the policy's param dtype in place (a no-op for
            float32 weights under the presets).
          tx: an optax transformation (clipping, schedules and weight decay inside it see unscaled gradients).
          policy: a `jmp.Policy` or a spec `jaxamp.get_policy` accepts (`"fp16"`, `"bf16"`, `"fp32"`, with
            `keep_float32` rules matched against paths such as `"encoder/embed/embedding"`).
          loss_scale: a jaxamp `NoOpLossScale`, `StaticLossScale` or `DynamicLossScale`.
          wrt: an NNX filter (`nnx.Param`, `nnx.All(nnx.Param, nnx.PathContains("head"))`, ...): the variables
            this optimizer owns (never the `Fp8Meta` variables: `train_step` updates those itself). They must be
            float arrays. `loss_fn` sees them in the compute dtype; all other variables (Params outside `wrt`
            included) stay as they are, are not differentiated and are never changed by the update (a way to
            freeze parts of the model, which then compute in their own dtype).
          trainable: `TrainState.create`'s rule over the `wrt` variables (a bool tree or prefix keyed like
            `nnx.state(model, wrt)`, or a callable `(path, leaf) -> bool`): frozen leaves are still cast to the
            compute dtype but are not differentiated, hold no optimizer state and stay bitwise unchanged.

        Raises:
          ValueError: `model` is not an NNX module, `wrt` selects no variable or a non-float one, or any error of
            `TrainState.create` (bad `tx`, `policy`, `loss_scale` or `trainable`).
        """
        _check_model(model)
        params = _model_params(model, wrt)
        state = TrainState.create(params=params, tx=tx, policy=policy, loss_scale=loss_scale,
                                  rng=jnp.zeros(_RNG, jnp.uint32), trainable=trainable)
        if jax.tree.map(jnp.result_type, state.params) != jax.tree.map(jnp.result_type, params):
            _update_model(model, state.params)  # master weights in the policy's param dtype (only if cast)
        self.tx, self.policy, self.wrt, self.trainable = tx, state.policy, wrt, state.trainable
        self.params_structure = jax.tree.structure(state.params)
        self.params_shapes = tuple(tuple(jnp.shape(x)) for x in jax.tree.leaves(state.params))  # static: ints
        state = _replicated_on_mesh(state, params)
        self.step = OptState(state.step)
        self.consecutive_skips = OptState(state.consecutive_skips)
        self.opt_state = nnx.data(to_opt_state(state.opt_state))
        self.loss_scale = nnx.data(jax.tree.map(OptArray, state.loss_scale))

    def train_state(self, model: nnx.Module, *, whole_model: bool = False) -> TrainState:
        """This optimizer and `model`'s `wrt` variables as a jaxamp `TrainState` (plain arrays, no copies).

        A model with `Fp8Meta` variables has them in `params` too, under `FP8_COLLECTION` (`"_overwrite_with_gradient"`,
        keyed like the model: `params["_overwrite_with_gradient"]["l1"]["dot_general"]["input_scale"]`), where
        `jaxamp.train_step` handles a linen model's FP8 collection.

        Args:
          model: the model this optimizer was built for.
          whole_model: put all of `nnx.state(model)` into `params` (BatchNorm statistics and RNG state too): the
            form to save with `jaxamp.checkpoint.Checkpointer`, restored with `load_train_state`. Such a state is
            for checkpoints only (its `trainable` is None and `params` holds non-float leaves), not for
            `jaxamp.train_step`.

        Returns:
          A `TrainState` whose `rng` is a constant (NNX models draw from their own `nnx.Rngs`).

        Raises:
          ValueError: `model`'s `wrt` variables do not match this optimizer (another model).
        """
        params = _pure(nnx.state(model)) if whole_model else self._params_of(model)
        return TrainState(step=self.step.get_value(), params=params, opt_state=_values(self.opt_state),
                          loss_scale=_values(self.loss_scale), rng=jnp.zeros(_RNG, jnp.uint32), tx=self.tx,
                          policy=self.policy, trainable=None if whole_model else self.trainable,
                          consecutive_skips=self.consecutive_skips.get_value())

    def load_train_state(self, model: nnx.Module, state: TrainState) -> None:
        """Writes a `train_state(model, whole_model=True)`-shaped state (e.g. restored from a checkpoint) into
        `model` and this optimizer, in place. (`train_state(model)`'s `wrt`-only form loads as well.)

        Raises:
          ValueError: the state does not fit the model and this optimizer (a leaf's place, shape or dtype, the optax
            state or the loss scale differs), naming the first difference; nothing is changed then.
        """
        whole, wrt = _pure(nnx.state(model)), self._params_of(model)
        _check_fits("params", state.params, max((wrt, whole), key=lambda t: len(_paths(t) & _paths(state.params))))
        _check_fits("opt_state", state.opt_state, _values(self.opt_state), what="optax transformation")
        _check_fits("step", state.step, self.step.get_value(), what="optimizer")
        if type(state.loss_scale) is not type(_values(self.loss_scale)):
            raise ValueError(f"the state's loss scale is a {type(state.loss_scale).__name__}, this optimizer's a "
                             f"{type(_values(self.loss_scale)).__name__}: build the Optimizer with the saved one")
        _check_fits("loss_scale", state.loss_scale, _values(self.loss_scale))
        _update_model(model, state.params)
        self._load(state)

    def _params_of(self, model) -> PyTree:
        params = _model_params(model, self.wrt)
        if jax.tree.structure(params) != self.params_structure or \
                tuple(tuple(jnp.shape(x)) for x in jax.tree.leaves(params)) != self.params_shapes:
            raise ValueError("the model's wrt variables do not match this Optimizer's (another model, or a model "
                             "whose structure or shapes changed); build the Optimizer from this model")
        return params

    def _load(self, state: TrainState) -> None:
        """Sets step, opt_state and loss scale from `state` (arrays shaped as this optimizer's)."""
        self.step.set_value(state.step)
        # (a state of an older jaxamp, without the counter, loads with 0)
        skips = state.consecutive_skips if state.consecutive_skips is not None else jnp.zeros((), jnp.int32)
        self.consecutive_skips.set_value(skips)
        _assign(self.opt_state, state.opt_state)
        _assign(self.loss_scale, state.loss_scale)


def _replicated_on_mesh(state: TrainState, params: PyTree) -> TrainState:
    """`state` with its arrays that are not on the params' mesh (the step, the counters, the loss scale: made on
    one device) replicated over it, when a param is sharded over several devices; else `state` as it is. So every
    array of the step is on one mesh, and the step keeps each one's sharding (one compile)."""
    mesh = next((x.sharding.mesh for x in jax.tree.leaves(params)
                 if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
                 and len(x.sharding.device_set) > 1), None)
    if mesh is None:
        return state
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(x):
        on_mesh = isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh or not isinstance(x, jax.Array) else jax.device_put(x, replicated)

    return state.replace(step=place(state.step), consecutive_skips=place(state.consecutive_skips),
                         opt_state=jax.tree.map(place, state.opt_state),
                         loss_scale=jax.tree.map(place, state.loss_scale))


def _paths(tree: PyTree) -> set[str]:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_fits(name: str, got: PyTree, want: PyTree, what: str = "model") -> None:
    """One-line ValueError naming the first leaf of `got` that `want` lacks (or the reverse), or whose shape or dtype
    differs, or `got`'s other structure with the same leaves (another optax chain)."""
    have, need = _paths(got), _paths(want)
    for extra, where in ((sorted(have - need), "has"), (sorted(need - have), "lacks")):
        if extra:
            raise ValueError(f"the state {where} {name}{extra[0]}, which this {what} "
                             f"{'lacks' if where == 'has' else 'has'}: a state of another {what}; nothing was loaded")
    wanted = dict((jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(want)[0])
    for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
        w = wanted[jax.tree_util.keystr(path)]
        if jnp.shape(g) != jnp.shape(w) or jnp.result_type(g) != jnp.result_type(w):
            raise ValueError(f"the state's {name}{jax.tree_util.keystr(path)} is {jnp.result_type(g)}"
                             f"{list(jnp.shape(g))} but this {what}'s is {jnp.result_type(w)}{list(jnp.shape(w))}; "
                             "nothing was loaded")
    if jax.tree.structure(got) != jax.tree.structure(want):
        raise ValueError(f"the state's {name} holds the same arrays in another structure (e.g. adamw's chain where "
                         f"this one is adam's): a state of another {what}; nothing was loaded")


def _trained(wrt):
    """The filter of the variables an optimizer with `wrt` trains: `wrt` without the FP8 variables."""
    return nnx.All(wrt, nnx.Not(_FP8))


def _model_params(model, wrt) -> PyTree:
    """`TrainState.params` of `model`: its `wrt` variables as plain arrays keyed like the model's attributes
    (`{"l1": {"kernel": f32[4, 32]}}`), plus, when it has `Fp8Meta` variables, those under `FP8_COLLECTION`
    (`{..., "_overwrite_with_gradient": {"l1": {"dot_general": {"input_scale": f32[1], ...}}}}`), where
    `jaxamp.train_step` finds a linen model's FP8 collection."""
    params = _wrt_params(model, wrt)
    fp8 = _pure(nnx.state(model, _FP8))
    if not fp8:
        return params
    if FP8_COLLECTION in params:
        raise ValueError(f"the model has an attribute named {FP8_COLLECTION!r}, the name under which jaxamp keeps "
                         "the FP8 variables; rename it")
    return {**params, FP8_COLLECTION: fp8}


def _update_model(model, params: PyTree, *more: PyTree) -> None:
    """`nnx.update(model, params, *more)` for `_model_params`-shaped (or whole-model) `params`."""
    regular, fp8 = split_fp8(params)
    nnx.update(model, regular, *([] if fp8 is None else [fp8]), *more)


def _wrt_params(model, wrt) -> PyTree:
    """`nnx.state(model, wrt)` without the FP8 variables, as plain arrays; raises on an empty selection or a
    non-float variable (naming `wrt` as the caller wrote it)."""
    params = _pure(nnx.state(model, _trained(wrt)))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if not flat:
        raise ValueError(f"wrt={wrt!r} selects no variable of the model: pass nnx.Param (the default) or a filter "
                         "that matches its weights")
    for path, x in flat:
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(f"wrt={wrt!r} selects {jax.tree_util.keystr(path)} of dtype {jnp.result_type(x)}: "
                             "only float variables can train; narrow wrt, e.g. to nnx.Param")
    return params


# ---------------------------------------------------------------------------------------------------------------------
# The step.


def _keep_finite(new: PyTree, old: PyTree) -> PyTree:
    """`new`, with every floating leaf that holds a non-finite element replaced by its `old` value (bitwise)."""

    def keep(n, o):
        if not jnp.issubdtype(jnp.result_type(n), jnp.floating):
            return n
        return jax.lax.select(jnp.all(jnp.isfinite(n)), n, o)

    return jax.tree.map(keep, new, old)


def _like(new: PyTree, old: PyTree) -> PyTree:
    """`new` with every leaf in `old`'s dtype (BatchNorm updated from float16 activations stays float32), or a
    one-line error when `loss_fn` changed the model's structure."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise ValueError("loss_fn changed the structure of the model's state (a new attribute or variable, or "
                         "Module.sow outside nnx.capture); remove such entries before it returns, e.g. "
                         "nnx.pop(model, nnx.Intermediate)")
    return jax.tree.map(lambda n, o: n if n.dtype == o.dtype else n.astype(o.dtype), new, old)


def _functional_loss(graphdef, loss_fn, trained, fp8_now: dict | None = None):
    """The user's `loss_fn(model, batch)` as the functional core's stateful loss `f(params, batch, rng, carry) ->
    (out, new_carry)`: `params` are `_model_params`-shaped (compute dtype), `carry` is the rest of the model's state
    (`nnx.split(model, trained, _FP8, ...)[3]` as plain arrays). Params and carry merge into a fresh model inside the
    differentiated function (so NNX's mutations happen at the trace that owns the variables); `fp8_now`, the current
    FP8 variables, stand in where `params` hold none (the FP8-bypassed reference of `grad_fidelity`). The model's
    FP8 ops are named by path for `fp8_report`'s recorder while it records."""

    def functional(params_c, batch, rng, carry):
        del rng  # NNX modules draw from their own nnx.Rngs streams (carried in `carry`)
        regular, fp8 = split_fp8(params_c)  # the FP8 variables: differentiated, their "gradient" the new value
        inner = nnx.merge(graphdef, regular, (fp8_now or {}) if fp8 is None else fp8, carry)
        recorder = fp8_report.active_recorder()
        if recorder is not None:
            recorder.names.update({id(node): "/".join(map(str, path)) for path, node in nnx.iter_graph(inner)
                                   if isinstance(node, Fp8Op)})
        out = loss_fn(inner, batch)
        return out, _like(_pure(nnx.split(inner, trained, _FP8, ...)[3]), carry)

    return functional


def _step_in_place(model, opt: Optimizer, batch, loss_fn, options: dict) -> dict:
    """The traced step: split, `train_step_with_carry`, write back. Returns the metrics."""
    trained = _trained(opt.wrt)
    graphdef, _, _, rest = nnx.split(model, trained, _FP8, ...)
    rest = _pure(rest)
    state = opt.train_state(model)  # params: the `wrt` variables, and the FP8 ones under FP8_COLLECTION
    new_state, metrics, new_rest = train_step_with_carry(state, batch, _functional_loss(graphdef, loss_fn, trained),
                                                         rest, caller="jaxamp.nnx.train_step", **options)
    _update_model(model, new_state.params, _keep_finite(new_rest, rest))
    opt._load(new_state)  # pylint: disable=protected-access
    return metrics


def _flatten(nodes, graph: bool):
    """`(structure, arrays)` of `(model, opt)`: as a JAX pytree (`structure` a `PyTreeDef`: fast, in C++) or as an
    NNX graph (`structure` a `GraphDef`: one Python traversal, which keeps a shared variable, a tied weight, once)."""
    if graph:
        return nnx.flatten(nodes, with_paths=False)
    arrays, treedef = jax.tree.flatten(nodes)
    return treedef, arrays


def _unflatten(structure, arrays):
    if isinstance(structure, jax.tree_util.PyTreeDef):
        return jax.tree.unflatten(structure, arrays)
    return nnx.unflatten(structure, arrays)


class _Static:
    """A jit static argument for a value that may not hash: an NNX `GraphDef` holds the model's static attributes,
    and a config with `__eq__` but no `__hash__` (transformers' `PretrainedConfig`, an `eq=True` dataclass) makes it
    unhashable. Hashes as the value where it can, else by its type (jit's cache then tells such values apart by
    equality); equal when the values are."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __hash__(self) -> int:
        try:
            return hash(self.value)
        except TypeError:
            return hash(type(self.value))

    def __eq__(self, other) -> bool:
        return isinstance(other, _Static) and type(other.value) is type(self.value) and bool(self.value == other.value)


def _step_arrays(structure, arrays, batch, loss_fn, accum_steps, on_overflow, max_retries, underflow_stats,
                 axis_name=None, shardings=None):
    """The fast path: plain arrays in and out; one compiled step per (structure, loss_fn, options, batch shapes).
    `shardings` (static: one per array, or None): the new arrays are constrained to the old ones' shardings, so a
    step on a mesh gives back what it took (no second compile)."""
    structure = structure.value
    model, opt = _unflatten(structure, arrays)  # fresh variables at this trace level
    metrics = _step_in_place(model, opt, batch, loss_fn, dict(
        accum_steps=accum_steps, on_overflow=on_overflow, max_retries=max_retries, underflow_stats=underflow_stats,
        axis_name=axis_name))
    new_structure, new_arrays = _flatten((model, opt), graph=isinstance(structure, nnx.GraphDef))
    if new_structure != structure:
        raise ValueError("loss_fn changed the structure of the model (a new attribute or variable, or Module.sow "
                         "outside nnx.capture); remove such entries before it returns")
    if shardings is not None:
        new_arrays = [x if s is None else jax.lax.with_sharding_constraint(x, s) for x, s in zip(new_arrays, shardings)]
    return new_arrays, metrics


def _mesh_shardings(arrays) -> tuple | None:
    """The arrays' shardings when any of them is a `NamedSharding` over several devices (else None: nothing to
    keep). Specs lose their trailing Nones (`P('fsdp', None)` is `P('fsdp')`, as a compiled step's outputs carry
    them), so equal placements give equal static arguments: one compile."""
    if any(isinstance(a, jax.core.Tracer) for a in arrays):  # inside another trace: its caller decides
        return None

    def normal(s):
        spec = list(s.spec)
        if not spec or spec[-1] is not None:  # already normal: no new object on the per-step path
            return s
        while spec and spec[-1] is None:
            spec.pop()
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=s.memory_kind)

    shardings = tuple(normal(a.sharding) if isinstance(getattr(a, "sharding", None), jax.sharding.NamedSharding)
                      else None for a in arrays)
    several = any(s is not None and len(s.device_set) > 1 for s in shardings)
    return shardings if several else None


_RNGS_OUTSIDE = ("loss_fn uses an nnx.Rngs that the model does not hold (e.g. model(x, rngs=rngs) with rngs made "
                 "outside the step): the compiled step cannot update it. Keep the Rngs in the model (nnx.Dropout(rate, "
                 "rngs=rngs) in __init__, or an attribute self.rngs = rngs that the forward passes on), so its state "
                 "runs through the step, or derive the keys from the batch (a key in the batch, then nnx.Rngs(key) "
                 "inside loss_fn)")

_STATIC = ("structure", "loss_fn", "accum_steps", "on_overflow", "max_retries", "underflow_stats", "axis_name",
           "shardings")
_JITTED = {False: jax.jit(_step_arrays, static_argnames=_STATIC),
           True: jax.jit(_step_arrays, static_argnames=_STATIC, donate_argnames="arrays")}


def _arrays_of(nodes) -> tuple[Any, list, list]:
    """`(structure, variables, arrays)` of `nodes`: the JAX pytree view (fast) unless a variable is shared (a tied
    weight would appear twice in it) or holds more than one array, or an array is held outside a variable (a plain
    attribute); then NNX's graph view, in which such an array's place in `variables` holds its path instead."""
    variables = jax.tree.leaves(nodes, is_leaf=_is_variable)
    if len({id(v) for v in variables}) == len(variables) and all(map(_is_variable, variables)):
        structure, arrays = _flatten(nodes, graph=False)
        if len(arrays) == len(variables):
            return structure, variables, arrays
    structure, flat = nnx.flatten(nodes, with_paths=True)
    variables = [v if _is_variable(v) else path for path, v in zip(flat.paths, flat.leaves)]
    return structure, variables, [v.get_raw_value() if _is_variable(v) else v for v in flat.leaves]


def train_step(model: nnx.Module, opt: Optimizer, batch: PyTree, loss_fn: Callable[[nnx.Module, PyTree], Any], *,
               accum_steps: int = 1, on_overflow: str = "skip", max_retries: int = 4,
               underflow_stats: bool = False, donate: bool = False, axis_name: Any = None) -> dict:
    """One mixed-precision optimizer step of an NNX model, in place: `model` and `opt` are updated.

    `jaxamp.train_step`'s step (see it for the order of operations, `accum_steps`, `on_overflow` and
    `underflow_stats`), run on the model's `wrt` variables: cast to the compute dtype, loss in float32, scaled,
    differentiated, unscaled in float32, one finite check, the optax update, new or old params and optimizer state
    selected by the finite flag, the loss scale adjusted once, `opt.step` advanced. Afterwards the `wrt` variables
    are master weights in the policy's param dtype again (float32 under the presets).

    The rest of the model's state (BatchNorm statistics, `nnx.Rngs` keys and counts, any other variable that
    `loss_fn` changes) runs through the step as a carry:

    - a skipped step (non-finite gradients) leaves the `wrt` variables and the optax state bitwise unchanged and
      backs the scale off, but keeps its BatchNorm statistics and RNG counts, as torch.amp does (the forward pass
      ran and consumed its randomness), except that a float variable whose new value is not finite (an inf batch
      through BatchNorm) keeps its old value bitwise: a non-finite running statistic would poison every later step;
    - every attempt of `on_overflow="retry"` starts from the state before the step, so a retried batch draws the
      same dropout masks; the state of the last attempt is kept (RNG counts advance once);
    - with `accum_steps` > 1 the micro-batches run in order, each from the state the previous one left (each draws
      new dropout masks; BatchNorm statistics update once per micro-batch, as k forward passes would).

    FP8 (`Fp8DotGeneral`, or a linen FP8 op through `nnx.bridge`): the model's `Fp8Meta` variables (scales and amax
    histories) go into the step as the linen FP8 collection does, whatever `wrt` says: float32, not cast, their
    "gradient" taken as their new value, stored loss-scale free (bitwise the same under any power-of-2 static
    scale), combined over micro-batches by element-wise maximum, kept bitwise on a skipped step, their new amax
    values part of the finite check, and no part of the optax update, `grad_norm` or clipping.

    The step is compiled: every call goes through one cached `jax.jit` that takes and returns plain arrays (the
    split/merge fast path of NNX's performance guide, with JAX's own pytree flattening of the model and optimizer,
    or NNX's graph flattening where a variable is shared), and the new arrays are written back into the variables.
    So a plain loop `for batch in data: train_step(model, opt, batch, loss_fn)` compiles once (a new loss-scale
    value never retraces) and costs little Python per step. Inside `nnx.jit` (or any other trace) the same jitted
    function is inlined into the caller's program, so `@nnx.jit(donate_argnames=("model", "opt"))` around it works
    too, at the price of NNX's graph traversal per call.

    Randomness: `loss_fn`'s model draws from the model's own `nnx.Rngs`; `TrainState.rng` plays no part.

    Args:
      model: the `nnx.Module` that `opt` was built for.
      opt: its `jaxamp.nnx.Optimizer`.
      batch: any pytree; passed to `loss_fn` (split by rows under accumulation, as for `jaxamp.train_step`).
      loss_fn: `loss_fn(model, batch) -> loss | (loss, aux)`; `model` has its `wrt` variables in the compute dtype
        (cast float inputs yourself, e.g. `x.astype(jnp.float16)`); its Dropout draws from the model's own
        `nnx.Rngs`, its BatchNorm updates its statistics (in train mode: `model.train()`). A static cache key:
        define it once, not as a fresh lambda per call. It must not change the model's structure.
      accum_steps, on_overflow, max_retries, underflow_stats: as for `jaxamp.train_step`.
      donate: donate the model's and optimizer's current arrays to the step, so their memory is reused for the new
        ones (as `donate_argnums` does for the functional step). The variables receive the new arrays; arrays read
        from them before the call are deleted. Off by default.
      axis_name: the mapped axis of a `jax.pmap` / `shard_map` around the step (see `jaxamp.train_step`), or None.
        On a mesh under plain jit none is needed; there every variable and optimizer array keeps its sharding
        across the step (the new arrays are constrained to the old ones'), so a loop compiles once.

    Returns:
      The metrics of `jaxamp.train_step` (same keys: `loss`, `loss_finite`, `grad_norm`, `loss_scale`,
      `grads_finite`, `grads_finite_leaves` keyed like `nnx.state(model, opt.wrt)`, `retries`, and `aux`,
      `underflow`, `nonfinite_at_min_scale` where they apply).

    Raises:
      ValueError: `model` is not an NNX module, `opt` is not a `jaxamp.nnx.Optimizer` or was built for a model of
        another structure or other shapes (a model of the same structure and shapes is taken: the way to load a
        restored optimizer), `loss_fn` changed the model's structure, `loss_fn` used an `nnx.Rngs` the model does
        not hold (one line naming the pattern that works), or any error of `jaxamp.train_step`.
    """
    _check_call(model, opt, loss_fn)
    structure, variables, arrays = _arrays_of((model, opt))
    try:
        new_arrays, metrics = _JITTED[bool(donate)](_Static(structure), arrays, batch, loss_fn, accum_steps,
                                                    on_overflow, max_retries, underflow_stats, axis_name,
                                                    _mesh_shardings(arrays))
    except flax.errors.TraceContextError as err:
        if "Rng" not in str(err):
            raise
        raise ValueError(_RNGS_OUTSIDE) from None
    raw = []  # (path, array) of arrays held outside a variable
    for variable, value in zip(variables, new_arrays):
        if _is_variable(variable):
            variable.set_raw_value(value)
        else:
            raw.append((variable, value))
    if raw:
        nnx.update((model, opt), nnx.from_flat_state(raw))
    return metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _eval(graphdef, trained, loss_fn, state, fp8, rest, batch):
    graphdef = graphdef.value
    params_c = fp8c.merge_fp8(state.policy.cast_to_compute(fp8c.split_fp8(state.params)[0]), fp8 or None)
    loss = compute_loss(state.policy, _functional_loss(graphdef, loss_fn, trained, fp8))
    out, _ = loss(params_c, batch, None, rest)  # the model's new state (statistics, RNG counts) is dropped
    loss_value, aux = split_loss(out)
    return {"loss": loss_value} if aux is None else {"loss": loss_value, "aux": aux}


def eval_step(model: nnx.Module, opt: Optimizer, batch: PyTree, loss_fn: Callable[[nnx.Module, PyTree], Any]) -> dict:
    """The loss on `batch` as `train_step` would compute it (the `wrt` variables cast to the compute dtype, or
    under autocast for an autocast policy), compiled, changing nothing: `jaxamp.eval_step` for an NNX model.

    Evaluate in the model's eval mode (`model.eval()`: BatchNorm's running statistics, no dropout); whatever state
    `loss_fn` changes (statistics, RNG counts) is dropped.

    Args:
      model, opt, batch, loss_fn: as for `train_step`.

    Returns:
      `{"loss": f32[]}`, plus `"aux"` when `loss_fn` returns one.

    Raises:
      ValueError: `model` is not an NNX module or `opt` not a `jaxamp.nnx.Optimizer` built for it.
    """
    _check_call(model, opt, loss_fn)
    graphdef, trained, state, fp8, rest = _split(model, opt)
    return _eval(_Static(graphdef), trained, loss_fn, state, fp8, rest, batch)


# ---------------------------------------------------------------------------------------------------------------------
# Diagnostics: the functional ones, on the model's functional form.


def _split(model, opt: Optimizer):
    """`(graphdef, trained, state, fp8, rest)`: the model's graph, the filter of the trained variables, the
    `TrainState` of `opt` and `model`, and the FP8 and other variables the functional loss merges back."""
    trained = _trained(opt.wrt)
    graphdef, _, fp8, rest = nnx.split(model, trained, _FP8, ...)
    return graphdef, trained, opt.train_state(model), _pure(fp8), _pure(rest)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _fidelity(graphdef, trained, loss_fn, accum_steps, state, fp8, rest, batch):
    graphdef = graphdef.value
    pair = fidelity.gradient_pair(state, batch, _functional_loss(graphdef, loss_fn, trained, fp8),
                                  accum_steps=accum_steps, carry=rest)
    return fidelity.errors(*pair)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _fidelity_report(graphdef, trained, loss_fn, accum_steps, noise_floor, state, fp8, rest, batch):
    graphdef = graphdef.value
    return fidelity.fidelity_report(state, batch, _functional_loss(graphdef, loss_fn, trained, fp8),
                                    accum_steps=accum_steps, noise_floor=noise_floor, carry=rest)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _capture(graphdef, trained, loss_fn, state, fp8, rest, batch):
    graphdef = graphdef.value
    stateful = _functional_loss(graphdef, loss_fn, trained, fp8)
    return fp8_report.capture(state, batch, lambda p, b, rng: stateful(p, b, rng, rest)[0])


def grad_fidelity(model: nnx.Module, opt: Optimizer, batch: PyTree, loss_fn: Callable[[nnx.Module, PyTree], Any], *,
                  accum_steps: int = 1) -> dict[str, jax.Array]:
    """`jaxamp.fidelity.grad_fidelity` for an NNX model: each trained leaf's relative L2 gradient error against a
    float32 recomputation, as `train_step(model, opt, batch, loss_fn)` would compute the gradient now.

    Both recomputations see the model's current state (the same dropout masks: both start from the same `nnx.Rngs`
    counts); neither changes the model or the optimizer. FP8 ops (`Fp8DotGeneral`, `Fp8Einsum`, bridged linen ops)
    compute their plain float32 matmul in the reference, so the error includes what FP8 costs. Compiled once per
    model structure, `loss_fn` and `accum_steps`.

    Args:
      model, opt, batch, loss_fn, accum_steps: as for `train_step`.

    Returns:
      `{leaf path: f32[] error}`, keyed like `nnx.state(model, opt.wrt)` (`"l1/kernel"`); inf where the
      mixed-precision gradient is not finite.

    Raises:
      ValueError: `model` is not an NNX module or `opt` not a `jaxamp.nnx.Optimizer` built for it.
    """
    _check_call(model, opt, loss_fn)
    graphdef, trained, state, fp8, rest = _split(model, opt)
    # before jit: accum_steps is one of its static arguments
    check_options(loss_fn, accum_steps, caller="jaxamp.nnx.grad_fidelity")
    return _fidelity(_Static(graphdef), trained, loss_fn, accum_steps, state, fp8, rest, batch)


def fidelity_report(model: nnx.Module, opt: Optimizer, batch: PyTree,
                    loss_fn: Callable[[nnx.Module, PyTree], Any], *, accum_steps: int = 1,
                    noise_floor: Any = False) -> dict:
    """`jaxamp.fidelity.fidelity_report` for an NNX model: `grad_fidelity`'s errors with the near-zero leaves
    marked, each leaf's error relative to the global gradient norm and (with `noise_floor`) what rounding the
    weights once to the compute dtype alone costs. Nothing in the model or the optimizer changes.

    Returns:
      `{"rel_err": ..., "global_rel_err": ..., "near_zero": ..., "noise_floor": ...}`, keyed like
      `nnx.state(model, opt.wrt)` (`"l1/kernel"`).

    Raises:
      ValueError: as `grad_fidelity`.
    """
    _check_call(model, opt, loss_fn)
    graphdef, trained, state, fp8, rest = _split(model, opt)
    check_options(loss_fn, accum_steps, caller="jaxamp.nnx.fidelity_report")
    floor = noise_floor if noise_floor is False or noise_floor is True else jnp.dtype(noise_floor)
    return _fidelity_report(_Static(graphdef), trained, loss_fn, accum_steps, floor, state, fp8, rest, batch)


def fp8_ranges(model: nnx.Module, opt: Optimizer, batch: PyTree,
               loss_fn: Callable[[nnx.Module, PyTree], Any]) -> list[dict]:
    """`jaxamp.fp8_report.fp8_ranges` for an NNX model: per FP8 op (`Fp8DotGeneral`, `Fp8Einsum`, or a linen FP8 op
    through `nnx.bridge`) and tensor, this batch's amax against the op's current scale, and the fractions that
    saturate or flush in e4m3 (inputs, kernels: max 448) and e5m2 (output gradients: max 57344).

    Args:
      model, opt, batch, loss_fn: as for `train_step`. Nothing changes.

    Returns:
      `fp8_report.fp8_ranges`'s rows; `layer` is the op's path in the model (`"l1/dot_general"`).

    Raises:
      ValueError: the model has no `Fp8Meta` variables, or `loss_fn` calls no FP8 op; or as `grad_fidelity`.
    """
    _check_call(model, opt, loss_fn)
    graphdef, trained, state, fp8, rest = _split(model, opt)
    if not fp8:
        raise ValueError("the model has no FP8 variables: build its layers with jaxamp.nnx.Fp8DotGeneral "
                         "(nnx.Linear(..., dot_general=Fp8DotGeneral())) or Fp8Einsum")
    return fp8_report.ranges_table(*fp8_report.run_capture(_capture, _Static(graphdef), trained, loss_fn, state, fp8,
                                                           rest, batch))


def precision_audit(model: nnx.Module, opt: Optimizer, batch: PyTree, loss_fn: Callable[[nnx.Module, PyTree], Any], *,
                    accum_steps: int = 1) -> audit.PrecisionReport:
    """`jaxamp.precision_audit` for an NNX model: traces (does not run) the gradient computation
    `train_step(model, opt, batch, loss_fn)` would run and reports what runs in which precision, forward and
    backward. Nothing in the model or the optimizer changes.

    Args:
      model, opt, batch, loss_fn, accum_steps: as for `train_step`.

    Returns:
      A `jaxamp.audit.PrecisionReport`.

    Raises:
      ValueError: `model` is not an NNX module or `opt` not a `jaxamp.nnx.Optimizer` built for it.
    """
    _check_call(model, opt, loss_fn)
    graphdef, trained, state, fp8, rest = _split(model, opt)
    check_options(loss_fn, accum_steps, caller="jaxamp.nnx.precision_audit")
    return audit.precision_audit(state, batch, _functional_loss(graphdef, loss_fn, trained, fp8),
                                 accum_steps=accum_steps, carry=rest)
