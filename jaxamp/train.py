"""The training loop for the Transformer LM: config -> data, model, policy, optimizer -> TrainState -> steps.

Side effects (printing, files) live here and in the checkpoint code only. `train(TrainConfig(...))` is what
`experiments/train_lm.py` calls and what the end-to-end tests call with tiny configs.
"""

from __future__ import annotations

import dataclasses
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

from jaxamp.checkpoint import Checkpointer
from jaxamp.data import CharDataset, batch_at, eval_batches, load_text
from jaxamp.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from jaxamp.metrics_log import MetricsLogger, read_metrics
from jaxamp.model import TransformerConfig, TransformerLM, count_params, cross_entropy_loss, generate
from jaxamp.precision import get_policy, needs_loss_scaling, policy_name
from jaxamp.state import TrainState
from jaxamp.step import eval_step, train_step

LOSS_SCALES = ("auto", "dynamic", "static", "none")
# Options a resumed run must share with the checkpoint (others, e.g. --steps or --eval-every, may change).
RESUME_MATCH_KEYS = ("corpus_sha256", "vocab_size", "precision", "loss_scale", "init_scale", "growth_interval",
                     "layers", "heads", "width", "seq_len", "batch_size", "seed", "dropout", "lr", "min_lr",
                     "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip")


class ConfigError(ValueError):
    """A training option is invalid; the message names the option and the fix."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults: nanoGPT's shakespeare_char CPU recipe (4 layers, 4 heads, width 128)."""

    data: str | None = None  # UTF-8 text file; None = the Python standard library's sources (no download)
    precision: str = "fp32"  # fp32 | bf16 | fp16 | a jmp policy string
    loss_scale: str = "auto"  # auto (dynamic for float16 compute, else none) | dynamic | static | none
    init_scale: float = 2.0**15  # initial (or static) loss scale
    growth_interval: int = 2000  # steps of finite gradients before the dynamic scale grows
    layers: int = 4  # Transformer blocks
    heads: int = 4  # attention heads per block
    width: int = 128  # d_model, channels
    seq_len: int = 64  # tokens per sequence (context)
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
    eval_every: int = 250  # steps between validation estimates (and at the last step)
    eval_batches: int = 50  # batches per validation estimate
    log_every: int = 10  # steps between host fetches of metrics (every step is still recorded)
    sample_tokens: int = 200  # characters generated at the end; 0 = none
    checkpoint_every: int = 500  # steps between checkpoints (and at the end, and on SIGTERM/SIGINT)
    keep: int = 3  # checkpoints kept (newest)
    seed: int = 1337
    workdir: str = "runs/default"
    progress: bool | None = None  # tqdm bar; None = only on a terminal

    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def validate(cfg: TrainConfig) -> None:
    """Raises ConfigError naming the first bad option and the fix."""
    positive = {"steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "layers": cfg.layers,
                "heads": cfg.heads, "width": cfg.width, "eval_every": cfg.eval_every,
                "eval_batches": cfg.eval_batches, "log_every": cfg.log_every, "growth_interval": cfg.growth_interval,
                "checkpoint_every": cfg.checkpoint_every, "keep": cfg.keep}
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"--lr must be a finite number > 0, got {cfg.lr}")
    if cfg.width % cfg.heads:
        raise ConfigError(f"--heads ({cfg.heads}) must divide --width ({cfg.width})")
    if cfg.decay_steps is not None and cfg.decay_steps <= 0:
        raise ConfigError(f"--decay-steps must be > 0, got {cfg.decay_steps}")
    if cfg.warmup_steps < 0 or cfg.weight_decay < 0 or cfg.grad_clip < 0:
        raise ConfigError("--warmup-steps, --weight-decay and --grad-clip must be >= 0")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout must lie in [0, 1), got {cfg.dropout}")
    if cfg.loss_scale not in LOSS_SCALES:
        raise ConfigError(f"--loss-scale must be one of {', '.join(LOSS_SCALES)}, got {cfg.loss_scale!r}")
    try:
        get_policy(cfg.precision)
    except ValueError as err:
        raise ConfigError(f"--precision: {err}") from None


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
    schedule = optax.warmup_cosine_decay_schedule(  # optax needs warmup < decay_steps
        0.0, cfg.lr, min(cfg.warmup_steps, decay_steps - 1), decay_steps, min_lr)
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)  # matrices and embeddings, as nanoGPT
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=decay_mask)
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return optax.chain(clip, adamw)


