"""Depth and size for the LM: the gpt2-xl preset, `--scan-layers` (blocks as one `nn.scan` over stacked parameters)
and `--remat` (per-block rematerialisation): same losses and gradients as the unrolled model from the same weights,
every precision, dropout, the fused loss, one compilation, checkpoints and resume, refusals, and the benchmark."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import number, table_rows

from jaxamp.fidelity import grad_fidelity
from jaxamp.fp8_collection import select, split_fp8
from jaxamp.lm.config import (
    RESUME_MATCH_KEYS,
    ConfigError,
    TrainConfig,
    resume_keys,
    saved_scan_layers,
    validate,
)
from jaxamp.lm.model import (
    REMAT_POLICIES,
    TransformerConfig,
    TransformerLM,
    count_params,
    generate,
    remat_policy,
    stack_params,
    unstack_params,
)
from jaxamp.lm.resume import relaid
from jaxamp.lm.setup import (
    decay_mask,
    init_variables,
    make_loss_fn,
    make_loss_scale,
    make_optimizer,
    make_policy,
    model_config,
)
from jaxamp.lm.train import train
from jaxamp.remat import recompute_elementwise
from jaxamp.state import TrainState
from jaxamp.step import train_step

REPO = Path(__file__).resolve().parents[1]
TINY = TransformerConfig(vocab_size=65, seq_len=16, num_layers=3, num_heads=2, width=16, use_bias=True)
REMATS = tuple(REMAT_POLICIES)


def _tokens(batch=2, seq=16, vocab=65, seed=1):
    tokens = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, vocab, dtype=jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]  # i32[batch, seq] inputs and targets


@pytest.fixture(scope="module")
def tiny():
    """(float32 variables of the unrolled TINY, the same stacked, (inputs, targets))."""
    inputs, targets = _tokens()
    variables = TransformerLM(TINY).init(jax.random.key(0), inputs)
    return variables, stack_params(variables), (inputs, targets)


def _loss_and_grads(cfg: TransformerConfig, variables, batch):
    model = TransformerLM(cfg)
    return jax.jit(jax.value_and_grad(lambda v: model.apply(v, *batch)))(variables)


def _rel_errors(a, b) -> dict[str, float]:
    """Per leaf |a - b| / |b| (L2), by path."""
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    return {jax.tree_util.keystr(p): float(jnp.linalg.norm((x - y).ravel()) / max(float(jnp.linalg.norm(y.ravel())),
                                                                                  1e-30))
            for (p, x), y in zip(flat_a, flat_b)}


# ---------------------------------------------------------------------------------------------------------------------
# The gpt2-xl preset.


def test_gpt2_xl_preset_has_gpt2_xls_shape_and_parameter_count():
    cfg = TrainConfig(model="gpt2-xl")
    assert (cfg.layers, cfg.heads, cfg.width, cfg.seq_len) == (48, 25, 1600, 1024)
    validate(cfg)
    counts = {}
    for bias in (False, True):
        mc = model_config(dataclasses.replace(cfg, bias=bias, scan_layers=True), 50304, fp8=False)
        shapes = jax.eval_shape(TransformerLM(mc).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        counts[bias] = (count_params(shapes), count_params(shapes) - count_params(shapes["wpe"]))
        assert shapes["h"]["attn"]["c_attn"]["kernel"].shape == (48, 1600, 4800)
        L, d, V, T = 48, 1600, 50304, 1024
        per_layer = 12 * d * d + (13 * d if bias else 2 * d)  # matrices, LayerNorm scales (and biases)
        assert counts[bias][0] == L * per_layer + (2 if bias else 1) * d + V * d + T * d
    # The figures of the docs' table (the experiment's default is --no-bias).
    assert counts[False] == (1_556_840_000, 1_555_201_600)
    assert counts[True] == (1_557_686_400, 1_556_048_000)
    # nanoGPT's own report for gpt2-xl: 1555.97M without the position table at GPT-2's unpadded vocab 50257.
    assert round((counts[True][1] - (50304 - 50257) * 1600) / 1e6, 2) == 1555.97


@pytest.mark.slow  # 4-6 s each on 2 cores
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_dry_run_prints_sizes_and_compiled_memory_and_writes_nothing(tmp_path, capsys, scan):
    """--dry-run: the header, the audit and one line of FLOPs and memory from the step compiled on shapes only; the
    figures are the model's (parameters, nanoGPT's FLOPs, the state's bytes among the arguments); no workdir."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog; " * 300, encoding="utf-8")
    workdir = tmp_path / "run"
    cfg = TrainConfig(data=str(corpus), layers=2, heads=2, width=16, seq_len=16, batch_size=4, workdir=str(workdir),
                      precision="bf16", scan_layers=scan, dry_run=True, progress=False)
    out = train(cfg)
    printed = capsys.readouterr().out.splitlines()
    assert not workdir.exists()
    assert printed[0].startswith("jaxamp: ") and printed[1].startswith("precision audit (bf16")
    assert printed[2].startswith("dry run: the step compiled for cpu in ")
    assert "nothing trained or written" in printed[2] and len(printed) == 3
    vocab = len(set(corpus.read_text()))
    n = 2 * (12 * 16 * 16 + 2 * 16) + 16 + vocab * 16 + 16 * 16  # blocks, ln_f, wte (tied head), wpe
    assert out["dry_run"] is True and out["parameters"] == n and out["tokens_per_step"] == 64
    assert out["model_flops"] == 64 * (6 * (n - 16 * 16) + 12 * 2 * 16 * 16)
    state_bytes = 12 * n  # float32 master weights and Adam's two moments
    assert state_bytes <= out["argument_bytes"] <= state_bytes + 4096, out  # + the batch, counters, loss scale
    assert out["temp_bytes"] > 0 and out["peak_bytes_estimate"] >= out["argument_bytes"] + out["temp_bytes"]
    if not scan:  # XLA's count: the matmuls and the rest (a scanned body is counted once)
        assert out["model_flops"] < out["flops"] < 3 * out["model_flops"], out
        (workdir / "checkpoints").mkdir(parents=True)  # a workdir with checkpoints: said, left as it is
        train(cfg)
        line = capsys.readouterr().out.splitlines()[-1]
        assert line == f"dry run: {workdir / 'checkpoints'}: no checkpoint: a run would start from step 0"
        assert [p.name for p in workdir.iterdir()] == ["checkpoints"] and not any((workdir / "checkpoints").iterdir())


