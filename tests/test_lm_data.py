"""Real LM data: nanoGPT token files (memmap, meta.pkl, checksum), the local byte-level BPE, model presets, and the
experiment on both (trains, resumes bitwise, refuses bad input untouched)."""

import json
import os
import pickle
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from asserts import assert_trees_equal

from jaxamp.checkpoint import Checkpointer
from jaxamp.lm.bpe import BPETokenizer
from jaxamp.lm.config import ConfigError, TrainConfig, validate
from jaxamp.lm.corpus import decode_sample, load_corpus, sample_prompt, write_bpe_cache
from jaxamp.lm.data import CharTokenizer, DataError, TokenFile, batch_at, eval_batches
from jaxamp.lm.metrics_log import read_metrics
from jaxamp.lm.setup import build
from jaxamp.lm.token_files import GPT2_VOCAB_SIZE, fingerprint, open_token_dir, read_meta

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import train_lm  # noqa: E402

TINY = ["--layers", "1", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "8",
        "--eval-batches", "2", "--no-progress"]
VOCAB = "320"  # every end-to-end run below has this vocabulary (characters padded up to it; a BPE trained to it),
# so they share one model shape and compile the step once (persistent cache)
UNICODE = "naïve café — ünïcode 中文 🎉\r\n\ttabs  and  spaces\x00 e\u0301 end\n"


@pytest.fixture(scope="module", autouse=True)
def compile_once(tmp_path_factory):
    """The end-to-end runs below compile the same step several times: a persistent compilation cache for this
    module makes the later ones cache hits (it changes no result: the same executable is loaded back)."""
    from jax.experimental.compilation_cache import compilation_cache

    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                  "jax_persistent_cache_min_compile_time_secs")}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax-cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()
    yield
    for key, value in saved.items():
        jax.config.update(key, value)
    compilation_cache.reset_cache()


def words(n: int, seed: int = 0) -> str:
    vocab = "to be or not to be that is the question whether tis nobler in the mind\n".split(" ")
    return " ".join(np.random.default_rng(seed).choice(vocab, n))


