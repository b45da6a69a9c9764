"""The README's Python examples run as written (8 fake CPU devices for the sharding one, in a child process)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _block(after: str) -> str:
    """The first ```python block after the line that contains `after`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(re.escape(after) + r".*?```python\n(.*?)```", text, re.S)
    assert match, f"no python block after {after!r} in README.md"
    return match.group(1)


def test_readme_examples_run(tmp_path):
    example = _block("## Use it in your own code")
    scale_out = _block("In your own code (`jaxamp.sharding`)")
    assert "Checkpointer(tempfile.mkdtemp())" in scale_out  # a fresh directory per run of the snippet
    script = tmp_path / "readme.py"
    script.write_text(example + scale_out + 'print("restored", int(state.step), config)\n', encoding="utf-8")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "JAX_NUMPY_DTYPE_PROMOTION": "strict"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    steps = [line.split() for line in lines[:3]]
    assert [s[1] for s in steps] == ["True"] * 3, lines  # no step of the example is skipped
    losses = [float(s[0]) for s in steps] + [float(lines[3])]
    assert losses == sorted(losses, reverse=True), losses  # the loss falls, also on the 8-device mesh
    assert lines[4] == "restored 4 {'note': 'any JSON-able run config'}", lines


def _section_blocks(heading: str) -> str:
    """Every ```python block of the README section that starts at `heading`, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return "".join(re.findall(r"```python\n(.*?)```", section, re.S))


def test_readme_nnx_examples_run(tmp_path):
    """The NNX section's MLP, Transformer block, checkpoint and FP8 examples, in one script (standard promotion: Flax's
    BatchNorm and LayerNorm mix float16 with float32 inside)."""
    script = tmp_path / "readme_nnx.py"
    script.write_text(_section_blocks("## Flax NNX models"), encoding="utf-8")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 9, lines
    mlp = [line.split() for line in lines[:3]]
    assert [s[1:] for s in mlp] == [["True", "float32"]] * 3, lines  # finite steps, float32 master weights
    for losses in ([float(s[0]) for s in mlp], [float(line) for line in lines[3:6]]):
        assert losses == sorted(losses, reverse=True), lines  # MLP and Transformer block losses fall
    assert lines[6] == "4 True True", lines  # restored model and optimizer continue exactly
    assert lines[7] == "True True", lines  # the FP8 MLP: finite steps, delayed scaling moved its input scale
    assert lines[8] == "l1/dot_general input ['l1/bias', 'l1/kernel', 'l2/bias', 'l2/kernel']", lines  # diagnostics


def test_readme_float32_lookups_example_trains_and_checks_its_gradients(tmp_path):
    """The `jaxamp.layers` LM of "Float32 lookups": it initialises, trains a step under its bf16 policy and passes
    grad_fidelity's float32 reference (its dtype comes from the params), under strict promotion."""
    block = _block("`jaxamp.layers` holds the pieces that keep those sums in float32")
    script = tmp_path / "readme_lm.py"
    script.write_text("import jax, jax.numpy as jnp, optax\nimport flax.linen as nn\n" + block + """
from jaxamp import NoOpLossScale, TrainState, train_step
from jaxamp.fidelity import grad_fidelity
lm = LM(50)
ids = jax.random.randint(jax.random.key(0), (4, 9), 0, 50)
state = TrainState.create(params=lm.init(jax.random.key(1), ids[:, :-1])["params"], tx=optax.adam(1e-3),
                          policy=policy, loss_scale=NoOpLossScale(), rng=jax.random.key(2))
def loss_fn(params, batch, rng):
    logits = lm.apply({"params": params}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
state, metrics = jax.jit(train_step, static_argnames="loss_fn")(state, ids, loss_fn)
errors = grad_fidelity(state, ids, loss_fn)
print(bool(metrics["grads_finite"]), sorted(errors)[:2], max(float(e) for e in errors.values()) < 0.05)
""", encoding="utf-8")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUMPY_DTYPE_PROMOTION": "strict"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "True ['down/bias', 'down/kernel'] True", proc.stdout
