"""Checkpoints of a `TrainState` with integrity checks, on orbax-checkpoint's `CheckpointManager`.

Layout. One folder per step under `directory`, named by the step number (orbax's default names). Each step holds
three orbax items, and a fourth when `save` gets `metrics`, written together by one `CheckpointManager.save`:

- `state`: the whole `TrainState` (params, opt_state, loss-scale leaves, step, rng), `ocp.args.StandardSave`;
- `config`: the run's settings, a JSON dict (`ocp.args.JsonSave`);
- `integrity`: a JSON record written by this module: per array leaf (keyed by `jax.tree_util.keystr` of its path)
  the sha256 of its bytes, its dtype and shape; the loss scale's type and static hyperparameters
  (`DynamicLossScale.config()`); the policy name; the pytree structure string; a sha256 of the config JSON (and
  of the metrics list); `record_sha256`, the digest of the record itself, so a damaged record makes the step
  unusable instead of reading as a settings mismatch (format 2; format-1 records, without it, are still read);
- `metrics` (optional): a JSON list, e.g. the training log's records up to this step (`Checkpointer.metrics(step)`).

Integrity design. orbax has no checksums: a flipped bit in a data file restores silently with wrong values (a
flip inside a compressed chunk may also surface as a decode error). So `restore` recomputes the sha256 of every
restored leaf and compares it with the record; any difference makes the step unusable. Static fields (`tx`,
`policy`, the loss scale's hyperparameters) are never stored as objects: they come from the abstract restore
target, and the record only lets `restore` tell whether the target matches what was saved. Nothing is unpickled
(orbax's standard format and JSON only).

Arrays that are not fully addressable (a multi-process run) cannot be hashed whole on one host. For those the
record holds one sha256 per shard, keyed by the shard's global index (e.g. `"0:512,0:1024"`); each process hashes
the shards it owns (replica 0) and the per-process records are gathered to every process before the save. On
restore, a fully addressable leaf is checked against the per-shard digests by slicing the restored array; a
non-fully-addressable one is checked shard by shard where the restored shard index equals a saved one (a shard
layout that differs from the saved one cannot be checked and is reported once with a warning). Single-process
runs (every array fully addressable, however many local devices) always use whole-array digests.

orbax pitfalls handled here (orbax-checkpoint 0.12.8):

- An empty or half-deleted `N/` folder counts as the latest step for orbax, its restore raises, and afterwards the
  same `CheckpointManager` refuses good steps too. `restore` therefore lists steps itself and uses a fresh,
  read-only `CheckpointManager` per attempt, newest first, skipping unusable steps with a warning.
- orbax refuses (returns False) to save a step that is not newer than the newest step folder, so a broken newer
  folder would silently stop all saving; `save` raises instead.
- Restoring without a target turns optax NamedTuples and dataclasses into dicts and cannot change the device
  topology; `restore` always takes an abstract target (ShapeDtypeStructs, with shardings when wanted).
- A wrong dtype in the target is cast silently by orbax; the record's dtypes and shapes are compared first.
- Saves killed mid-way leave `N.orbax-checkpoint-tmp-*` folders; they are ignored when listing and removed by
  orbax (`cleanup_tmp_directories`) when this module first saves into the directory.
- `best_fn` with `max_to_keep` can delete the newest step; only `max_to_keep` is used.
- A failed orbax read leaves suspended coroutines behind that print "Exception ignored in <coroutine ...>" when
  garbage-collected; `restore` collects them (and the partly read buffers) before trying the previous step.
- orbax logs two absl warnings per read-only manager ("Given directory is read only"), one per step folder
  without its metadata file (an old step whose deletion a kill cut short), and one per save that waited over a
  second for the previous one; they are dropped (see below), and `save` warns once about slow saves instead.
- When a save fails (e.g. the disk fills), orbax logs the error with a traceback from each of its threads, asyncio
  reports its failed tasks, and tensorstore's callbacks print "RuntimeError: Event loop is closed" for every write
  still pending (hundreds of lines for one failure); a failed read leaves a suspended coroutine per array that
  prints its traceback when collected. The first `Checkpointer` of a process installs a logging filter (loggers
  `absl` and `asyncio`: orbax's error records only) and an unraisable-exception hook (that RuntimeError and
  orbax's coroutines only) that keep them off stderr: the failure reaches the caller once, a failed save as a
  `CheckpointSaveError` naming the step and the operating-system error, a failed read as `restore`'s warning or
  error. After a failed save, asyncio's "Future exception was never retrieved" and the "coroutine ... was never
  awaited" RuntimeWarning (orbax's leftovers, collected at exit) are dropped too. `JAXAMP_ORBAX_LOGS=1` keeps
  them all.
- A save whose step folder is missing after orbax reports success raises `CheckpointSaveError` too.

Modules. This one holds the policy: what is saved, the checks against the record, the fallback to the previous
step, setting unusable steps aside, the messages. Every orbax and tensorstore call (the writer and read-only
managers, the items' save and restore arguments, the OCDBT index check, the step and tmp folder listing) is in
`jaxamp.checkpoint_storage`; the integrity record is built and checked in `jaxamp.checkpoint_record`; orbax's
failure reports are kept quiet, and failures told in one line, by `jaxamp.checkpoint_quiet`.
"""

