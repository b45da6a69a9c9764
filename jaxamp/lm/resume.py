"""Resuming a run from its newest usable checkpoint, with a precision switch (fp32 <-> bf16 <-> fp16) when the
run asks for another precision than the checkpoint's: the master weights and optimizer state carry over, the loss
scale is kept when it is the same kind with the same settings, else made anew. A checkpoint of the other block
layout (`--scan-layers` or not) is restored in its own layout and converted (`stack_params` / `unstack_params`:
the same values, moved).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxamp.checkpoint import Checkpointer, CheckpointError, loss_scale_from_record
from jaxamp.lm.config import PRECISION_KEYS, RESUME_MATCH_KEYS, ConfigError, resume_keys, saved_scan_layers
from jaxamp.lm.log import say
from jaxamp.lm.model import stack_params, unstack_params
from jaxamp.lm.setup import Run
from jaxamp.precision import get_policy, policy_name, uses_fp8
from jaxamp.sharding import abstract_state
from jaxamp.state import TrainState


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How this run restores the workdir's newest checkpoint (from its settings alone)."""

    target: TrainState  # the restore target: this run's state in the saved layout and precision
    expected: dict  # this run's config as the checkpoint's would read (its scan_layers the saved one)
    match_keys: tuple  # the config keys that must equal the saved ones
    scanned: bool  # the checkpoint's block layout (--scan-layers)
    switched_from: str | None  # the saved precision's name when this run switches to another one, else None
    as_run: bool  # the target is this run's own state (same layout, same policy): nothing to carry over


def _plan(run: Run, ckpt: Checkpointer) -> _Plan:
    """The restore target and the settings to match, read from the newest checkpoint's JSON items.

    Raises:
      ConfigError: a precision or layout switch that cannot be made (fp8 <-> not, other master weights, frozen
        params in the other layout).
    """
    target, match_keys, switched_from = run.state, RESUME_MATCH_KEYS, None
    settings = ckpt.read_settings()  # None if unreadable: restore reports it and falls back
    scanned = saved_scan_layers(None if settings is None else settings[0], run.cfg)  # --scan-layers
    cfg = dataclasses.replace(run.cfg, scan_layers=scanned)  # restore as a run of the saved layout
    if scanned != run.cfg.scan_layers:  # shapes only: `run.state` may be abstract (a dry run)
        target = jax.eval_shape(functools.partial(relaid, scanned=scanned, workdir=run.cfg.workdir), run.state)
    match_keys = resume_keys(match_keys, None if settings is None else settings[0], cfg)
    if settings is not None and settings[1].get("policy") != policy_name(run.state.policy):
        # Saved under another policy: restore into a target with the saved one, then carry the run over. (A policy
        # that differs only in its per-leaf rule, e.g. a checkpoint of an older jaxamp, is no precision switch.)
        target, saved_name = _saved_precision_target(run, target, *settings)
        if saved_name != policy_name(run.state.policy, rules=False):
            switched_from, match_keys = saved_name, tuple(k for k in match_keys if k not in PRECISION_KEYS)
    abstract = jax.eval_shape(lambda t: t, target) if run.mesh is None else abstract_state(target, run.mesh)
    return _Plan(abstract, {**run.run_config(), "scan_layers": scanned}, tuple(match_keys), scanned, switched_from,
                 target is run.state)


def resume_check(run: Run, ckpt: Checkpointer) -> str:
    """One line on what this run would do with the workdir's checkpoints (the dry run's): resume step N (with the
    layout conversion or precision switch it would make), or stop with the mismatch `resume_state` would raise.
    Reads the checkpoints' JSON items only; writes nothing."""
    try:
        plan = _plan(run, ckpt)
        n, problem = ckpt.check(plan.target, plan.expected, match_keys=plan.match_keys)
    except (ConfigError, CheckpointError) as err:
        return f"a run would stop: {err}"
    if problem:
        return f"a run would stop: {problem}"
    if n >= run.cfg.steps:
        return f"step {n} is saved: a run would find it finished (--steps {run.cfg.steps}; raise it to go on)"
    changes = [f"its blocks {'unstacked without' if plan.scanned else 'stacked for'} --scan-layers"] \
        if plan.scanned != run.cfg.scan_layers else []
    if plan.switched_from is not None:
        changes.append(f"its precision switched from {plan.switched_from}")
    return f"a run would resume from step {n}" + "".join(f", {c}" for c in changes) + \
        " (settings checked, arrays not read)"


