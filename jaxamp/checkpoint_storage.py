"""Storage of `jaxamp.checkpoint`: every orbax-checkpoint and tensorstore call of the package, behind a narrow
interface (the one other module that imports them, `jaxamp.checkpoint_quiet`, only filters their logs).

`jaxamp.checkpoint.Checkpointer` decides what to save, verifies what it reads, falls back to older steps and words
the messages; this module only writes and reads the items of a step folder and lists the folders:

- listing: `step_numbers`, `interrupted_steps` and `stray_entries` (orbax's folder names: `N/` for a committed
  step, `N.orbax-checkpoint-tmp-*` for a save in progress or cut short, `metadata/` for its root metadata);
- `Writer`: one `ocp.CheckpointManager` that saves a step's items together (`save`, `wait_until_finished`,
  `close`); library errors reach the caller unchanged, so it can find the operating-system error in their chain;
- `Reader`: a fresh read-only manager per step attempt (`read_settings`, `read_metrics`, `check_array_index`,
  `read_state`); every failed read raises `ReadError` in one line;
- `restore_target`: the abstract target with a sharding on every leaf.

Items and their formats (they must stay as they are: checkpoints written earlier are read with them): `state` in
orbax's standard format (`ocp.args.StandardSave`, an OCDBT array database), `config`, `integrity` and `metrics`
as JSON (`ocp.args.JsonSave`), with orbax's default step folder names. Written for orbax-checkpoint 0.12.8 and
tensorstore 0.1.86 (`jaxamp.checkpoint`'s module docstring lists the orbax pitfalls avoided here).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxamp.checkpoint_quiet import short_error

__all__ = ["ITEMS", "ArrayIndexMissing", "ReadError", "Reader", "Writer", "interrupted_steps", "restore_target",
           "step_numbers", "stray_entries"]

ITEMS = ("state", "config", "integrity", "metrics")  # a step folder's items (`metrics` only when saved)
_STEP_RE = re.compile(r"^\d+$")
_TMP_RE = re.compile(r"^\d+\.orbax-checkpoint-tmp.*$")
_ROOT_ENTRIES = frozenset({"metadata"})  # orbax's root metadata folder (written only with custom metadata)


class ReadError(Exception):
    """Reading an item of a step failed; `str()` is one line: the library's error type and message, shortened."""


class ArrayIndexMissing(ReadError):
    """The step's array database has data but no index; `str()` is the index file's path in the step folder."""


# -- listing -------------------------------------------------------------------------------------------------------


def step_numbers(directory: Path) -> list[int]:
    """The committed step folders (`N/`) in `directory`, ascending; [] when it is not a directory."""
    if not directory.is_dir():
        return []
    return sorted(int(e) for e in os.listdir(directory) if _STEP_RE.match(e) and (directory / e).is_dir())


def interrupted_steps(directory: Path) -> list[int]:
    """Steps with an `N.orbax-checkpoint-tmp-*` folder (a save in progress or cut short), ascending."""
    if not directory.is_dir():
        return []
    return sorted({int(e.split(".", 1)[0]) for e in os.listdir(directory) if _TMP_RE.match(e)})


def stray_entries(directory: Path) -> list[str]:
    """The entries of an existing `directory` that orbax did not write, sorted, folders ending in "/".

    A step-like name that vanished since the listing is orbax's: a tmp folder renamed by a committing process.
    """
    stray = []
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        ours = _STEP_RE.match(entry) or _TMP_RE.match(entry) or entry in _ROOT_ENTRIES
        if ours and (path.is_dir() or not path.exists()):
            continue
        stray.append(entry + ("/" if path.is_dir() else ""))
    return stray


# -- writing -------------------------------------------------------------------------------------------------------


