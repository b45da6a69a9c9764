"""benchmarks/torch_amp_drift.py: torch.amp on PyTorch twins of three outside models (skipped without PyTorch, which
is not a jaxamp dependency).

The twins must be the JAX trials' functions (same weights, same batch, same float32 loss), and the emulation of CUDA
autocast's float32 list must put exactly those ops in float32, or the torch.amp yardstick measures something else.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import torch_amp_drift as tad  # noqa: E402


def test_the_cuda_float32_list_runs_softmax_and_layer_norm_in_float32_and_leaves_matmuls_in_bf16():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu = x @ w
        cpu_softmax, cpu_norm = torch.nn.functional.softmax(cpu, -1), torch.nn.functional.layer_norm(cpu, (8,))
        with tad.CudaFloat32List():
            y = x @ w
            softmax, norm = torch.nn.functional.softmax(y, -1), torch.nn.functional.layer_norm(y, (8,))
            total, powered = y.sum(), y.pow(2)
    assert (cpu.dtype, cpu_softmax.dtype, cpu_norm.dtype) == (torch.bfloat16,) * 3  # CPU autocast's own lists
    assert y.dtype == torch.bfloat16
    assert (softmax.dtype, norm.dtype, total.dtype, powered.dtype) == (torch.float32,) * 4
    # float32 inputs from the bf16 values: the same numbers as an explicit upcast
    assert torch.equal(softmax, torch.nn.functional.softmax(y.float(), -1))
    with tad.CudaFloat32List():  # autocast off: the mode changes nothing
        assert torch.nn.functional.softmax(y, -1).dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("name", list(tad.TWINS))
def test_each_twin_computes_the_jax_trials_float32_loss(name):
    assert tad.twin_first_loss(name, {}) == pytest.approx(tad.jax_first_loss(name), rel=1e-5, abs=1e-5)


@pytest.mark.slow
def test_two_float32_runs_agree_bitwise_and_the_rounded_and_autocast_runs_differ():
    """The yardstick's float32 run is deterministic (same data, same dropout masks), so every gap is the
    precision's; rounding the weights and autocast each move the losses."""
    runs = {mode: tad.run("gpt2_hf", mode, 3, 1, {}) for mode in tad.MODES}
    assert runs["fp32"] == tad.run("gpt2_hf", "fp32", 3, 1, {})
    for mode in tad.MODES[1:]:
        assert runs[mode] != runs["fp32"], mode
    assert np.allclose(runs["autocast cpu"], runs["fp32"], atol=0.05)  # bf16 rounding, not another model


def test_leaf_count_uses_the_near_zero_rule_and_the_floor():
    exact = {"a": torch.ones(4, dtype=torch.float64), "b": torch.full((4,), 1e-6, dtype=torch.float64)}
    floor = {"a": exact["a"] * 1.01, "b": exact["b"]}  # a's floor 1%: its bound max(2%, 1.5%) = 2%
    assert tad.leaf_count({"a": exact["a"] * 1.019, "b": exact["b"] * 9}, exact, floor) == (1, 1)  # b near zero
    assert tad.leaf_count({"a": exact["a"] * 1.021, "b": exact["b"]}, exact, floor) == (0, 1)


@pytest.mark.slow
def test_torch_amp_drift_tiny(tmp_path):
    """The script end to end on the ResNet twin, 2 steps, one draw: its table and the twin's first-loss check."""
    out = tmp_path / "drift.md"
    assert tad.main(["--trials", "imagenet_resnet", "--steps", "2", "--seeds", "1", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| imagenet_resnet |")]
    assert [r.split(" | ")[1] for r in rows] == ["autocast cpu", "autocast + CUDA float32 list", "2.020420"]
    assert "/10 |" in rows[0]  # the leaf count of the ResNet's 10 counted leaves


def test_dropout_is_refused_for_twins_without_dropout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tad.main(["--trials", "esm2_equinox", "--dropout", "0", "--out", str(tmp_path / "z.md")])
    assert "--dropout 0.0: give a rate in [0, 1), with --trials gpt2_hf" in capsys.readouterr().err
    assert not (tmp_path / "z.md").exists() and not tad.TRIAL_OPTIONS