from __future__ import annotations

import errno as errno_codes
import gc
import json
import os
import time
import warnings
from pathlib import Path

import jax

from jaxamp import checkpoint_storage as storage
from jaxamp.checkpoint_quiet import after_failed_save, quiet_library_failures, save_reason
from jaxamp.checkpoint_record import (
    READABLE_FORMATS,
    config_digest,
    integrity_record,
    legacy_target,
    mismatch,
    seal_intact,
    sealed,
    verify,
    with_counter,
)
from jaxamp.loss_scale import LossScale, from_description
from jaxamp.state import TrainState

__all__ = ["CheckpointError", "CheckpointMismatchError", "CheckpointSaveError", "Checkpointer",
           "loss_scale_from_record"]

_clock = time.monotonic  # how long a save waited for the previous one (a test replaces it)


class CheckpointError(Exception):
    """A checkpoint directory or step is unreadable, corrupt, or holds no usable step.

    The message names the directory or step folder and the problem.
    """


class CheckpointMismatchError(CheckpointError):
    """A checkpoint was saved with different settings than this run (config value, structure, dtype, loss scale).

    The message names the field and both values. Raised at once: an older step is not tried instead.
    """


class CheckpointSaveError(CheckpointError):
    """A save failed or did not commit; the steps already on disk are untouched.

    Attributes:
      step: the step whose save failed (None when unknown).
      errno: the operating-system error behind it (e.g. `errno.ENOSPC`), or None.
    """

    def __init__(self, message: str, *, step: int | None = None, errno: int | None = None):
        super().__init__(message)
        self.step, self.errno = step, errno


class _Unusable(Exception):
    """Internal: this step cannot be restored; the message is the reason."""


def loss_scale_from_record(record: dict) -> LossScale:
    """A loss scale of the type and hyperparameters an integrity record names (`record["loss_scale"]`), e.g. a
    restore target for a checkpoint saved under another precision; its values come from the restore.

    Raises:
      CheckpointError: an unknown type.
    """
    try:
        return from_description(record)
    except ValueError as err:
        raise CheckpointError(f"{err} in a checkpoint record") from None


