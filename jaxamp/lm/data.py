"""Character-level text data whose batches are a pure function of (seed, step).

The tokenisation and the train/validation split follow nanoGPT's
``data/shakespeare_char/prepare.py`` (https://github.com/karpathy/nanoGPT):
the vocabulary is the sorted set of distinct characters of the whole text, the
first 90% of the token ids are the training split and the last 10% the
validation split. Batches are drawn like nanoGPT's ``get_batch`` (random
windows of ``seq_len + 1`` tokens) but from ``np.random.default_rng([seed,
step])``, so the batch at a given step does not depend on what ran before: a
resumed run sees exactly the same batches as an uninterrupted one.

Without a data file the corpus is the Python standard library's own ``.py``
sources, which every machine with Python has, so nothing needs downloading.

Token files (nanoGPT's ``train.bin``/``val.bin``, see :mod:`jaxamp.lm.token_files`)
are passed to :func:`batch_at` as a :class:`TokenFile`: each batch maps the
file afresh with ``numpy.memmap`` and gathers only its windows, so a file of
billions of tokens is never read whole.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import sysconfig
from pathlib import Path

import numpy as np

__all__ = [
    "DataError",
    "default_corpus_text",
    "load_text",
    "CharTokenizer",
    "CharDataset",
    "TokenFile",
    "batch_at",
    "eval_batches",
]

# Directory names skipped anywhere under the stdlib when building the default corpus.
_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})
# Generated at install time, so their text depends on the install prefix and build flags, not only on the version:
# the build's sysconfig data (`_sysconfigdata_*.py`) and the `config-X.Y-*` directory (python-config.py).
_GENERATED_PREFIXES = ("_sysconfigdata",)
_GENERATED_DIR_PREFIX = "config-"
# Added to the training seed to seed evaluation batches, so they never coincide with training ones.
_EVAL_SEED_OFFSET = 10**6
# Windows gathered per memmap of a TokenFile: each touched window maps its page-cache folio (up to 2 MiB on kernels
# with large folios) into the process until the memmap is dropped, so this bounds the resident set a batch adds.
_WINDOWS_PER_MAP = 8


class DataError(ValueError):
    """A problem with the text data; the message names the culprit and the fix."""


def default_corpus_text(max_bytes: int = 2_000_000) -> str:
    """Returns the default corpus: the Python standard library's ``.py`` sources.

    Files are taken from ``sysconfig.get_paths()["stdlib"]``, skipping any
    directory named ``site-packages``, ``test``, ``tests``, ``idlelib`` or
    ``lib2to3``, and the files generated at install time (``_sysconfigdata*.py``
    and the ``config-*`` directory, whose text depends on the install prefix),
    in the order of their sorted relative POSIX paths. Each is
    read as UTF-8 (files that fail to decode are skipped; no newline
    translation) and they are concatenated until ``max_bytes`` characters are
    collected; the result is truncated to exactly ``max_bytes`` characters if
    longer. The text is the same for every installation of one Python version
    and build (it differs between Python versions).

    Args:
        max_bytes: Maximum length of the corpus in characters (for the
            mostly-ASCII stdlib, about the same number of bytes). Must be >= 1.

    Returns:
        The corpus, ``min(max_bytes, total stdlib source length)`` characters.

    Raises:
        ValueError: If ``max_bytes < 1``.
        DataError: If no readable ``.py`` file is found (e.g. a zipped stdlib).
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith(_GENERATED_DIR_PREFIX)]
        rel_dir = Path(dirpath).relative_to(root)
        rel_paths.extend((rel_dir / f).as_posix() for f in filenames
                         if f.endswith(".py") and not f.startswith(_GENERATED_PREFIXES))
    rel_paths.sort()
    parts: list[str] = []
    total = 0  # characters collected so far
    for rel in rel_paths:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if total == 0:
        raise DataError(
            f"no readable .py files under the standard library directory {root}; "
            f"pass a text file path instead of using the default corpus"
        )
    return "".join(parts)[:max_bytes]