def nanogpt_char_dir(text: str, directory: Path) -> Path:
    """What nanoGPT's data/shakespeare_char/prepare.py writes for `text`: train.bin, val.bin, meta.pkl."""
    chars = sorted(set(text))
    stoi, itos = {ch: i for i, ch in enumerate(chars)}, dict(enumerate(chars))
    n = len(text)
    directory.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.bin", text[:int(n * 0.9)]), ("val.bin", text[int(n * 0.9):])):
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(directory / name)
    with open(directory / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return directory


def snapshot(path: Path):
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


# ---- nanoGPT token files --------------------------------------------------------------------------------------------

def test_token_dir_reads_nanogpt_layout(tmp_path):
    text = words(3000)
    d = open_token_dir(nanogpt_char_dir(text, tmp_path / "d"), vocab_size=None, seq_len=16)
    train = np.fromfile(tmp_path / "d" / "train.bin", dtype=np.uint16)
    assert (len(d.train), len(d.val)) == (int(len(text) * 0.9), len(text) - int(len(text) * 0.9)) == (
        len(train), d.val.length)
    assert d.vocab_size == len(set(text)) and d.tokenizer == CharTokenizer.from_text(text)
    assert d.tokenizer.decode(train) == text[:len(train)]
    assert isinstance(d.train.open(), np.memmap) and d.train.open().dtype == np.dtype("<u2")
    for step in (0, 7):  # the memmap gives the batches of the same ids in memory
        ours = batch_at(d.train, seed=3, step=step, batch_size=4, seq_len=16, vocab_size=d.vocab_size)
        ref = batch_at(train, seed=3, step=step, batch_size=4, seq_len=16)
        assert all(a.dtype == np.int32 and type(a) is np.ndarray for a in ours)
        np.testing.assert_array_equal(ours, ref)
    assert decode_sample(d.tokenizer, [1, 300, 0]) == d.tokenizer.decode([1, 0])  # padding ids left out
    assert np.array_equal(sample_prompt(d.tokenizer), d.tokenizer.encode("\n"))
    assert decode_sample(None, np.array([7, 300])) == "token ids (no tokenizer for this data): 7 300"
    (tmp_path / "d" / "meta.pkl").unlink()  # GPT-2 BPE datasets have no meta.pkl
    d = open_token_dir(tmp_path / "d", vocab_size=None, seq_len=16)
    assert (d.vocab_size, d.tokenizer) == (GPT2_VOCAB_SIZE, None) == (50304, None)
    assert open_token_dir(tmp_path / "d", vocab_size=40, seq_len=16).vocab_size == 40


def test_each_process_gathers_only_its_rows(tmp_path, monkeypatch):
    ids = np.arange(5000, dtype=np.uint16)  # id == position
    ids.tofile(tmp_path / "t.bin")
    file = TokenFile(tmp_path / "t.bin", len(ids))
    full = batch_at(file, seed=1, step=4, batch_size=8, seq_len=10)
    seen = []

    class Recording(np.ndarray):
        def __getitem__(self, index):
            seen.append(np.asarray(index))
            return np.ndarray.__getitem__(self, index)

    monkeypatch.setattr(TokenFile, "open", lambda self: np.fromfile(self.path, "<u2").view(Recording))
    part = batch_at(file, seed=1, step=4, batch_size=8, seq_len=10, rows=slice(2, 5))
    np.testing.assert_array_equal(part[0], full[0][2:5])
    np.testing.assert_array_equal(part[1], full[1][2:5])
    assert len(seen) == 1 and seen[0].shape == (3, 11)  # three windows of seq_len + 1, nothing else
    np.testing.assert_array_equal(seen[0][:, 0], full[0][2:5, 0])


def test_checksum_covers_size_and_sampled_blocks_of_big_files(tmp_path):
    path = tmp_path / "big.bin"
    n = 6 * 2**20  # 12 MiB: above the 8 MiB read whole, so 32 blocks of 256 KiB are sampled
    np.random.default_rng(0).integers(0, 1000, n, dtype=np.uint16).tofile(path)
    digest = fingerprint(TokenFile(path, n), 1000)
    assert fingerprint(TokenFile(path, n), 1000) == digest
    last = int(np.fromfile(path, "<u2")[-1])
    with open(path, "r+b") as f:  # the first and last blocks are always sampled
        f.seek(2 * n - 2)
        f.write(np.uint16((last + 1) % 1000).tobytes())
    assert fingerprint(TokenFile(path, n), 1000) != digest
    digest = fingerprint(TokenFile(path, n), 1000)
    gap = 256 * 1024 + 1000  # inside the gap after the first block: not sampled (the file is never read whole)
    with open(path, "r+b") as f:
        f.seek(gap)
        f.write(b"\x01\x02")
    assert fingerprint(TokenFile(path, n), 1000) == digest
    with open(path, "ab") as f:
        f.write(b"\x00\x00")
    assert fingerprint(TokenFile(path, n + 1), 1000) != digest


def _bad_dirs(tmp_path: Path):
    good = nanogpt_char_dir(words(2000), tmp_path / "good")
    cases = {}
    for name, damage, expected in [
        ("no_val", lambda d: (d / "val.bin").unlink(), "val.bin not found"),
        ("odd", lambda d: open(d / "train.bin", "ab").write(b"\x07"), "odd length"),
        ("big_id", lambda d: np.array([5, 70, 2] * 20, np.uint16).tofile(d / "val.bin"), "token id 70 at token 1"),
        ("short", lambda d: np.array([1, 2, 3], np.uint16).tofile(d / "val.bin"), "holds 3 tokens"),
        ("evil_meta", lambda d: (d / "meta.pkl").write_bytes(pickle.dumps(Evil())), "refers to posix.system"),
        ("list_meta", lambda d: (d / "meta.pkl").write_bytes(pickle.dumps([65])), "no integer vocab_size"),
        ("huge_meta", lambda d: (d / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 10**9})),
         "has vocab_size 1,000,000,000, more than uint16 token ids can address (65,536)"),  # was an OOM traceback
    ]:
        d = tmp_path / name
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        damage(d)
        cases[name] = (d, expected)
    return cases


class Evil:
    def __reduce__(self):
        return os.system, (f"touch {EVIL_MARK}",)


EVIL_MARK = Path("/tmp/jaxamp-test-meta-pkl-ran-code")


