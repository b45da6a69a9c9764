"""The documentation runs and builds: every ```python block of README.md and docs/**/*.md, and the Sphinx site.

Code blocks. A page's ```python blocks run in order as one script, in a child process on the CPU (so one block may
use the names of the blocks before it). A block right after a `<!-- not-run -->` line is left out (illustrative
only; use it rarely). One comment per page sets how it runs, e.g. `<!-- docs-test: continues=README.md devices=8 -->`:

- `continues=PATH`: the blocks of PATH (from the repository root) run first, as the page's text says it continues
  that example;
- `devices=N`: N fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`);
- `promotion=standard`: JAX's standard dtype promotion (the default is `strict`, as in the rest of the tests);
- `requires=MOD,MOD`: modules the page imports beyond jaxamp's own dependencies (the test extras install them);
  where one is missing the page skips, except where `CI` or `JAXAMP_REQUIRE_DOCS=1` is set.

Where a page's printed output is part of what it teaches, `CHECKS` asserts on it.

Sphinx. `sphinx-build -W -b html docs OUT` must pass (warnings are errors), and every public name (each `__all__` of
the library, the application's entry points) must be in the built reference's `objects.inv`. Without sphinx and
myst-parser (`pip install -e ".[docs]"`) those tests skip, except where `CI` or `JAXAMP_REQUIRE_DOCS=1` is set.
"""

