"""nanoGPT's prepared datasets: a directory with ``train.bin``, ``val.bin`` and, for characters, ``meta.pkl``.

nanoGPT's ``data/*/prepare.py`` scripts (https://github.com/karpathy/nanoGPT) write each split as one flat array of
little-endian ``uint16`` token ids (``np.array(ids, dtype=np.uint16).tofile(...)``): OpenWebText and shakespeare in
GPT-2's BPE (no ``meta.pkl``: the vocabulary is GPT-2's 50257 ids, which nanoGPT pads to 50304), shakespeare_char in
characters, with ``meta.pkl`` = ``{"vocab_size": int, "itos": {int: str}, "stoi": {str: int}}``.

The files are opened as :class:`jaxamp.lm.data.TokenFile` (a memmap per batch), never read whole: OpenWebText's train
split is about 9e9 tokens (17 GB). The corpus checksum covers each file's size and a fixed sample of blocks; the same
blocks are checked for ids outside the vocabulary (and each batch is checked again as it is gathered).
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

__all__ = ["GPT2_VOCAB_SIZE", "TokenDir", "open_token_dir", "token_file", "read_meta", "write_tokens", "fingerprint"]

GPT2_VOCAB_SIZE = 50304  # GPT-2's 50257 BPE ids padded up to a multiple of 64 (nanoGPT's default vocab_size)
SPLITS = ("train.bin", "val.bin")
_TOKEN_DTYPE = np.dtype("<u2")  # nanoGPT's uint16, little-endian
_MAX_VOCAB = 2**16  # ids a uint16 file can hold; a larger meta.pkl vocab_size is refused
_BLOCKS = 32  # blocks hashed (and checked for out-of-vocabulary ids) per file
_BLOCK_BYTES = 256 * 1024  # bytes per block: files up to 8 MiB are hashed and checked whole
_META_MAX_BYTES = 16 * 2**20  # a larger meta.pkl is refused unread (nanoGPT's is a few kB)
_FINGERPRINT_VERSION = b"jaxamp token files v1\n"


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDir:
    """An opened nanoGPT data directory.

    Attributes:
        train: ``u16[n_train]`` ``train.bin``, read by memmap per batch.
        val: ``u16[n_val]`` ``val.bin``.
        vocab_size: Ids per token (embedding rows): ``--vocab-size``, else ``meta.pkl``'s, else 50304.
        tokenizer: The character vocabulary of ``meta.pkl`` (for decoding samples), or None.
        sha256: Hex digest over both files' sizes and sampled blocks (:func:`fingerprint`).
    """

    train: TokenFile
    val: TokenFile
    vocab_size: int
    tokenizer: CharTokenizer | None
    sha256: str


def open_token_dir(directory: str | os.PathLike[str], *, vocab_size: int | None, seq_len: int) -> TokenDir:
    """Opens ``directory/train.bin`` and ``val.bin`` (nanoGPT's layout) without reading them whole.

    Args:
        directory: The data directory.
        vocab_size: ``--vocab-size``, or None for ``meta.pkl``'s (or 50304 without one).
        seq_len: Tokens per sequence; each split needs ``seq_len + 1``.

    Returns:
        The opened directory.

    Raises:
        DataError: A missing split, a file of odd byte length (not ``uint16``) or too short for ``seq_len``, an
            unreadable ``meta.pkl`` while no ``vocab_size`` is given, or an id ``>= vocab_size`` in the sampled
            blocks. Nothing is written.
    """
    directory = Path(directory)
    files = [token_file(directory, name, seq_len) for name in SPLITS]
    meta = None
    if (directory / "meta.pkl").exists():
        try:
            meta = read_meta(directory / "meta.pkl")
        except DataError:
            if vocab_size is None:
                raise
    if vocab_size is None:
        vocab_size = meta["vocab_size"] if meta is not None else GPT2_VOCAB_SIZE
    digest = hashlib.sha256(_FINGERPRINT_VERSION)
    for file in files:
        digest.update(fingerprint(file, vocab_size))
    return TokenDir(files[0], files[1], vocab_size, _char_tokenizer(meta), digest.hexdigest())


def token_file(directory: Path, name: str, seq_len: int) -> TokenFile:
    """``directory/name`` as a :class:`TokenFile`, after checking its size (nothing else is read).

    Args:
        directory: The data directory.
        name: ``train.bin`` or ``val.bin``.
        seq_len: Tokens per sequence; the file needs ``seq_len + 1``.

    Returns:
        The token file (``u16[size / 2]``).

    Raises:
        DataError: The file is missing, has an odd byte length, or holds fewer than ``seq_len + 1`` tokens.
    """
    path = directory / name
    if not path.is_file():
        raise DataError(f"{path} not found: nanoGPT's prepare.py writes {' and '.join(SPLITS)} side by side in "
                        f"--data DIR; run it, or pass a text file")
    size = path.stat().st_size
    if size % _TOKEN_DTYPE.itemsize:
        raise DataError(f"{path} has an odd length ({size:,} bytes), but it should hold uint16 token ids of 2 bytes "
                        f"each (nanoGPT's format); the file is truncated or was written in another format")
    n = size // _TOKEN_DTYPE.itemsize
    if n < seq_len + 1:
        raise DataError(f"{path} holds {n:,} tokens, but seq_len={seq_len} needs at least {seq_len + 1}; use more "
                        f"data or a smaller --seq-len")
    return TokenFile(path, n)


def fingerprint(file: TokenFile, vocab_size: int) -> bytes:
    """Digest of a token file's size and ``_BLOCKS`` evenly spaced blocks; checks those blocks' ids.

    Reads at most ``_BLOCKS * _BLOCK_BYTES`` bytes (8 MiB) with plain reads (no memmap), so a 17 GB file costs
    what a small one does; a file no larger is read whole.

    Args:
        file: The token file.
        vocab_size: Every id read must be below it.

    Returns:
        The 32-byte sha256 digest.

    Raises:
        DataError: An id ``>= vocab_size`` in a sampled block (names the id and its position).
    """
    size = file.length * _TOKEN_DTYPE.itemsize
    digest = hashlib.sha256(f"{file.path.name} {size}\n".encode())
    with open(file.path, "rb") as f:
        for start in _block_starts(size):
            f.seek(start)
            block = f.read(_BLOCK_BYTES)
            digest.update(block)
            ids = np.frombuffer(block, dtype=_TOKEN_DTYPE)  # u16[<= _BLOCK_BYTES / 2]
            if ids.size and ids.max() >= vocab_size:
                i = int(np.argmax(ids >= vocab_size))
                raise DataError(f"{file.path} holds token id {int(ids[i])} at token {start // 2 + i:,}, but the "
                                f"vocabulary has {vocab_size} ids; pass --vocab-size above {int(ids[i])} (or check "
                                f"meta.pkl)")
    return digest.digest()


def _block_starts(size: int) -> list[int]:
    """Byte offsets (even) of the sampled blocks: the whole file in order if small, else first to last evenly."""
    if size <= _BLOCKS * _BLOCK_BYTES:
        return list(range(0, size, _BLOCK_BYTES))
    last = size - _BLOCK_BYTES
    return [(last * i // (_BLOCKS - 1)) // 2 * 2 for i in range(_BLOCKS)]


class _PlainUnpickler(pickle.Unpickler):
    """Builds only pickle's own types (dict, list, str, int, ...): any class or function reference is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


def read_meta(path: str | os.PathLike[str]) -> dict:
    """Reads nanoGPT's ``meta.pkl`` safely: no class or function is ever loaded, only plain values.

    Args:
        path: The file.

    Returns:
        ``{"vocab_size": int, "itos": {int: str} or None}``; other keys are ignored.

    Raises:
        DataError: If the file is larger than 16 MiB, not a pickle of plain values (e.g. it names a class), not a
            dict with an int ``vocab_size`` in [1, 65536], or has an ``itos`` that is not ``{int: str}``; the
            message asks for ``--vocab-size``.
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
    if vocab > _MAX_VOCAB:
        raise DataError(f"{path} has vocab_size {vocab:,}, more than uint16 token ids can address ({_MAX_VOCAB:,}); "
                        f"{fix}")
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


def write_tokens(path: str | os.PathLike[str], ids) -> None:
    """Writes ids as nanoGPT does: raw little-endian ``uint16``.

    Args:
        path: The file to write (replaced if present).
        ids: ``int[n]`` ids in ``[0, 65535]``.

    Raises:
        ValueError: An id outside ``[0, 65535]``.
    """
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"token ids must lie in [0, 65535] for uint16 files, got [{ids.min()}, {ids.max()}]")
    ids.astype(_TOKEN_DTYPE).tofile(path)