def applied_lr(opt_state) -> jax.Array:
    """The learning rate of the last applied update, read back from `inject_hyperparams`' state."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        if hasattr(node, "hyperparams"):
            return node.hyperparams["learning_rate"]
    raise ValueError("optimizer state holds no inject_hyperparams state with a learning_rate")


def make_loss_fn(model: TransformerLM):
    """`loss_fn(params, (inputs, targets), rng)`: mean cross-entropy in float32; dropout on when rng is given."""

    def loss_fn(params, batch, rng):
        inputs, targets = batch  # i32[batch, seq] each
        rngs = None if rng is None else {"dropout": rng}
        logits = model.apply({"params": params}, inputs, deterministic=rng is None, rngs=rngs)
        return cross_entropy_loss(logits, targets)  # logits f32[batch, seq, vocab]

    return loss_fn


@dataclasses.dataclass
class Run:
    """Everything built from a config: data, model, jitted functions and the initial state."""

    cfg: TrainConfig
    dataset: CharDataset
    model: TransformerLM
    state: TrainState
    step_fn: Any
    eval_fn: Any
    val_batches: list
    corpus_sha256: str

    def run_config(self) -> dict:
        """The config saved with each checkpoint: the options plus what the data and model derive from them."""
        return {**dataclasses.asdict(self.cfg), "corpus_sha256": self.corpus_sha256,
                "vocab_size": self.dataset.tokenizer.vocab_size}


def build(cfg: TrainConfig) -> Run:
    """Validates `cfg`, loads the data and builds the model, optimizer, loss scale and initial state."""
    validate(cfg)
    text = load_text(cfg.data)
    dataset = CharDataset.from_text(text, cfg.seq_len)
    model_cfg = TransformerConfig(vocab_size=dataset.tokenizer.vocab_size, seq_len=cfg.seq_len,
                                  num_layers=cfg.layers, num_heads=cfg.heads, width=cfg.width, dropout=cfg.dropout)
    model = TransformerLM(model_cfg)
    init_key, state_key = jax.random.split(jax.random.PRNGKey(cfg.seed))
    params = model.init(init_key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
    state = TrainState.create(params=params, tx=make_optimizer(cfg, params), policy=get_policy(cfg.precision),
                              loss_scale=make_loss_scale(cfg), rng=state_key)
    loss_fn = make_loss_fn(model)

    def step_with_lr(state, batch):
        state, metrics = train_step(state, batch, loss_fn)
        return state, {**metrics, "lr": jnp.copy(applied_lr(state.opt_state))}  # own buffer: state is donated

    step_fn = jax.jit(step_with_lr, donate_argnums=0)
    eval_fn = jax.jit(lambda s, b: eval_step(s, b, loss_fn)["loss"])
    val = eval_batches(dataset.val, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                       num_batches=cfg.eval_batches, seed=cfg.seed)
    return Run(cfg, dataset, model, state, step_fn, eval_fn, val, hashlib.sha256(text.encode()).hexdigest())


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
    return [{"step": first_step + i + 1, "loss": float(m["loss"]), "loss_scale": float(m["loss_scale"]),
             "grads_finite": bool(m["grads_finite"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
             "tokens_per_s": tokens_per_s} for i, m in enumerate(host)]




class StopRequest:
    """SIGTERM/SIGINT handler for the loop: the first signal asks it to finish the step, save and exit 0; a second
    SIGINT exits at once (status 130; the last complete checkpoint is untouched: orbax writes into a tmp folder)."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if self.signal is not None and signum == signal.SIGINT:
            os._exit(130)
        self.signal = signum

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _header(run: Run) -> str:
    cfg, n = run.cfg, count_params(run.state.params)
    return (f"jaxamp: {n:,} parameters ({n * 4 / 2**20:.1f} MiB float32 master weights); vocab "
            f"{run.dataset.tokenizer.vocab_size}; train {len(run.dataset.train):,} / val {len(run.dataset.val):,} "
            f"tokens; {cfg.tokens_per_step():,} tokens per step; precision {policy_name(run.state.policy)}; "
            f"loss scale {type(run.state.loss_scale).__name__}")