def test_bad_token_dirs_give_one_line_errors_and_touch_nothing(tmp_path, capsys):
    EVIL_MARK.unlink(missing_ok=True)
    for name, (d, expected) in _bad_dirs(tmp_path).items():
        before, workdir = snapshot(d), tmp_path / f"run_{name}"
        assert train_lm.main([*TINY, "--data", str(d), "--workdir", str(workdir)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and expected in err, (name, err)
        assert snapshot(d) == before and not workdir.exists(), name
    assert not EVIL_MARK.exists()  # meta.pkl's code never ran
    with pytest.raises(DataError, match="pass --vocab-size N to ignore it"):
        read_meta(tmp_path / "evil_meta" / "meta.pkl")
    d = open_token_dir(tmp_path / "evil_meta", vocab_size=80, seq_len=16)  # --vocab-size: meta.pkl is ignored
    assert (d.vocab_size, d.tokenizer) == (80, None)
    with pytest.raises(DataError, match=r"token id 70 at token 1.*vocabulary has 65 ids; pass --vocab-size above 70"):
        open_token_dir(tmp_path / "big_id", vocab_size=65, seq_len=16)
    with pytest.raises(DataError, match="trains on a text file"):
        load_corpus(tmp_path / "good", tokenizer="bpe", vocab_size=512, seq_len=16, bpe_dir=tmp_path / "x")


def test_an_id_beyond_the_vocabulary_in_a_batch_names_the_file(tmp_path):
    np.array([1, 2, 3, 40, 5, 6] * 10, np.uint16).tofile(tmp_path / "t.bin")
    file = TokenFile(tmp_path / "t.bin", 60)
    batch_at(file, seed=0, step=0, batch_size=4, seq_len=8, vocab_size=41)
    with pytest.raises(DataError, match=r"t\.bin holds token id 40 at token .*vocabulary has 40 ids"):
        eval_batches(file, batch_size=4, seq_len=8, num_batches=2, vocab_size=40)


# ---- byte-level BPE -------------------------------------------------------------------------------------------------

def test_bpe_round_trip_is_exact(shakespeare_path):
    text = shakespeare_path.read_text(encoding="utf-8")
    split = int(len(text) * 0.9)
    tok = BPETokenizer.train(text[:split], 1024)
    assert tok.vocab_size == 1024
    assert tok.to_json() == BPETokenizer.train(text[:split], 1024).to_json()  # deterministic
    for sample in (text[split:], text[:split], UNICODE, ""):
        ids = tok.encode(sample)
        assert ids.dtype == np.int32 and (ids.size == 0 or 0 <= ids.min() <= ids.max() < 1024)
        assert tok.decode(ids) == sample
    ratio = (len(text) - split) / len(tok.encode(text[split:]))
    assert 2.0 < ratio < 2.6, ratio  # merges learned: ~2.26 characters per token on the validation split
    again = BPETokenizer.from_json(tok.to_json(), "mem")
    np.testing.assert_array_equal(again.encode(UNICODE), tok.encode(UNICODE))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1024])


def test_bpe_rejects_bad_sizes_and_damaged_json():
    with pytest.raises(ValueError, match=r"\[256, 65536\]"):
        BPETokenizer.train("abc", 100)
    for text, expected in (('{"model": ', "cannot be read"), ('{"version": "1.0"}', "cannot be read")):
        with pytest.raises(DataError, match=expected):
            BPETokenizer.from_json(text, "f.json")
    char_level = json.loads(BPETokenizer.train(words(500), 300).to_json())
    char_level["pre_tokenizer"] = None
    with pytest.raises(DataError, match="not a byte-level BPE"):
        BPETokenizer.from_json(json.dumps(char_level), "f.json")


