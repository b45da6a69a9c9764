"""The training data of the experiment, whatever its source: a text file in characters or in a locally trained
byte-level BPE, or a directory of nanoGPT token files.

:func:`load_corpus` only reads. A BPE tokenizer trained on this run's text comes back in ``Corpus.bpe_cache``;
the training loop writes it with :func:`write_bpe_cache` into ``WORKDIR/tokenizer`` (``tokenizer.json``, the text
encoded once as nanoGPT-style ``train.bin``/``val.bin``, and ``meta.json``), which later runs on that workdir (a
resume, sampling) read instead of training again.

Text is split as nanoGPT's shakespeare ``prepare.py`` does: the first 90% of the characters are the training split,
the rest the validation split, each encoded on its own; so character- and BPE-level runs on one file are validated on
the very same text, and ``Corpus.chars_per_token`` turns a loss in nats per token into nats per character.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from jaxamp.lm.bpe import MAX_VOCAB, MIN_VOCAB, BPETokenizer
from jaxamp.lm.data import CharDataset, CharTokenizer, DataError, TokenFile, load_text
from jaxamp.lm.token_files import fingerprint, open_token_dir, token_file, write_tokens

__all__ = ["TOKENIZERS", "Corpus", "BPECache", "load_corpus", "write_bpe_cache", "sample_prompt", "decode_sample"]

TOKENIZERS = ("char", "bpe")
VAL_FRACTION = 0.1  # the last 10% of the text (nanoGPT)
_CACHE_FORMAT = 1  # meta.json's "format"; a cache of another format is refused
_HASH_CHUNK = 1 << 20  # bytes per read when hashing a cached token file

Tokenizer = CharTokenizer | BPETokenizer


@dataclasses.dataclass(frozen=True, eq=False)
class BPECache:
    """A BPE tokenizer trained in this run and its token files, not written yet (see :func:`write_bpe_cache`).

    Attributes:
        tokenizer: The tokenizer.
        train: ``u16[n_train]`` the encoded training split.
        val: ``u16[n_val]`` the encoded validation split.
        meta: What ``meta.json`` records: the text's sha256, vocabulary size, characters and tokens per split.
    """

    tokenizer: BPETokenizer
    train: np.ndarray
    val: np.ndarray
    meta: dict


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """What training needs of the data.

    Attributes:
        train: ``int[n_train]`` training ids: an array, or a :class:`TokenFile` read by memmap per batch.
        val: ``int[n_val]`` validation ids, likewise.
        vocab_size: Ids per token, the model's embedding rows; every id is below it.
        tokenizer: Encodes the sampling prompt and decodes samples; None for token files without ``meta.pkl``.
        sha256: The corpus checksum a resumed run must match (text: sha256 of the text; BPE: of the text and the
            tokenizer; token files: of their sizes and sampled blocks).
        chars_per_token: Characters of text per validation token (1 for characters); None if unknown.
        description: One line for the run's header.
        bpe_cache: A tokenizer trained by this call, to be written to the workdir; None otherwise.
    """

    train: np.ndarray | TokenFile
    val: np.ndarray | TokenFile
    vocab_size: int
    tokenizer: Tokenizer | None
    sha256: str
    chars_per_token: float | None
    description: str
    bpe_cache: BPECache | None = None


def load_corpus(data: str | os.PathLike[str] | None, *, tokenizer: str = "char", vocab_size: int | None = None,
                seq_len: int, bpe_dir: str | os.PathLike[str], data_format: str = "auto",
                token_dtype: str = "auto") -> Corpus:
    """Opens the training data; reads only (a new BPE tokenizer is returned in ``bpe_cache``, not written).

    Args:
        data: A UTF-8 text file, a directory holding nanoGPT's ``train.bin``/``val.bin``, or None for the Python
            standard library's sources.
        tokenizer: ``char`` or ``bpe`` for text (a directory's ids are already tokens).
        vocab_size: Ids per token: for ``bpe`` the size to train (required), for characters at least the distinct
            characters (None = exactly them), for a directory as :func:`jaxamp.lm.token_files.open_token_dir`.
        seq_len: Tokens per sequence; each split needs ``seq_len + 1``.
        bpe_dir: Where a BPE tokenizer of this run is kept (``WORKDIR/tokenizer``); read if present.
        data_format: One of ``DATA_FORMATS`` (``text``: a UTF-8 file; ``tokens``: a directory of nanoGPT token
            files), or ``auto``: ``tokens`` for a directory, ``text`` otherwise (see :func:`data_format_of`).
        token_dtype: For token files, one of ``TOKEN_DTYPES`` (as :func:`jaxamp.lm.token_files.open_token_dir`);
            text takes only ``auto`` (its BPE cache is always ``uint16``).

    Returns:
        The corpus.

    Raises:
        DataError: Bad data (as :func:`jaxamp.lm.data.load_text`, :func:`jaxamp.lm.token_files.open_token_dir`), a
            format that does not fit the path, a ``token_dtype`` other than ``auto`` for text, a vocabulary too
            small for the data or unlike the one ``bpe_dir`` was trained with, text unlike the text it was trained
            on, or a damaged ``bpe_dir``.
    """
    if tokenizer not in TOKENIZERS:
        raise DataError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    load = DATA_FORMATS[data_format_of(data, data_format)]
    return load(data, tokenizer=tokenizer, vocab_size=vocab_size, seq_len=seq_len, bpe_dir=Path(bpe_dir),
                token_dtype=token_dtype)


def data_format_of(data: str | os.PathLike[str] | None, data_format: str = "auto") -> str:
    """The format `--data` is read in: `data_format` itself once checked against the path, or for ``auto`` the
    format the path shows (a directory: ``tokens``; a file or None: ``text``).

    Raises:
        DataError: an unknown format; ``tokens`` for a file or None; ``text`` for a directory; ``auto`` for a file
            named ``*.bin`` (a token file: pass its directory, or ``--data-format text`` if it really is text).
    """
    if data_format != "auto" and data_format not in DATA_FORMATS:
        raise DataError(f"--data-format must be auto or one of {', '.join(DATA_FORMATS)}, got {data_format!r}")
    is_dir = data is not None and Path(data).is_dir()
    if data_format == "auto":
        if data is not None and not is_dir and Path(data).suffix == ".bin":
            raise DataError(f"--data {data} looks like a token file; pass the directory that holds train.bin and "
                            "val.bin (--data-format tokens), or --data-format text if it is UTF-8 text")
        return "tokens" if is_dir else "text"
    if data_format == "tokens" and not is_dir:
        raise DataError(f"--data-format tokens reads a directory holding nanoGPT's train.bin and val.bin, but "
                        f"{data if data is not None else 'no --data'} is not a directory; pass that directory")
    if data_format == "text" and is_dir:
        raise DataError(f"--data-format text reads a UTF-8 file, but {data} is a directory; pass the file, or "
                        "--data-format tokens for nanoGPT's token files")
    return data_format


def _token_corpus(data, *, tokenizer: str, vocab_size: int | None, seq_len: int, bpe_dir: Path,
                  token_dtype: str = "auto") -> Corpus:
    del bpe_dir
    if tokenizer == "bpe":
        raise DataError(f"--tokenizer bpe trains on a text file, but {data} is a directory of token ids "
                        "(nanoGPT's train.bin/val.bin); drop --tokenizer or pass a text file")
    d = open_token_dir(data, vocab_size=vocab_size, seq_len=seq_len, token_dtype=token_dtype)
    kind = "characters of meta.pkl" if d.tokenizer else "token ids, no tokenizer to decode them"
    width = "" if d.train.dtype == "<u2" else "uint32 "
    return Corpus(d.train, d.val, d.vocab_size, d.tokenizer, d.sha256, 1.0 if d.tokenizer else None,
                  f"{data} (nanoGPT {width}token files, {kind})")


def _text_corpus(data, *, tokenizer: str, vocab_size: int | None, seq_len: int, bpe_dir: Path,
                 token_dtype: str = "auto") -> Corpus:
    if token_dtype != "auto":
        raise DataError(f"--token-dtype {token_dtype} reads nanoGPT token files, but "
                        f"{data if data is not None else 'the default data'} is text; drop --token-dtype")
    text = load_text(data)
    source = "the Python standard library's sources" if data is None else str(data)
    if tokenizer == "bpe":
        return _bpe_corpus(text, source, vocab_size, seq_len, bpe_dir)
    return _char_corpus(text, source, vocab_size, seq_len)


def _char_corpus(text: str, source: str, vocab_size: int | None, seq_len: int) -> Corpus:
    ds = CharDataset.from_text(text, seq_len, VAL_FRACTION)
    chars = ds.tokenizer.vocab_size
    if vocab_size is not None and vocab_size < chars:
        raise DataError(f"--vocab-size {vocab_size} is smaller than the {chars} distinct characters of {source}; "
                        f"pass --vocab-size {chars} or more, or leave it out")
    return Corpus(ds.train, ds.val, vocab_size or chars, ds.tokenizer, hashlib.sha256(text.encode()).hexdigest(),
                  1.0, f"{source} (characters)")


def _bpe_corpus(text: str, source: str, vocab_size: int | None, seq_len: int, bpe_dir: Path) -> Corpus:
    if vocab_size is None or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(f"--tokenizer bpe needs --vocab-size N with {MIN_VOCAB} <= N <= {MAX_VOCAB} (the 256 byte "
                        f"tokens included), got {vocab_size}; e.g. --vocab-size 1024")
    text_sha = hashlib.sha256(text.encode()).hexdigest()
    split = int(len(text) * (1 - VAL_FRACTION))
    if bpe_dir.exists():  # write_bpe_cache makes it whole or not at all: a missing file there is damage
        tok, train, val, meta = _read_bpe_cache(bpe_dir, text_sha, vocab_size, seq_len)
        cache = None
    else:
        tok = BPETokenizer.train(text[:split], vocab_size)
        train, val = (tok.encode(part).astype(np.uint16) for part in (text[:split], text[split:]))
        meta = {"format": _CACHE_FORMAT, "text_sha256": text_sha, "vocab_size": vocab_size,
                "tokenizer_vocab_size": tok.vocab_size, "train_chars": split, "val_chars": len(text) - split,
                "train_tokens": len(train), "val_tokens": len(val)}
        cache = BPECache(tok, train, val, meta)
    for name, part in (("training", train), ("validation", val)):
        if len(part) < seq_len + 1:
            raise DataError(f"corpus too short: the {name} split of {source} is {len(part)} BPE tokens, but "
                            f"seq_len={seq_len} needs at least {seq_len + 1}; use a longer text or a smaller "
                            "--seq-len")
    digest = hashlib.sha256(f"bpe v1\n{text_sha}\n".encode() + tok.to_json().encode()).hexdigest()
    return Corpus(train, val, vocab_size, tok, digest, meta["val_chars"] / meta["val_tokens"],
                  f"{source} (byte-level BPE of {tok.vocab_size} tokens, {bpe_dir})", cache)


def _read_bpe_cache(bpe_dir: Path, text_sha: str, vocab_size: int, seq_len: int):
    """(tokenizer, train TokenFile, val TokenFile, meta) of a cache :func:`write_bpe_cache` wrote; checks it all."""
    fix = "restore it, or start over in a new --workdir"
    try:
        meta = json.loads((bpe_dir / "meta.json").read_text(encoding="utf-8"))
        if meta.get("format") != _CACHE_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {_CACHE_FORMAT}")
    except (OSError, ValueError, AttributeError) as err:
        raise DataError(f"{bpe_dir / 'meta.json'} cannot be read ({err}); {fix}") from None
    if meta.get("text_sha256") != text_sha:
        raise DataError(f"--data is not the text the tokenizer in {bpe_dir} was trained on (its sha256 differs); "
                        "pass that text, or a new --workdir")
    if meta.get("vocab_size") != vocab_size:
        raise DataError(f"the tokenizer in {bpe_dir} was trained with --vocab-size {meta.get('vocab_size')}, not "
                        f"{vocab_size}; pass --vocab-size {meta.get('vocab_size')}, or a new --workdir")
    try:
        tok_json = (bpe_dir / "tokenizer.json").read_text(encoding="utf-8")
    except (OSError, ValueError) as err:
        raise DataError(f"{bpe_dir / 'tokenizer.json'} cannot be read ({err}); {fix}") from None
    tok = BPETokenizer.from_json(tok_json, str(bpe_dir / "tokenizer.json"))
    files = []
    for split in ("train", "val"):
        file = token_file(bpe_dir, f"{split}.bin", seq_len, "uint16")  # write_bpe_cache's dtype
        if file.length != meta.get(f"{split}_tokens") or _file_sha256(file.path) != meta.get(f"{split}_sha256"):
            raise DataError(f"{file.path} is not the file meta.json describes (length or sha256 differs); {fix}")
        fingerprint(file, tok.vocab_size)  # ids below the tokenizer's vocabulary
        files.append(file)
    return tok, files[0], files[1], meta


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_bpe_cache(cache: BPECache, bpe_dir: str | os.PathLike[str]) -> None:
    """Writes a trained tokenizer and its token files to ``bpe_dir``, all or nothing; an existing one is kept.

    Files: ``tokenizer.json``, ``train.bin`` and ``val.bin`` (nanoGPT's ``uint16`` layout) and ``meta.json``
    (``cache.meta`` plus each file's sha256). They are written into ``bpe_dir + ".tmp"`` (a leftover one is
    replaced), then that folder is renamed.

    Args:
        cache: ``Corpus.bpe_cache``.
        bpe_dir: The folder to create (``WORKDIR/tokenizer``).

    Raises:
        OSError: The folder cannot be written.
    """
    bpe_dir = Path(bpe_dir)
    if bpe_dir.exists():
        return
    tmp = bpe_dir.with_name(bpe_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "tokenizer.json").write_text(cache.tokenizer.to_json(), encoding="utf-8")
    meta = dict(cache.meta)
    for split, ids in (("train", cache.train), ("val", cache.val)):
        write_tokens(tmp / f"{split}.bin", ids, "uint16")  # a BPE vocabulary has at most 65,536 ids
        meta[f"{split}_sha256"] = _file_sha256(tmp / f"{split}.bin")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, bpe_dir)


def sample_prompt(tokenizer: Tokenizer | None) -> np.ndarray:
    """``i32[k]`` the sampling prompt: a newline where the tokenizer can encode one (nanoGPT's default), else id 0."""
    if isinstance(tokenizer, BPETokenizer) or (isinstance(tokenizer, CharTokenizer) and "\n" in tokenizer.chars):
        return tokenizer.encode("\n")
    return np.zeros((1,), np.int32)


def decode_sample(tokenizer: Tokenizer | None, ids) -> str:
    """Decodes sampled ids; ids the tokenizer lacks (padding rows of the vocabulary) are left out.

    Args:
        tokenizer: The corpus's tokenizer, or None.
        ids: ``int[n]`` sampled ids.

    Returns:
        The text, or the ids as a line of numbers when there is no tokenizer.
    """
    ids = np.asarray(ids).reshape(-1)
    if tokenizer is None:
        return "token ids (no tokenizer for this data): " + " ".join(map(str, ids.tolist()))
    return tokenizer.decode(ids[(ids >= 0) & (ids < tokenizer.vocab_size)])


# `--data-format`: the one place a data format is defined (name -> loader).
DATA_FORMATS = {"text": _text_corpus, "tokens": _token_corpus}