@pytest.mark.slow
def test_dry_run_says_what_a_run_would_do_with_the_workdirs_checkpoints_and_touches_nothing(tmp_path, capsys):
    """A dry run on a workdir with a checkpoint checks its settings as a resume would (JSON items only): resume,
    with the layout conversion or precision switch named; finished; or the mismatch a run would stop with."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog; " * 300, encoding="utf-8")
    workdir = tmp_path / "run"
    common = dict(data=str(corpus), layers=2, heads=2, width=16, seq_len=16, batch_size=4, workdir=str(workdir),
                  precision="bf16", eval_every=2, eval_batches=1, progress=False)
    train(TrainConfig(steps=2, **common))
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*")}
    capsys.readouterr()
    held = workdir / "checkpoints"
    cases = [(dict(steps=4), "a run would resume from step 2 (settings checked, arrays not read)"),
             (dict(steps=4, scan_layers=True),
              "a run would resume from step 2, its blocks stacked for --scan-layers (settings"),
             (dict(steps=4, precision="fp32"), "a run would resume from step 2, its precision switched from bf16 ("),
             (dict(steps=2), "step 2 is saved: a run would find it finished (--steps 2; raise it to go on)"),
             (dict(steps=4, lr=3e-3), "a run would stop: checkpoint at step 2 was saved with lr=0.001 but this run "
                                      "has lr=0.003; use another checkpoint directory (--workdir) or the same "
                                      "settings"),
             (dict(steps=4, precision="fp8"), "a run would stop: the checkpoint in")]
    for change, said in cases:
        train(TrainConfig(dry_run=True, **{**common, **change}))
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith(f"dry run: {held}: {said}"), (change, line)
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*")} == before  # nothing written, moved or touched
    (held / "notes.txt").write_text("not a checkpoint")  # a folder the run would refuse: said, left as it is
    train(TrainConfig(dry_run=True, **{**common, "steps": 4}))
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(f"dry run: {held}: a run would stop: ") and "notes.txt" in line, line


# ---------------------------------------------------------------------------------------------------------------------
# stack_params / unstack_params.


@pytest.mark.slow
def test_stack_and_unstack_params_round_trip(tiny):
    variables, stacked, _ = tiny
    assert set(variables["params"]) == {"wte", "wpe", "h_0", "h_1", "h_2", "ln_f"}  # unrolled names as ever
    assert set(stacked["params"]) == {"wte", "wpe", "h", "ln_f"}
    assert stacked["params"]["h"]["mlp"]["c_fc"]["kernel"].shape == (3, 16, 64)
    assert stacked["params"]["h"]["ln_1"]["scale"].shape == (3, 16)
    np.testing.assert_array_equal(stacked["params"]["h"]["attn"]["c_proj"]["kernel"][1],
                                  variables["params"]["h_1"]["attn"]["c_proj"]["kernel"])
    back = unstack_params(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(variables)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(variables)))
    frozen = stack_params(flax.core.freeze(variables))
    assert isinstance(frozen, flax.core.FrozenDict) and isinstance(frozen["params"], flax.core.FrozenDict)
    # The shapes a scanned model's own init makes.
    scanned = TransformerLM(dataclasses.replace(TINY, scan_layers=True))
    own = jax.eval_shape(scanned.init, jax.random.key(0), tiny[2][0])
    assert jax.tree.map(jnp.shape, own) == jax.tree.map(jnp.shape, stacked)


def test_stack_params_refuses_gaps_and_mixed_trees(tiny):
    params = dict(tiny[0]["params"])
    del params["h_1"]
    with pytest.raises(ValueError, match="h_0 .. h_"):
        stack_params(params)
    with pytest.raises(ValueError, match="both 'h' and h_i"):
        unstack_params({"h": {"w": jnp.zeros((2, 3))}, "h_0": {"w": jnp.zeros(3)}})
    with pytest.raises(ValueError, match="one leading"):
        unstack_params({"h": {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}})


# ---------------------------------------------------------------------------------------------------------------------
# Scanned = unrolled, from the same weights.


@pytest.mark.slow
@pytest.mark.parametrize("remat", REMATS)
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_scan_and_remat_give_the_unrolled_loss_and_gradients_in_float32(tiny, scan, remat):
    variables, stacked, batch = tiny
    ref_loss, ref_grads = _loss_and_grads(TINY, variables, batch)
    cfg = dataclasses.replace(TINY, scan_layers=scan, remat=remat)
    loss, grads = _loss_and_grads(cfg, stacked if scan else variables, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    errors = _rel_errors(unstack_params(grads) if scan else grads, ref_grads)
    assert max(errors.values()) < 1e-6, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.slow
def test_scanned_fused_loss_equals_unrolled_whole_logits(tiny):
    variables, stacked, batch = tiny
    ref_loss, ref_grads = _loss_and_grads(TINY, variables, batch)
    loss, grads = _loss_and_grads(dataclasses.replace(TINY, scan_layers=True, remat="dots", loss_chunk=8), stacked,
                                  batch)
    assert abs(float(loss) - float(ref_loss)) <= 2e-6 * abs(float(ref_loss))
    assert max(_rel_errors(unstack_params(grads), ref_grads).values()) < 2e-6


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_scanned_half_precision_matches_unrolled_and_computes_in_it(tiny, dtype):
    variables, stacked, batch = tiny
    policy = make_policy({jnp.bfloat16: "bf16", jnp.float16: "fp16"}[dtype])
    ref = TransformerLM(TINY).apply({"params": policy.cast_to_compute(variables["params"])}, *batch)
    model = TransformerLM(dataclasses.replace(TINY, scan_layers=True, remat="full"))
    compute = {"params": policy.cast_to_compute(stacked["params"])}
    assert compute["params"]["h"]["attn"]["c_attn"]["kernel"].dtype == dtype
    assert compute["params"]["wte"]["embedding"].dtype == jnp.float32  # LM_KEEP_FLOAT32 as unrolled
    loss = jax.jit(model.apply)(compute, *batch)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), float(ref), rtol=2e-3)
    logits = jax.jit(lambda v, x: model.apply(v, x))(compute, batch[0])
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


def test_scanned_jaxpr_holds_one_block_whatever_the_depth(tiny):
    inputs, targets = tiny[2]

    def eqns(layers, scan):
        model = TransformerLM(dataclasses.replace(TINY, num_layers=layers, scan_layers=scan, remat="full"))
        shapes = jax.eval_shape(model.init, jax.random.key(0), inputs)
        return len(jax.make_jaxpr(jax.grad(lambda v: model.apply(v, inputs, targets)))(shapes).eqns)

    assert eqns(2, True) == eqns(5, True)  # one scanned block, traced once
    assert eqns(5, False) > eqns(2, False)  # unrolled: one per layer


def test_remat_policy_names_are_jax_checkpoint_policies():
    assert remat_policy("none") is None
    assert remat_policy("full") is jax.checkpoint_policies.nothing_saveable
    assert remat_policy("dots") is jax.checkpoint_policies.dots_saveable
    assert remat_policy("dots_with_no_batch_dims") is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    assert remat_policy("elementwise") is recompute_elementwise
    with pytest.raises(ValueError, match="remat must be one of none, full, dots, dots_with_no_batch_dims, elementwise"):
        remat_policy("everything")
    with pytest.raises(ValueError, match="TransformerConfig.remat must be one of"):
        dataclasses.replace(TINY, remat="nothing_saveable")
    with pytest.raises(ValueError, match="scan_layers must be a bool"):
        dataclasses.replace(TINY, scan_layers=1)


# ---------------------------------------------------------------------------------------------------------------------
# Dropout under scan.


@pytest.mark.slow
def test_scanned_dropout_draws_each_layer_its_own_mask(tiny):
    _, stacked, (inputs, targets) = tiny
    model = TransformerLM(dataclasses.replace(TINY, scan_layers=True, dropout=0.5, remat="full"))
    apply = jax.jit(lambda v, r: model.apply(v, inputs, deterministic=False, rngs={"dropout": r},
                                             capture_intermediates=True, mutable=["intermediates"]))
    _, state = apply(stacked, jax.random.key(5))
    out = state["intermediates"]["h"]["attn"]["Dropout_0"]["__call__"][0]  # [layers, batch, seq, width]
    assert out.shape == (3, 2, 16, 16)
    dropped = np.asarray(out == 0)
    assert all(0.35 < dropped[i].mean() < 0.65 for i in range(3))
    assert (dropped[0] != dropped[1]).mean() > 0.3 and (dropped[1] != dropped[2]).mean() > 0.3  # split per layer
    # The same key gives the same loss; another key another; deterministic is the dropout-free model.
    loss = jax.jit(lambda v, r: model.apply(v, inputs, targets, deterministic=False, rngs={"dropout": r}))
    assert float(loss(stacked, jax.random.key(5))) == float(loss(stacked, jax.random.key(5)))
    assert float(loss(stacked, jax.random.key(5))) != float(loss(stacked, jax.random.key(6)))
    plain = TransformerLM(dataclasses.replace(TINY, scan_layers=True))
    np.testing.assert_allclose(float(model.apply(stacked, inputs, targets)),
                               float(plain.apply(stacked, inputs, targets)), rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# The training step: every precision, FP8's stacked collection, one compilation.


def _state(precision: str, scan: bool, remat: str = "none", layers: int = 2):
    cfg = TrainConfig(layers=layers, heads=2, width=16, seq_len=16, batch_size=2, precision=precision,
                      scan_layers=scan, remat=remat, fp8_amax_history=4, steps=10, warmup_steps=1)
    validate(cfg)
    policy = make_policy(precision)
    mc = model_config(cfg, 65, fp8=precision == "fp8")
    variables = init_variables(mc, jax.random.PRNGKey(cfg.seed))
    params = variables if mc.fp8 else variables["params"]
    state = TrainState.create(params=params, tx=make_optimizer(cfg, split_fp8(params)[0]), policy=policy,
                              loss_scale=make_loss_scale(cfg), rng=jax.random.PRNGKey(1))
    return state, make_loss_fn(TransformerLM(mc))


_RUNS: dict = {}


def _three_steps(precision: str, scan: bool):
    """(losses, final state) of 3 steps of the experiment's step (scanned: with --remat full), compiled once."""
    if (precision, scan) not in _RUNS:
        state, loss_fn = _state(precision, scan, remat="full" if scan else "none")
        step = jax.jit(lambda s, b, f=loss_fn: train_step(s, b, f), donate_argnums=0)
        losses = []
        for _ in range(3):
            state, metrics = step(state, _tokens(vocab=65))
            losses.append(float(metrics["loss"]))
        assert step._cache_size() == 1  # compiled once
        _RUNS[precision, scan] = (losses, state)
    return _RUNS[precision, scan]