class Writer:
    """Saves steps into `directory` (created if missing) through one orbax `CheckpointManager`.

    When created it starts removing the tmp folders of interrupted saves in the background (close one Writer
    before creating the next for the same directory: two at once race). After `keep` steps exist, orbax deletes
    the oldest once a new one is complete. Its step list is cached: use a new Writer after folders changed by hand.

    Args:
      directory: the checkpoint folder.
      keep: orbax's `max_to_keep`.
      async_save: write in orbax's background thread (`save` returns after the device-to-host copy).
    """

    def __init__(self, directory: Path, *, keep: int, async_save: bool):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
            lightweight_initialize=True,  # orbax would parse each step's "metrics" item: a damaged one raised
        )
        self._manager = ocp.CheckpointManager(directory, options=options, item_names=ITEMS)

    def save(self, step: int, *, state, config: dict, integrity: dict, metrics: list | None = None,
             force: bool = False) -> bool:
        """Starts writing step `step`'s items (`metrics` only when given) into `N.orbax-checkpoint-tmp-*`, renamed
        to `N/` once complete.

        Returns:
          orbax's answer: False when it skipped the step (not newer than its newest step, or its save-interval
          policy, unless `force`).

        Raises:
          Exception: whatever orbax raises (OSError, ValueError, RuntimeError, ...), with its cause chain.
        """
        items = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config),
                 "integrity": ocp.args.JsonSave(integrity)}
        if metrics is not None:
            items["metrics"] = ocp.args.JsonSave(metrics)
        return bool(self._manager.save(step, args=ocp.args.Composite(**items), force=force))

    def wait_until_finished(self) -> None:
        """Blocks until the background save is written, committed and old steps deleted.

        Raises:
          Exception: whatever the background thread raised.
        """
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the background save and releases orbax's threads; raises a failed save's error again."""
        self._manager.close()


# -- reading -------------------------------------------------------------------------------------------------------


class Reader:
    """Reads the items of steps in `directory` through a fresh read-only orbax `CheckpointManager`.

    Use one Reader per step attempt: after a failed restore orbax's manager refuses good steps too. Nothing is
    written. A context manager (closes the manager).
    """

    def __init__(self, directory: Path):
        self._dir = directory
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False,
                                               lightweight_initialize=True)  # see Writer
        self._manager = ocp.CheckpointManager(directory, options=options, item_names=ITEMS)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._manager.close()

    def _restore(self, step: int, **args):
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as err:  # noqa: BLE001 - orbax raises anything from KeyError to bare Exception
            raise ReadError(short_error(err)) from None

    def read_settings(self, step: int) -> tuple:
        """`(config, integrity)`: the two JSON items as stored (not checked; no array is read).

        Raises:
          ReadError: either item is missing or unreadable.
        """
        meta = self._restore(step, config=ocp.args.JsonRestore(), integrity=ocp.args.JsonRestore())
        return meta.config, meta.integrity

    def read_metrics(self, step: int):
        """The `metrics` JSON item as stored (not checked).

        Raises:
          ReadError: the item is missing or unreadable.
        """
        return self._restore(step, metrics=ocp.args.JsonRestore()).metrics

    def check_array_index(self, step: int) -> None:
        """Lists the keys of the `state` item's OCDBT array database (its manifest and b-tree nodes).

        Run before `read_state`: when the index itself is damaged, each of orbax's concurrent array reads fails
        and tensorstore prints a "RuntimeError: Event loop is closed" traceback for every one still pending after
        orbax closes its event loop (hundreds of lines for one bad file). This one read fails quietly instead. An
        item in another format (no OCDBT files) is left to `read_state`.

        Raises:
          ArrayIndexMissing: data files without `state/manifest.ocdbt`.
          ReadError: the index is unreadable.
        """
        item_dir = self._dir / str(step) / ITEMS[0]
        if not (item_dir / "manifest.ocdbt").exists():
            if (item_dir / "d").exists() or any(item_dir.glob("ocdbt.process_*")):
                raise ArrayIndexMissing(f"{item_dir.name}/manifest.ocdbt")
            return
        try:
            store = ts.KvStore.open({"driver": "ocdbt", "base": item_dir.resolve().as_uri() + "/"}).result()
            store.list().result()
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError with a DATA_LOSS status and others
            raise ReadError(short_error(err)) from None

    def read_state(self, step: int, target):
        """The `state` item restored into `target` (see `restore_target`): its structure, dtypes and shardings.

        orbax casts to the target's dtypes silently and has no checksums: compare dtypes and shapes before, and
        digests after.

        Raises:
          ReadError: orbax could not restore the arrays (missing, truncated or undecodable data).
        """
        return self._restore(step, state=ocp.args.StandardRestore(target)).state


def restore_target(abstract_state):
    """`abstract_state` with the default device's sharding on leaves that have none, so orbax never falls back to
    the saved topology (it may not exist here), as `jax.ShapeDtypeStruct`s.

    Raises:
      ValueError: a leaf has no shape or dtype.
    """
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def fix(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"abstract_state leaves must be jax.ShapeDtypeStruct (or arrays), got {type(x)}")
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if sharding is not None else device)

    return jax.tree.map(fix, abstract_state)