def test_bpe_corpus_is_cached_once_and_checked_on_reuse(tmp_path):
    text_file = tmp_path / "t.txt"
    text_file.write_bytes((words(6000) + UNICODE).encode("utf-8"))
    kw = dict(tokenizer="bpe", vocab_size=300, seq_len=16, bpe_dir=tmp_path / "w" / "tokenizer")
    first = load_corpus(text_file, **kw)
    assert first.bpe_cache is not None and not (tmp_path / "w").exists()  # loading writes nothing
    write_bpe_cache(first.bpe_cache, kw["bpe_dir"])
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["tokenizer"]
    second = load_corpus(text_file, **kw)
    assert second.bpe_cache is None and isinstance(second.train, TokenFile)
    assert second.sha256 == first.sha256 and second.vocab_size == 300
    np.testing.assert_array_equal(second.train.open(), first.train)
    np.testing.assert_array_equal(second.val.open(), first.val)
    text = text_file.read_bytes().decode("utf-8")  # no newline translation (UNICODE holds a \r\n)
    val_text = text[int(len(text) * 0.9):]
    assert first.tokenizer.decode(first.val) == second.tokenizer.decode(second.val.open()) == val_text
    assert second.chars_per_token == len(val_text) / len(first.val)
    assert decode_sample(second.tokenizer, sample_prompt(second.tokenizer)) == "\n"
    with pytest.raises(DataError, match="trained with --vocab-size 300, not 320"):
        load_corpus(text_file, **{**kw, "vocab_size": 320})
    with pytest.raises(DataError, match="needs --vocab-size"):
        load_corpus(text_file, **{**kw, "vocab_size": None})
    other = tmp_path / "other.txt"
    other.write_text(words(6000, seed=1), encoding="utf-8")
    with pytest.raises(DataError, match="not the text the tokenizer"):
        load_corpus(other, **kw)
    train_bin = kw["bpe_dir"] / "train.bin"
    ids = np.fromfile(train_bin, "<u2")
    ids[5] ^= 1
    ids.tofile(train_bin)
    with pytest.raises(DataError, match="train.bin is not the file meta.json describes"):
        load_corpus(text_file, **kw)
    (kw["bpe_dir"] / "tokenizer.json").unlink()  # was silently trained anew, and the cache never rewritten
    with pytest.raises(DataError, match=r"tokenizer.json cannot be read \(\[Errno 2\] No such file"):
        load_corpus(text_file, **kw)


# ---- presets --------------------------------------------------------------------------------------------------------

def test_model_presets_and_explicit_overrides():
    gpt2 = TrainConfig(model="gpt2-124m")
    assert (gpt2.layers, gpt2.heads, gpt2.width, gpt2.seq_len) == (12, 12, 768, 1024)
    medium = TrainConfig(model="gpt2-medium", seq_len=256)
    assert (medium.layers, medium.heads, medium.width, medium.seq_len) == (24, 16, 1024, 256)
    assert (TrainConfig().layers, TrainConfig().width, TrainConfig().seq_len) == (4, 128, 64)
    cli = train_lm.parse_args(["--model", "gpt2-124m", "--layers", "2"])
    assert (cli.layers, cli.heads, cli.width, cli.seq_len) == (2, 12, 768, 1024)
    assert train_lm.parse_args(["--model", "gpt2-124m"]) == gpt2
    with pytest.raises(ConfigError, match="--model must be one of small, gpt2-124m, gpt2-medium, gpt2-xl, got "
                                          ".gpt3."):
        validate(TrainConfig(model="gpt3"))
    with pytest.raises(ConfigError, match="--tokenizer must be one of char, bpe"):
        validate(TrainConfig(tokenizer="wordpiece"))


def test_gpt2_preset_on_token_files_builds_nanogpts_124m_model(tmp_path):
    d = tmp_path / "owt"
    d.mkdir()
    for name in ("train.bin", "val.bin"):
        np.random.default_rng(0).integers(0, 50257, 4000, dtype=np.uint16).tofile(d / name)
    cfg = TrainConfig(model="gpt2-124m", data=str(d), batch_size=1, eval_batches=1, workdir=str(tmp_path / "w"))
    shapes = jax.eval_shape(lambda: build(cfg).state.params)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert shapes["wte"]["embedding"].shape == (50304, 768)
    assert n - 1024 * 768 == 123_587_328  # nanoGPT prints "number of parameters: 123.59M" (position table excluded)


# ---- the experiment on token files and BPE --------------------------------------------------------------------------

def _run_args(data, workdir, steps, *extra):
    return [*TINY, "--data", str(data), "--workdir", str(workdir), "--steps", str(steps), "--checkpoint-every", "4",
            "--eval-every", "4", "--log-every", "2", "--decay-steps", "8", "--precision", "fp16",
            "--init-scale", str(2.0**24), "--growth-interval", "3", "--sample-tokens", "0", "--vocab-size", VOCAB,
            *extra]


def _restored(workdir, cfg):
    with Checkpointer(Path(workdir) / "checkpoints") as ckpt:
        return ckpt.restore(jax.eval_shape(lambda: build(cfg).state))[0]


