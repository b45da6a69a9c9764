"""A byte-level BPE tokenizer (GPT-2's scheme) trained locally with Hugging Face ``tokenizers``; nothing downloaded.

Byte-level: the text's UTF-8 bytes are the 256 base tokens, so any text encodes, and decoding the ids of a whole text
gives the text back exactly. Merges are learned from the training split only (``BpeTrainer``, deterministic for the
same text, vocabulary size and library version). The tokenizer is kept as its JSON serialisation, which is what the
run's workdir stores and what its corpus checksum covers.
"""

from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxamp.lm.data import DataError

__all__ = ["BPETokenizer", "MIN_VOCAB", "MAX_VOCAB"]

MIN_VOCAB = 256  # the byte alphabet
MAX_VOCAB = 2**16  # ids must fit nanoGPT's uint16 token files
_CHUNK_CHARS = 1 << 20  # text is trained on and encoded in pieces of about this many characters, cut after a newline


class BPETokenizer:
    """Byte-level BPE: ``encode``/``decode`` between text and ``i32`` ids, ``to_json`` to store it.

    Build one with :meth:`train` or :meth:`from_json`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Learns merges on ``text`` until ``vocab_size`` tokens (fewer if the text runs out of pairs).

        Args:
            text: The training text (non-empty).
            vocab_size: Tokens in all, 256 byte tokens included; in ``[256, 65536]``.

        Returns:
            The tokenizer.

        Raises:
            ValueError: ``vocab_size`` outside ``[256, 65536]`` or empty ``text``.
        """
        if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
            raise ValueError(f"a byte-level BPE vocabulary must lie in [{MIN_VOCAB}, {MAX_VOCAB}], got {vocab_size}")
        if not text:
            raise ValueError("cannot train a BPE tokenizer on empty text")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=[], show_progress=False)
        tok.train_from_iterator(_chunks(text), trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, text: str, source: str) -> BPETokenizer:
        """Loads a tokenizer written by :meth:`to_json`.

        Args:
            text: The JSON.
            source: Where it came from, for error messages (e.g. the file's path).

        Returns:
            The tokenizer.

        Raises:
            DataError: Not a tokenizer JSON, or not a byte-level BPE.
        """
        fix = "it is damaged: restore it, or start over in a new --workdir"
        try:
            spec = json.loads(text)
            tok = Tokenizer.from_str(text)
        except Exception as err:  # noqa: BLE001 - tokenizers raises its own Exception types
            why = (str(err).splitlines() or [type(err).__name__])[0][:120]
            raise DataError(f"tokenizer file {source} cannot be read ({why}); {fix}") from None
        model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
        if model.get("type") != "BPE" or pre.get("type") != "ByteLevel":
            raise DataError(f"tokenizer file {source} is not a byte-level BPE (model {model.get('type')}, "
                            f"pre-tokenizer {pre.get('type')}); {fix}")
        return cls(tok)

    def to_json(self) -> str:
        """The tokenizer's JSON serialisation (what :meth:`from_json` reads)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (at most the ``vocab_size`` it was trained for)."""
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        """Encodes text (any text: unseen characters fall back to byte tokens).

        Args:
            text: The text.

        Returns:
            ``i32[n]`` token ids, ``n`` about ``len(text) / 2`` for English at 1024 tokens.
        """
        parts = [enc.ids for enc in self._tok.encode_batch(list(_chunks(text)))]
        return np.fromiter((i for ids in parts for i in ids), dtype=np.int32, count=sum(map(len, parts)))

    def decode(self, ids) -> str:
        """Decodes token ids; the ids of a whole text give it back exactly.

        Args:
            ids: ``int[n]`` ids below :attr:`vocab_size` (any integer array-like).

        Returns:
            The text; a cut through a multi-byte character decodes to U+FFFD.

        Raises:
            ValueError: An id outside ``[0, vocab_size)``.
        """
        ids = np.asarray(ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(ids[np.argmax(bad)])} is outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids.tolist(), skip_special_tokens=False)


def _chunks(text: str):
    """Pieces of ``text`` of about ``_CHUNK_CHARS`` characters, each cut after a newline where one is near."""
    start = 0
    while start < len(text):
        stop = min(start + _CHUNK_CHARS, len(text))
        if stop < len(text):
            newline = text.rfind("\n", start, stop)
            stop = newline + 1 if newline > start else stop
        yield text[start:stop]
        start = stop