import importlib
import importlib.util
import io
import os
import posixpath
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_RUN = "<!-- not-run -->"
SETTINGS = re.compile(r"<!--\s*docs-test:(.*?)-->", re.S)
SETTING_KEYS = {"continues", "devices", "promotion", "requires"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
SLOW_PAGES = {"docs/guide/autocast.md", "docs/guide/nnx.md", "docs/guide/scale-out.md", "docs/guide/fp8.md",
              "docs/guide/diagnostics.md", "docs/guide/checkpoints.md", "docs/guide/policies.md",
              "docs/guide/own-model.md", "docs/guide/loops.md"}

# The public names the API reference must hold: every public library module's __all__, and the application's entry
# points.
PUBLIC_MODULES = ("jaxamp", "jaxamp.loss_scale", "jaxamp.precision", "jaxamp.state", "jaxamp.opt_state", "jaxamp.step",
                  "jaxamp.audit",
                  "jaxamp.autocasting", "jaxamp.autocast_rules", "jaxamp.fp8_recipes", "jaxamp.fp8_quant",
                  "jaxamp.gradients", "jaxamp.finite", "jaxamp.metrics", "jaxamp.trainable", "jaxamp.fp8_collection",
                  "jaxamp.fidelity", "jaxamp.diagnostics", "jaxamp.fp8_report", "jaxamp.grad_stats", "jaxamp.layers",
                  "jaxamp.attention", "jaxamp.remat", "jaxamp.nnx", "jaxamp.nnx_fp8", "jaxamp.sharding",
                  "jaxamp.checkpoint")
APP_ENTRY_POINTS = ("jaxamp.lm.config.TrainConfig", "jaxamp.lm.train.train", "jaxamp.lm.setup.build")


def pages() -> list[Path]:
    """README.md and every Markdown page of docs/ (not the build output)."""
    found = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [ROOT / "README.md", *found]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def fences(path: Path) -> list[tuple[str, str, bool]]:
    """`(info string, code, not-run)` of every fenced block of `path`, in order."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = [line.strip() for line in text[:m.start()].splitlines() if line.strip()]
        out.append((m.group(1).strip(), m.group(2), bool(before) and before[-1] == NOT_RUN))
    return out


def python_blocks(path: Path) -> list[str]:
    return [code for info, code, skip in fences(path) if info == "python" and not skip]


def settings(path: Path) -> dict[str, str]:
    found = SETTINGS.findall(path.read_text(encoding="utf-8"))
    assert len(found) <= 1, f"{rel(path)}: more than one docs-test comment"
    pairs = dict(item.split("=", 1) for item in found[0].split()) if found else {}
    assert set(pairs) <= SETTING_KEYS, f"{rel(path)}: unknown docs-test settings {set(pairs) - SETTING_KEYS}"
    return pairs


def script(path: Path, seen=()) -> str:
    """The page's blocks, after those of the page it continues."""
    assert path not in seen, f"docs-test continues= loops through {rel(path)}"
    first = settings(path).get("continues")
    head = script(ROOT / first, (*seen, path)) if first else ""
    return head + "".join(python_blocks(path))


def run_page(path: Path, tmp_path: Path) -> list[str]:
    """Runs the page's script in a child process; returns its printed lines."""
    opts = settings(path)
    missing = [m for m in opts.get("requires", "").split(",") if m and importlib.util.find_spec(m) is None]
    if missing:
        reason = f"{rel(path)} needs {', '.join(missing)}: pip install -e \".[test]\""
        if os.environ.get("CI") or os.environ.get("JAXAMP_REQUIRE_DOCS") == "1":
            pytest.fail(reason + " (required here: CI or JAXAMP_REQUIRE_DOCS=1)")
        pytest.skip(reason)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "JAX_NUMPY_DTYPE_PROMOTION": opts.get("promotion", "strict")}
    if "devices" in opts:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={int(opts['devices'])}").strip()
    file = tmp_path / (path.stem + ".py")
    file.write_text(script(path), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(file)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{rel(path)}'s code failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.splitlines()


# ---------------------------------------------------------------------------------------------------------------------
# What the pages print.


def _falling_finite_steps(lines: list[str]) -> None:
    """Lines `LOSS True ...`: finite steps whose loss falls."""
    steps = [line.split() for line in lines]
    assert [s[1] for s in steps] == ["True"] * len(steps), lines  # no step skipped
    losses = [float(s[0]) for s in steps]
    assert losses == sorted(losses, reverse=True), losses


def check_readme(lines):
    assert len(lines) == 3, lines
    _falling_finite_steps(lines)


def check_own_model(lines):
    assert len(lines) == 6, lines
    _falling_finite_steps(lines[:3])
    assert lines[3] == "(4,) 4", lines  # aux stacked per micro-batch; one optimizer step
    assert lines[4] == "['aux', 'loss']", lines
    assert lines[5] == "True False", lines  # the frozen kernel bitwise unchanged, the trained one changed


def check_loss_scaling(lines):
    assert len(lines) == 3, lines
    assert lines[0] == "False 32768.0 1.0", lines  # skipped: params unchanged
    finite, scale, w = lines[1].split()
    assert (finite, scale) == ("True", "16384.0") and abs(float(w) - 0.7) < 1e-6, lines
    assert lines[2] == "True 1 16384.0", lines  # one retry at the backed-off scale


def check_policies(lines):
    assert lines == ["True ['down/bias', 'down/kernel'] True", "float16 1", "bf16 12.0 float32",
                     "bf16;opt_state=bf16 8.0 bfloat16"], lines


def check_nnx(lines):
    assert len(lines) == 12, lines
    mlp = [line.split() for line in lines[:3]]
    assert [s[1:] for s in mlp] == [["True", "float32"]] * 3, lines  # finite steps, float32 master weights
    assert lines[3] == "True", lines  # eval_step in eval mode
    assert lines[4] == "loss_fn uses an nnx.Rngs that the model does not hold (e.g.", lines  # the one-line refusal
    assert lines[5] == "True", lines  # the keys from the batch: finite steps
    for losses in ([float(s[0]) for s in mlp], [float(line) for line in lines[6:9]]):
        assert losses == sorted(losses, reverse=True), lines  # MLP and Transformer block losses fall
    assert lines[9] == "4 True True", lines  # restored model and optimizer continue exactly
    assert lines[10] == "True True", lines  # the FP8 MLP: finite steps, delayed scaling moved its input scale
    assert lines[11] == "l1/dot_general input ['l1/bias', 'l1/kernel', 'l2/bias', 'l2/kernel']", lines  # diagnostics


def check_fp8(lines):
    assert len(lines) == 8, lines
    # fp8-current on a plain float32 model: finite, the hidden layer in FP8 (most FLOPs), the head bf16
    assert re.fullmatch(r"True 0\.9\d \[\('bfloat16', 'bfloat16'\), \('float8_e4m3fn', 'float8_e4m3fn'\)\]",
                        lines[7]), lines
    _falling_finite_steps(lines[:3])
    assert lines[3] == "float32 (1024,) True", lines  # FP8 state float32, delayed scaling moved the input scale
    assert lines[4] == ("[('Dense_0/Fp8DirectDotGeneralOp_0', 'input'), ('Dense_0/Fp8DirectDotGeneralOp_0', "
                        "'kernel'), ('Dense_0/Fp8DirectDotGeneralOp_0', 'output_grad')]"), lines
    assert lines[5].startswith("| FP8 op | tensor | format | amax |"), lines
    leaves = [f"params/Dense_{i}/{name}" for i in (0, 1) for name in ("bias", "kernel")]
    assert lines[6] == str(leaves), lines  # grad_fidelity of the whole variables dict: the Params, not the FP8 state


def check_checkpoints(lines):
    assert lines == ["[2] {'lr': 0.001, 'precision': 'fp16'} 2",
                     "True",  # resumed bitwise
                     "checkpoint at step 2 was saved with lr=0.001 but this run has lr=0.0003",
                     "fp16 DynamicLossScale",
                     "bfloat16 2"], lines


def check_scale_out(lines):
    """The README's example, then one step of it on a data=2,fsdp=4 mesh of 8 devices, saved and restored."""
    assert len(lines) == 5, lines
    check_readme(lines[:3])
    losses = [float(line.split()[0]) for line in lines[:3]] + [float(lines[3])]
    assert losses == sorted(losses, reverse=True), losses  # the loss falls, also on the 8-device mesh
    assert lines[4] == "restored 4 {'note': 'any JSON-able run config'}", lines


def check_diagnostics(lines):
    assert len(lines) == 8, lines
    assert lines[0].startswith("| layer | module | shape |"), lines
    assert lines[1] == "fp16", lines
    assert lines[2] == "True True", lines  # the loss scale flushes no more than no scale; 2**15 has headroom
    assert lines[3] == "['headroom_log2', 'leaf_headroom_log2', 'leaf_zero_fraction', 'zero_fraction']", lines
    assert re.fullmatch(r"Dense_[01]/(kernel|bias)", lines[4]), lines
    assert lines[5] == "[]", lines
    assert lines[6] == "['Dense_0/bias', 'Dense_0/kernel', 'Dense_1/bias', 'Dense_1/kernel'] True", lines
    assert lines[7] == "2", lines


def check_autocast(lines):
    assert lines[:2] == ["True float32", "1.0"], lines  # trained, float32 master weights; every matmul in bf16
    assert lines[2] == "{'bfloat16'}", lines  # forward and backward matmuls of autocast's x @ w: bfloat16
    assert float(lines[3]) > 0, lines
    assert lines[4] == "0.0 True", lines  # the cast policy: every matmul float32, because the images are float32
    assert 0.1 < float(lines[5]) < 0.6, lines  # recompute_elementwise: a scanned block under autocast saves less


def check_loops(lines):
    assert lines[:3] == ["True 1 32768.0", "False 1 16384.0", "True 2 16384.0"], lines  # the overflow skipped
    assert lines[3].startswith("precision audit (fp16): 100.0% of ") and lines[3].endswith(" in half precision")
    assert lines[4] == "True" and lines[5].startswith("precision audit (bf16;autocast): 100.0% of "), lines
    assert lines[6:] == ["['Dense_0/bias']", "8 True True", "29.0", "False 3 1024.0", "True float32",
                         "['bfloat16', 'float32']", "1.000 True", "1.000 0.000"], lines


CHECKS = {
    "README.md": check_readme,
    "docs/guide/loops.md": check_loops,
    "docs/guide/autocast.md": check_autocast,
    "docs/guide/own-model.md": check_own_model,
    "docs/guide/loss-scaling.md": check_loss_scaling,
    "docs/guide/policies.md": check_policies,
    "docs/guide/nnx.md": check_nnx,
    "docs/guide/fp8.md": check_fp8,
    "docs/guide/checkpoints.md": check_checkpoints,
    "docs/guide/scale-out.md": check_scale_out,
    "docs/guide/diagnostics.md": check_diagnostics,
}


def _page_params():
    for path in pages():
        if python_blocks(path):
            marks = [pytest.mark.slow] if rel(path) in SLOW_PAGES else []
            yield pytest.param(path, id=rel(path), marks=marks)


@pytest.mark.parametrize("path", list(_page_params()))
def test_page_code_runs(path, tmp_path):
    lines = run_page(path, tmp_path)
    check = CHECKS.get(rel(path))
    if check is not None:
        check(lines)


# ---------------------------------------------------------------------------------------------------------------------
# The pages themselves (quick).


def test_every_code_block_is_collected():
    """Python blocks are fenced as ```python (another spelling would not run), opt-outs sit before a python block, and
    every page with a printed result has its check."""
    for path in pages():
        for info, _, skip in fences(path):
            assert not (info.lower().startswith("py") and info != "python"), f"{rel(path)}: ```{info} would not run"
            assert not skip or info == "python", f"{rel(path)}: {NOT_RUN} before a ```{info} block"
        settings(path)  # known keys only
        text = path.read_text(encoding="utf-8")
        assert text.count(NOT_RUN) == sum(skip for _, _, skip in fences(path)), f"{rel(path)}: a stray {NOT_RUN}"
    assert set(CHECKS) <= {rel(p) for p in pages()}, "a check names a page that does not exist"


def test_readme_example_is_the_guides():
    """The README's example is the first block of "Your own model" (the scale-out page continues either)."""
    assert python_blocks(ROOT / "README.md")[0] == python_blocks(DOCS / "guide" / "own-model.md")[0]


def test_readme_is_one_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "the README is the front page: keep details in docs/"
    assert "python -m pytest -q" in text and "experiments/train_lm.py --steps 300" in text


def _slug(heading: str) -> str:
    """GitHub's (and myst's) anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_links_resolve():
    """Relative links of README.md and docs/ point at files that exist, and `page.md#anchor` at a heading there
    (Sphinx checks docs/ again; the README is not part of the Sphinx build)."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    for path in pages():
        text = FENCE.sub("", path.read_text(encoding="utf-8"))
        for target in link.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{rel(path)}: link to missing {target}"
            if anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", FENCE.sub("", dest.read_text(encoding="utf-8")), re.M)
                assert anchor in {_slug(h) for h in headings}, f"{rel(path)}: no heading #{anchor} in {file}"


# ---------------------------------------------------------------------------------------------------------------------
# Sphinx.


def _require_sphinx():
    missing = [m for m in ("sphinx", "myst_parser") if importlib.util.find_spec(m) is None]
    if missing:
        reason = (f"{' and '.join(missing)} not installed: the docs build needs pip install -e \".[docs]\"")
        if os.environ.get("CI") or os.environ.get("JAXAMP_REQUIRE_DOCS") == "1":
            pytest.fail(reason + " (required here: CI or JAXAMP_REQUIRE_DOCS=1)")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory):
    """`sphinx-build -W -b html docs OUT`: (completed process, OUT)."""
    _require_sphinx()
    out = tmp_path_factory.mktemp("html")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", str(DOCS), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return proc, out


@pytest.mark.slow
def test_docs_build_without_warnings(built_docs):
    proc, out = built_docs
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stderr[-6000:]}"
    assert (out / "index.html").exists() and (out / "api" / "jaxamp.html").exists()


@pytest.mark.slow
def test_api_reference_has_every_public_name(built_docs):
    proc, out = built_docs
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stderr[-6000:]}"
    from sphinx.util.inventory import InventoryFile

    data = (out / "objects.inv").read_bytes()
    if hasattr(InventoryFile, "loads"):  # Sphinx >= 8.2
        inventory = InventoryFile.loads(data, uri="")
    else:
        inventory = InventoryFile.load(io.BytesIO(data), "", posixpath.join)
    entries = getattr(inventory, "data", inventory)  # {role: {name: entry}}
    documented = {name for names in entries.values() for name in names}
    wanted = [f"{m}.{name}" for m in PUBLIC_MODULES for name in importlib.import_module(m).__all__]
    wanted += APP_ENTRY_POINTS
    missing = [name for name in wanted if name not in documented]
    assert not missing, f"not in the API reference (docs/api, docs/_tools/gen_api.py): {missing}"
