"""The training loop for the Transformer LM: config -> data, model, policy, optimizer -> TrainState -> steps.

Side effects (printing, files) live here and in the checkpoint code only. `train(TrainConfig(...))` is what
`experiments/train_lm.py` calls and what the end-to-end tests call with tiny configs.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxamp.checkpoint import Checkpointer, CheckpointSaveError, loss_scale_from_record
from jaxamp.sharding import (abstract_state, check_distributed_args, distributed_args_from_env, format_mesh_spec,
                             gather_to_host, initialize_distributed, is_main_process, jit_eval_step, jit_train_step,
                             make_global_batch, make_mesh, parse_mesh_spec, shard_state)
from jaxamp.corpus import TOKENIZERS, Corpus, decode_sample, load_corpus, sample_prompt, write_bpe_cache
from jaxamp.data import batch_at, eval_batches
from jaxamp.grad_stats import nonfinite_paths, worst_leaves
from jaxamp.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from jaxamp.metrics_log import MetricsLogger, read_metrics, scan_metrics, sync_metrics
from jaxamp.fidelity import grad_fidelity, worst
from jaxamp.model import LM_KEEP_FLOAT32, TransformerConfig, TransformerLM, count_params, generate
from jaxamp.precision import auto_precision, get_policy, needs_loss_scaling, policy_name, uses_fp8
from jaxamp.presets import MODEL_PRESETS, PRESET_FIELDS
from jaxamp.state import TrainState, split_fp8
from jaxamp.step import eval_step, train_step

LOSS_SCALES = ("auto", "dynamic", "static", "none")
# Options a resumed run must share with the checkpoint (others, e.g. --steps or --eval-every, may change).
RESUME_MATCH_KEYS = ("corpus_sha256", "vocab_size", "precision", "loss_scale", "init_scale", "growth_interval",
                     "layers", "heads", "width", "seq_len", "batch_size", "seed", "dropout", "bias", "lr", "min_lr",
                     "warmup_steps", "decay_steps", "weight_decay", "beta1", "beta2", "grad_clip", "accum_steps",
                     "on_overflow", "max_retries", "fp8_amax_history")
# Of those, the ones that may change together with the precision (fp32 <-> bf16 <-> fp16 on resume): the master
# weights and optimizer state carry over, the loss scale is made anew for the new precision.
PRECISION_KEYS = ("precision", "loss_scale", "init_scale", "growth_interval")


class ConfigError(ValueError):
    """A training option is invalid; the message names the option and the fix."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults: nanoGPT's shakespeare_char CPU recipe (4 layers, 4 heads, width 128)."""

    data: str | None = None  # UTF-8 text file, or a directory of nanoGPT train.bin/val.bin; None = stdlib sources
    tokenizer: str = "char"  # char | bpe (byte-level BPE trained on the text, kept in WORKDIR/tokenizer); text only
    vocab_size: int | None = None  # ids (embedding rows); None = the characters' / meta.pkl's / 50304; bpe: required
    precision: str = "fp32"  # fp32 | bf16 | fp16 | a jmp policy string
    loss_scale: str = "auto"  # auto (dynamic for float16 compute, else none) | dynamic | static | none
    init_scale: float = 2.0**15  # initial (or static) loss scale
    growth_interval: int = 2000  # steps of finite gradients before the dynamic scale grows
    model: str = "small"  # preset of layers, heads, width, seq_len (jaxamp.presets); explicit values override it
    layers: int | None = None  # Transformer blocks; None = the preset's
    heads: int | None = None  # attention heads per block; None = the preset's
    width: int | None = None  # d_model, channels; None = the preset's
    seq_len: int | None = None  # tokens per sequence (context); None = the preset's
    batch_size: int = 12  # sequences per step
    steps: int = 2000  # optimizer steps (train_step calls)
    lr: float = 1e-3  # peak learning rate
    min_lr: float | None = None  # final learning rate of the cosine; None = lr / 10 (nanoGPT)
    warmup_steps: int = 100  # steps of linear warmup from 0 to lr
    decay_steps: int | None = None  # steps of warmup + cosine decay (nanoGPT's lr_decay_iters); None = steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay on matrices and embeddings
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global norm of the unscaled gradients; 0 = off
    dropout: float = 0.0  # probability
    bias: bool = False  # biases in Dense and LayerNorm layers (nanoGPT's train.py default: False)
    eval_every: int = 250  # steps between validation estimates (and at the last step)
    eval_batches: int = 50  # batches per validation estimate
    log_every: int = 10  # steps between host fetches of metrics (every step is still recorded)
    sample_tokens: int = 200  # characters generated at the end; 0 = none
    checkpoint_every: int = 500  # steps between checkpoints (and at the end, and on SIGTERM/SIGINT)
    accum_steps: int = 1  # micro-batches of batch_size sequences per optimizer step (gradient accumulation)
    on_overflow: str = "skip"  # skip (drop the update) | retry (back off and recompute the same batch)
    max_retries: int = 4  # retries per step with --on-overflow retry
    underflow_stats: bool = False  # log gradient zero fraction and loss-scale headroom per step
    fidelity_every: int = 0  # steps between gradient-fidelity checks against float32 (0 = off)
    fp8_amax_history: int = 1024  # steps of amax history per FP8 tensor (--precision fp8)
    loss_chunk: int = 0  # tokens per block of the fused head + cross-entropy; 0 = whole f32 logits
    max_consecutive_skips: int = 100  # stop (after saving) when this many steps in a row overflow
    keep: int = 3  # checkpoints kept (newest)
    seed: int = 1337
    workdir: str = "runs/default"
    progress: bool | None = None  # tqdm bar; None = only on a terminal
    mesh: str | None = None  # "data=N" or "data=N,fsdp=M" over every device (batch_size is global); None = 1 device
    coordinator: str | None = None  # HOST:PORT of process 0 for jax.distributed (else JAX_COORDINATOR_ADDRESS)
    num_processes: int | None = None  # processes in all (else JAX_NUM_PROCESSES)
    process_id: int | None = None  # this process, 0 .. num_processes - 1 (else JAX_PROCESS_ID)

    def __post_init__(self) -> None:
        """Fills the shape fields left None from the `model` preset (an unknown name is left to `validate`)."""
        preset = MODEL_PRESETS.get(self.model, {})
        for name in PRESET_FIELDS:
            if getattr(self, name) is None and name in preset:
                object.__setattr__(self, name, preset[name])

    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.accum_steps


