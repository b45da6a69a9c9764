"""Token files' id width: a uint32 file is never read as uint16 (refused in one line naming --token-dtype uint32),
uint32 files are read when asked for (memmap batches, checksum, vocabulary checks, a tiny run), and real uint16 data
with many zero tokens is not mistaken for uint32."""

import hashlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxamp.lm import token_files
from jaxamp.lm.config import ConfigError, TrainConfig, validate
from jaxamp.lm.corpus import load_corpus
from jaxamp.lm.data import DataError, TokenFile, batch_at
from jaxamp.lm.token_files import TOKEN_DTYPES, fingerprint, open_token_dir, token_file, uint32_signature, write_tokens

REPO = Path(__file__).resolve().parents[1]
FIX = "pass --token-dtype uint32"


def token_dir(directory: Path, train, val, dtype, vocab_size=None) -> Path:
    """train.bin and val.bin of `train`/`val` written as raw little-endian `dtype`, and meta.pkl if `vocab_size`."""
    directory.mkdir(parents=True, exist_ok=True)
    np.asarray(train).astype(dtype).tofile(directory / "train.bin")
    np.asarray(val).astype(dtype).tofile(directory / "val.bin")
    if vocab_size is not None:
        with open(directory / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": vocab_size}, f)
    return directory


def shearing_ids(n: int, high: int, seed: int) -> np.ndarray:
    """Ids as LLM-Shearing's uint32 files hold them: a 32000-id (Llama) vocabulary, below 65,536."""
    return np.random.default_rng(seed).integers(1, high, n)


# ---- refused when read as uint16 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["auto", "uint16"])
def test_uint32_file_is_refused_as_uint16_in_one_line(tmp_path, dtype):
    d = token_dir(tmp_path / "d", shearing_ids(13_176, 32_000, 0), shearing_ids(3_000, 32_000, 1), "<u4")
    with pytest.raises(DataError) as err:
        open_token_dir(d, vocab_size=32_000, seq_len=8, token_dtype=dtype)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{d / 'train.bin'} does not hold uint16 token ids")
    # what was seen: the 26,352 uint16 halves of 13,176 ids, every odd one 0
    assert "all 13,176 sampled odd-position values are <= 0 while 13,176 of 13,176 even-position" in msg
    assert msg.endswith(FIX)
    # Without --vocab-size (GPT-2's 50304 by default) the signature is judged before the vocabulary.
    with pytest.raises(DataError, match=f"train.bin does not hold uint16 token ids.*{FIX}$"):
        open_token_dir(d, vocab_size=None, seq_len=8, token_dtype=dtype)


def test_uint32_ids_above_65535_are_refused_as_uint16(tmp_path):
    ids = np.random.default_rng(2).integers(0, 100_000, 5_000)
    assert (ids > 65_535).mean() > 0.3
    d = token_dir(tmp_path / "d", ids, ids[:3000], "<u4", vocab_size=100_000)
    with pytest.raises(DataError) as err:  # meta.pkl's vocab_size already says uint16 cannot hold them
        open_token_dir(d, vocab_size=None, seq_len=8)
    assert str(err.value) == (f"{d / 'meta.pkl'} has vocab_size 100,000, more than uint16 token ids can address "
                              "(65,536); if train.bin and val.bin hold uint32 ids pass --token-dtype uint32, else "
                              "pass --vocab-size N to ignore it")
    # With --vocab-size 100000 the high halves are 0 or 1 (<= (100000 - 1) >> 16): still the uint32 signature.
    with pytest.raises(DataError, match=r"all 5,000 sampled odd-position values are <= 1 .*pass --token-dtype uint32"):
        open_token_dir(d, vocab_size=100_000, seq_len=8)


def test_signature_in_a_big_file_counts_parity_from_the_files_start(tmp_path):
    """Above 8 MiB the sampled blocks start at even byte offsets, some 2 mod 4: parity is the token's in the file."""
    n = 3 * 2**20  # uint32 ids: 12 MiB
    path = tmp_path / "train.bin"
    shearing_ids(n, 32_000, 3).astype("<u4").tofile(path)
    starts = token_files._block_starts(4 * n)
    assert len(starts) == 32 and any(s % 4 == 2 for s in starts)
    with pytest.raises(DataError, match=r"all 2,097,152 sampled odd-position values are <= 0"):
        fingerprint(TokenFile(path, 2 * n), 32_000)
    fingerprint(TokenFile(path, n, "<u4"), 32_000)  # as uint32: fine


def test_signature_thresholds():
    pairs = np.zeros((1000, 2), np.uint16)
    pairs[:50, 0] = 7  # exactly 5% of the even positions nonzero, every odd one 0
    assert uint32_signature(pairs.ravel(), 50_304)
    assert not uint32_signature(pairs.ravel()[:-2], 50_304)  # 999 pairs: not judged
    one = pairs.copy()
    one[500, 1] = 1  # one odd position nonzero
    assert not uint32_signature(one.ravel(), 50_304)
    assert uint32_signature(one.ravel(), 100_000)  # ... but a high half of 1 is an id below 100,000
    fewer = pairs.copy()
    fewer[49, 0] = 0  # 4.9% of the even positions nonzero
    assert not uint32_signature(fewer.ravel(), 50_304)
    assert not uint32_signature(np.zeros(4000, np.uint16), 50_304)  # all zeros: nothing says uint32
    assert not uint32_signature(np.ones(4000, np.uint16), 100_000)  # all 1: even positions look like high halves too


# ---- no false positive on real uint16 data with many zeros ----------------------------------------------------------

def test_uint16_files_with_many_zero_tokens_are_not_refused(tmp_path):
    rng = np.random.default_rng(4)
    n = 40_000
    mostly_zero = np.where(rng.random(n) < 0.9, 0, rng.integers(1, 50_257, n))  # 90% token 0, no parity
    padded = np.concatenate([np.pad(rng.integers(1, 50_257, rng.integers(3, 300)), (0, 256)) for _ in range(200)])
    char_level = rng.choice([0, 0, 0, 1, 5, 17, 30, 44], n)  # '\n' = 0 in shakespeare_char's vocabulary
    for name, ids in (("mostly_zero", mostly_zero), ("padded", padded), ("chars", char_level)):
        ids = ids[:len(ids) // 2 * 2]  # an even count: a size that is a multiple of 4, as a uint32 file's
        d = token_dir(tmp_path / name, ids, ids, "<u2")
        for dtype in ("auto", "uint16"):
            got = open_token_dir(d, vocab_size=None, seq_len=8, token_dtype=dtype)
            assert got.train.dtype == "<u2" and len(got.train) == len(ids), name
            np.testing.assert_array_equal(got.train.open(), ids)
        assert not uint32_signature(ids, 50_304), name
    assert (mostly_zero[1::2] == 0).mean() > 0.85 and (padded == 0).mean() > 0.4


def test_uint16_checksum_is_unchanged_and_uint32_names_its_dtype(tmp_path):
    """Checkpoints of uint16 token files from before --token-dtype still match: the same digest as then."""
    path = tmp_path / "train.bin"
    ids = shearing_ids(4_000, 1000, 5)
    ids.astype("<u2").tofile(path)
    old = hashlib.sha256(f"train.bin {2 * len(ids)}\n".encode() + path.read_bytes()).digest()
    assert fingerprint(TokenFile(path, len(ids)), 1000) == old
    path.write_bytes(ids.astype("<u4").tobytes())
    as_u32 = fingerprint(TokenFile(path, len(ids), "<u4"), 1000)
    assert as_u32 == hashlib.sha256(f"train.bin {4 * len(ids)} uint32\n".encode() + path.read_bytes()).digest()


# ---- read as uint32 when asked ---------------------------------------------------------------------------------------

def test_uint32_file_reads_its_ids(tmp_path):
    train, val = shearing_ids(13_176, 32_000, 0), shearing_ids(3_000, 32_000, 1)
    d = token_dir(tmp_path / "d", train, val, "<u4")
    got = open_token_dir(d, vocab_size=32_000, seq_len=8, token_dtype="uint32")
    assert (len(got.train), len(got.val), got.vocab_size) == (13_176, 3_000, 32_000)
    assert got.train.dtype == "<u4" and got.train.open().dtype == np.dtype("<u4")
    np.testing.assert_array_equal(got.train.open(), train)
    np.testing.assert_array_equal(got.val.open(), val)
    for step in (0, 5):  # memmap batches: the ids written
        ours = batch_at(got.train, seed=1, step=step, batch_size=4, seq_len=8, vocab_size=32_000)
        ref = batch_at(train, seed=1, step=step, batch_size=4, seq_len=8)
        assert all(a.dtype == np.int32 for a in ours)
        np.testing.assert_array_equal(ours, ref)
    corpus = load_corpus(d, vocab_size=32_000, seq_len=8, bpe_dir=tmp_path / "x", token_dtype="uint32")
    assert corpus.sha256 == got.sha256 and "nanoGPT uint32 token files" in corpus.description


def test_uint32_sizes_and_vocabulary_are_checked(tmp_path):
    d = token_dir(tmp_path / "d", np.arange(100), np.arange(100), "<u4")
    with open(d / "val.bin", "ab") as f:
        f.write(b"\x01\x02")  # 402 bytes: a whole number of uint16 ids, not of uint32 ones
    with pytest.raises(DataError, match=r"val\.bin has 402 bytes, not a multiple of 4"):
        open_token_dir(d, vocab_size=200, seq_len=8, token_dtype="uint32")
    ids = np.arange(100)
    ids[37] = 3_000_000_000  # above int32: checked before the batch becomes int32
    d = token_dir(tmp_path / "e", ids, ids, "<u4")
    with pytest.raises(DataError, match=r"token id 3000000000 at token 37, but the vocabulary has 200 ids"):
        open_token_dir(d, vocab_size=200, seq_len=8, token_dtype="uint32")
    file = token_file(d, "train.bin", 8, "uint32")
    with pytest.raises(DataError, match=r"holds token id 3000000000 at token 37,"):
        batch_at(file, seed=0, step=0, batch_size=64, seq_len=60, vocab_size=200)
    with pytest.raises(DataError, match="more than the 16,777,216 ids read from uint32"):
        token_dir(tmp_path / "f", np.arange(100), np.arange(100), "<u4", vocab_size=10**9)
        open_token_dir(tmp_path / "f", vocab_size=None, seq_len=8, token_dtype="uint32")
    write_tokens(tmp_path / "w.bin", [0, 70_000, 2**32 - 1], "uint32")
    assert np.fromfile(tmp_path / "w.bin", "<u4").tolist() == [0, 70_000, 2**32 - 1]
    with pytest.raises(ValueError, match=r"\[0, 65535\] for uint16"):
        write_tokens(tmp_path / "w.bin", [70_000])


@pytest.mark.slow
def test_uint32_run_trains_and_the_option_is_checked(tmp_path, capsys):
    from jaxamp.lm.train import train

    rng = np.random.default_rng(6)
    train_ids, val_ids = rng.integers(0, 100_000, 3_000), rng.integers(0, 100_000, 500)
    assert train_ids.max() > 65_535
    d = token_dir(tmp_path / "d", train_ids, val_ids, "<u4", vocab_size=100_000)
    tiny = dict(data=str(d), layers=1, width=16, heads=2, seq_len=8, batch_size=2, steps=2, eval_batches=1,
                sample_tokens=0, log_every=1, checkpoint_every=2, progress=False)
    summary = train(TrainConfig(**tiny, token_dtype="uint32", workdir=str(tmp_path / "run")))
    out = capsys.readouterr().out
    assert "nanoGPT uint32 token files" in out and "vocab 100000" in out and "train 3,000 / val 500 tokens" in out
    assert summary["vocab_size"] == 100_000 and np.isfinite(summary["val_loss"])
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["val_loss"] == summary["val_loss"]
    with pytest.raises(DataError, match="pass --token-dtype uint32"):  # the default refuses, and says how
        train(TrainConfig(**tiny, workdir=str(tmp_path / "run2")))
    assert not (tmp_path / "run2").exists()
    assert TOKEN_DTYPES == ("auto", "uint16", "uint32") and TrainConfig().token_dtype == "auto"
    with pytest.raises(ConfigError, match=r"^--token-dtype must be one of auto, uint16, uint32, got 'int32'$"):
        validate(TrainConfig(token_dtype="int32"))
    with pytest.raises(DataError, match="--token-dtype uint32 reads nanoGPT token files, but .* is text"):
        (tmp_path / "t.txt").write_text("hello world " * 100, encoding="utf-8")
        load_corpus(tmp_path / "t.txt", seq_len=8, bpe_dir=tmp_path / "x", token_dtype="uint32")


@pytest.mark.slow
def test_cli_lists_the_flag():
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "train_lm.py"), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    help_text = " ".join(proc.stdout.split())
    assert "--token-dtype TOKEN_DTYPE" in help_text and "| uint16 | uint32" in help_text
    entry = help_text.rsplit("--token-dtype TOKEN_DTYPE", 1)[1]  # the flag's own entry, after the usage line
    assert entry.startswith(" token files' ids: auto") and "(default: auto)" in entry[:400]
