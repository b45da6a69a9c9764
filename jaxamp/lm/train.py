"""The training loop for the Transformer LM: config -> data, model, policy, optimizer -> TrainState -> steps.

Side effects (printing, files) live here, in the loop's helpers (`jaxamp.lm.workdir`: the run directory, its lock and
summary.json; `jaxamp.lm.log`: printed lines and metrics.jsonl; `jaxamp.lm.stopping`: the signal handlers) and in the
checkpoint code only. `train(TrainConfig(...))` is what `experiments/train_lm.py` calls and what the end-to-end tests
call with tiny configs. The options (`TrainConfig`, `validate`, `ConfigError`) live in `jaxamp.lm.config`, what a run
is built from (`build` -> `Run`) in `jaxamp.lm.setup`, and the resume from a checkpoint (and precision switches) in
`jaxamp.lm.resume`.
"""

from __future__ import annotations

import errno
import signal
import time
import warnings
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxamp.audit import PrecisionWarning
from jaxamp.checkpoint import Checkpointer, CheckpointError, CheckpointSaveError
from jaxamp.checkpoint_quiet import after_failed_save
from jaxamp.fp8_collection import split_fp8
from jaxamp.lm.config import ConfigError, TrainConfig, validate_scale_out
from jaxamp.lm.corpus import write_bpe_cache
from jaxamp.lm.data import eval_batches
from jaxamp.lm.log import host_records, open_logger, report_fidelity, report_skips, say, summary_line, warn
from jaxamp.lm.metrics_log import MetricsLogger, read_metrics, record_with, sync_metrics
from jaxamp.lm.model import count_params
from jaxamp.lm.resume import resume_check, resume_state
from jaxamp.lm.setup import Run, build, device_batch, evaluate, sample_text, step_costs, train_batch
from jaxamp.lm.stopping import DivergenceError, DivergenceGuard, StopRequest
from jaxamp.lm.workdir import (
    BPE_DIR,
    STORAGE_ERRNOS,
    SUMMARY_DIGEST,
    WorkdirWriteError,
    open_workdir,
    read_summary,
    resume_advice,
    write_summary,
)
from jaxamp.precision import policy_name
from jaxamp.sharding import initialize_distributed, is_main_process
from jaxamp.state import TrainState

__all__ = ["ConfigError", "DivergenceError", "TrainConfig", "WorkdirWriteError", "train"]


