"""Failures of orbax-checkpoint and tensorstore, told in one line: the short text of an error and the operating-system
error behind a failed save, and the filters that keep the libraries' own reports of a failure (logged from their
background threads, hundreds of lines with tracebacks) off stderr. Why each report is dropped is told in
`jaxamp.checkpoint`'s module docstring ("orbax pitfalls"); `JAXAMP_ORBAX_LOGS=1` keeps them all.

It imports orbax and tensorstore only to find their source folders (the log records and unraisable reports dropped
are those raised from files there) and calls nothing in them: every orbax and tensorstore call of the package is in
`jaxamp.checkpoint_storage` (tests/test_checkpoint.py checks that no other module imports them).
"""

from __future__ import annotations

import atexit
import errno as errno_codes
import gc
import inspect
import logging
import os
import re
import sys
import warnings

import orbax.checkpoint as ocp
import tensorstore as ts

__all__ = ["after_failed_save", "os_errno", "quiet_library_failures", "save_reason", "short_error"]

_MAX_REASON = 400

def short_error(err: BaseException) -> str:
    """One line: the exception's type and message, without TensorStore's spec dump, at most _MAX_REASON chars."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


_OS_ERROR_RE = re.compile(r"\[os_error_code='?(\d+)'?\]|\[Errno (\d+)\]")


def os_errno(err: BaseException) -> int | None:
    """The operating-system error behind `err` (its own errno, one in its cause chain, or tensorstore's
    `[os_error_code=N]` in a message), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno:
            return err.errno
        match = _OS_ERROR_RE.search(str(err))
        if match:
            return int(match.group(1) or match.group(2))
        err = err.__cause__ or err.__context__
    return None


def save_reason(err: BaseException) -> tuple[str, int | None]:
    """One line for a failed save: the OS error's text when there is one (e.g. "No space left on device", which
    tensorstore's messages bury after two file paths), else `short_error(err)`."""
    code = os_errno(err)
    if code is None:
        return short_error(err), None
    name = errno_codes.errorcode.get(code, str(code))
    return f"{os.strerror(code)} ({name})", code


# ---------------------------------------------------------------------------------------------------------------
# orbax's and tensorstore's reports of failures in their background threads.

_VERBOSE_ENV = "JAXAMP_ORBAX_LOGS"  # "1": leave orbax's and tensorstore's failure reports on stderr
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (ocp, ts))


def _mentions_library(record: logging.LogRecord) -> bool:
    if record.pathname.startswith(_LIBRARY_DIRS) or any(d in record.getMessage() for d in _LIBRARY_DIRS):
        return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
            return True
        tb = tb.tb_next
    return False


class _LibraryFailureFilter(logging.Filter):
    """Drops error records that orbax logs from its threads when a save or read fails (each with a traceback, and
    one per thread), and asyncio's "Task exception was never retrieved" reports of orbax's failed tasks. The
    failure itself reaches the caller as a CheckpointError; these would only repeat it, hundreds of lines long.
    Also drops the two warnings orbax logs for every read-only manager (one per restore), which say nothing, and
    the one it logs, per manager, for each step folder without its metadata file (an old step whose deletion was
    cut short: restores never reach it; a damaged newest step is reported by `restore` itself), and its note, at
    every save, that waiting for the previous one took over a second (`save` says so once)."""

    _HARMLESS = ("Given directory is read only", "CheckpointManagerOptions.read_only=True",
                 "Metadata file does not exist", "Waiting for previous save to complete took")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            debris = _SAVE_FAILED and record.name == "asyncio" and "exception was never retrieved" in str(record.msg)
            return not (debris or _mentions_library(record))
        return not (record.pathname.startswith(_LIBRARY_DIRS) and str(record.msg).startswith(self._HARMLESS))


_FAILURE_FILTER = _LibraryFailureFilter()
_SAVE_FAILED = False  # set by the first failed save of the process: see after_failed_save


def after_failed_save() -> None:
    """A failed save leaves orbax's futures and coroutines behind; collected later (often at exit, after the error
    line), they report "Future exception was never retrieved" (asyncio's logger, with no trace of orbax in the
    record) and "coroutine '...write_fragment' was never awaited" (a RuntimeWarning). The save's failure was raised
    already: from now on both are dropped, for the process."""
    global _SAVE_FAILED
    if os.environ.get(_VERBOSE_ENV) == "1":
        return
    if not _SAVE_FAILED:
        atexit.register(_drop_abandoned_coroutines)
    _SAVE_FAILED = True
    _ignore_unawaited()


def _ignore_unawaited() -> None:
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


def _drop_abandoned_coroutines() -> None:
    """At exit, after a failed save: the filter again (a caller's `warnings.catch_warnings()` block around the save
    drops it when it ends), then the library's coroutines that never started collected or closed now, while it
    holds, rather than in the interpreter's teardown ("sys:1: RuntimeWarning: coroutine 'async_serialize_from_host.
    <locals>.write_fragment' was never awaited", seen once in four CI runs)."""
    _ignore_unawaited()
    gc.collect()
    for obj in gc.get_objects():
        if inspect.iscoroutine(obj) and inspect.getcoroutinestate(obj) == inspect.CORO_CREATED \
                and obj.cr_code.co_filename.startswith(_LIBRARY_DIRS):
            obj.close()


def _closed_loop_wakeup(unraisable) -> bool:
    """tensorstore's callbacks waking an asyncio loop that orbax already closed after a failure."""
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


def _abandoned_library_coroutine(unraisable) -> bool:
    """A coroutine of a failed orbax read, left suspended and collected later ("Exception ignored in: <coroutine
    object _read_array_index_and_device_put ...>" and its traceback, one per array): the failure was reported."""
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and code.co_filename.startswith(_LIBRARY_DIRS)


def quiet_library_failures() -> None:
    """Keeps orbax's and tensorstore's failure reports from background threads off stderr, for the process
    (idempotent). Set JAXAMP_ORBAX_LOGS=1 to see them."""
    if os.environ.get(_VERBOSE_ENV) == "1":
        return
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _FAILURE_FILTER not in logger.filters:
            logger.addFilter(_FAILURE_FILTER)
    if getattr(sys.unraisablehook, "_jaxamp_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (_closed_loop_wakeup(unraisable) or _abandoned_library_coroutine(unraisable)):
            previous(unraisable)

    hook._jaxamp_quiet = True
    sys.unraisablehook = hook