def _unrolled_params(state, scan: bool):
    params = split_fp8(state.params)[0]
    params = params.get("params", params)  # FP8: the variables dict
    return unstack_params(params) if scan else params


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_scanned_step_matches_unrolled_step_in_every_precision(precision):
    """fp32: the same to float32 rounding. Half precision and FP8: XLA rounds the scanned program's half-precision
    values at other places than the unrolled one's (other fusions), so the two differ by rounding noise: the
    scanned run is as close to the unrolled one as the unrolled one is to float32 (1.5x margin)."""
    (ref_losses, ref), (losses, scanned) = _three_steps(precision, False), _three_steps(precision, True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6 if precision == "fp32" else 2e-3)
    errors = _rel_errors(_unrolled_params(scanned, True), _unrolled_params(ref, False))
    if precision == "fp32":
        assert max(errors.values()) < 1e-5, max(errors.items(), key=lambda kv: kv[1])
    else:
        floor = _rel_errors(_unrolled_params(ref, False), _unrolled_params(_three_steps("fp32", False)[1], False))
        assert max(errors.values()) < 1.5 * max(floor.values()), (max(errors.values()), max(floor.values()))
    # The optimizer state is laid out as the params are (Adam's moments stacked too) and is finite.
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(scanned.opt_state))
    if precision == "fp8":  # the FP8 collection stacked [layers, 1] / [layers, history], every layer updated
        fp8, ref_fp8 = split_fp8(scanned.params)[1], split_fp8(ref.params)[1]
        op = fp8["h"]["mlp"]["c_fc"]["fp8"]
        assert op["input_scale"].shape == (2, 1) and op["input_amax_history"].shape == (2, 4)
        np.testing.assert_array_equal(np.sum(np.asarray(op["input_amax_history"]) > 0, axis=1), [3, 3])  # 3 steps
        assert bool(jnp.all(op["kernel_scale"] != 1.0))
        assert jax.tree.structure(unstack_params(fp8)) == jax.tree.structure(ref_fp8)
        for leaf, ref_leaf in zip(jax.tree.leaves(unstack_params(fp8)), jax.tree.leaves(ref_fp8)):
            np.testing.assert_allclose(np.asarray(leaf), np.asarray(ref_leaf), rtol=5e-2)  # bf16 noise


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_scanned_half_precision_gradients_are_within_the_precisions_own_error(tiny, precision):
    variables, stacked, batch = tiny
    policy = make_policy(precision)

    def grads(cfg, params, cast=True):
        model = TransformerLM(cfg)
        return jax.jit(jax.grad(lambda p: model.apply({"params": policy.cast_to_compute(p) if cast else p},
                                                      *batch)))(params)

    ref32 = grads(TINY, variables["params"], cast=False)
    unrolled = grads(TINY, variables["params"])
    own = max(_rel_errors(unrolled, ref32).values())  # the precision's own error against float32
    for remat in ("none", "full"):
        scanned = grads(dataclasses.replace(TINY, scan_layers=True, remat=remat), stacked["params"])
        assert max(_rel_errors(unstack_params(scanned), unrolled).values()) < own
        assert max(_rel_errors(unstack_params(scanned), ref32).values()) < 1.5 * own