def _summary(run: Run, state: TrainState, records: list[dict], wall_s: float) -> dict:
    cfg = run.cfg
    train_eval = eval_batches(run.dataset.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                              num_batches=cfg.eval_batches, seed=cfg.seed, vocab_size=run.dataset.vocab_size)
    train_eval = [device_batch(run.mesh, b) for b in train_eval]
    train_loss = float(np.mean(jax.device_get([run.eval_fn(state, b) for b in train_eval])))
    speeds = [r["tokens_per_s"] for r in records[cfg.log_every:]] or [r["tokens_per_s"] for r in records]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    val_step = [r["step"] for r in records if "val_loss" in r]
    switches = [{"step": r["step"], "from": r["precision_from"], "to": r["precision"]}
                for r in records if "precision_from" in r]
    chars = run.dataset.chars_per_token  # nats/char = nats/token / (chars/token)
    return {"precision": policy_name(state.policy, rules=False), "precision_switches": switches,
            "loss_scale_kind": type(state.loss_scale).__name__,
            "steps": int(state.step), "val_loss": val[-1] if val else None,
            "val_loss_step": val_step[-1] if val else None,
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
            warn(f"{path} differed from the copy saved with checkpoint step {step} from line {line} on; "
                 "rewritten from it")
    summary, why = read_summary(workdir / "summary.json")
    if summary is None or summary.get("steps") != step:
        why = why or f"written before step {step} (stopped in between)"
        summary = {**_summary(run, state, read_metrics(path), 0.0), "stopped_by": None}
        write_summary(workdir, summary)
        warn(f"{workdir / 'summary.json'} was {why}; rewritten from checkpoint step {step} and the metrics")
    say(f"{workdir} already holds step {step} (--steps {run.cfg.steps}): nothing to train; raise --steps to "
         "continue")
    say(summary_line(summary))
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
        new = host_records(self.pending, done - len(self.pending), self.t0, self.run.cfg.tokens_per_step())
        record_with(new[0], **self.first_extra)
        self.first_extra = {}
        if evaluate_now:
            record_with(new[-1], val_loss=evaluate(self.run, state))
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
    finishes the current step, saves, and returns (summary["stopped_by"] names the signal). With `cfg.dry_run`,
    prints and returns `dry_run`'s figures instead, and touches no file.

    Raises:
      ConfigError: a bad option. DataError: a bad corpus. CheckpointError: an unusable or mismatched checkpoint
        (CheckpointSaveError: a save failed, e.g. the disk is full; the message says how to resume).
      WorkdirWriteError: metrics, events or the summary could not be written (the message says how to resume).
    """
    validate_scale_out(cfg)  # no JAX call (validate's --precision auto asks for the devices)
    try:  # before any other JAX call
        initialize_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    run = build(cfg)
    if cfg.dry_run:
        with warnings.catch_warnings():  # the audit's line says it; train_step's PrecisionWarning would repeat it
            warnings.simplefilter("ignore", PrecisionWarning)
            return dry_run(run)
    workdir, ckpt, lock = open_workdir(cfg)
    try:
        return _run_in_workdir(run, workdir, ckpt, lock)
    except CheckpointSaveError:
        after_failed_save()  # the run's catch_warnings block restored the filters it found: orbax's leftovers' again
        raise


def _run_in_workdir(run: Run, workdir: Path, ckpt: Checkpointer, lock) -> dict:
    """`_train_in_workdir` under the workdir's lock, with a failure to write told in one line with resume advice."""
    # Signals are held from here to the end: one that arrives after the loop (final save, summary, sample) lets the
    # finished run complete and exit 0.
    # The run prints the precision audit's summary when it starts; train_step's PrecisionWarning would repeat it.
    with lock, StopRequest() as stop, warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        try:
            return _train_in_workdir(run, workdir, ckpt, stop)
        except CheckpointSaveError as err:
            raise CheckpointSaveError(f"{err}; {resume_advice(err.errno, ckpt)}", step=err.step,
                                      errno=err.errno) from err
        except OSError as err:
            if err.errno not in STORAGE_ERRNOS:
                raise
            name = f" ({Path(err.filename).name})" if err.filename else ""
            raise WorkdirWriteError(f"cannot write in --workdir {workdir}{name}: {err.strerror} "
                                    f"({errno.errorcode.get(err.errno, err.errno)}); "
                                    f"{resume_advice(err.errno, ckpt)}") from err


def dry_run(run: Run) -> dict:
    """Prints the run's header, its precision audit and the compiled step's FLOPs and memory, and returns them;
    no weights are made (the state is shapes only), no step is run, the workdir is not touched."""
    say(run.header())
    audit = run.precision_summary()
    if audit:
        say(audit)
    costs = step_costs(run)
    cfg, tokens = run.cfg, run.cfg.tokens_per_step()
    params = split_fp8(run.state.params)[0]
    n = count_params(params)
    n_no_pos = n - count_params([x for path, x in jax.tree_util.tree_leaves_with_path(params)
                                 if "wpe" in jax.tree_util.keystr(path)])
    model_flops = tokens * (6 * n_no_pos + 12 * cfg.layers * cfg.seq_len * cfg.width)  # nanoGPT's estimate_mfu
    total = costs["argument_bytes"] + costs["temp_bytes"] + costs["output_bytes"]
    looped = [name for name, on in (("scanned blocks", cfg.scan_layers), ("micro-batches", cfg.accum_steps > 1)) if on]
    loops = f", a loop's body counted once: {' and '.join(looped)}" if looped else ""
    per_device = " per device" if run.mesh is not None else ""
    held = Path(cfg.workdir) / "checkpoints"
    say(f"dry run: the step compiled for {jax.devices()[0].platform} in {costs['seconds']:.1f} s; "
        f"{_flops(model_flops)} per step (nanoGPT's 6 N + 12 L T d per token; XLA's cost analysis: "
        f"{_flops(costs['flops'])}{per_device}{loops}); memory per device {_bytes(costs['argument_bytes'])} of "
        f"arguments (weights, optimizer state, batch) + {_bytes(costs['temp_bytes'])} of temporaries (activations, "
        f"gradients) + {_bytes(costs['output_bytes'])} of outputs not donated = {_bytes(total)} (XLA's memory "
        "analysis of this backend's program); nothing trained or written")
    if held.is_dir():
        say(f"dry run: {held}: {_checkpoints_check(run, held)}")
    return {"dry_run": True, "parameters": n, "tokens_per_step": tokens, "model_flops": model_flops, **costs,
            "peak_bytes_estimate": total}


def _checkpoints_check(run: Run, held: Path) -> str:
    """What a run of this config would do with the checkpoints in `held` (`resume_check`), read-only."""
    try:
        ckpt = Checkpointer(held, keep=run.cfg.keep)
    except CheckpointError as err:
        return f"a run would stop: {err}"
    if ckpt.latest_step() is None:
        return "no checkpoint: a run would start from step 0"
    return resume_check(run, ckpt)


def _flops(n: float) -> str:
    return f"{n / 1e9:,.1f} GFLOP" if n >= 1e9 else f"{n / 1e6:,.1f} MFLOP"


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _train_in_workdir(run: Run, workdir: Path, ckpt: Checkpointer, stop: StopRequest) -> dict:
    """Resumes (or starts), trains, saves and writes the summary; the workdir is locked and signals are held."""
    cfg = run.cfg
    try:
        state, switched_from = resume_state(run, ckpt)
        history = ckpt.metrics(int(state.step)) if ckpt.steps() else []  # the records saved with that checkpoint
        if int(state.step) >= cfg.steps:
            return _finished(run, workdir, state, history)
        if run.dataset.bpe_cache is not None and is_main_process():  # after the resume checks passed
            write_bpe_cache(run.dataset.bpe_cache, workdir / BPE_DIR)
        say(run.header())
        summary = run.precision_summary()
        if summary:
            say(summary)
        logger = open_logger(workdir, int(state.step), history)
        state, stopped_by, wall_s = _train_loop(run, ckpt, logger, state, stop, switched_from)
        logger.close()
        ckpt.wait()
    finally:
        ckpt.close()
    summary = _summary(run, state, read_metrics(workdir / "metrics.jsonl"), wall_s)
    summary["stopped_by"] = stopped_by
    write_summary(workdir, summary)
    if stopped_by:
        say(f"stopped by {stopped_by} after step {int(state.step)}; checkpoint saved; run the same command to "
             "resume")
    elif cfg.sample_tokens > 0:
        say("sample:\n" + sample_text(run, state))
    say(summary_line(summary))
    return summary


def _train_loop(run: Run, ckpt: Checkpointer, logger: MetricsLogger, state: TrainState, stop: StopRequest,
                switched_from: str | None = None):
    cfg, loop = run.cfg, _Loop(run, ckpt, logger, switched_from)
    bar = tqdm(total=cfg.steps, initial=min(int(state.step), cfg.steps), dynamic_ncols=True,
               disable=not is_main_process() or ((not cfg.progress) if cfg.progress is not None else None))
    t_start, stopped_by, done = time.perf_counter(), None, int(state.step)
    guard = DivergenceGuard(cfg.max_consecutive_skips, getattr(state.loss_scale, "min_loss_scale", 1.0))
    first = True
    while done < cfg.steps and stop.signal is None:
        t_step = time.perf_counter()
        state = loop.step(state, done)  # the first call traces and compiles the step, then dispatches it
        if first and is_main_process():  # (process 0 only, as every printed line)
            bar.write(f"step {done + 1}: traced and compiled in {time.perf_counter() - t_step:.1f} s")
        first = False
        done += 1
        if done % cfg.log_every == 0:
            stop.sync()  # several processes: agree on a signal (a no-op in one process)
        at_eval = done % cfg.eval_every == 0 or done == cfg.steps
        at_save = done % cfg.checkpoint_every == 0 or done == cfg.steps
        if at_eval or at_save or done % cfg.log_every == 0 or stop.signal is not None:
            new = loop.flush(state, done, evaluate_now=at_eval)
            report_skips(bar, new)
            report_fidelity(bar, new)
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
