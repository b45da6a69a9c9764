"""jaxamp.diagnostics (activation ranges, policy recommendation, gradient underflow) and its two CLIs, tiny sizes."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script

import jaxamp.lm.setup
from jaxamp.checkpoint import Checkpointer
from jaxamp.diagnostics import FORMATS, activation_ranges, gradient_underflow, range_fractions, recommend_policy
from jaxamp.lm.config import TrainConfig
from jaxamp.lm.model import TransformerConfig, TransformerLM
from jaxamp.lm.setup import build, make_loss_fn

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = TransformerConfig(vocab_size=16, seq_len=8, num_layers=1, num_heads=2, width=16)
TINY_FLAGS = ["--layers", "1", "--heads", "2", "--width", "16", "--seq-len", "8", "--batch-size", "4"]
TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n" * 30
# One loss function per (equal) model, so the CLIs run in this process reuse the functions compiled for the tests
# (`gradient_underflow` and `activation_ranges` are jitted with the loss function / model as static arguments).
_cached_make_loss_fn = functools.lru_cache(maxsize=None)(make_loss_fn)



@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


@pytest.fixture(autouse=True)
def shared_compiles(monkeypatch):
    monkeypatch.setattr(jaxamp.lm.setup, "make_loss_fn", _cached_make_loss_fn)


@pytest.fixture(scope="module")
def tiny_lm(corpus):
    """The model, params and validation batches the tiny CLI runs below build too (same flags, same corpus)."""
    run = build(TrainConfig(data=corpus, layers=1, heads=2, width=16, seq_len=8, batch_size=4, eval_batches=2))
    return run.model, run.state.params, list(run.val_batches)


# -- range_fractions --------------------------------------------------------------------------------------------


def test_range_fractions_on_a_hand_made_array():
    x = np.array([0.0, 1.0, -7e4, 65519.0, 65520.0, 1e-9, 4e-8, 1e-5, 1e-39, 5e-41, 4e-41, 3.4e38, np.inf, np.nan],
                 np.float32)
    f = range_fractions(x)
    n = x.size
    assert f["size"] == n
    assert f["max_abs"] == pytest.approx(3.4e38)
    assert f["nonfinite"] == pytest.approx(2 / n)  # inf, nan
    # 65519 rounds down to 65504; 65520 (max + half an ulp, a tie to even) and beyond round to inf.
    assert f["fp16_overflow"] == pytest.approx(4 / n)  # -7e4, 65520, 3.4e38, inf
    # <= 2^-25 ~ 2.98e-8 rounds to 0; 4e-8 rounds up to the smallest subnormal 5.96e-8.
    assert f["fp16_flush_to_zero"] == pytest.approx(4 / n)  # 1e-9, 1e-39, 5e-41, 4e-41
    assert f["fp16_below_normal"] == pytest.approx(6 / n)  # those four + 4e-8 + 1e-5
    assert f["bf16_overflow"] == pytest.approx(2 / n)  # 3.4e38 (> ~3.396e38), inf
    assert f["bf16_flush_to_zero"] == pytest.approx(1 / n)  # 4e-41 <= 2^-134 ~ 4.59e-41 (5e-41 is kept)
    assert f["bf16_below_normal"] == pytest.approx(3 / n)  # 1e-39, 5e-41, 4e-41


def test_range_fractions_match_actual_casts():
    rng = np.random.default_rng(0)
    x = (np.exp2(rng.uniform(-150, 127.9, 200_000)) * rng.choice([-1.0, 1.0], 200_000)).astype(np.float32)
    f = range_fractions(x)
    with np.errstate(over="ignore"):
        for key, dtype in (("fp16", np.float16), ("bf16", jnp.bfloat16)):
            y = x.astype(dtype).astype(np.float32)
            assert f[f"{key}_overflow"] == np.mean(np.isinf(y)), key
            assert f[f"{key}_flush_to_zero"] == np.mean((y == 0) & (x != 0)), key
            assert FORMATS[key].max == float(jnp.finfo(dtype).max)


# -- activation_ranges / recommend_policy -----------------------------------------------------------------------


@pytest.mark.slow
def test_activation_ranges_fit_fp16_at_init(tiny_lm):
    model, params, batches = tiny_lm
    report = activation_ranges(model, params, batches)
    by_layer = {r["layer"]: r for r in report}
    assert {"wte", "wpe", "h_0/ln_1", "h_0/attn/c_attn", "h_0/mlp/c_fc", "h_0", "ln_f", "(output)"} <= set(by_layer)
    assert not any("Dropout" in layer for layer in by_layer)
    assert by_layer["(output)"]["float32_island"]  # the logits stay float32 under any policy
    assert not by_layer["h_0/mlp/c_fc"]["float32_island"]
    tokens = np.concatenate([b[0] for b in batches])
    embedding = np.asarray(params["wte"]["embedding"])
    assert by_layer["wte"]["max_abs"] == pytest.approx(np.abs(embedding[tokens]).max())
    assert by_layer["h_0/mlp/c_fc"]["shape"] == (4, 8, 4 * 16)
    assert all(r["fp16_overflow"] == 0 for r in report)
    name, reason = recommend_policy(report)
    assert name == "fp16" and "loss scaling" in reason


@pytest.mark.slow
def test_activation_ranges_recommend_bf16_when_an_embedding_is_huge(tiny_lm):
    model, params, batches = tiny_lm
    # nanoGPT's init has std 0.02, so x1e5 only reaches ~6e3; x1e7 (std 2e5) is far beyond float16's 65504.
    big = {**params, "wte": {"embedding": params["wte"]["embedding"] * 1e7}}
    report = activation_ranges(model, big, batches)
    by_layer = {r["layer"]: r for r in report}
    assert by_layer["wte"]["max_abs"] > 65504 and by_layer["wte"]["fp16_overflow"] > 0.5
    assert by_layer["wte"]["bf16_overflow"] == 0
    name, reason = recommend_policy(report)
    assert name == "bf16" and "65504" in reason


def test_recommend_policy_fp32_and_errors():
    row = {"layer": "x", "float32_island": False, "max_abs": 1e39, "nonfinite": 0.0, "fp16_overflow": 1.0,
           "bf16_overflow": 1.0, "fp16_below_normal": 0.0}
    assert recommend_policy([row])[0] == "fp32"
    with pytest.raises(ValueError, match="half precision"):
        recommend_policy([{**row, "float32_island": True}])
    with pytest.raises(ValueError, match="empty"):
        activation_ranges(TransformerLM(TINY), {}, [])


# -- gradient_underflow ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gradient_underflow_scaling_keeps_small_gradients(tiny_lm):
    model, params, batches = tiny_lm
    loss_fn = _cached_make_loss_fn(model)
    out = gradient_underflow(loss_fn, params, batches, loss_scale=2.0**15)
    acts, grads = out["activations"], out["params"]
    assert acts["size"] > grads["size"] > 0
    names = [r["name"] for r in acts["per_leaf"]]
    assert "h_0/mlp/c_fc" in names and "(output)" not in names  # float32 logits are not a half-precision site
    # Parameter gradients accumulate in float32 (lookups, biases: jaxamp.layers) and round once, so on this tiny LM
    # about none flushes; the activation gradients, rounded at every module output, do.
    assert acts["flushed_unscaled"] > acts["flushed_scaled"] and grads["flushed_unscaled"] >= grads["flushed_scaled"]
    for s in (acts, grads):
        assert s["nonfinite_unscaled"] == 0 and s["nonfinite_scaled"] == 0
        assert int(s["counts_reference"].sum()) == s["nonzero_reference"]
        assert int(s["counts_flushed_unscaled"].sum()) == round(s["flushed_unscaled"] * s["nonzero_reference"])
        assert np.all(s["counts_flushed_unscaled"] <= s["counts_reference"])
    assert acts["flushed_unscaled"] > 1e-3  # a few tenths of a percent of this tiny LM's activation gradients
    # Everything the float32 reference says is below 2^-25 is flushed by float16 without scaling.
    assert acts["flushed_unscaled"] >= acts["predicted_flush_unscaled"]

    # A scale far beyond the headroom overflows instead (same compiled functions: the scale is traced).
    huge = gradient_underflow(loss_fn, params, batches[:1], loss_scale=2.0 ** (acts["max_safe_log2_scale"] + 8))
    assert huge["activations"]["nonfinite_scaled"] > 0


def test_gradient_underflow_uses_the_compute_dtypes_thresholds():
    """Gradients of 1, 1e-8 and 1e-12: float16 flushes the last two (<= 2^-25), bfloat16 none (down to 2^-134)."""
    import flax.linen as nn

    dense = nn.Dense(3, kernel_init=nn.initializers.ones, bias_init=nn.initializers.zeros)
    params = dense.init(jax.random.key(0), jnp.ones((1, 1)))["params"]
    weights = jnp.asarray([1.0, 1e-8, 1e-12], jnp.float32)

    def loss_fn(p, batch, rng):
        del rng
        out = dense.apply({"params": p}, batch.astype(jax.tree.leaves(p)[0].dtype))
        return jnp.sum(out.astype(jnp.float32) * weights)

    batch = [jnp.ones((1, 1), jnp.float32)]
    f16 = gradient_underflow(loss_fn, params, batch, loss_scale=1.0, compute_dtype=jnp.float16)["params"]
    b16 = gradient_underflow(loss_fn, params, batch, loss_scale=1.0, compute_dtype=jnp.bfloat16)["params"]
    assert f16["predicted_flush_unscaled"] == pytest.approx(2 / 3) and f16["flushed_unscaled"] == pytest.approx(2 / 3)
    assert b16["predicted_flush_unscaled"] == 0 and b16["flushed_unscaled"] == 0
    assert f16["max_safe_log2_scale"] == 15 and b16["max_safe_log2_scale"] == 127
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gradient_underflow(loss_fn, params, batch, compute_dtype=jnp.float32)


def test_gradient_underflow_rejects_a_bare_batch(tiny_lm):
    model, params, batches = tiny_lm
    with pytest.raises(ValueError, match=r"\[batch\]"):
        gradient_underflow(_cached_make_loss_fn(model), params, batches[0])


# -- the CLIs ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_paper_check_cli_tiny(tmp_path, corpus, tiny_lm, capsys):
    paper_check = load_script("experiments/paper_check.py")
    out = tmp_path / "pc"
    # --train-steps 0: at initialisation only (a training step would add a compile; measure() runs the same code).
    assert paper_check.main(["--data", corpus, *TINY_FLAGS, "--train-steps", "0", "--batches", "1",
                             "--out-dir", str(out)]) == 0
    assert (out / "paper_check.png").read_bytes()[:8] == PNG_SIGNATURE
    text = (out / "paper_check.md").read_text()
    assert text in capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| init")]
    assert [r[1] for r in rows] == ["activations", "parameters"]
    unscaled, scaled = (float(c.strip("*%")) for c in rows[0][5:7])
    assert unscaled > scaled  # the activation gradients of the tiny LM lose more without the 2^15 scale
    assert "scale 2^15" in text


@pytest.mark.slow
def test_activation_report_cli_fresh_and_from_checkpoint(tmp_path, corpus, tiny_lm, capsys):
    report = load_script("experiments/activation_report.py")
    out = tmp_path / "report.md"
    assert report.main(["--data", corpus, *TINY_FLAGS, "--batches", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| h_0/mlp/c_fc |" in text and "Recommendation: **fp16**" in text and "fresh initialisation" in text

    # A "trained" run: its checkpoint holds an embedding no float16 can hold (sizes and data come from it).
    workdir = tmp_path / "run"
    run = build(TrainConfig(data=corpus, layers=1, heads=2, width=16, seq_len=8, batch_size=4, eval_batches=1,
                            workdir=str(workdir)))
    params = {**run.state.params, "wte": {"embedding": run.state.params["wte"]["embedding"] * 1e7}}
    with Checkpointer(workdir / "checkpoints") as ckpt:
        ckpt.save(run.state.replace(params=params), run.run_config())
    capsys.readouterr()
    assert report.main(["--checkpoint-workdir", str(workdir), "--batches", "1"]) == 0
    printed = capsys.readouterr().out
    assert "Recommendation: **bf16**" in printed and "checkpoint step 0" in printed

    assert report.main(["--checkpoint-workdir", str(tmp_path / "nothing"), "--batches", "1"]) == 2
