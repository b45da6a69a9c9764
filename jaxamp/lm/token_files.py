"""nanoGPT's prepared datasets: a directory with ``train.bin``, ``val.bin`` and, for characters, ``meta.pkl``.

nanoGPT's ``data/*/prepare.py`` scripts (https://github.com/karpathy/nanoGPT) write each split as one flat array of
little-endian ``uint16`` token ids (``np.array(ids, dtype=np.uint16).tofile(...)``): OpenWebText and shakespeare in
GPT-2's BPE (no ``meta.pkl``: the vocabulary is GPT-2's 50257 ids, which nanoGPT pads to 50304), shakespeare_char in
characters, with ``meta.pkl`` = ``{"vocab_size": int, "itos": {int: str}, "stoi": {str: int}}``.

Other writers use ``uint32`` for vocabularies above 65,535 (e.g. princeton-nlp/LLM-Shearing): ``--token-dtype
uint32`` (``token_dtype="uint32"``) reads those. The default, ``auto``, reads ``uint16`` and never guesses ``uint32``:
a file that shows it is not ``uint16`` is refused in one line naming ``--token-dtype uint32`` (the rule:
:func:`uint32_signature`), as is a ``meta.pkl`` whose ``vocab_size`` is above 65,536.

The files are opened as :class:`jaxamp.lm.data.TokenFile` (a memmap per batch), never read whole: OpenWebText's train
split is about 9e9 tokens (17 GB). The corpus checksum covers each file's size, its token dtype (for ``uint32``) and a
fixed sample of blocks; the same blocks are checked for ids outside the vocabulary and for the ``uint32`` signature
(and each batch is checked again as it is gathered).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
from pathlib import Path

import numpy as np

from jaxamp.lm.data import CharTokenizer, DataError, TokenFile

__all__ = ["GPT2_VOCAB_SIZE", "TOKEN_DTYPES", "TokenDir", "open_token_dir", "token_file", "read_meta", "write_tokens",
           "fingerprint", "uint32_signature"]

GPT2_VOCAB_SIZE = 50304  # GPT-2's 50257 BPE ids padded up to a multiple of 64 (nanoGPT's default vocab_size)
SPLITS = ("train.bin", "val.bin")
TOKEN_DTYPES = ("auto", "uint16", "uint32")  # --token-dtype: auto reads uint16 and refuses files that are not
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # little-endian, as numpy's tofile on x86 and ARM
_MAX_VOCAB = 2**16  # ids a uint16 file can hold; a larger meta.pkl vocab_size is refused for uint16
_MAX_VOCAB_UINT32 = 2**24  # a larger meta.pkl vocab_size is refused for uint32 too (a damaged one: an embedding OOM)
_SIGNATURE_PAIRS = 1000  # sampled positions of each parity below which the uint32 signature is not judged
_SIGNATURE_LOW_SHARE = 0.05  # share of even positions that must look like ids, not high halves
_BLOCKS = 32  # blocks hashed (and checked for out-of-vocabulary ids) per file
_BLOCK_BYTES = 256 * 1024  # bytes per block: files up to 8 MiB are hashed and checked whole
_META_MAX_BYTES = 16 * 2**20  # a larger meta.pkl is refused unread (nanoGPT's is a few kB)
_FINGERPRINT_VERSION = b"jaxamp token files v1\n"


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDir:
    """An opened nanoGPT data directory.

    Attributes:
        train: ``u16[n_train]`` (or ``u32``) ``train.bin``, read by memmap per batch.
        val: ``u16[n_val]`` (or ``u32``) ``val.bin``.
        vocab_size: Ids per token (embedding rows): ``--vocab-size``, else ``meta.pkl``'s, else 50304.
        tokenizer: The character vocabulary of ``meta.pkl`` (for decoding samples), or None.
        sha256: Hex digest over both files' sizes and sampled blocks (:func:`fingerprint`).
    """

    train: TokenFile
    val: TokenFile
    vocab_size: int
    tokenizer: CharTokenizer | None
    sha256: str


def open_token_dir(directory: str | os.PathLike[str], *, vocab_size: int | None, seq_len: int,
                   token_dtype: str = "auto") -> TokenDir:
    """Opens ``directory/train.bin`` and ``val.bin`` (nanoGPT's layout) without reading them whole.

    Args:
        directory: The data directory.
        vocab_size: ``--vocab-size``, or None for ``meta.pkl``'s (or 50304 without one).
        seq_len: Tokens per sequence; each split needs ``seq_len + 1``.
        token_dtype: One of ``TOKEN_DTYPES``: ``uint16`` (nanoGPT's), ``uint32``, or ``auto`` = ``uint16``, with the
            same refusals (``auto`` never picks ``uint32`` by itself: say so with ``uint32``).

    Returns:
        The opened directory.

    Raises:
        DataError: An unknown ``token_dtype``; a missing split, a file whose byte length is not a whole number of
            ids or too short for ``seq_len``; an unreadable ``meta.pkl`` (or, for ``uint16``, one with a
            ``vocab_size`` above 65,536) while no ``vocab_size`` is given; an id ``>= vocab_size`` in the sampled
            blocks; or, for ``uint16``, a file showing the uint32 signature (:func:`uint32_signature`). Nothing is
            written.
    """
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"--token-dtype must be one of {', '.join(TOKEN_DTYPES)}, got {token_dtype!r}")
    dtype = "uint32" if token_dtype == "uint32" else "uint16"
    directory = Path(directory)
    files = [token_file(directory, name, seq_len, dtype) for name in SPLITS]
    meta = None
    if (directory / "meta.pkl").exists():
        try:
            meta = read_meta(directory / "meta.pkl", dtype)
        except DataError:
            if vocab_size is None:
                raise
    if vocab_size is None:
        vocab_size = meta["vocab_size"] if meta is not None else GPT2_VOCAB_SIZE
    digest = hashlib.sha256(_FINGERPRINT_VERSION)
    for file in files:
        digest.update(fingerprint(file, vocab_size))
    return TokenDir(files[0], files[1], vocab_size, _char_tokenizer(meta), digest.hexdigest())


def token_file(directory: Path, name: str, seq_len: int, dtype: str = "uint16") -> TokenFile:
    """``directory/name`` as a :class:`TokenFile`, after checking its size (nothing else is read).

    Args:
        directory: The data directory.
        name: ``train.bin`` or ``val.bin``.
        seq_len: Tokens per sequence; the file needs ``seq_len + 1``.
        dtype: ``uint16`` (nanoGPT's) or ``uint32``: the ids' width.

    Returns:
        The token file (``u16[size / 2]`` or ``u32[size / 4]``).

    Raises:
        DataError: The file is missing, its byte length is not a multiple of the id's width, or it holds fewer than
            ``seq_len + 1`` tokens.
    """
    path = directory / name
    if not path.is_file():
        raise DataError(f"{path} not found: nanoGPT's prepare.py writes {' and '.join(SPLITS)} side by side in "
                        f"--data DIR; run it, or pass a text file")
    size, width = path.stat().st_size, _DTYPES[dtype].itemsize
    if size % width and dtype == "uint16":
        raise DataError(f"{path} has an odd length ({size:,} bytes), but it should hold uint16 token ids of 2 bytes "
                        f"each (nanoGPT's format); the file is truncated or was written in another format")
    if size % width:
        raise DataError(f"{path} has {size:,} bytes, not a multiple of 4, so it cannot hold the uint32 token ids of "
                        f"--token-dtype uint32; the file is truncated, or drop --token-dtype for nanoGPT's uint16")
    n = size // width
    if n < seq_len + 1:
        raise DataError(f"{path} holds {n:,} tokens, but seq_len={seq_len} needs at least {seq_len + 1}; use more "
                        f"data or a smaller --seq-len")
    return TokenFile(path, n, _DTYPES[dtype].str)


def fingerprint(file: TokenFile, vocab_size: int) -> bytes:
    """Digest of a token file's size, dtype and ``_BLOCKS`` evenly spaced blocks; checks those blocks' ids.

    Reads at most ``_BLOCKS * _BLOCK_BYTES`` bytes (8 MiB) with plain reads (no memmap), so a 17 GB file costs
    what a small one does; a file no larger is read whole. A ``uint16`` file's digest is what it was before
    ``uint32`` files were read (its header names no dtype), so checkpoints of earlier runs still match; a ``uint32``
    file's names its dtype, so the same bytes read as other ids never match a checkpoint of the first reading.

    Args:
        file: The token file (``file.dtype`` little-endian ``uint16`` or ``uint32``).
        vocab_size: Every id read must be below it.

    Returns:
        The 32-byte sha256 digest.

    Raises:
        DataError: For ``uint16``, the sampled blocks show the uint32 signature (:func:`uint32_signature`; judged
            first, since its ids would also look out of the vocabulary); an id ``>= vocab_size`` in a sampled
            block (names the id and its position).
    """
    dtype = np.dtype(file.dtype)
    size = file.length * dtype.itemsize
    header = f"{file.path.name} {size}\n" if dtype.itemsize == 2 else f"{file.path.name} {size} {dtype.name}\n"
    digest = hashlib.sha256(header.encode())
    stats = _SignatureStats()
    bad = None  # (id, token index) of the first id >= vocab_size
    with open(file.path, "rb") as f:
        for start in _block_starts(size, dtype.itemsize):
            f.seek(start)
            block = f.read(_BLOCK_BYTES)
            digest.update(block)
            ids = np.frombuffer(block, dtype=dtype)  # u16[<= _BLOCK_BYTES / 2] or u32[<= _BLOCK_BYTES / 4]
            first = start // dtype.itemsize  # the token index of ids[0]
            if dtype.itemsize == 2:
                stats.add(ids, first, vocab_size)
            if bad is None and ids.size and ids.max() >= vocab_size:
                i = int(np.argmax(ids >= vocab_size))
                bad = int(ids[i]), first + i
    if dtype.itemsize == 2 and size % 4 == 0 and stats.matches():
        raise DataError(f"{file.path} does not hold uint16 token ids: read as uint16, all {stats.odd:,} sampled "
                        f"odd-position values are <= {stats.high} while {stats.even_above:,} of {stats.even:,} "
                        f"even-position ones are above it, which is how uint32 ids read as uint16 look (each id's high "
                        f"half); pass --token-dtype uint32")
    if bad is not None:
        raise DataError(f"{file.path} holds token id {bad[0]} at token {bad[1]:,}, but the vocabulary has "
                        f"{vocab_size} ids; pass --vocab-size above {bad[0]} (or check meta.pkl)")
    return digest.digest()


def uint32_signature(ids, vocab_size: int) -> bool:
    """Whether ``ids``, read as ``uint16`` from token 0 of a file, look like ``uint32`` ids below ``vocab_size``.

    A little-endian ``uint32`` id ``v`` read as two ``uint16`` is ``(v & 0xFFFF, v >> 16)``: at every odd position the
    high half, at most ``high = (vocab_size - 1) >> 16`` (0 for a vocabulary of up to 65,536 ids, 1 up to 131,072).
    The rule, judged on the blocks the fingerprint samples (token positions counted from the file's start): at least
    ``_SIGNATURE_PAIRS`` (1,000) odd and 1,000 even positions sampled, every odd-position value ``<= high``, and at
    least ``_SIGNATURE_LOW_SHARE`` (5%) of the even-position values ``> high``; :func:`fingerprint` also requires the
    byte size to be a multiple of 4, as a uint32 file's is.

    False positives: real uint16 token streams have no parity, so for a file to match, a value ``<= high`` (token 0,
    for a vocabulary up to 65,536) must sit at every one of >= 1,000 sampled odd positions (all of a file up to
    8 MiB; 32 blocks of 128Ki tokens spread over a larger one) and at none of >= 5% of the even ones. Even where token 0
    is 90% of the data (padding), independent positions match with probability 0.9**1000 ~ 1e-46; runs of padding
    zero both parities, so they never make the odd positions alone zero. Only a stream that strictly alternates
    ``x, 0, y, 0, ...`` over the whole sample matches, which is what uint32 ids read as uint16 are; files under
    2,000 tokens are not judged.

    Args:
        ids: ``u16[n]`` ids from token 0 of a file.
        vocab_size: The vocabulary the ids should be below.

    Returns:
        True where the file should be read as uint32.
    """
    stats = _SignatureStats()
    stats.add(np.asarray(ids), 0, vocab_size)
    return stats.matches()


class _SignatureStats:
    """Counts, over the sampled blocks, of what :func:`uint32_signature` judges."""

    def __init__(self) -> None:
        self.high = 0  # the largest high half an id below the vocabulary has
        self.odd = self.even = self.even_above = 0
        self.odd_max = 0

    def add(self, ids: np.ndarray, first: int, vocab_size: int) -> None:
        """Adds ``ids``, whose ``ids[0]`` is token ``first`` of the file."""
        self.high = (max(vocab_size, 1) - 1) >> 16
        even, odd = ids[first % 2::2], ids[1 - first % 2::2]
        self.odd += odd.size
        self.even += even.size
        if odd.size:
            self.odd_max = max(self.odd_max, int(odd.max()))
        self.even_above += int(np.count_nonzero(even > self.high))

    def matches(self) -> bool:
        return (self.odd >= _SIGNATURE_PAIRS and self.even >= _SIGNATURE_PAIRS and self.odd_max <= self.high
                and self.even_above >= _SIGNATURE_LOW_SHARE * self.even)


def _block_starts(size: int, width: int = 2) -> list[int]:
    """Byte offsets (multiples of the id's width) of the sampled blocks: the whole file in order if small, else first
    to last evenly. For width 2 they are what they were before uint32 files were read."""
    if size <= _BLOCKS * _BLOCK_BYTES:
        return list(range(0, size, _BLOCK_BYTES))
    last = size - _BLOCK_BYTES
    return [(last * i // (_BLOCKS - 1)) // width * width for i in range(_BLOCKS)]


class _PlainUnpickler(pickle.Unpickler):
    """Builds only pickle's own types (dict, list, str, int, ...): any class or function reference is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


def read_meta(path: str | os.PathLike[str], dtype: str = "uint16") -> dict:
    """Reads nanoGPT's ``meta.pkl`` safely: no class or function is ever loaded, only plain values.

    Args:
        path: The file.
        dtype: The token files' ``uint16`` or ``uint32``: ``vocab_size`` may be up to 65,536, or up to 2**24 (a
            larger one is a damaged file, whose embedding would not fit in memory).

    Returns:
        ``{"vocab_size": int, "itos": {int: str} or None}``; other keys are ignored.

    Raises:
        DataError: If the file is larger than 16 MiB, not a pickle of plain values (e.g. it names a class), not a
            dict with an int ``vocab_size`` in [1, 65536] (uint16; the message then names ``--token-dtype uint32``)
            or [1, 2**24] (uint32), or has an ``itos`` that is not ``{int: str}``; the message asks for
            ``--vocab-size``.
    """
    path = Path(path)
    fix = "pass --vocab-size N to ignore it"
    try:
        with open(path, "rb") as f:
            raw = f.read(_META_MAX_BYTES + 1)
    except OSError as err:
        raise DataError(f"cannot read {path} ({err.strerror}); {fix}") from None
    if len(raw) > _META_MAX_BYTES:
        raise DataError(f"{path} is larger than nanoGPT's meta.pkl can be (over {_META_MAX_BYTES:,} bytes); {fix}")
    try:
        meta = _PlainUnpickler(io.BytesIO(raw)).load()
    except Exception as err:  # noqa: BLE001 - any unpickling failure is one bad file
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{path} is not nanoGPT's plain meta.pkl ({why}); {fix}") from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if type(vocab) is not int or vocab < 1:  # noqa: E721 - bool is not a vocabulary size
        raise DataError(f"{path} has no integer vocab_size >= 1 (nanoGPT writes {{'vocab_size': ..., 'itos': ..., "
                        f"'stoi': ...}}); {fix}")
    if dtype == "uint16" and vocab > _MAX_VOCAB:
        also = ("; if train.bin and val.bin hold uint32 ids pass --token-dtype uint32, else "
                if vocab <= _MAX_VOCAB_UINT32 else "; ")
        raise DataError(f"{path} has vocab_size {vocab:,}, more than uint16 token ids can address ({_MAX_VOCAB:,})"
                        f"{also}{fix}")
    if vocab > _MAX_VOCAB_UINT32:
        raise DataError(f"{path} has vocab_size {vocab:,}, more than the {_MAX_VOCAB_UINT32:,} ids read from uint32 "
                        f"token files (its embedding would not fit in memory); {fix}")
    itos = meta.get("itos")
    if itos is not None and not (isinstance(itos, dict) and all(
            type(k) is int and isinstance(v, str) for k, v in itos.items())):  # noqa: E721
        raise DataError(f"{path}: itos is not a dict of int to str; {fix}")
    return {"vocab_size": vocab, "itos": itos}


def _char_tokenizer(meta: dict | None) -> CharTokenizer | None:
    """meta.pkl's vocabulary as a CharTokenizer when it is nanoGPT's (sorted distinct characters, ids 0..n-1)."""
    itos = None if meta is None else meta["itos"]
    if not itos or sorted(itos) != list(range(len(itos))) or any(len(itos[i]) != 1 for i in itos):
        return None
    try:
        return CharTokenizer("".join(itos[i] for i in range(len(itos))))
    except ValueError:
        return None


def write_tokens(path: str | os.PathLike[str], ids, dtype: str = "uint16") -> None:
    """Writes ids as nanoGPT does: raw little-endian ``uint16`` (or ``uint32``).

    Args:
        path: The file to write (replaced if present).
        ids: ``int[n]`` ids in ``[0, 65535]`` (``uint32``: ``[0, 2**32 - 1]``).
        dtype: ``uint16`` or ``uint32``.

    Raises:
        ValueError: An unknown dtype, or an id outside its range.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be uint16 or uint32, got {dtype!r}")
    ids, top = np.asarray(ids), np.iinfo(_DTYPES[dtype]).max
    if ids.size and (ids.min() < 0 or ids.max() > top):
        raise ValueError(f"token ids must lie in [0, {top}] for {dtype} files, got [{ids.min()}, {ids.max()}]")
    ids.astype(_DTYPES[dtype]).tofile(path)