def test_the_fp8_collection_keeps_an_uncalled_layer_of_a_stack():
    """`select` per layer of a stacked [layers, 1] collection: a layer whose new scale is 0 (not called) keeps its
    values; a skipped step keeps all of them bitwise."""
    def op(scale, hist):
        return {f"{t}_{k}": v for t in ("input", "kernel", "output_grad")
                for k, v in (("scale", jnp.asarray(scale, jnp.float32)), ("amax_history", jnp.asarray(hist,
                                                                                                     jnp.float32)))}

    old = {"h": {"mlp": {"fp8": op([[1.0], [2.0]], [[0.5, 0.0], [0.7, 0.0]])}}}
    new = {"h": {"mlp": {"fp8": op([[3.0], [0.0]], [[0.9, 0.5], [0.0, 0.0]])}}}  # layer 1 not called
    out = select(jnp.asarray(True), new, old)["h"]["mlp"]["fp8"]
    np.testing.assert_array_equal(out["input_scale"], np.float32([[3.0], [2.0]]))
    np.testing.assert_array_equal(out["kernel_amax_history"], np.float32([[0.9, 0.5], [0.7, 0.0]]))
    kept = select(jnp.asarray(False), new, old)
    assert jax.tree.structure(kept) == jax.tree.structure(old)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(old)))