@pytest.mark.slow
def test_token_files_train_like_their_text_and_resume_bitwise(tmp_path, capsys):
    """nanoGPT's char files of a text give the very records of the text itself; resumed half-way, the same bits."""
    text_file = tmp_path / "t.txt"
    text_file.write_text(words(4000), encoding="utf-8")
    bins = nanogpt_char_dir(text_file.read_text(encoding="utf-8"), tmp_path / "bins")
    assert train_lm.main(_run_args(text_file, tmp_path / "text", 8)) == 0
    assert train_lm.main(_run_args(bins, tmp_path / "bins_run", 4)) == 0
    assert train_lm.main(_run_args(bins, tmp_path / "bins_run", 8)) == 0
    out = capsys.readouterr().out
    assert "resumed from step 4" in out and "characters of meta.pkl" in out
    strip = lambda rs: json.dumps([{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs])  # NaN == NaN
    ref, ours = read_metrics(tmp_path / "text" / "metrics.jsonl"), read_metrics(tmp_path / "bins_run" / "metrics.jsonl")
    assert [r["step"] for r in ours] == list(range(1, 9)) and strip(ours) == strip(ref)
    assert sum(not r["grads_finite"] for r in ref) >= 1  # a skipped fp16 step inside
    cfg = train_lm.parse_args(_run_args(text_file, tmp_path / "text", 8))
    a = _restored(tmp_path / "text", cfg)
    b = _restored(tmp_path / "bins_run", train_lm.parse_args(_run_args(bins, tmp_path / "bins_run", 8)))
    assert_trees_equal(a, b)
    summary = json.loads((tmp_path / "bins_run" / "summary.json").read_text())
    assert summary["val_loss_per_char"] == summary["val_loss"] and summary["vocab_size"] == 320
    # A vocabulary that changes on resume is refused, and nothing is touched.
    before = snapshot(tmp_path / "bins_run")
    assert train_lm.main([*_run_args(bins, tmp_path / "bins_run", 12), "--vocab-size", "321"]) == 2
    err = capsys.readouterr().err.strip()
    assert "saved with vocab_size=320 but this run has vocab_size=321" in err and "\n" not in err, err
    assert snapshot(tmp_path / "bins_run") == before
    # So are token files that changed since (the checksum covers sizes and sampled blocks).
    val = np.fromfile(bins / "val.bin", "<u2")
    val[0] = (val[0] + 1) % len(set(words(4000)))
    val.tofile(bins / "val.bin")
    assert train_lm.main(_run_args(bins, tmp_path / "bins_run", 12)) == 2
    assert "saved with corpus_sha256=" in capsys.readouterr().err
    assert snapshot(tmp_path / "bins_run") == before


@pytest.mark.slow
def test_bpe_run_trains_once_resumes_from_its_cache_and_decodes_samples(tmp_path, capsys, monkeypatch):
    text_file = tmp_path / "t.txt"
    text_file.write_text(words(8000), encoding="utf-8")
    args = lambda steps, *extra: _run_args(text_file, tmp_path / "run", steps, "--tokenizer", "bpe", *extra)
    assert train_lm.main(args(4)) == 0
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()
    capsys.readouterr()
    monkeypatch.setattr(BPETokenizer, "train", lambda *a: pytest.fail("retrained instead of reusing the cache"))
    assert train_lm.main(args(6, "--sample-tokens", "40")) == 0
    out = capsys.readouterr().out
    assert "resumed from step 4" in out
    sample = out.split("sample:\n", 1)[1].split("\nsummary:", 1)[0]
    assert sample.startswith("\n") and sample.strip() and "token ids" not in sample  # decoded text after the prompt
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["vocab_size"] == 320 and 2 < summary["chars_per_token"] < 5
    assert summary["val_loss_per_char"] == pytest.approx(summary["val_loss"] / summary["chars_per_token"])
    # A damaged tokenizer file or another vocabulary: one line, nothing touched.
    for damage, extra, expected in (
            (lambda: None, ("--vocab-size", "512"), "trained with --vocab-size 320, not 512"),
            (lambda: (tmp_path / "run" / "tokenizer" / "tokenizer.json").write_text('{"model": {'), (),
             "cannot be read")):
        damage()
        before = snapshot(tmp_path / "run")
        assert train_lm.main([*args(8), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and expected in err and "\n" not in err, err
        assert snapshot(tmp_path / "run") == before
