"""Tests for jaxamp.lm.data: corpus loading, tokenizer, nanoGPT split, (seed, step)-pure batches."""

import numpy as np
import pytest
from asserts import assert_trees_equal

from jaxamp.lm.data import (
    CharDataset,
    CharTokenizer,
    DataError,
    batch_at,
    default_corpus_text,
    eval_batches,
    load_text,
)

SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def random_text(n, seed=0, alphabet="abcdefghij \n"):
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list(alphabet), size=n))


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_vocab():
    text = "hello, wörld!\n→ ünïcode ok"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == "".join(sorted(set(text)))
    assert tok.vocab_size == len(set(text)) == len(tok.chars)
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert ids.min() >= 0 and ids.max() == tok.vocab_size - 1  # '→' is the largest code point
    np.testing.assert_array_equal(ids, [tok.chars.index(c) for c in text])
    assert tok.decode(ids) == text
    assert tok.decode(list(ids[:5])) == text[:5]
    assert tok.decode(np.array([], np.int32)) == ""
    assert tok.encode("").shape == (0,)


def test_tokenizer_errors():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'z' \(U\+007A\) at index 2"):
        tok.encode("abzc")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="sorted"):
        CharTokenizer("ba")
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")


# ----------------------------------------------------------------------------- split


@pytest.mark.parametrize("n", [1000, 1234, 999])
def test_split_sizes_follow_nanogpt(n):
    text = random_text(n)
    ds = CharDataset.from_text(text, seq_len=8)
    assert len(ds.train) == int(n * 0.9)
    assert len(ds.val) == n - int(n * 0.9)
    assert ds.train.dtype == np.int32 and ds.val.dtype == np.int32
    np.testing.assert_array_equal(np.concatenate([ds.train, ds.val]), ds.tokenizer.encode(text))
    assert ds.tokenizer == CharTokenizer.from_text(text)  # vocabulary of the whole text


def test_corpus_too_short():
    text = random_text(20)  # train 18 tokens, val 2 tokens
    with pytest.raises(DataError, match=(
        r"corpus too short: 20 characters gives a validation split of 2 tokens, "
        r"but seq_len=8 needs at least 9; use a longer corpus or a smaller --seq-len"
    )):
        CharDataset.from_text(text, seq_len=8)
    with pytest.raises(DataError, match="training split of 18 tokens, but seq_len=18 needs at least 19"):
        CharDataset.from_text(text, seq_len=18)
    ds = CharDataset.from_text(random_text(100), seq_len=9)  # val exactly seq_len + 1 = 10 tokens: fine
    assert len(ds.val) == 10


def test_tinyshakespeare_matches_nanogpt(shakespeare_path):
    ds = CharDataset.from_text(load_text(shakespeare_path), seq_len=256)
    assert ds.tokenizer.vocab_size == 65
    assert ds.tokenizer.chars == SHAKESPEARE_CHARS
    assert (len(ds.train), len(ds.val)) == (1_003_854, 111_540)


# ----------------------------------------------------------------------------- batches


def test_batch_at_is_a_pure_function_of_seed_and_step():
    tokens = CharTokenizer.from_text(text := random_text(5000)).encode(text)
    kw = dict(batch_size=4, seq_len=16)
    x1, y1 = batch_at(tokens, seed=3, step=7, **kw)
    batch_at(tokens, seed=3, step=8, **kw)  # no hidden state between calls
    x2, y2 = batch_at(tokens, seed=3, step=7, **kw)
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == y1.dtype == np.int32
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(x1, batch_at(tokens, seed=3, step=8, **kw)[0])
    assert not np.array_equal(x1, batch_at(tokens, seed=4, step=7, **kw)[0])


def test_batch_offsets_come_from_default_rng_seed_step():
    n, seq, batch = 10_000, 32, 8
    ids = np.arange(n)  # token value == position, so a window reveals its offset
    x, y = batch_at(ids, seed=5, step=123, batch_size=batch, seq_len=seq)
    expected = np.random.default_rng([5, 123]).integers(0, n - seq, size=batch)
    np.testing.assert_array_equal(x[:, 0], expected)
    np.testing.assert_array_equal(x, expected[:, None] + np.arange(seq))
    np.testing.assert_array_equal(y, expected[:, None] + np.arange(1, seq + 1))