def test_scanned_weight_decay_mask_is_the_unrolled_one():
    """A stacked LayerNorm scale is 2-D ([layers, width]) but is no matrix: it is not decayed, as unrolled."""
    params = split_fp8(_state("fp32", True)[0].params)[0]
    decayed = decay_mask(params)
    assert not decayed["h"]["ln_1"]["scale"] and decayed["h"]["attn"]["c_attn"]["kernel"]
    assert decayed["wte"]["embedding"] and not decayed["ln_f"]["scale"]
    ref = decay_mask(split_fp8(_state("fp32", False)[0].params)[0])
    assert decayed["h"] == ref["h_0"] == ref["h_1"]
    assert {k: v for k, v in decayed.items() if k != "h"} == {k: v for k, v in ref.items() if k[:2] != "h_"}


def test_build_gives_a_scanned_run_the_unrolled_runs_initial_weights():
    unrolled, _ = _state("fp32", False, layers=3)
    scanned, _ = _state("fp32", True, layers=3)
    back = unstack_params(scanned.params)
    assert jax.tree.structure(back) == jax.tree.structure(unrolled.params)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(unrolled.params)))


@pytest.mark.slow
def test_scanned_model_samples_as_unrolled_and_its_fp8_fidelity_reference_bypasses_fp8(tiny):
    variables, stacked, batch = tiny
    greedy = dict(num_tokens=5, rng=jax.random.key(0), temperature=1e-30)
    ref = generate(TransformerLM(TINY), variables, [1, 2, 3], **greedy)
    got = generate(TransformerLM(dataclasses.replace(TINY, scan_layers=True, remat="full")), stacked, [1, 2, 3],
                   **greedy)
    np.testing.assert_array_equal(got, ref)
    # grad_fidelity's float32 reference bypasses the FP8 ops inside the scan (else it raises: none bypassed).
    state, loss_fn = _state("fp8", True)
    errors = grad_fidelity(state, batch, loss_fn)
    assert "params/h/attn/c_attn/kernel" in errors
    assert all(0 < float(e) < 1 for e in errors.values())