def _sample(run: Run, state: TrainState) -> str:
    tok = run.dataset.tokenizer
    prompt = tok.encode("\n") if "\n" in tok.chars else np.zeros((1,), np.int32)
    params = state.policy.cast_to_compute(state.params)
    ids = generate(run.model, {"params": params}, prompt, run.cfg.sample_tokens, jax.random.PRNGKey(run.cfg.seed))
    return tok.decode(np.asarray(ids).reshape(-1))


def _summary(run: Run, state: TrainState, records: list[dict], wall_s: float) -> dict:
    cfg = run.cfg
    train_eval = eval_batches(run.dataset.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                              num_batches=cfg.eval_batches, seed=cfg.seed)
    train_loss = float(np.mean(jax.device_get([run.eval_fn(state, b) for b in train_eval])))
    speeds = [r["tokens_per_s"] for r in records[cfg.log_every:]] or [r["tokens_per_s"] for r in records]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"precision": policy_name(state.policy), "loss_scale_kind": type(state.loss_scale).__name__,
            "steps": int(state.step), "val_loss": val[-1] if val else None, "train_loss": train_loss,
            "last_step_loss": records[-1]["loss"] if records else None,
            "skipped_steps": sum(not r["grads_finite"] for r in records),
            "final_loss_scale": float(state.loss_scale.loss_scale),
            "tokens_per_s": float(np.median(speeds)) if speeds else None, "wall_s": wall_s,
            "params": count_params(state.params), "tokens_per_step": cfg.tokens_per_step()}


def _summary_line(s: dict) -> str:
    val = "n/a" if s["val_loss"] is None else f"{s['val_loss']:.4f}"
    speed = "n/a" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.0f}"
    return (f"summary: precision={s['precision']} steps={s['steps']} val_loss={val} "
            f"train_loss={s['train_loss']:.4f} skipped_steps={s['skipped_steps']} "
            f"final_loss_scale={s['final_loss_scale']:g} tokens_per_s={speed} wall_s={s['wall_s']:.1f}")


def _open_workdir(cfg: TrainConfig) -> tuple[Path, Checkpointer]:
    workdir = Path(cfg.workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} is a file; pass a directory")
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir, Checkpointer(workdir / "checkpoints", keep=cfg.keep)


def _resume(run: Run, ckpt: Checkpointer) -> TrainState:
    """The newest usable checkpoint's state, or the fresh state when the workdir has none."""
    if ckpt.latest_step() is None:
        return run.state
    abstract = jax.eval_shape(lambda: run.state)
    state, _ = ckpt.restore(abstract, run.run_config(), match_keys=RESUME_MATCH_KEYS,
                            set_aside=Path(run.cfg.workdir) / "unusable-checkpoints")
    print(f"resumed from step {int(state.step)} ({ckpt.directory})", flush=True)
    return state


