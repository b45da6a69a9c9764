"""The training loop for the Transformer LM: config -> data, model, policy, optimizer -> TrainState -> steps.

Side effects (printing, files) live here, in the loop's helpers (`jaxamp.workdir`: the run directory, its lock and
summary.json; `jaxamp.train_log`: printed lines and metrics.jsonl; `jaxamp.stopping`: the signal handlers) and in the
checkpoint code only. `train(TrainConfig(...))` is what `experiments/train_lm.py` calls and what the end-to-end tests
call with tiny configs. The options (`TrainConfig`, `validate`, `ConfigError`) live in `jaxamp.train_config` and the
resume from a checkpoint (and precision switches) in `jaxamp.resume`; they are importable from here as before.
"""

from __future__ import annotations

import dataclasses
import errno
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxamp.checkpoint import Checkpointer, CheckpointSaveError
from jaxamp.sharding import (gather_to_host, initialize_distributed, is_main_process, jit_eval_step, jit_train_step,
                             make_global_batch, make_mesh, shard_state)
from jaxamp.corpus import Corpus, decode_sample, load_corpus, sample_prompt, write_bpe_cache
from jaxamp.data import batch_at, eval_batches
from jaxamp.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from jaxamp.metrics_log import MetricsLogger, read_metrics, sync_metrics
from jaxamp.fidelity import grad_fidelity
from jaxamp.model import LM_KEEP_FLOAT32, TransformerConfig, TransformerLM, count_params, generate
from jaxamp.precision import get_policy, needs_loss_scaling, policy_name, uses_fp8
from jaxamp.state import TrainState, split_fp8
from jaxamp.step import eval_step, train_step
# The loop's helpers. TrainConfig, ConfigError, validate, StopRequest, DivergenceError and WorkdirWriteError are
# also imported from here (`from jaxamp.train import ...`) by the experiments, benchmarks and tests.
from jaxamp.resume import _resume
from jaxamp.stopping import DivergenceError, DivergenceGuard, StopRequest
from jaxamp.train_config import ConfigError, TrainConfig, _validate_scale_out, validate
from jaxamp.train_log import (_header, _open_logger, _records, _report_fidelity, _report_skips, _say, _summary_line,
                               _warn)
from jaxamp.workdir import (BPE_DIR, STORAGE_ERRNOS, SUMMARY_DIGEST, WorkdirWriteError, _open_workdir, _read_summary,
                            _resume_advice, _write_summary)


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
    # FP8: the float32 reference bypasses the FP8 ops (the same model without them; grad_fidelity does it). Keys as in
    # the other precisions: an FP8 state's params are the variables dict, its paths start with "params/".
    fidelity_fn = jax.jit(lambda s, b: {k.removeprefix("params/") if model_cfg.fp8 else k: v for k, v in
                                        grad_fidelity(s, b, loss_fn, accum_steps=cfg.accum_steps).items()})
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


def evaluate(run: Run, state: TrainState) -> float:
    """Mean validation loss over the run's fixed validation batches (nats per token)."""
    losses = [run.eval_fn(state, batch) for batch in run.val_batches]
    return float(np.mean(jax.device_get(losses)))


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


def _finished(run: Run, workdir: Path, state: TrainState, history: list[dict] | None) -> dict:
    """A run already at `--steps` or beyond: nothing is trained. Its metrics.jsonl (from the checkpoint's copy) and
    summary.json (from the state and the records) are checked and repaired; an intact run is left as it is."""
    step = int(state.step)
    path = workdir / "metrics.jsonl"
    if history is not None and is_main_process():
        line = sync_metrics(path, [r for r in history if r["step"] <= step])
        if line is not None:
            _warn(f"{path} differed from the copy saved with checkpoint step {step} from line {line} on; "
                 "rewritten from it")
    summary, why = _read_summary(workdir / "summary.json")
    if summary is None or summary.get("steps") != step:
        why = why or f"written before step {step} (stopped in between)"
        summary = {**_summary(run, state, read_metrics(path), 0.0), "stopped_by": None}
        _write_summary(workdir, summary)
        _warn(f"{workdir / 'summary.json'} was {why}; rewritten from checkpoint step {step} and the metrics")
    _say(f"{workdir} already holds step {step} (--steps {run.cfg.steps}): nothing to train; raise --steps to "
         "continue")
    _say(_summary_line(summary))
    return {k: v for k, v in summary.items() if k != SUMMARY_DIGEST}


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