def _check_save_args(config, metrics) -> None:
    """Raises ValueError unless `config` is a JSON-serializable dict and `metrics` None or a JSON-serializable list."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    try:
        json.dumps(config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"config must be JSON-serializable: {err}") from None
    if metrics is not None:
        try:
            if not isinstance(metrics, list):
                raise TypeError(f"got {type(metrics).__name__}")
            json.dumps(metrics)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metrics must be a JSON-serializable list: {err}") from None


# ---------------------------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves `TrainState`s asynchronously with orbax and restores the newest usable one, verified by sha256.

    What is saved. Each `save` writes one step folder with the whole `TrainState` (params, opt_state, the loss
    scale's values, step, rng), the run's `config` (a JSON dict), an integrity record and, when given, a `metrics`
    list (e.g. the training log up to that step). Static fields (`tx`, `policy`, the loss scale's hyperparameters)
    are not stored as objects: `restore` takes them from its abstract target, and the record tells whether the
    target matches what was saved. Nothing is pickled: orbax's standard format and JSON only.

    Directory layout (orbax's default names; checkpoints written by earlier jaxamp versions restore)::

        directory/
          4/                            a committed step, named by its number
            state/                      the TrainState's arrays (orbax standard format, an OCDBT database)
            config/  integrity/         JSON: the run's config; the integrity record (`integrity/metadata`)
            metrics/                    JSON: the `metrics` list (only when saved with one)
            _CHECKPOINT_METADATA        orbax's step metadata
          8.orbax-checkpoint-tmp-*/     a save in progress or cut short (`interrupted_saves`); never read

    The integrity record holds each array leaf's sha256, dtype and shape (per shard in a multi-process run), the
    loss scale's type and hyperparameters, the policy name, the pytree structure, the digests of the config and
    metrics, and its own digest (see `jaxamp.checkpoint_record`).

    Integrity guarantees:
      - A restored state is bitwise the saved one: every leaf's sha256 is recomputed and compared with the record.
        A step that differs, or whose files are missing, truncated or unreadable, is skipped with a warning and the
        previous one is tried (unless `restore` gets `step`).
      - A step saved with other settings (the config's `match_keys`, the loss scale, the policy, a leaf's presence,
        dtype or shape, the pytree structure) raises `CheckpointMismatchError` before any array is read: nothing is
        cast or reshaped silently, and no older step is tried instead.
      - A step folder appears under its number only once its save is complete (orbax renames its tmp folder), so a
        process killed mid-save leaves the previous steps intact; a failed save raises `CheckpointSaveError` once.
      - Steps on disk are never overwritten, and a directory holding entries other than checkpoints is refused
        before anything is read, written or deleted.

    orbax. Written and tested against orbax-checkpoint 0.12.8 (the project accepts 0.11.32 to 0.12), whose pitfalls
    it handles: an empty or half-deleted step folder that breaks orbax's manager, saves that orbax refuses without
    an error, dtypes cast silently, restores without a target, and failure reports of hundreds of lines (the
    module docstring lists them). Every orbax call is in `jaxamp.checkpoint_storage`.

    One writer per directory: two `Checkpointer`s saving into the same directory at once (two runs sharing a
    workdir) collide in orbax's temporary folders.

    Args:
      directory: the checkpoint folder. Created at the first save if missing. If it exists it must hold nothing
        but step folders (and orbax's own entries).
      keep: how many of the newest steps to keep on disk (orbax `max_to_keep`), >= 1.
      async_save: save in a background thread (the device-to-host copy itself is synchronous, so the caller may
        donate or overwrite the state right after `save` returns).
      checksums: record a sha256 per leaf at save time (needs a host copy of every leaf). Restores always verify
        the digests a step holds.

    Raises:
      CheckpointError: `directory` is a file, or holds entries that are not checkpoints (named in the message).
      ValueError: `keep` < 1.

    Example::

        with Checkpointer(workdir / "checkpoints", keep=3) as ckpt:
            ckpt.save(state, {"lr": 1e-3})
        state, config = Checkpointer(workdir / "checkpoints").restore(jax.eval_shape(build_state))
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True, checksums: bool = True):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1 (steps kept on disk), got {keep!r}")
        self._dir = Path(directory).expanduser().absolute()
        self._keep = keep
        self._async = bool(async_save)
        self._checksums = bool(checksums)
        self._manager: storage.Writer | None = None  # the writer, created at each save
        self._pending: int | None = None  # the step of a save started and not yet waited for
        self._slow_noted = False  # warned once that saves wait for each other
        quiet_library_failures()
        self._check_directory()

    @property
    def directory(self) -> Path:
        """The checkpoint folder (absolute)."""
        return self._dir

    # -- listing ---------------------------------------------------------------------------------------------

    def _check_directory(self) -> None:
        """Raises CheckpointError when the directory is a file or holds entries that are not checkpoints."""
        if not self._dir.exists():
            return
        if not self._dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self._dir} is not a directory")
        stray = storage.stray_entries(self._dir)
        if stray:
            raise CheckpointError(
                f"checkpoint directory {self._dir} holds non-checkpoint entries: {', '.join(stray)}; pass an empty "
                f"directory or one that holds only checkpoints (nothing was read, written or deleted)")

    def interrupted_saves(self) -> list[int]:
        """Steps whose save began but never committed.

        Returns:
          The steps of `N.orbax-checkpoint-tmp-*` folders (the process was killed, or the disk filled, while
          writing), ascending; orbax removes these folders when this directory is next saved into.
        """
        return storage.interrupted_steps(self._dir)

    def steps(self) -> list[int]:
        """The step folders on disk.

        Returns:
          Their steps, ascending. Interrupted saves (`N.orbax-checkpoint-tmp-*`) are ignored. A listed step can
          still be unusable (an empty or damaged folder): `restore` checks and skips those.
        """
        return storage.step_numbers(self._dir)

    def latest_step(self) -> int | None:
        """The newest step folder on disk.

        Returns:
          Its step, or None when there is none (it may be unusable: see `steps`).
        """
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving ----------------------------------------------------------------------------------------------

    def save(self, state: TrainState, config: dict, *, force: bool = False, metrics: list | None = None) -> bool:
        """Starts saving `state` and `config` (and `metrics`) as step `int(state.step)`.

        The arrays are copied to the host and hashed before this returns (that part is synchronous, and its cost
        grows with the state's size); writing happens in the background when `async_save`. A previous pending
        save is waited for first. Once `keep` steps exist, the oldest is deleted after the new one is complete.

        Args:
          state: the `TrainState` to save.
          config: the run's settings, a JSON-serializable dict (restored with the state; `restore` compares keys).
          force: passed to orbax: save even if its save-interval policy would skip this step.
          metrics: optional JSON-serializable list, e.g. the run's log records up to this step, saved as a fourth
            item with its sha256 in the integrity record (read back, verified, with `metrics(step)`).

        Returns:
          True if a save started; False if this step is already on disk (it is never overwritten).

        Raises:
          ValueError: `config` is not a JSON-serializable dict, or `metrics` not a JSON-serializable list.
          CheckpointError: the directory holds non-checkpoint entries, or a step folder newer than this step
            (orbax would silently refuse every save; remove the newer folders or use another directory).
          CheckpointSaveError: a previous background save failed, or orbax failed to start this save (the cause is
            chained; `errno` names an operating-system error such as ENOSPC).
        """
        _check_save_args(config, metrics)
        label = int(jax.device_get(state.step))
        self._check_directory()
        waited = _clock()
        self.wait()  # a pending save may still be creating its folder; its failure surfaces here
        self._note_slow_saves(label, _clock() - waited)
        on_disk = self.steps()
        if label in on_disk:
            return False
        newer = [s for s in on_disk if s > label]
        if newer:
            raise CheckpointError(
                f"cannot save step {label} in {self._dir}: it holds newer step folders {newer} (orbax saves only "
                f"steps newer than the newest folder); remove them or use another directory")
        started = self._start_save(label, state, config, force, metrics)
        if started:
            self._pending = label
        return started

    def _start_save(self, label: int, state: TrainState, config: dict, force: bool, metrics: list | None) -> bool:
        """Hashes the state and hands the items to a fresh writer; raises CheckpointSaveError when orbax fails."""
        # A fresh writer for each save: orbax caches its step list, and steps removed by hand must not block this
        # save (reload() would parse every step's "metrics" item as orbax's own metrics: a damaged one raised). The
        # previous writer is closed first: each writer starts removing interrupted saves' tmp folders in the
        # background, and two at once raced (ENOENT).
        previous, self._manager = self._manager, None
        if previous is not None:
            previous.close()
        self._manager = storage.Writer(self._dir, keep=self._keep, async_save=self._async)
        integrity = sealed(integrity_record(state, config, self._checksums, metrics))
        try:
            return self._manager.save(label, state=state, config=config, integrity=integrity, metrics=metrics,
                                      force=force)
        except Exception as err:  # noqa: BLE001 - orbax raises OSError, ValueError, RuntimeError, ...
            after_failed_save()
            reason, code = save_reason(err)
            collision = code in (None, errno_codes.EEXIST, errno_codes.ENOENT)
            raise CheckpointSaveError(
                f"saving step {label} to {self._dir} failed: {reason}" + (
                    " (one Checkpointer, in one process or one multi-process run, may write a directory)"
                    if collision else ""), step=label, errno=code) from err

    def _note_slow_saves(self, label: int, waited: float) -> None:
        """Warns once per Checkpointer when a save had to wait over a second for the previous one."""
        if waited > 1.0 and not self._slow_noted:
            self._slow_noted = True
            warnings.warn(f"saving step {label} waited {waited:.1f} s for the previous save to finish: saves take "
                          "longer than the steps between them (a larger checkpoint interval avoids the stall)",
                          stacklevel=3)

    def wait(self) -> None:
        """Blocks until pending saves are complete (written, committed and old steps deleted).

        Raises:
          CheckpointSaveError: a background save failed (the cause is chained; `errno` names an operating-system
            error such as ENOSPC), or its step folder is missing afterwards. The failure is reported once: the
            writer is dropped, so a later `wait` or `close` does not raise it again (a later `save` starts a new
            one).
        """
        if self._manager is None:
            return
        pending, self._pending = self._pending, None
        step = "a step" if pending is None else f"step {pending}"
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - orbax re-raises whatever the background thread raised
            after_failed_save()
            reason, code = save_reason(err)
            self._drop_writer()
            raise CheckpointSaveError(f"saving {step} to {self._dir} failed: {reason}", step=pending,
                                      errno=code) from err
        if pending is not None and pending not in self.steps():
            raise CheckpointSaveError(f"saving {step} to {self._dir} left no step folder {pending} (deleted "
                                      "meanwhile, or orbax failed without raising)", step=pending)

    def _drop_writer(self) -> None:
        """Closes the writer after a failed save; orbax's close re-raises that failure, already reported."""
        manager, self._manager = self._manager, None
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - pylint: disable=broad-except
            pass

    def close(self) -> None:
        """Waits for pending saves, then releases orbax's resources. The object can still save afterwards.

        Raises:
          CheckpointSaveError: a background save failed.
        """
        try:
            self.wait()
        finally:
            if self._manager is not None:
                self._manager.close()
                self._manager = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restoring -------------------------------------------------------------------------------------------

    def restore(self, abstract_state: TrainState, expected_config: dict | None = None, *, match_keys=(),
                step: int | None = None, set_aside: str | Path | None = None) -> tuple[TrainState, dict]:
        """Restores the newest usable step (or `step`) into `abstract_state` and verifies every leaf's sha256.

        Steps are tried newest first. Each attempt uses a fresh read-only orbax manager; it reads the config and
        the integrity record, checks them against `expected_config` and `abstract_state` (no array is read before),
        restores the arrays and recomputes their digests. A step that fails (empty or damaged folder, missing or
        truncated file, checksum mismatch, any orbax error) is skipped with a warning
        `checkpoint step N in DIR is unusable (REASON); trying the previous one`. Nothing is written.

        Args:
          abstract_state: a `TrainState` whose array leaves are `jax.ShapeDtypeStruct`s (e.g.
            `jax.eval_shape(build_state)`); static fields (`tx`, `policy`, loss-scale hyperparameters) and dtypes
            come from it. Leaves carrying a `sharding` are restored with it (any device count); others go to the
            default device.
          expected_config: this run's settings; needed when `match_keys` is not empty.
          match_keys: config keys that must equal the saved ones (compared after a JSON round trip).
          step: restore exactly this step (no fallback) instead of the newest usable one.
          set_aside: a folder outside the checkpoint directory; when given, unusable steps newer than the restored
            one are moved there (kept, never deleted, with a warning), so the resumed run can save those steps
            again. Without it nothing is written.

        Returns:
          `(state, config)`: the restored `TrainState` and the config dict saved with it.

        Raises:
          CheckpointMismatchError: a `match_keys` value, the loss-scale type or hyperparameters, the policy, a leaf's
            presence, dtype or shape, or the pytree structure differs from the checkpoint (names both values).
          CheckpointError: the directory holds non-checkpoint entries, holds no step, `step` is not on disk or is
            unusable, or every step is unusable (each listed with its reason).
          ValueError: a `match_keys` entry is missing from `expected_config`, or a leaf of `abstract_state` has no
            shape or dtype.
        """
        match_keys = tuple(match_keys)
        target = self._restore_target(abstract_state, expected_config, match_keys)
        candidates = self._candidates(step)
        failures = []
        for n in candidates:
            try:
                restored = self._restore_step(n, target, expected_config, match_keys)
            except _Unusable as err:
                failures.append((n, str(err)))
                # A failed orbax read leaves coroutines and partly read buffers behind; free them before the next
                # attempt (they also print "Exception ignored in <coroutine ...>" when collected).
                gc.collect()
                if step is not None:
                    raise CheckpointError(f"checkpoint step {n} in {self._dir} is unusable ({err})") from None
                warnings.warn(f"checkpoint step {n} in {self._dir} is unusable ({err}); trying the previous one",
                              stacklevel=2)
                continue
            if set_aside is not None:
                self._set_aside([f for f, _ in failures], Path(set_aside))
            return restored
        listing = "; ".join(f"step {n} ({self._dir / str(n)}): {why}" for n, why in failures)
        raise CheckpointError(f"no usable checkpoint in {self._dir}: {listing}")

    def check(self, abstract_state: TrainState, expected_config: dict | None = None, *, match_keys=(),
              step: int | None = None) -> tuple[int, str | None]:
        """What `restore` would do with the same arguments, from the JSON items alone: no array is read, nothing
        is written (e.g. a dry run's report on a workdir's checkpoints).

        Steps are tried newest first, as `restore` tries them; one whose config or integrity record cannot be read
        is passed over (`restore` would pass it over too, with a warning).

        Args:
          abstract_state: the restore target, as for `restore` (shapes, dtypes, static fields).
          expected_config: this run's settings; needed when `match_keys` is not empty.
          match_keys: config keys that must equal the saved ones.
          step: check exactly this step instead of the newest readable one.

        Returns:
          `(step, problem)`: the step `restore` would restore, and None when its settings and structure match, or
          the one line `restore` would raise as a `CheckpointMismatchError`.

        Raises:
          CheckpointError: the directory holds no step, non-checkpoint entries, or no readable step.
          ValueError: a `match_keys` entry is missing from `expected_config`.
        """
        target = self._restore_target(abstract_state, expected_config, tuple(match_keys))
        failures = []
        for n in self._candidates(step):
            try:
                with storage.Reader(self._dir) as reader:
                    config, record = self._read_meta(reader, n)
            except _Unusable as err:
                failures.append(f"step {n}: {err}")
                continue
            return n, mismatch(n, self._dir, config, record, legacy_target(record, target), expected_config,
                               tuple(match_keys))
        raise CheckpointError(f"no readable checkpoint in {self._dir}: {'; '.join(failures)}")

    def _restore_target(self, abstract_state, expected_config, match_keys: tuple):
        """`restore`'s and `check`'s preamble: the arguments checked, a pending save waited for, the directory
        checked; returns the target on the default device. Raises ValueError or CheckpointError."""
        missing = [k for k in match_keys if expected_config is None or k not in expected_config]
        if missing:
            raise ValueError(f"match_keys {missing} are not in expected_config")
        self.wait()
        self._check_directory()
        return storage.restore_target(abstract_state)

    def _candidates(self, step: int | None) -> list[int]:
        """The steps `restore` tries, in order: `step` alone, or every step on disk newest first."""
        on_disk = self.steps()
        if step is not None:
            if int(step) not in on_disk:
                raise CheckpointError(f"no checkpoint step {step} in {self._dir}; steps on disk: {on_disk}")
            return [int(step)]
        if not on_disk:
            raise CheckpointError(f"no checkpoint in {self._dir}")
        return on_disk[::-1]

    def _set_aside(self, steps: list[int], dest: Path) -> None:
        """Moves unusable step folders out of the checkpoint directory into `dest` (kept for inspection).

        In a multi-process run only process 0 moves them (the directory is shared); every process then waits at a
        barrier, so none saves a step whose old folder is still in place.
        """
        if jax.process_index() == 0:
            self._move_steps(steps, dest)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

            multihost_utils.sync_global_devices(f"jaxamp set_aside {self._dir}")

    def _move_steps(self, steps: list[int], dest: Path) -> None:
        for n in steps:
            if not (self._dir / str(n)).exists():
                continue
            dest.mkdir(parents=True, exist_ok=True)
            target, k = dest / str(n), 1
            while target.exists():
                target, k = dest / f"{n}.{k}", k + 1
            os.replace(self._dir / str(n), target)
            warnings.warn(f"moved unusable checkpoint step {n} to {target}", stacklevel=4)

    def _restore_step(self, n: int, target, expected_config, match_keys) -> tuple[TrainState, dict]:
        if not any((self._dir / str(n)).iterdir()):
            raise _Unusable("empty step folder")
        # One fresh read-only reader per attempt: after a failed restore orbax's manager refuses good steps too.
        with storage.Reader(self._dir) as reader:
            # 1. The JSON items only: config, integrity record (and the metrics copy when the record lists one).
            config, record = self._read_meta(reader, n)
            # 2. Settings and structure: a mismatch means the user changed settings, so it is raised, not skipped.
            saved_as = legacy_target(record, target)  # a state saved before it held consecutive_skips
            problem = mismatch(n, self._dir, config, record, saved_as, expected_config, match_keys)
            if problem:
                raise CheckpointMismatchError(problem)
            # 3. The arrays, into the abstract target (after one cheap read of the array database's index).
            state = self._read_arrays(reader, n, saved_as)
        # 4. Recompute digests.
        bad, unverified = verify(state, record)
        if bad:
            raise _Unusable(bad)
        if unverified:
            warnings.warn(
                f"checkpoint step {n} in {self._dir}: {len(unverified)} leaves could not be verified on this shard "
                f"layout (saved with another one): {unverified[:5]}", stacklevel=2)
        return with_counter(state, target), config

    @staticmethod
    def _read_arrays(reader: storage.Reader, n: int, target) -> TrainState:
        """Step `n`'s arrays restored into `target`, not yet verified; raises `_Unusable`."""
        try:
            reader.check_array_index(n)
        except storage.ArrayIndexMissing as err:
            raise _Unusable(f"its array index ({err}) is missing") from None
        except storage.ReadError as err:
            raise _Unusable(f"its array index is unreadable: {err}") from None
        try:
            return reader.read_state(n, target)
        except storage.ReadError as err:
            raise _Unusable(f"orbax could not restore the arrays: {err}") from None

    @staticmethod
    def _read_meta(reader: storage.Reader, n: int, *, with_metrics: bool = True) -> tuple[dict, dict]:
        """Step `n`'s config and integrity record, both verified (no array is read); with `with_metrics`, the
        metrics copy too, when the record lists one (a damaged copy makes the step unusable, as any other damaged
        file does). Raises `_Unusable`."""
        try:
            config, record = reader.read_settings(n)
        except storage.ReadError as err:
            raise _Unusable(f"cannot read its config/integrity record: {err}") from None
        if (not isinstance(config, dict) or not isinstance(record, dict)
                or record.get("format") not in READABLE_FORMATS):
            raise _Unusable("config or integrity record is missing or not in the expected format")
        if not seal_intact(record):
            raise _Unusable("integrity record does not match its sha256")
        if record.get("config_sha256") != config_digest(config):
            raise _Unusable("config JSON does not match its sha256")
        if with_metrics and "metrics_sha256" in record:
            Checkpointer._read_metrics_item(reader, n, record)
        return config, record

    @staticmethod
    def _read_metrics_item(reader: storage.Reader, n: int, record: dict) -> list:
        """Step `n`'s metrics copy, verified against `record`; raises `_Unusable`."""
        try:
            metrics = reader.read_metrics(n)
        except storage.ReadError as err:
            raise _Unusable(f"cannot read its metrics copy: {err}") from None
        if not isinstance(metrics, list) or config_digest(metrics) != record["metrics_sha256"]:
            raise _Unusable("metrics copy does not match its sha256")
        return metrics

    def read_settings(self, step: int | None = None) -> tuple[dict, dict] | None:
        """The config and integrity record of a step, verified against their digests, without reading any array.

        Args:
          step: the step to read; default: the newest on disk.

        Returns:
          `(config, record)`, or None when there is no such step or it cannot be read (`restore` then reports it).
          `record["policy"]` is the saved policy's name (`policy_name`), `record["loss_scale"]` its loss scale's
          type and hyperparameters (`loss_scale_from_record` builds one).
        """
        step = self.latest_step() if step is None else step
        if step is None or not (self._dir / str(step)).is_dir():
            return None
        self.wait()
        with storage.Reader(self._dir) as reader:
            try:
                return self._read_meta(reader, step, with_metrics=False)
            except _Unusable:
                return None

    def metrics(self, step: int) -> list | None:
        """The `metrics` list saved with a step, verified against its sha256.

        Args:
          step: a step on disk.

        Returns:
          The list, or None when the step holds none.

        Raises:
          CheckpointError: the step is not on disk, or its record or metrics copy is unreadable or damaged.
        """
        if int(step) not in self.steps():
            raise CheckpointError(f"no checkpoint step {step} in {self._dir}; steps on disk: {self.steps()}")
        with storage.Reader(self._dir) as reader:
            try:
                _, record = self._read_meta(reader, int(step), with_metrics=False)
                return self._read_metrics_item(reader, int(step), record) if "metrics_sha256" in record else None
            except _Unusable as err:
                raise CheckpointError(f"checkpoint step {step} in {self._dir} is unusable ({err})") from None