def test_targets_are_inputs_shifted_by_one_in_the_raw_tokens():
    text = random_text(3000, seed=1)
    tokens = CharTokenizer.from_text(text).encode(text)
    seq = 12
    x, y = batch_at(tokens, seed=0, step=2, batch_size=6, seq_len=seq)
    offsets = batch_at(np.arange(len(tokens)), seed=0, step=2, batch_size=6, seq_len=seq)[0][:, 0]
    for b, o in enumerate(offsets):
        np.testing.assert_array_equal(x[b], tokens[o : o + seq])
        np.testing.assert_array_equal(y[b], tokens[o + 1 : o + seq + 1])
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])


def test_batch_at_uses_the_whole_range_and_stays_in_bounds():
    n, seq = 40, 8
    ids = np.arange(n)
    starts = np.concatenate([batch_at(ids, seed=0, step=s, batch_size=16, seq_len=seq)[0][:, 0] for s in range(50)])
    assert starts.min() == 0 and starts.max() == n - seq - 1  # last window's target is the last token
    x, y = batch_at(np.arange(seq + 1), seed=0, step=0, batch_size=3, seq_len=seq)  # only one window fits
    np.testing.assert_array_equal(x, np.tile(np.arange(seq), (3, 1)))
    np.testing.assert_array_equal(y, np.tile(np.arange(1, seq + 1), (3, 1)))
    with pytest.raises(ValueError, match="seq_len"):
        batch_at(np.arange(seq), seed=0, step=0, batch_size=1, seq_len=seq)
    with pytest.raises(ValueError, match="non-negative"):
        batch_at(ids, seed=-1, step=0, batch_size=1, seq_len=seq)


def test_eval_batches_are_fixed_and_distinct_from_training():
    ids = np.arange(2000)
    kw = dict(batch_size=4, seq_len=16)
    ev = eval_batches(ids, num_batches=3, seed=1, **kw)
    assert len(ev) == 3
    for i, (x, y) in enumerate(ev):
        ref_x, ref_y = batch_at(ids, seed=1 + 10**6, step=i, **kw)
        np.testing.assert_array_equal(x, ref_x)
        np.testing.assert_array_equal(y, ref_y)
        assert not np.array_equal(x, batch_at(ids, seed=1, step=i, **kw)[0])
    again = eval_batches(ids, num_batches=3, seed=1, **kw)
    assert_trees_equal([x for x, _ in again], [x for x, _ in ev], bitwise=False)
    assert not np.array_equal(ev[0][0], ev[1][0])


# ----------------------------------------------------------------------------- corpus loading


def test_default_corpus_is_deterministic_and_usable():
    a = default_corpus_text()
    b = default_corpus_text()
    assert a == b
    assert len(a) == 2_000_000  # the stdlib has far more .py source than this
    assert CharTokenizer.from_text(a).vocab_size > 50
    assert "def " in a and "import " in a
    small = default_corpus_text(max_bytes=1000)
    assert small == a[:1000]
    assert load_text(None) == a


def test_default_corpus_skips_files_generated_at_install(tmp_path, monkeypatch):
    import sysconfig

    (tmp_path / "config-3.11-x86_64-linux-gnu").mkdir()
    (tmp_path / "config-3.11-x86_64-linux-gnu" / "python-config.py").write_text("prefix = '/opt/py'\n")
    (tmp_path / "_sysconfigdata__linux_x86_64-linux-gnu.py").write_text("build_time_vars = {'prefix': '/opt/py'}\n")
    (tmp_path / "b.py").write_text("import os\n")
    (tmp_path / "a.py").write_text("def f():\n    pass\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("assert True\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert default_corpus_text() == "def f():\n    pass\nimport os\n"  # sorted by path; nothing prefix-dependent


def test_load_text_reads_utf8(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("naïve\r\ntext\n".encode())
    assert load_text(f) == "naïve\r\ntext\n"
    assert load_text(str(f)) == "naïve\r\ntext\n"


def test_load_text_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="not found") as e:
        load_text(missing)
    assert str(missing) in str(e.value)
    with pytest.raises(DataError, match="is a directory") as e:
        load_text(tmp_path)
    assert str(tmp_path) in str(e.value)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty") as e:
        load_text(empty)
    assert str(empty) in str(e.value)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"abc" + "é".encode("latin-1") + b"def")
    with pytest.raises(DataError, match="not valid UTF-8.*offset 3") as e:
        load_text(latin1)
    assert str(latin1) in str(e.value)
    assert isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)  # one-line message