# ---------------------------------------------------------------------------------------------------------------------
# Flags, validation, resume.


def test_flags_and_validation():
    sys.path.insert(0, str(REPO / "experiments"))
    import train_lm  # noqa: PLC0415

    cfg = train_lm.parse_args(["--scan-layers", "--remat", "dots"])
    assert cfg.scan_layers is True and cfg.remat == "dots"
    assert train_lm.parse_args([]).scan_layers is False and train_lm.parse_args([]).remat == "none"
    assert "scan_layers" in train_lm.HELP and "remat" in train_lm.HELP and "gpt2-xl" in train_lm.HELP["model"]
    with pytest.raises(ConfigError) as err:
        validate(TrainConfig(remat="selective"))
    assert str(err.value) == ("--remat must be one of none, full, dots, dots_with_no_batch_dims, elementwise, "
                              "got 'selective'")
    with pytest.raises(ConfigError, match=r"^--scan-layers needs --layers >= 1 \(blocks to scan over\), got 0$"):
        validate(TrainConfig(scan_layers=True, layers=0))
    for remat in REMATS:
        validate(TrainConfig(scan_layers=True, remat=remat))


def test_resume_settings_scan_layers_is_read_from_the_checkpoint_remat_may_change():
    assert "scan_layers" in RESUME_MATCH_KEYS and "remat" not in RESUME_MATCH_KEYS
    old = {"layers": 4}  # a checkpoint of a jaxamp before --scan-layers: unrolled
    unrolled, scanned = TrainConfig(workdir="w"), TrainConfig(workdir="w", scan_layers=True)
    assert saved_scan_layers(old, scanned) is False and saved_scan_layers({"scan_layers": True}, unrolled) is True
    assert saved_scan_layers(None, scanned) is True and saved_scan_layers(None, unrolled) is False  # unreadable
    assert "scan_layers" not in resume_keys(RESUME_MATCH_KEYS, old, unrolled)
    assert "scan_layers" in resume_keys(RESUME_MATCH_KEYS, {"scan_layers": False}, unrolled)
    assert "scan_layers" in resume_keys(RESUME_MATCH_KEYS, old, scanned)


