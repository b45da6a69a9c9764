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
