"""Resuming a run from its newest usable checkpoint, with a precision switch (fp32 <-> bf16 <-> fp16) when the
run asks for another precision than the checkpoint's: the master weights and optimizer state carry over, the loss
scale is kept when it is the same kind with the same settings, else made anew.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxamp.checkpoint import Checkpointer, loss_scale_from_record
from jaxamp.lm.config import PRECISION_KEYS, RESUME_MATCH_KEYS, ConfigError, layout_mismatch, resume_keys
from jaxamp.lm.log import say
from jaxamp.lm.setup import Run
from jaxamp.precision import get_policy, policy_name, uses_fp8
from jaxamp.sharding import abstract_state
from jaxamp.state import TrainState


def resume_state(run: Run, ckpt: Checkpointer) -> tuple[TrainState, str | None]:
    """The newest usable checkpoint's state (or the fresh state when the workdir has none), and the precision it was
    saved with when this run switches to another one (else None)."""
    if ckpt.latest_step() is None:
        return run.state, None
    target, match_keys, switched_from = run.state, RESUME_MATCH_KEYS, None
    settings = ckpt.read_settings()  # None if unreadable: restore reports it and falls back
    problem = layout_mismatch(None if settings is None else settings[0], run.cfg)  # --scan-layers
    if problem:
        raise ConfigError(problem)
    match_keys = resume_keys(match_keys, None if settings is None else settings[0], run.cfg)
    if settings is not None and settings[1].get("policy") != policy_name(run.state.policy):
        # Saved under another policy: restore into a target with the saved one, then carry the run over. (A policy
        # that differs only in its per-leaf rule, e.g. a checkpoint of an older jaxamp, is no precision switch.)
        target, saved_name = _saved_precision_target(run, *settings)
        if saved_name != policy_name(run.state.policy, rules=False):
            switched_from, match_keys = saved_name, tuple(k for k in match_keys if k not in PRECISION_KEYS)
    abstract = jax.eval_shape(lambda: target) if run.mesh is None else abstract_state(target, run.mesh)
    state, _ = ckpt.restore(abstract, run.run_config(), match_keys=match_keys,
                            set_aside=Path(run.cfg.workdir) / "unusable-checkpoints")
    if int(state.step) < run.cfg.steps:  # a finished run says "already holds step N" instead: nothing resumes
        say(f"resumed from step {int(state.step)} ({ckpt.directory})")
    if target is run.state:
        return state, None
    same_scale = (type(state.loss_scale) is type(run.state.loss_scale)
                  and state.loss_scale.config() == run.state.loss_scale.config())
    state = state.with_policy(run.state.policy, state.loss_scale if same_scale else run.state.loss_scale)
    if switched_from is not None:
        say(f"precision: switched from {switched_from} to {policy_name(run.state.policy, rules=False)} (master "
             f"weights and optimizer state carried over; loss scale {type(state.loss_scale).__name__}"
             f"{' kept' if same_scale else ' made anew'})")
    return state, switched_from


def _saved_precision_target(run: Run, config: dict, record: dict) -> tuple[TrainState, str]:
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
    target = run.state.replace(policy=saved, loss_scale=loss_scale_from_record(record.get("loss_scale") or {}))
    return target, policy_name(saved, rules=False)