class _Loop:
    """Steps, a fetch of metrics per logging interval, evaluation and checkpoints; owns no state of its own."""

    def __init__(self, run: Run, ckpt: Checkpointer, logger: MetricsLogger):
        self.run, self.ckpt, self.logger = run, ckpt, logger
        self.step_fn = run.step_fn
        self.pending: list[dict] = []
        self.t0 = time.perf_counter()

    def flush(self, state: TrainState, done: int, *, evaluate_now: bool) -> list[dict]:
        """Fetches the pending metrics once (steps up to `done`), adds val_loss if asked, and logs them."""
        if not self.pending:
            return []
        new = _records(self.pending, done - len(self.pending), self.t0, self.run.cfg.tokens_per_step())
        if evaluate_now:
            new[-1]["val_loss"] = evaluate(self.run, state)
        self.logger.write(new)
        self.pending, self.t0 = [], time.perf_counter()
        return new

    def save(self, state: TrainState, *, force: bool = False) -> None:
        self.ckpt.save(state, self.run.run_config(), force=force)

    def step(self, state: TrainState, step: int) -> TrainState:
        """Runs step `step` (== state.step, mirrored on the host so the loop never waits on the device)."""
        cfg = self.run.cfg
        batch = batch_at(self.run.dataset.train, seed=cfg.seed, step=step, batch_size=cfg.batch_size,
                         seq_len=cfg.seq_len)
        state, metrics = self.step_fn(state, batch)
        self.pending.append(metrics)
        return state


def train(cfg: TrainConfig) -> dict:
    """Trains the LM as `cfg` says, resuming from WORKDIR/checkpoints when it holds a checkpoint.

    Writes WORKDIR/metrics.jsonl (one record per step), TensorBoard events (WORKDIR/tb), checkpoints every
    `checkpoint_every` steps and at the end, and WORKDIR/summary.json; returns the summary. SIGTERM or SIGINT
    finishes the current step, saves, and returns (summary["stopped_by"] names the signal).

    Raises:
      ConfigError: a bad option. DataError: a bad corpus. CheckpointError: an unusable or mismatched checkpoint.
    """
    run = build(cfg)
    workdir, ckpt = _open_workdir(cfg)
    try:
        state = _resume(run, ckpt)
        print(_header(run), flush=True)
        logger = MetricsLogger(workdir, resume_step=int(state.step))
        state, stopped_by, wall_s = _train_loop(run, ckpt, logger, state)
        logger.close()
        ckpt.wait()
    finally:
        ckpt.close()
    summary = _summary(run, state, read_metrics(workdir / "metrics.jsonl"), wall_s)
    summary["stopped_by"] = stopped_by
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if stopped_by:
        print(f"stopped by {stopped_by} after step {int(state.step)}; checkpoint saved; run the same command to "
              "resume", flush=True)
    elif cfg.sample_tokens > 0:
        print("sample:\n" + _sample(run, state), flush=True)
    print(_summary_line(summary), flush=True)
    return summary


def _train_loop(run: Run, ckpt: Checkpointer, logger: MetricsLogger, state: TrainState):
    cfg, loop = run.cfg, _Loop(run, ckpt, logger)
    bar = tqdm(total=cfg.steps, initial=min(int(state.step), cfg.steps), dynamic_ncols=True,
               disable=(not cfg.progress) if cfg.progress is not None else None)
    t_start, stopped_by, done = time.perf_counter(), None, int(state.step)
    with StopRequest() as stop:
        while done < cfg.steps and stop.signal is None:
            state = loop.step(state, done)
            done += 1
            at_eval = done % cfg.eval_every == 0 or done == cfg.steps
            at_save = done % cfg.checkpoint_every == 0 or done == cfg.steps
            if at_eval or at_save or done % cfg.log_every == 0 or stop.signal is not None:
                new = loop.flush(state, done, evaluate_now=at_eval)
                bar.update(len(new))
                bar.set_postfix(loss=f"{new[-1]['loss']:.3f}", scale=f"{new[-1]['loss_scale']:g}",
                                tok_s=f"{new[-1]['tokens_per_s']:.0f}")
            if at_save or stop.signal is not None:
                loop.save(state, force=True)
        if stop.signal is not None:
            stopped_by = signal.Signals(stop.signal).name
            ckpt.wait()
    bar.close()
    return state, stopped_by, time.perf_counter() - t_start