def validate(cfg: TrainConfig) -> None:
    """Raises ConfigError naming the first bad option and the fix."""
    if cfg.model not in MODEL_PRESETS:
        raise ConfigError(f"--model must be one of {', '.join(MODEL_PRESETS)}, got {cfg.model!r}")
    if cfg.tokenizer not in TOKENIZERS:
        raise ConfigError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {cfg.tokenizer!r}")
    if cfg.vocab_size is not None and cfg.vocab_size <= 0:
        raise ConfigError(f"--vocab-size must be > 0, got {cfg.vocab_size}")
    positive = {"steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "layers": cfg.layers,
                "heads": cfg.heads, "width": cfg.width, "eval_every": cfg.eval_every,
                "eval_batches": cfg.eval_batches, "log_every": cfg.log_every, "growth_interval": cfg.growth_interval,
                "checkpoint_every": cfg.checkpoint_every, "keep": cfg.keep, "accum_steps": cfg.accum_steps,
                "max_consecutive_skips": cfg.max_consecutive_skips, "fp8_amax_history": cfg.fp8_amax_history}
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"--lr must be a finite number > 0, got {cfg.lr}")
    if cfg.width % cfg.heads:
        raise ConfigError(f"--heads ({cfg.heads}) must divide --width ({cfg.width})")
    if cfg.decay_steps is not None and cfg.decay_steps <= 0:
        raise ConfigError(f"--decay-steps must be > 0, got {cfg.decay_steps}")
    for name, value in (("warmup_steps", cfg.warmup_steps), ("weight_decay", cfg.weight_decay),
                        ("grad_clip", cfg.grad_clip)):
        if not value >= 0:  # NaN fails too
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if cfg.min_lr is not None and not (math.isfinite(cfg.min_lr) and 0 <= cfg.min_lr <= cfg.lr):
        raise ConfigError(f"--min-lr must lie in [0, --lr] = [0, {cfg.lr}], got {cfg.min_lr}")
    for name, beta in (("beta1", cfg.beta1), ("beta2", cfg.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"--{name} must lie in [0, 1), got {beta}")
    if not 0 <= cfg.seed < 2**31:
        raise ConfigError(f"--seed must lie in [0, 2**31), got {cfg.seed}")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout must lie in [0, 1), got {cfg.dropout}")
    if cfg.on_overflow not in ("skip", "retry"):
        raise ConfigError(f"--on-overflow must be skip or retry, got {cfg.on_overflow!r}")
    if cfg.max_retries < 0:
        raise ConfigError(f"--max-retries must be >= 0, got {cfg.max_retries}")
    if cfg.loss_chunk < 0:
        raise ConfigError(f"--loss-chunk must be >= 0 (tokens; 0 = whole logits), got {cfg.loss_chunk}")
    if cfg.fidelity_every < 0:
        raise ConfigError(f"--fidelity-every must be >= 0 (steps; 0 = off), got {cfg.fidelity_every}")
    if cfg.loss_scale not in LOSS_SCALES:
        raise ConfigError(f"--loss-scale must be one of {', '.join(LOSS_SCALES)}, got {cfg.loss_scale!r}")
    try:
        get_policy(cfg.precision)
    except ValueError as err:
        raise ConfigError(f"--precision: {err}") from None
    _validate_scale_out(cfg)


def _validate_scale_out(cfg: TrainConfig) -> None:
    """--mesh and the multi-process flags (or JAX_* environment); the device count is checked in `build`."""
    try:
        shape = None if cfg.mesh is None else parse_mesh_spec(cfg.mesh)
        several = check_distributed_args(*distributed_args_from_env(cfg.coordinator, cfg.num_processes,
                                                                    cfg.process_id))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if shape is not None and cfg.batch_size % math.prod(shape.values()):
        raise ConfigError(f"--batch-size ({cfg.batch_size}, the global batch) must be divisible by the "
                          f"{math.prod(shape.values())} devices of --mesh {cfg.mesh}")
    if several and shape is None:
        raise ConfigError("several processes need --mesh, e.g. --mesh data=N with N the devices of all processes")


def make_policy(precision: str):
    """The LM's policy for `--precision`: with half-precision compute, its embedding tables stay float32 in the
    compute copy (`LM_KEEP_FLOAT32`), so their gradients accumulate exactly."""
    policy = get_policy(precision)
    if jnp.dtype(policy.compute_dtype) == jnp.float32:
        return policy
    # FP8: `params` is the whole variables dict (the FP8 collection rides along), so the tables sit under "params/".
    keep = tuple(f"params/{p}" for p in LM_KEEP_FLOAT32) if uses_fp8(policy) else LM_KEEP_FLOAT32
    return get_policy(policy, keep_float32=keep)


def make_loss_scale(cfg: TrainConfig) -> LossScale:
    """The loss scale the config asks for; `auto` = dynamic when the compute dtype is float16, else none."""
    kind = cfg.loss_scale
    if kind == "auto":
        kind = "dynamic" if needs_loss_scaling(get_policy(cfg.precision)) else "none"
    try:
        if kind == "dynamic":
            return DynamicLossScale(cfg.init_scale, growth_interval=cfg.growth_interval)
        if kind == "static":
            return StaticLossScale(cfg.init_scale)
    except ValueError as err:
        raise ConfigError(f"--init-scale / --growth-interval: {err}") from None
    return NoOpLossScale()


def make_optimizer(cfg: TrainConfig, params) -> optax.GradientTransformation:
    """Clip (unscaled gradients) -> AdamW with linear warmup then cosine decay; LR readable from the state."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    decay_steps = cfg.steps if cfg.decay_steps is None else cfg.decay_steps  # after it: min_lr
    warmup = min(cfg.warmup_steps, decay_steps - 1)  # optax needs warmup < decay_steps
    schedule = optax.warmup_cosine_decay_schedule(  # step 0 runs at lr / (warmup + 1), as nanoGPT
        cfg.lr / (warmup + 1), cfg.lr, warmup, decay_steps, min_lr)
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)  # matrices and embeddings, as nanoGPT
    # Hyperparameters in float32 even for half-precision master weights (in bfloat16, beta2=0.99 would round to 1).
    adamw = optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(
        learning_rate=schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=decay_mask)
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return optax.chain(clip, adamw)


def applied_lr(opt_state) -> jax.Array:
    """The learning rate of the last applied update, read back from `inject_hyperparams`' state."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        if hasattr(node, "hyperparams"):
            return node.hyperparams["learning_rate"]
    raise ValueError("optimizer state holds no inject_hyperparams state with a learning_rate")


def lm_variables(params) -> dict:
    """The LM's variables for `model.apply`: the params tree as `{"params": ...}`, or the variables dict itself (an
    FP8 model keeps `{"params": ..., "_overwrite_with_gradient": ...}` in the state)."""
    return params if "params" in params else {"params": params}


def make_loss_fn(model: TransformerLM):
    """`loss_fn(params, (inputs, targets), rng)`: mean cross-entropy in float32; dropout on when rng is given."""

    def loss_fn(params, batch, rng):
        inputs, targets = batch  # i32[batch, seq] each
        rngs = None if rng is None else {"dropout": rng}
        # f32[] mean loss: the model takes the head and the loss together (fused when config.loss_chunk > 0)
        return model.apply(lm_variables(params), inputs, targets, deterministic=rng is None, rngs=rngs)

    return loss_fn


@dataclasses.dataclass
class Run:
    """Everything built from a config: data, model, jitted functions and the initial state."""

    cfg: TrainConfig
    dataset: Corpus
    model: TransformerLM
    state: TrainState
    step_fn: Any
    eval_fn: Any
    val_batches: list
    corpus_sha256: str
    mesh: Any = None  # a jax.sharding.Mesh when cfg.mesh is set: state and batches are global arrays on it
    fidelity_fn: Any = None  # (state, batch) -> {leaf path: f32[] relative error against float32}

    def run_config(self) -> dict:
        """The config saved with each checkpoint: the options plus what the data and model derive from them."""
        return {**dataclasses.asdict(self.cfg), "corpus_sha256": self.corpus_sha256,
                "vocab_size": self.dataset.vocab_size}


def build(cfg: TrainConfig) -> Run:
    """Validates `cfg`, loads the data and builds the model, optimizer, loss scale and initial state."""
    validate(cfg)
    try:
        mesh = None if cfg.mesh is None else make_mesh(cfg.mesh)  # checks the device count before any work
    except ValueError as err:
        raise ConfigError(str(err)) from None
    dataset = load_corpus(cfg.data, tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                          bpe_dir=Path(cfg.workdir) / BPE_DIR)
    policy = make_policy(cfg.precision)
    model_cfg = TransformerConfig(vocab_size=dataset.vocab_size, seq_len=cfg.seq_len,
                                  num_layers=cfg.layers, num_heads=cfg.heads, width=cfg.width, dropout=cfg.dropout,
                                  use_bias=cfg.bias, fp8=uses_fp8(policy), fp8_amax_history=cfg.fp8_amax_history,
                                  loss_chunk=cfg.loss_chunk)
    model = TransformerLM(model_cfg)
    init_key, state_key = jax.random.split(jax.random.PRNGKey(cfg.seed))
    variables = model.init(init_key, jnp.zeros((1, cfg.seq_len), jnp.int32))
    params = variables if model_cfg.fp8 else variables["params"]  # FP8: scales and histories ride along
    state = TrainState.create(params=params, tx=make_optimizer(cfg, split_fp8(params)[0]), policy=policy,
                              loss_scale=make_loss_scale(cfg), rng=state_key)
    if mesh is not None:
        state = shard_state(state, mesh)  # every leaf a global array: params/opt_state by the FSDP rule
    loss_fn = make_loss_fn(model)

    def step_with_lr(state, batch):
        state, metrics = train_step(state, batch, loss_fn, accum_steps=cfg.accum_steps, on_overflow=cfg.on_overflow,
                                    max_retries=cfg.max_retries, underflow_stats=cfg.underflow_stats)
        return state, {**metrics, "lr": jnp.copy(applied_lr(state.opt_state))}  # own buffer: state is donated

    step_fn = jax.jit(step_with_lr, donate_argnums=0)
    eval_fn = jax.jit(lambda s, b: eval_step(s, b, loss_fn)["loss"])
    # FP8: the float32 reference runs the same model without FP8 ops.
    reference = make_loss_fn(TransformerLM(dataclasses.replace(model_cfg, fp8=False))) if model_cfg.fp8 else None
    fidelity_fn = jax.jit(lambda s, b: grad_fidelity(s, b, loss_fn, accum_steps=cfg.accum_steps,
                                                     reference_loss_fn=reference))
    if mesh is not None:  # shardings pinned: a step's output feeds the next one (and a restore) with no recompile
        step_fn = jit_train_step(step_with_lr, mesh)
        eval_fn = jit_eval_step(lambda s, b: eval_step(s, b, loss_fn)["loss"], mesh)
    val = eval_batches(dataset.val, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                       num_batches=cfg.eval_batches, seed=cfg.seed, vocab_size=dataset.vocab_size)
    val = [_device_batch(mesh, b) for b in val]
    return Run(cfg, dataset, model, state, step_fn, eval_fn, val, dataset.sha256, mesh, fidelity_fn)


def _device_batch(mesh, batch):
    """A whole host batch as is (one device), or as global arrays sharded over `mesh` (this process's rows only)."""
    if mesh is None:
        return batch
    rows = len(jax.tree.leaves(batch)[0])
    return make_global_batch(lambda a, z: jax.tree.map(lambda x: x[a:z], batch), rows, mesh)


def train_batch(run: Run, step: int):
    """The global training batch of step `step`; with a mesh, each process gathers only its own rows."""
    cfg, rows = run.cfg, run.cfg.batch_size * run.cfg.accum_steps  # accum_steps micro-batches, split in the step
    vocab = run.dataset.vocab_size
    if run.mesh is None:
        return batch_at(run.dataset.train, seed=cfg.seed, step=step, batch_size=rows, seq_len=cfg.seq_len,
                        vocab_size=vocab)
    return make_global_batch(lambda a, z: batch_at(run.dataset.train, seed=cfg.seed, step=step, batch_size=rows,
                                                   seq_len=cfg.seq_len, rows=slice(a, z), vocab_size=vocab),
                             rows, run.mesh)


def _say(message: str) -> None:
    """Prints from process 0 only (every process runs the same loop)."""
    if is_main_process():
        print(message, flush=True)


def evaluate(run: Run, state: TrainState) -> float:
    """Mean validation loss over the run's fixed validation batches (nats per token)."""
    losses = [run.eval_fn(state, batch) for batch in run.val_batches]
    return float(np.mean(jax.device_get(losses)))


def _records(metrics: list[dict], first_step: int, t0: float, tokens_per_step: int) -> list[dict]:
    """Host records for the steps of one logging interval (one device fetch for the whole interval).

    `t0` is `time.perf_counter()` when the interval began; the fetch waits for the device, so tokens/s is real.
    """
    host = jax.device_get(metrics)
    tokens_per_s = tokens_per_step * len(host) / max(time.perf_counter() - t0, 1e-9)
    return [_record(first_step + i + 1, m, tokens_per_s) for i, m in enumerate(host)]


def _record(step: int, m: dict, tokens_per_s: float) -> dict:
    """One metrics.jsonl record; overflowed leaves are named (on the host) for skipped steps only."""
    record = {"step": step, "loss": float(m["loss"]), "loss_scale": float(m["loss_scale"]),
              "grads_finite": bool(m["grads_finite"]), "loss_finite": bool(m["loss_finite"]),
              "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]), "retries": int(m["retries"]),
              "tokens_per_s": tokens_per_s}
    if not record["grads_finite"]:
        record["nonfinite_leaves"] = nonfinite_paths(m["grads_finite_leaves"])
    if "nonfinite_at_min_scale" in m:
        record["nonfinite_at_min_scale"] = bool(m["nonfinite_at_min_scale"])
    if "grad_rel_err" in m:
        record["grad_rel_err"] = {k: float(v) for k, v in m["grad_rel_err"].items()}
    if "underflow" in m:
        u = m["underflow"]
        record.update(grad_zero_fraction=float(u["zero_fraction"]), headroom_log2=float(u["headroom_log2"]),
                      worst_zero_leaves=worst_leaves(u["leaf_zero_fraction"], 3),
                      worst_headroom_leaves=worst_leaves(u["leaf_headroom_log2"], 3, largest=False))
    return record


class DivergenceError(RuntimeError):
    """Training stopped because steps kept overflowing; the last good state was saved first."""


class DivergenceGuard:
    """Counts consecutive skipped steps in the host records; says why to stop, or None.

    Stops after `max_skips` skipped steps in a row, or after `at_min` in a row while the loss scale already sits at
    its minimum (a lower scale cannot help any more).
    """

    def __init__(self, max_skips: int, min_scale: float, at_min: int = 10):
        self.max_skips, self.min_scale, self.at_min = max_skips, min_scale, min(at_min, max_skips)
        self.streak = self.streak_at_min = 0

    def check(self, records: list[dict]) -> str | None:
        for r in records:
            skipped = not r["grads_finite"]
            self.streak = self.streak + 1 if skipped else 0
            self.streak_at_min = self.streak_at_min + 1 if skipped and r["loss_scale"] <= self.min_scale else 0
            if self.streak >= self.max_skips or self.streak_at_min >= self.at_min:
                return self._reason(r)
        return None

    def _reason(self, r: dict) -> str:
        where = "the loss itself is not finite (NaN/inf from the inputs or the forward pass)" if not r[
            "loss_finite"] else f"gradient overflow in {', '.join(r.get('nonfinite_leaves', [])[:5]) or '?'}"
        at_min = self.streak_at_min >= self.at_min
        why = (f"{self.streak_at_min} consecutive overflows at the minimum loss scale {self.min_scale:g}" if at_min
               else f"{self.streak} consecutive skipped steps (--max-consecutive-skips {self.max_skips})")
        return (f"training diverged at step {r['step']}: {why}; {where}; lower --lr, check the data, or try "
                "--precision bf16")


class _NullLogger:
    """The metrics logger of processes other than 0: they compute the same records, keep them (each checkpoint
    saves a copy; only process 0's is written) and write no file."""

    skipped = 0

    def __init__(self, history: list[dict] | None = None):
        self.records = list(history or [])

    def write(self, records: list[dict]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


class StopRequest:
    """SIGTERM/SIGINT handler for the loop: the first signal asks it to finish the step, save and exit 0; a second
    SIGINT exits at once (status 130; the last complete checkpoint is untouched: orbax writes into a tmp folder).

    In a multi-process run the signal a process received takes effect at the next `sync()` (the loop calls it every
    `log_every` steps, at the same step on every process), for every process at once: a process that stopped alone
    would leave the others waiting in a collective."""

    def __init__(self):
        self.signal: int | None = None
        self._received: int | None = None
        self._several = jax.process_count() > 1
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if (self._received is not None or self.signal is not None) and signum == signal.SIGINT:
            os._exit(130)
        self._received = signum
        if not self._several:
            self.signal = signum

    def sync(self) -> None:
        """Multi-process runs: a collective that sets `signal` on every process if any process received one."""
        if not self._several or self.signal is not None:
            return
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        got = np.asarray(multihost_utils.process_allgather(np.int32(self._received or 0))).reshape(-1)
        if got.any():
            self.signal = int(got[np.flatnonzero(got)[0]])

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _header(run: Run) -> str:
    cfg, n = run.cfg, count_params(split_fp8(run.state.params)[0])
    dtype = jnp.dtype(run.state.policy.param_dtype)
    return (f"jaxamp: {n:,} parameters ({n * dtype.itemsize / 2**20:.1f} MiB {dtype.name} master weights); data "
            f"{run.dataset.description}; vocab {run.dataset.vocab_size}; train {len(run.dataset.train):,} / val "
            f"{len(run.dataset.val):,} tokens; {cfg.tokens_per_step():,} tokens per step; precision "
            f"{policy_name(run.state.policy, rules=False)}"
            f"{' (auto: ' + auto_precision()[1] + ')' if cfg.precision.strip().lower() == 'auto' else ''}; "
            f"loss scale {type(run.state.loss_scale).__name__}"
            + ("" if run.mesh is None else f"; mesh {format_mesh_spec(run.mesh)} over {jax.device_count()} devices "
               f"({jax.process_count()} process(es)), global batch {cfg.batch_size}"))


def _sample(run: Run, state: TrainState) -> str:
    tok = run.dataset.tokenizer
    host = state if run.mesh is None else state.replace(params=gather_to_host(state.params))
    ids = generate(run.model, lm_variables(host.compute_params()), sample_prompt(tok), run.cfg.sample_tokens,
                   jax.random.PRNGKey(run.cfg.seed))
    return decode_sample(tok, ids)


def _summary(run: Run, state: TrainState, records: list[dict], wall_s: float) -> dict:
    cfg = run.cfg
    train_eval = eval_batches(run.dataset.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                              num_batches=cfg.eval_batches, seed=cfg.seed, vocab_size=run.dataset.vocab_size)
    train_eval = [_device_batch(run.mesh, b) for b in train_eval]
    train_loss = float(np.mean(jax.device_get([run.eval_fn(state, b) for b in train_eval])))
    speeds = [r["tokens_per_s"] for r in records[cfg.log_every:]] or [r["tokens_per_s"] for r in records]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    switches = [{"step": r["step"], "from": r["precision_from"], "to": r["precision"]}
                for r in records if "precision_from" in r]
    chars = run.dataset.chars_per_token  # nats/char = nats/token / (chars/token)
    return {"precision": policy_name(state.policy, rules=False), "precision_switches": switches,
            "loss_scale_kind": type(state.loss_scale).__name__,
            "steps": int(state.step), "val_loss": val[-1] if val else None,
            "val_loss_per_char": val[-1] / chars if val and chars else None, "chars_per_token": chars,
            "vocab_size": run.dataset.vocab_size, "train_loss": train_loss,
            "last_step_loss": records[-1]["loss"] if records else None,
            "skipped_steps": sum(not r["grads_finite"] for r in records),
            "final_loss_scale": float(state.loss_scale.loss_scale),
            "tokens_per_s": float(np.median(speeds)) if speeds else None, "wall_s": wall_s,
            "params": count_params(split_fp8(state.params)[0]), "tokens_per_step": cfg.tokens_per_step()}


def _summary_line(s: dict) -> str:
    val = "n/a" if s["val_loss"] is None else f"{s['val_loss']:.4f}"
    speed = "n/a" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.0f}"
    return (f"summary: precision={s['precision']} steps={s['steps']} val_loss={val} "
            f"train_loss={s['train_loss']:.4f} skipped_steps={s['skipped_steps']} "
            f"final_loss_scale={s['final_loss_scale']:g} tokens_per_s={speed} wall_s={s['wall_s']:.1f}")


BPE_DIR = "tokenizer"  # WORKDIR/tokenizer: a BPE tokenizer trained by the run and its token files (jaxamp.corpus)
RUN_ENTRIES = {"metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "tb", "checkpoints", "unusable-checkpoints",
               "lock", BPE_DIR, BPE_DIR + ".tmp"}


class _WorkdirLock:
    """An exclusive `flock` on WORKDIR/lock for the run's lifetime: a second run on the same workdir is refused
    before it touches anything. The kernel releases it when the process ends, even on SIGKILL, so it never goes
    stale, and it writes nothing into the file (a refused run changes no file). Process 0 takes it (the one that
    writes metrics; several processes may share a filesystem) and tells the others whether it could."""

    _BUSY, _UNWRITABLE = 1, 2

    def __init__(self, workdir: Path):
        self._fd, outcome, reason = None, 0, ""
        if is_main_process():
            outcome, reason = self._take(workdir)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

            outcome = int(multihost_utils.broadcast_one_to_all(np.int32(outcome)))
        if outcome == self._BUSY:
            raise ConfigError(f"--workdir {workdir} is in use by another run (it holds {workdir / 'lock'}); wait for "
                              "it to end or pass another directory")
        if outcome == self._UNWRITABLE:
            raise ConfigError(f"cannot write in --workdir {workdir}{reason}; pass a writable directory")

    def _take(self, workdir: Path) -> tuple[int, str]:
        import errno  # pylint: disable=import-outside-toplevel
        import fcntl  # pylint: disable=import-outside-toplevel  (POSIX)

        try:
            self._fd = os.open(workdir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            return self._UNWRITABLE, f" ({err.strerror})"
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                self.release()
                return self._BUSY, ""
            _say(f"warning: cannot lock {workdir / 'lock'} ({err.strerror}; the filesystem may not support flock): "
                 "running without the guard against a second run on this workdir")
        return 0, ""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _open_workdir(cfg: TrainConfig) -> tuple[Path, Checkpointer, _WorkdirLock]:
    """The run directory, locked: new, empty, or a jaxamp run's own (anything else is refused, untouched)."""
    workdir = Path(cfg.workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} is a file; pass a directory")
    stray = sorted(e.name for e in workdir.iterdir() if e.name not in RUN_ENTRIES) if workdir.exists() else []
    if stray:
        raise ConfigError(f"--workdir {workdir} holds entries that are not a jaxamp run's ({', '.join(stray[:5])}"
                          f"{' ...' if len(stray) > 5 else ''}); pass a new directory or a jaxamp run's workdir")
    ckpt = Checkpointer(workdir / "checkpoints", keep=cfg.keep)
    _check_resumable(workdir, cfg, ckpt)  # reads only
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create --workdir {workdir} ({err.strerror}); pass a writable directory") from None
    return workdir, ckpt, _WorkdirLock(workdir)


def _check_resumable(workdir: Path, cfg: TrainConfig, ckpt: Checkpointer) -> None:
    """Refuses a workdir whose checkpoints were removed; a run killed before its first save starts over."""
    if ckpt.steps():
        return  # metrics.jsonl is rewritten from the copy saved with the checkpoint: damage in it is repaired
    try:
        records, _ = scan_metrics(workdir / "metrics.jsonl")  # past damaged lines; another program's file raises
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # No checkpoint: a run killed before its first save committed (none begun yet, or one still being written when
    # it died) starts over: its records are recomputed, bitwise, from the same seed. Records past a save that
    # should have committed, or a finished run's summary, mean checkpoints were removed.
    last, cut = max((r["step"] for r in records), default=0), ckpt.interrupted_saves()
    # The first save is at step checkpoint_every (or earlier: at the end or on a signal); the loop runs on while it
    # is written, but the next save waits for it, so its records stop at 2 * checkpoint_every.
    first_save_cut = bool(cut) and max(cut) <= cfg.checkpoint_every and last <= 2 * cfg.checkpoint_every
    if (workdir / "summary.json").exists() or (last > cfg.checkpoint_every and not first_save_cut):
        raise ConfigError(f"--workdir {workdir} holds a previous run's metrics (steps up to {last}) but no checkpoint "
                          "to resume from; pass a new directory, or delete this one to start over")


SUMMARY_DIGEST = "sha256"  # summary.json's digest of its other fields, to tell a damaged file


def _sealed_summary(summary: dict) -> dict:
    body = {k: v for k, v in summary.items() if k != SUMMARY_DIGEST}
    return {**body, SUMMARY_DIGEST: hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def _read_summary(path: Path) -> tuple[dict | None, str]:
    """summary.json if it is intact, else None and why (missing, not JSON, or not matching its digest)."""
    if not path.exists():
        return None, "missing"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, "damaged (not JSON)"
    if not isinstance(summary, dict):
        return None, "damaged (not a JSON object)"
    if SUMMARY_DIGEST in summary and _sealed_summary(summary) != summary:
        return None, "damaged (it does not match its sha256)"
    return summary, ""


def _write_summary(workdir: Path, summary: dict) -> None:
    if is_main_process():
        (workdir / "summary.json").write_text(json.dumps(_sealed_summary(summary), indent=2) + "\n")


def _finished(run: Run, workdir: Path, state: TrainState, history: list[dict] | None) -> dict:
    """A run already at `--steps` or beyond: nothing is trained. Its metrics.jsonl (from the checkpoint's copy) and
    summary.json (from the state and the records) are checked and repaired; an intact run is left as it is."""
    step = int(state.step)
    path = workdir / "metrics.jsonl"
    if history is not None and is_main_process():
        line = sync_metrics(path, [r for r in history if r["step"] <= step])
        if line is not None:
            _say(f"warning: {path} differed from the copy saved with checkpoint step {step} from line {line} on; "
                 "rewritten from it")
    summary, why = _read_summary(workdir / "summary.json")
    if summary is None or summary.get("steps") != step:
        why = why or f"written before step {step} (stopped in between)"
        summary = {**_summary(run, state, read_metrics(path), 0.0), "stopped_by": None}
        _write_summary(workdir, summary)
        _say(f"warning: {workdir / 'summary.json'} was {why}; rewritten from checkpoint step {step} and the metrics")
    _say(f"{workdir} already holds step {step} (--steps {run.cfg.steps}): nothing to train; raise --steps to "
         "continue")
    _say(_summary_line(summary))
    return {k: v for k, v in summary.items() if k != SUMMARY_DIGEST}


def _resume(run: Run, ckpt: Checkpointer) -> tuple[TrainState, str | None]:
    """The newest usable checkpoint's state (or the fresh state when the workdir has none), and the precision it was
    saved with when this run switches to another one (else None)."""
    if ckpt.latest_step() is None:
        return run.state, None
    target, match_keys, switched_from = run.state, RESUME_MATCH_KEYS, None
    settings = ckpt.read_settings()  # None if unreadable: restore reports it and falls back
    if settings is not None and settings[1].get("policy") != policy_name(run.state.policy):
        # Saved under another policy: restore into a target with the saved one, then carry the run over. (A policy
        # that differs only in its per-leaf rule, e.g. a checkpoint of an older jaxamp, is no precision switch.)
        target, saved_name = _saved_precision_target(run, *settings)
        if saved_name != policy_name(run.state.policy, rules=False):
            switched_from, match_keys = saved_name, tuple(k for k in RESUME_MATCH_KEYS if k not in PRECISION_KEYS)
    abstract = jax.eval_shape(lambda: target) if run.mesh is None else abstract_state(target, run.mesh)
    state, _ = ckpt.restore(abstract, run.run_config(), match_keys=match_keys,
                            set_aside=Path(run.cfg.workdir) / "unusable-checkpoints")
    _say(f"resumed from step {int(state.step)} ({ckpt.directory})")
    if target is run.state:
        return state, None
    same_scale = (type(state.loss_scale) is type(run.state.loss_scale)
                  and getattr(state.loss_scale, "config", dict)() == getattr(run.state.loss_scale, "config", dict)())
    state = state.with_policy(run.state.policy, state.loss_scale if same_scale else run.state.loss_scale)
    if switched_from is not None:
        _say(f"precision: switched from {switched_from} to {policy_name(run.state.policy, rules=False)} (master "
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


class _Loop:
    """Steps, a fetch of metrics per logging interval, evaluation and checkpoints; owns no state of its own."""

    def __init__(self, run: Run, ckpt: Checkpointer, logger: MetricsLogger, switched_from: str | None = None):
        self.run, self.ckpt, self.logger = run, ckpt, logger
        self.step_fn = run.step_fn
        self.pending: list[dict] = []
        self.t0 = time.perf_counter()
        # The first record after a precision switch says so (summary.json lists the switches from these records).
        self.first_extra = {} if switched_from is None else {
            "precision": policy_name(run.state.policy, rules=False), "precision_from": switched_from}

    def flush(self, state: TrainState, done: int, *, evaluate_now: bool) -> list[dict]:
        """Fetches the pending metrics once (steps up to `done`), adds val_loss if asked, and logs them."""
        if not self.pending:
            return []
        new = _records(self.pending, done - len(self.pending), self.t0, self.run.cfg.tokens_per_step())
        new[0].update(self.first_extra)
        self.first_extra = {}
        if evaluate_now:
            new[-1]["val_loss"] = evaluate(self.run, state)
        self.logger.write(new)
        self.pending, self.t0 = [], time.perf_counter()
        return new

    def save(self, state: TrainState, *, force: bool = False) -> None:
        """Saves `state` with the run's config and a copy of the records so far (all flushed: steps <= state's)."""
        self.ckpt.save(state, self.run.run_config(), force=force, metrics=list(self.logger.records))

    def step(self, state: TrainState, step: int) -> TrainState:
        """Runs step `step` (== state.step, mirrored on the host so the loop never waits on the device)."""
        batch = train_batch(self.run, step)
        every = self.run.cfg.fidelity_every
        errors = self.run.fidelity_fn(state, batch) if every and (step + 1) % every == 0 else None
        state, metrics = self.step_fn(state, batch)  # donates the state: the check above ran first
        self.pending.append(metrics if errors is None else {**metrics, "grad_rel_err": errors})
        return state


def train(cfg: TrainConfig) -> dict:
    """Trains the LM as `cfg` says, resuming from WORKDIR/checkpoints when it holds a checkpoint.

    Writes WORKDIR/metrics.jsonl (one record per step), TensorBoard events (WORKDIR/tb), checkpoints every
    `checkpoint_every` steps and at the end, and WORKDIR/summary.json; returns the summary. SIGTERM or SIGINT
    finishes the current step, saves, and returns (summary["stopped_by"] names the signal).

    Raises:
      ConfigError: a bad option. DataError: a bad corpus. CheckpointError: an unusable or mismatched checkpoint
        (CheckpointSaveError: a save failed, e.g. the disk is full; the message says how to resume).
      WorkdirWriteError: metrics, events or the summary could not be written (the message says how to resume).
    """
    _validate_scale_out(cfg)  # no JAX call (validate's --precision auto asks for the devices)
    try:  # before any other JAX call
        initialize_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    run = build(cfg)
    workdir, ckpt, lock = _open_workdir(cfg)
    # Signals are held from here to the end: one that arrives after the loop (final save, summary, sample) lets the
    # finished run complete and exit 0.
    with lock, StopRequest() as stop:
        try:
            return _train_in_workdir(run, workdir, ckpt, stop)
        except CheckpointSaveError as err:
            raise CheckpointSaveError(f"{err}; {_resume_advice(err.errno, ckpt)}", step=err.step,
                                      errno=err.errno) from err
        except OSError as err:
            if err.errno not in STORAGE_ERRNOS:
                raise
            name = f" ({Path(err.filename).name})" if err.filename else ""
            raise WorkdirWriteError(f"cannot write in --workdir {workdir}{name}: {err.strerror} "
                                    f"({errno.errorcode.get(err.errno, err.errno)}); "
                                    f"{_resume_advice(err.errno, ckpt)}") from err


def _train_in_workdir(run: Run, workdir: Path, ckpt: Checkpointer, stop: StopRequest) -> dict:
    """Resumes (or starts), trains, saves and writes the summary; the workdir is locked and signals are held."""
    cfg = run.cfg
    try:
        state, switched_from = _resume(run, ckpt)
        history = ckpt.metrics(int(state.step)) if ckpt.steps() else []  # the records saved with that checkpoint
        if int(state.step) >= cfg.steps:
            return _finished(run, workdir, state, history)
        if run.dataset.bpe_cache is not None and is_main_process():  # after the resume checks passed
            write_bpe_cache(run.dataset.bpe_cache, workdir / BPE_DIR)
        _say(_header(run))
        logger = _open_logger(workdir, int(state.step), history)
        state, stopped_by, wall_s = _train_loop(run, ckpt, logger, state, stop, switched_from)
        logger.close()
        ckpt.wait()
    finally:
        ckpt.close()
    summary = _summary(run, state, read_metrics(workdir / "metrics.jsonl"), wall_s)
    summary["stopped_by"] = stopped_by
    _write_summary(workdir, summary)
    if stopped_by:
        _say(f"stopped by {stopped_by} after step {int(state.step)}; checkpoint saved; run the same command to "
             "resume")
    elif cfg.sample_tokens > 0:
        _say("sample:\n" + _sample(run, state))
    _say(_summary_line(summary))
    return summary


def _open_logger(workdir: Path, step: int, history: list[dict] | None):
    """Process 0's metrics logger, metrics.jsonl made to begin with the checkpoint's copy of the records (repaired
    if it differs, with a warning); the other processes' in-memory one."""
    if not is_main_process():
        return _NullLogger(history)
    try:
        logger = MetricsLogger(workdir, resume_step=step, history=history)
    except ValueError as err:  # no copy in the checkpoint (saved by an older jaxamp) and a damaged record
        raise ConfigError(str(err)) from None
    if logger.repaired_line is not None:
        _say(f"warning: {logger.path} differed from the copy saved with checkpoint step {step} from line "
             f"{logger.repaired_line} on; rewritten from it")
    return logger


# Operating-system errors of a workdir that cannot take more writes: the run stops with one line saying what to do.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


class WorkdirWriteError(RuntimeError):
    """Writing a run's files (metrics, TensorBoard events, summary) failed: disk full, read-only, no permission."""


def _resume_advice(code: int | None, ckpt: Checkpointer) -> str:
    """What to do after a failed write: the fix for the OS error, and where the same command will resume."""
    fix = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space (disk quota)",
           errno.EFBIG: "raise the file-size limit (ulimit -f)", errno.EROFS: "make the workdir writable",
           errno.EACCES: "make the workdir writable", errno.EPERM: "make the workdir writable"}.get(code,
                                                                                                 "fix the cause")
    steps = ckpt.steps()
    where = f"resume from step {steps[-1]}" if steps else "start over (no checkpoint was committed)"
    return f"{fix}, then run the same command to {where}"


def _report_skips(bar, records: list[dict]) -> None:
    """One line per logging interval with skipped steps: which step, why, and which leaves overflowed."""
    skipped = [r for r in records if not r["grads_finite"]]
    if skipped and is_main_process():
        r = skipped[0]
        why = "non-finite loss" if not r["loss_finite"] else f"overflow at loss scale {r['loss_scale']:g}"
        leaves = ", ".join(r["nonfinite_leaves"][:3]) + (" ..." if len(r["nonfinite_leaves"]) > 3 else "")
        bar.write(f"step {r['step']}: skipped ({why}) in {leaves}" +
                  (f"; {len(skipped) - 1} more skipped up to step {records[-1]['step']}" if len(skipped) > 1 else ""))


def _report_fidelity(bar, records: list[dict]) -> None:
    """One line per gradient-fidelity check: the three leaves whose gradients are furthest from float32."""
    for r in records:
        if "grad_rel_err" in r and is_main_process():
            leaves = ", ".join(f"{k} {100 * v:.2f}%" for k, v in worst(r["grad_rel_err"], 3))
            bar.write(f"step {r['step']}: gradient error against float32, worst leaves: {leaves}")


def _train_loop(run: Run, ckpt: Checkpointer, logger: MetricsLogger, state: TrainState, stop: StopRequest,
                switched_from: str | None = None):
    cfg, loop = run.cfg, _Loop(run, ckpt, logger, switched_from)
    bar = tqdm(total=cfg.steps, initial=min(int(state.step), cfg.steps), dynamic_ncols=True,
               disable=not is_main_process() or ((not cfg.progress) if cfg.progress is not None else None))
    t_start, stopped_by, done = time.perf_counter(), None, int(state.step)
    guard = DivergenceGuard(cfg.max_consecutive_skips, getattr(state.loss_scale, "min_loss_scale", 1.0))
    while done < cfg.steps and stop.signal is None:
        state = loop.step(state, done)
        done += 1
        if done % cfg.log_every == 0:
            stop.sync()  # several processes: agree on a signal (a no-op in one process)
        at_eval = done % cfg.eval_every == 0 or done == cfg.steps
        at_save = done % cfg.checkpoint_every == 0 or done == cfg.steps
        if at_eval or at_save or done % cfg.log_every == 0 or stop.signal is not None:
            new = loop.flush(state, done, evaluate_now=at_eval)
            _report_skips(bar, new)
            _report_fidelity(bar, new)
            diverged = guard.check(new)
            if diverged:
                loop.save(state, force=True)
                ckpt.wait()
                raise DivergenceError(f"{diverged}; the state after step {done} (skipped steps leave the "
                                      f"weights unchanged) is saved in {ckpt.directory}")
            bar.update(len(new))
            bar.set_postfix(loss=f"{new[-1]['loss']:.3f}", scale=f"{new[-1]['loss_scale']:g}",
                            tok_s=f"{new[-1]['tokens_per_s']:.0f}")
        if at_save:
            loop.save(state, force=True)
    if loop.pending:  # a signal that came after this step's flush check: its records are written before the save
        bar.update(len(loop.flush(state, done, evaluate_now=False)))
    if stop.signal is not None and done < cfg.steps:  # a signal during the last step leaves a finished run
        stopped_by = signal.Signals(stop.signal).name
        loop.save(state, force=True)  # the step it stopped at (step 0 if before the first); a no-op if just saved
        ckpt.wait()
    bar.close()
    return state, stopped_by, time.perf_counter() - t_start