def load_text(path: str | os.PathLike[str] | None) -> str:
    """Loads the training text.

    Args:
        path: A UTF-8 text file, or None for :func:`default_corpus_text`.

    Returns:
        The file's text (no newline translation).

    Raises:
        DataError: If the path does not exist, is a directory, cannot be read,
            is empty, or is not valid UTF-8 (the message gives the byte offset).
    """
    if path is None:
        return default_corpus_text()
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file not found: {p}; pass the path of an existing UTF-8 text file")
    if p.is_dir():
        raise DataError(f"data path is a directory, not a file: {p}; pass the path of a UTF-8 text file inside it")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {p}: {e.strerror}; check its permissions") from e
    if not raw:
        raise DataError(f"data file is empty: {p}; pass a file containing training text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data file is not valid UTF-8: {p} (invalid byte at offset {e.start}); "
            f"convert it to UTF-8, e.g. with iconv"
        ) from e


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Character-level tokenizer (nanoGPT ``shakespeare_char``): token id = index in ``chars``.

    Attributes:
        chars: The vocabulary: distinct characters in sorted (code point) order.

    Raises:
        ValueError: If ``chars`` is empty, unsorted or has duplicates.
    """

    chars: str

    def __post_init__(self) -> None:
        if not self.chars:
            raise ValueError("CharTokenizer.chars is empty; build the tokenizer from a non-empty text")
        if "".join(sorted(set(self.chars))) != self.chars:
            raise ValueError(
                "CharTokenizer.chars must be distinct characters in sorted order; use CharTokenizer.from_text"
            )

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Builds the vocabulary from the distinct characters of ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters (tokens)."""
        return len(self.chars)

    @functools.cached_property
    def _code_points(self) -> np.ndarray:
        """``u32[vocab_size]`` sorted code points of ``chars`` (cached)."""
        return _code_points(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Encodes text.

        Args:
            text: Any string made of vocabulary characters.

        Returns:
            ``i32[len(text)]`` token ids.

        Raises:
            ValueError: If ``text`` contains a character outside the
                vocabulary (the message names the first one and its index).
        """
        cps = _code_points(text)  # u32[len(text)]
        table = self._code_points
        ids = np.searchsorted(table, cps)  # int64[len(text)], in [0, vocab_size]
        ok = table[np.minimum(ids, len(table) - 1)] == cps
        if not ok.all():
            i = int(np.argmin(ok))
            raise ValueError(
                f"character {text[i]!r} (U+{ord(text[i]):04X}) at index {i} is not in the vocabulary; "
                f"build the tokenizer from text that contains it"
            )
        return ids.astype(np.int32)

    def decode(self, ids) -> str:
        """Decodes token ids.

        Args:
            ids: ``int[n]`` (any integer array-like, e.g. a NumPy or JAX array).

        Returns:
            The ``n``-character string.

        Raises:
            ValueError: If an id is outside ``[0, vocab_size)``.
        """
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            return ""
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise ValueError(
                f"token id {int(ids[np.argmax(bad)])} is outside the vocabulary [0, {self.vocab_size})"
            )
        return self._code_points[ids].astype("<u4").tobytes().decode("utf-32-le")


def _code_points(text: str) -> np.ndarray:
    """``u32[len(text)]`` Unicode code points of ``text``."""
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


@dataclasses.dataclass(frozen=True, eq=False)
class CharDataset:
    """Tokenised text split nanoGPT-style into training and validation token arrays.

    Attributes:
        tokenizer: Vocabulary of the whole text.
        train: ``i32[n_train]`` the first ``int(n * (1 - val_fraction))`` token ids.
        val: ``i32[n - n_train]`` the remaining token ids.
    """

    tokenizer: CharTokenizer
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def from_text(cls, text: str, seq_len: int, val_fraction: float = 0.1) -> CharDataset:
        """Tokenises ``text`` and splits it (nanoGPT: ``train = data[:int(n*0.9)]``).

        Args:
            text: The whole corpus.
            seq_len: Context length in tokens the splits must support.
            val_fraction: Fraction of tokens (at the end) held out for validation, in (0, 1).

        Returns:
            The dataset.

        Raises:
            ValueError: If ``seq_len < 1`` or ``val_fraction`` is not in (0, 1).
            DataError: If either split is shorter than ``seq_len + 1`` tokens.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        tokenizer = CharTokenizer.from_text(text)
        data = tokenizer.encode(text)  # i32[n]
        n = len(data)
        split = int(n * (1.0 - val_fraction))
        train, val = data[:split], data[split:]
        for name, part in (("training", train), ("validation", val)):
            if len(part) < seq_len + 1:
                raise DataError(
                    f"corpus too short: {n} characters gives a {name} split of {len(part)} tokens, "
                    f"but seq_len={seq_len} needs at least {seq_len + 1}; "
                    f"use a longer corpus or a smaller --seq-len"
                )
        return cls(tokenizer=tokenizer, train=train, val=val)


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A flat file of little-endian ``uint16`` token ids (nanoGPT's ``train.bin``), or ``uint32`` ones, read through
    ``numpy.memmap``.

    Attributes:
        path: The file.
        length: Number of tokens (the file's size in bytes / the id's width).
        dtype: The ids' numpy dtype: ``"<u2"`` (nanoGPT's) or ``"<u4"``.
    """

    path: Path
    length: int
    dtype: str = "<u2"

    def __len__(self) -> int:
        return self.length

    def open(self) -> np.memmap:
        """A fresh read-only ``u16[length]`` (or ``u32``) memmap of the file; reads nothing yet.

        Dropping its last reference unmaps it, which takes the pages it touched
        out of the process's resident set (nanoGPT re-creates its memmap per
        batch for the same reason), so the resident memory of a long run does
        not grow towards the file's size. The mapping is advised
        ``MADV_RANDOM`` where the OS has it: windows are random, so the kernel
        reads only their pages, with no readahead around them.
        """
        memmap = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.length,))
        raw = getattr(memmap, "_mmap", None)  # numpy's mmap.mmap object (absent for an empty file)
        if raw is not None and hasattr(mmap, "MADV_RANDOM"):
            raw.madvise(mmap.MADV_RANDOM)
        return memmap


def batch_at(
    tokens: np.ndarray | TokenFile, *, seed: int, step: int, batch_size: int, seq_len: int,
    rows: slice | None = None, vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The batch for training step ``step``: a pure function of ``(seed, step)``.

    Draws ``batch_size`` window offsets uniformly from
    ``[0, len(tokens) - seq_len)`` with ``np.random.default_rng([seed, step])``
    (nanoGPT's ``get_batch``) and gathers the windows with one fancy-indexing
    operation (from a :class:`TokenFile`, through fresh memmaps of 8 windows
    each: only the pages of these windows are read, and only those of 8
    windows are mapped at a time).

    Args:
        tokens: ``int[n]`` token ids with ``n >= seq_len + 1`` (an array, a
            ``np.memmap``, or a :class:`TokenFile`).
        seed: Non-negative run seed.
        step: Non-negative step index.
        batch_size: Sequences per batch (>= 1).
        seq_len: Tokens per sequence (>= 1).
        rows: Only these rows of the batch (e.g. one process's part of a
            global batch, see ``jaxamp.sharding.make_global_batch``): the
            same values as ``batch_at(...)[k][rows]``, without gathering the
            other rows. None = all ``batch_size`` rows.
        vocab_size: If given, every gathered id must be below it.

    Returns:
        ``(inputs, targets)``, both ``i32[batch_size, seq_len]`` (or
        ``i32[len(rows), seq_len]``), with
        ``targets[b, t] == inputs[b, t + 1]`` for ``t < seq_len - 1``: each
        target is the token following its input in ``tokens``.

    Raises:
        ValueError: On a negative seed/step, non-positive sizes, or ``tokens``
            that is not 1-D or is shorter than ``seq_len + 1``.
        DataError: If a gathered id is ``>= vocab_size`` (names the file and
            the token's position).
    """
    source = tokens
    tokens = tokens if isinstance(tokens, TokenFile) else np.asanyarray(tokens)
    if isinstance(tokens, np.ndarray) and tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D int[n], got shape {tokens.shape}")
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be non-negative, got seed={seed}, step={step}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got batch_size={batch_size}, seq_len={seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"{len(tokens)} tokens cannot hold a window of seq_len + 1 = {seq_len + 1}; "
            f"use a longer corpus or a smaller seq_len"
        )
    rng = np.random.default_rng([seed, step])
    offsets = rng.integers(0, len(tokens) - seq_len, size=batch_size)  # int64[batch]
    if rows is not None:
        offsets = offsets[rows]  # the same draws as the whole batch, then only these rows gathered
    index = offsets[:, None] + np.arange(seq_len + 1)[None, :]  # int64[batch, seq + 1]
    windows = _gather(tokens, index)  # i64[batch, seq + 1]: a uint32 id is checked before it becomes an int32
    if vocab_size is not None and windows.size and windows.max() >= vocab_size:
        _raise_out_of_vocab(source, windows, index, vocab_size)
    windows = windows.astype(np.int32)  # i32[batch, seq + 1]
    return windows[:, :-1], windows[:, 1:]