def resume_state(run: Run, ckpt: Checkpointer) -> tuple[TrainState, str | None]:
    """The newest usable checkpoint's state (or the fresh state when the workdir has none), and the precision it was
    saved with when this run switches to another one (else None)."""
    if ckpt.latest_step() is None:
        return run.state, None
    plan = _plan(run, ckpt)
    target, scanned, switched_from = plan.target, plan.scanned, plan.switched_from
    state, _ = ckpt.restore(target, plan.expected, match_keys=plan.match_keys,
                            set_aside=Path(run.cfg.workdir) / "unusable-checkpoints")
    if int(state.step) < run.cfg.steps:  # a finished run says "already holds step N" instead: nothing resumes
        say(f"resumed from step {int(state.step)} ({ckpt.directory})")
    if scanned != run.cfg.scan_layers:
        state = _placed_like(relaid(state, run.cfg.scan_layers, run.cfg.workdir), run.state)
        unrolled = f"h_0 .. h_{run.model.config.num_layers - 1}"
        say(f"layout: the checkpoint's blocks were {'stacked under h' if scanned else unrolled}; "
            f"{'unstacked' if scanned else 'stacked'} for this run {'with' if run.cfg.scan_layers else 'without'} "
            "--scan-layers (params and optimizer state: the same values; its next checkpoints are in this layout)")
    if plan.as_run:
        return state, None
    same_scale = (type(state.loss_scale) is type(run.state.loss_scale)
                  and state.loss_scale.config() == run.state.loss_scale.config())
    state = state.with_policy(run.state.policy, state.loss_scale if same_scale else run.state.loss_scale)
    if switched_from is not None:
        say(f"precision: switched from {switched_from} to {policy_name(run.state.policy, rules=False)} (master "
             f"weights and optimizer state carried over; loss scale {type(state.loss_scale).__name__}"
             f"{' kept' if same_scale else ' made anew'})")
    return state, switched_from


def relaid(state: TrainState, scanned: bool, workdir: str = "") -> TrainState:
    """`state` with its blocks in the scanned layout (`scanned`: `h`, leaves `[layers, ...]`) or the unrolled one
    (`h_0 .. h_{L-1}`): `stack_params` / `unstack_params` on every mapping of its params (the FP8 collection
    included), optimizer state (Adam's `mu` and `nu`) and model state. Values are moved, never changed.

    Raises:
      ConfigError: the state has frozen leaves (`trainable`, one flag per leaf of one layout).
    """
    if state.trainable is not None:
        raise ConfigError(f"the checkpoint in {workdir} has the other block layout (--scan-layers) and frozen "
                          "params, which cannot be converted: resume with the saved --scan-layers setting")
    convert = stack_params if scanned else unstack_params

    def each(tree):
        return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, Mapping))

    return state.replace(params=each(state.params), opt_state=each(state.opt_state),
                         model_state=each(state.model_state))


def _placed_like(state: TrainState, like: TrainState) -> TrainState:
    """`state`'s params, optimizer state and model state on the devices and shardings of `like`'s (a converted
    state, for a run on a mesh).

    Raises:
      ConfigError: they differ from `like`'s in structure (a checkpoint that does not convert to this layout).
    """
    parts = {}
    for name in ("params", "opt_state", "model_state"):
        got, ref = getattr(state, name), getattr(like, name)
        if jax.tree.structure(got) != jax.tree.structure(ref):
            raise ConfigError("the checkpoint's blocks do not convert to this run's layout (--scan-layers): resume "
                              "with the saved --scan-layers setting, or pass a new --workdir")
        parts[name] = jax.tree.map(lambda x, r: jax.device_put(x, r.sharding) if hasattr(r, "sharding") else x,
                                   got, ref)
    return state.replace(**parts)


def _saved_precision_target(run: Run, base: TrainState, config: dict, record: dict) -> tuple[TrainState, str]:
    """The fresh state under the checkpoint's own policy and loss scale (the restore target when the precision
    changes on resume), and the saved precision's name.

    Raises:
      ConfigError: the saved master weights have another dtype than this run's (their optimizer state differs).
    """
    saved = get_policy(record["policy"])
    if uses_fp8(saved) != uses_fp8(run.state.policy):
        raise ConfigError(
            f"the checkpoint in {run.cfg.workdir} was saved with precision {config.get('precision')!r} but this run "
            f"has --precision {run.cfg.precision}: switching to or from fp8 changes the model's variables (FP8 "
            "scales and amax histories); resume with the saved precision, or pass a new --workdir")
    old, new = jnp.dtype(saved.param_dtype), jnp.dtype(run.state.policy.param_dtype)
    if old != new:
        raise ConfigError(
            f"the checkpoint in {run.cfg.workdir} keeps its master weights in {old.name} (precision "
            f"{config.get('precision')!r}) but --precision {run.cfg.precision} keeps them in {new.name}; resume with "
            f"a precision whose master weights are {old.name} (fp32, bf16 and fp16 all keep float32), or pass a new "
            "--workdir")
    target = base.replace(policy=saved, loss_scale=loss_scale_from_record(record.get("loss_scale") or {}))
    return target, policy_name(saved, rules=False)