def _filled(state: TrainState) -> TrainState:
    """`state` with a distinct random value in every floating leaf of its params and optimizer state (Adam's
    moments start at zero, which would compare equal however they were moved)."""
    leaves, treedef = jax.tree.flatten((state.params, state.opt_state))
    keys = jax.random.split(jax.random.key(3), len(leaves))
    leaves = [jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
              for k, x in zip(keys, leaves)]
    params, opt_state = jax.tree.unflatten(treedef, leaves)
    return state.replace(params=params, opt_state=opt_state)


def _adam_mu(opt_state):
    """Adam's first moment (`ScaleByAdamState.mu`) inside the optax chain's state."""
    mu = next(x.mu for x in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(x, "mu"))
    return mu.get("params", mu)  # FP8: the moments of the variables dict's params


def _same(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_relaid_moves_params_adam_moments_and_the_fp8_collection_bitwise(precision):
    """The resume's layout conversion: an unrolled state stacked has the scanned run's structure (params with the
    FP8 collection, Adam's mu and nu), layer i of a stacked leaf is h_i's leaf bitwise, and back is the same state."""
    unrolled = _filled(_state(precision, False, layers=3)[0])
    scanned_fresh = _state(precision, True, layers=3)[0]
    scanned = relaid(unrolled, True)
    assert jax.tree.structure(scanned.params) == jax.tree.structure(scanned_fresh.params)
    assert jax.tree.structure(scanned.opt_state) == jax.tree.structure(scanned_fresh.opt_state)
    assert _same(relaid(scanned, False).params, unrolled.params)
    assert _same(relaid(scanned, False).opt_state, unrolled.opt_state)
    mu, mu_ref = _adam_mu(scanned.opt_state), _adam_mu(unrolled.opt_state)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(mu["h"]["mlp"]["c_fc"]["kernel"][i]),
                                      np.asarray(mu_ref[f"h_{i}"]["mlp"]["c_fc"]["kernel"]))
    if precision == "fp8":
        fp8 = split_fp8(scanned.params)[1]["h"]["mlp"]["c_fc"]["fp8"]
        assert fp8["input_amax_history"].shape == (3, 4)
    with pytest.raises(ConfigError, match="frozen params"):
        relaid(unrolled.replace(trainable=(True,) * len(jax.tree.leaves(unrolled.params))), True, "w")