def _gather(tokens: np.ndarray | TokenFile, index: np.ndarray) -> np.ndarray:
    """``i64[*index.shape]`` ``tokens[index]``, a plain array; a TokenFile is mapped afresh every 8 rows."""
    if not isinstance(tokens, TokenFile):
        return np.array(tokens[index], dtype=np.int64)
    windows = np.empty(index.shape, np.int64)
    for start in range(0, len(index), _WINDOWS_PER_MAP):
        rows = slice(start, start + _WINDOWS_PER_MAP)
        windows[rows] = tokens.open()[index[rows]]  # the memmap is dropped (unmapped) at once
    return windows


def _raise_out_of_vocab(source, windows: np.ndarray, index: np.ndarray, vocab_size: int) -> None:
    """DataError for the first id ``>= vocab_size`` in ``windows`` (``index`` = their positions in the source)."""
    at = np.unravel_index(np.argmax(windows >= vocab_size), windows.shape)
    where = source.path if isinstance(source, TokenFile) else "the token array"
    raise DataError(
        f"{where} holds token id {int(windows[at])} at token {int(index[at]):,}, but the vocabulary has "
        f"{vocab_size} ids; pass --vocab-size above {int(windows[at])} (or the data's meta.pkl vocabulary)"
    )


def eval_batches(
    tokens: np.ndarray | TokenFile, *, batch_size: int, seq_len: int, num_batches: int, seed: int = 0,
    vocab_size: int | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed list of batches for estimating the validation loss.

    Uses :func:`batch_at` with steps ``0 .. num_batches - 1`` and the seed
    ``seed + 10**6``, so evaluation windows are the same at every evaluation
    and are drawn independently of the training batches.

    Args:
        tokens: ``int[n]`` token ids (normally the validation split), or a :class:`TokenFile`.
        batch_size: Sequences per batch.
        seq_len: Tokens per sequence.
        num_batches: Number of batches (>= 1).
        seed: The run seed.
        vocab_size: If given, every id must be below it (as :func:`batch_at`).

    Returns:
        ``num_batches`` pairs ``(inputs, targets)`` of ``i32[batch_size, seq_len]``.

    Raises:
        ValueError: If ``num_batches < 1`` or as :func:`batch_at`.
        DataError: As :func:`batch_at`.
    """
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    return [
        batch_at(tokens, seed=seed + _EVAL_SEED_OFFSET, step=i, batch_size=batch_size, seq_len=seq_len,
                 vocab_size=vocab_size)
        for i in range(num_batches)
    ]