def _records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_scanned_run_trains_as_unrolled_and_resumes_in_either_layout(tmp_path, capsys):
    """4 steps unrolled against 2 scanned steps + 2 resumed with --remat full: the same losses to float32 rounding
    (remat recomputes the same forward; XLA may fuse it otherwise, so not bitwise). Then that scanned checkpoint
    resumes without --scan-layers (steps 5-6), and that unrolled checkpoint with it again (steps 7-8): the same
    run as the unrolled one's to float32 rounding, each switch said in one line."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog; " * 300, encoding="utf-8")
    common = dict(data=str(corpus), layers=2, heads=2, width=16, seq_len=16, batch_size=4, eval_every=2,
                  eval_batches=1, log_every=1, sample_tokens=0, checkpoint_every=2, warmup_steps=1, progress=False,
                  bias=True, decay_steps=8)
    train(TrainConfig(workdir=str(tmp_path / "unrolled"), steps=4, **common))
    scanned = tmp_path / "scanned"
    train(TrainConfig(workdir=str(scanned), steps=2, scan_layers=True, **common))
    capsys.readouterr()
    train(TrainConfig(workdir=str(scanned), steps=4, scan_layers=True, remat="full", **common))
    out = capsys.readouterr().out  # the header names the layout; the first step's compile time is printed
    assert "; blocks scanned; remat full" in out.splitlines()[1] and re.search(r"step 3: traced and compiled in "
                                                                              r"[0-9.]+ s", out), out
    ref, got = _records(tmp_path / "unrolled"), _records(scanned)
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=1e-5)
    meta = json.loads((scanned / "checkpoints" / "4" / "config" / "metadata").read_text())
    assert meta["scan_layers"] is True and meta["remat"] == "full"
    for steps, scan in ((6, False), (8, True)):
        train(TrainConfig(workdir=str(tmp_path / "unrolled"), steps=steps, **common))
        capsys.readouterr()
        train(TrainConfig(workdir=str(scanned), steps=steps, scan_layers=scan, **common))
        out = capsys.readouterr().out
        layout = [line for line in out.splitlines() if line.startswith("layout:")]
        assert len(layout) == 1 and ("stacked under h; unstacked for this run without --scan-layers" if not scan
                                     else "were h_0 .. h_1; stacked for this run with --scan-layers") in layout[0], out
        meta = json.loads((scanned / "checkpoints" / str(steps) / "config" / "metadata").read_text())
        assert meta["scan_layers"] is scan
    ref, got = _records(tmp_path / "unrolled"), _records(scanned)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 9))
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The benchmark.


@pytest.mark.slow
def test_compile_depth_benchmark_tiny(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()}
    out = tmp_path / "compile_depth.md"
    proc = subprocess.run([sys.executable, "benchmarks/compile_depth.py", "--tiny", "--steps", "1", "--warmup", "0",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "os.cpu_count()" in text and "jax " in text and "compile_depth.py --tiny" in text
    rows = table_rows(text)
    variants = ["unrolled", "unrolled, remat full", "scanned", "scanned, remat full", "scanned, remat dots"]
    losses = []
    for name in variants:
        cells = rows[name]
        trace, lower, compile_, total = (number(c) for c in cells[:4])
        assert min(trace, lower, compile_) > 0 and math.isclose(total, trace + lower + compile_, abs_tol=0.02)
        assert number(cells[7]) == 0  # no recompilation while stepping
        losses.append(number(cells[8]))
    assert max(losses) - min(losses) < 1e-5  # the same initial weights and loss in every variant
    assert number(rows["1"][0]) > 0 and number(rows["2"][1]) > 0  # the depth table
