"""Where the outside model code comes from: registry packages, used as published, never copied into this repo.

- Hugging Face GPT-2 (`transformers.FlaxGPT2LMHeadModel`) and ESM2 in Equinox (`esm2quinox.ESM2`) are installed
  packages: imported as a user imports them.
- The four Flax models (lm1b, ImageNet ResNet, NNX Gemma, the NNX MNIST tutorial's CNN) are not in Flax's wheel but
  are in Flax's source distribution on PyPI (`examples/` and `docs_nnx/`). `flax_source()` takes the sdist of the
  *installed* Flax version with pip (`pip download --no-deps --no-binary :all: flax==X`, once: it is cached), keeps
  only the files listed in `FLAX_FILES` plus the LICENSE, and the trials import those files from there unchanged:
  `load_module` imports a file by path, `load_functions` runs only the named top-level functions of a training
  script (its other imports, tensorflow, clu, ..., are not needed), `load_code_cell` runs the import statements and
  the named class/function definitions of a MyST notebook's code cells (the MNIST tutorial).

Cache: `$JAXAMP_OUTSIDE_MODELS_CACHE`, else `~/.cache/jaxamp/outside_models`. `JAXAMP_FLAX_SDIST=/path/flax-X.tar.gz`
uses a given sdist instead of pip (offline machines). `python -m tests.outside_models` (from the repo root) fills the
cache (a CI step before pytest); the tests only read it: without it `SourceUnavailable` is raised and they skip with
its message.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

# sha256 of the PyPI sdists these trials were written against (pip checks the index's hashes as it downloads; this
# pins the exact file for the versions we know).
KNOWN_SDIST_SHA256 = {
    "0.12.8": "1bb438775b967a3f1f42b9c3d4ddf1d2883cd6406589f9cecdc244634036bdc4",
}

# Files kept from the sdist (paths below its top folder `flax-X/`).
FLAX_FILES = (
    "LICENSE",
    "examples/lm1b/models.py",
    "examples/lm1b/train.py",
    "examples/imagenet/models.py",
    "examples/imagenet/train.py",
    "examples/gemma/helpers.py",
    "examples/gemma/layers.py",
    "examples/gemma/modules.py",
    "examples/gemma/params.py",
    "examples/gemma/positional_embeddings.py",
    "examples/gemma/sow_lib.py",
    "examples/gemma/train.py",
    "examples/gemma/transformer.py",
    "examples/gemma/transformer_cfg.py",
    "docs_nnx/mnist_tutorial.md",
)


class SourceUnavailable(RuntimeError):
    """The outside model source could not be had here (no cache, no pip download)."""


def cache_root() -> Path:
    env = os.environ.get("JAXAMP_OUTSIDE_MODELS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "jaxamp" / "outside_models"


def flax_version() -> str:
    return importlib.metadata.version("flax")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_sdist(version: str, into: Path) -> Path:
    given = os.environ.get("JAXAMP_FLAX_SDIST")
    if given:
        return Path(given)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           f"flax=={version}", "-d", str(into)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SourceUnavailable(f"`{' '.join(cmd)}` did not run: {err}") from err
    found = sorted(into.glob(f"flax-{version}.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SourceUnavailable(f"`pip download flax=={version}` (sdist) failed: {' | '.join(tail)}")
    return found[0]


def flax_source(*, download: bool = False) -> Path:
    """The folder holding `FLAX_FILES` of the installed Flax version's sdist, from the cache; with `download`
    (`python -m tests.outside_models`, a CI step before the tests) it is fetched with pip first if absent. Tests
    never download: without the cache they skip."""
    version = flax_version()
    root = cache_root() / f"flax-{version}"
    if all((root / rel).is_file() for rel in FLAX_FILES):
        return root
    if not download and not os.environ.get("JAXAMP_FLAX_SDIST"):
        raise SourceUnavailable(f"Flax {version}'s example sources are not cached in {root}: run "
                                "`python -m tests.outside_models` once (it fetches Flax's sdist from PyPI with pip)")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = _download_sdist(version, Path(tmp))
        want = KNOWN_SDIST_SHA256.get(version)
        got = _sha256(sdist)
        if want and got != want:
            raise SourceUnavailable(f"{sdist} has sha256 {got}, expected {want} for flax {version}")
        staging = Path(tempfile.mkdtemp(prefix=f".flax-{version}-", dir=root.parent))  # same filesystem as root
        try:
            with tarfile.open(sdist) as tar:
                top = f"flax-{version}/"
                members = {m.name[len(top):]: m for m in tar.getmembers() if m.name.startswith(top)}
                missing = [rel for rel in FLAX_FILES if rel not in members]
                if missing:
                    raise SourceUnavailable(f"flax {version}'s sdist lacks {missing}")
                for rel in FLAX_FILES:
                    out = staging / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(members[rel]).read())
            (staging / "SOURCE.txt").write_text(
                f"PyPI sdist flax-{version}.tar.gz, sha256 {got}; files: {', '.join(FLAX_FILES)}\n")
            if root.exists():  # an incomplete earlier copy
                shutil.rmtree(root, ignore_errors=True)
            try:
                os.rename(staging, root)  # whole or not at all
            except OSError:
                if not all((root / rel).is_file() for rel in FLAX_FILES):  # not another process's complete copy
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root


def load_module(path: Path, name: str, search_path: Path | None = None,
                siblings: tuple[str, ...] = ()) -> ModuleType:
    """Imports the file `path` as module `name`, unchanged.

    `search_path`/`siblings`: for example code that imports its sibling files by top-level name (Flax's Gemma
    example: `import layers`, `import modules`, ...). The folder goes first on `sys.path` while the import runs; the
    siblings it imported are then removed from `sys.modules` again (the loaded modules keep their references), so
    generic names such as `layers` or `params` do not shadow anything else in the test process.
    """
    if name in sys.modules:
        return sys.modules[name]
    saved = {s: sys.modules.pop(s) for s in siblings if s in sys.modules}
    if search_path is not None:
        sys.path.insert(0, str(search_path))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    finally:
        if search_path is not None:
            sys.path.remove(str(search_path))
        for s in siblings:
            sys.modules.pop(s, None)
        sys.modules.update(saved)


def _run_nodes(nodes: list[ast.stmt], filename: str, namespace: dict) -> dict:
    code = compile(ast.Module(body=nodes, type_ignores=[]), filename, "exec")
    exec(code, namespace)  # noqa: S102 -- the published definitions, as written
    return namespace


def load_functions(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    """Runs only the top-level definitions `names` of the script `path` (decorators included) in `namespace`.

    For the loss functions of the examples' training scripts, whose other imports (tensorflow, clu, ...) the model
    does not need: `namespace` supplies the modules those definitions use (`jnp`, `nn`, `common_utils`, ...).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    found = {n.name for n in nodes}
    if found != set(names):
        raise SourceUnavailable(f"{path} does not define {sorted(set(names) - found)}")
    return _run_nodes(nodes, str(path), namespace)


def code_cells(markdown: str) -> list[tuple[int, str]]:
    """The ```{code-cell} blocks of a MyST (jupytext) notebook, in order, each with its first line's number - 1."""
    cells, current, start = [], None, 0
    for number, line in enumerate(markdown.splitlines(), 1):
        if current is None and line.startswith("```{code-cell}"):
            current, start = [], number
        elif current is not None and line.startswith("```"):
            cells.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return cells


def load_code_cell(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    """Runs, from the code cells of the notebook `path` that define `names`, their imports and those definitions.

    Other statements of those cells (instantiating and displaying a model, plotting) are left out.
    """
    nodes: list[ast.stmt] = []
    found: set[str] = set()
    for offset, cell in code_cells(path.read_text(encoding="utf-8")):
        tree = ast.increment_lineno(ast.parse(cell, filename=str(path)), offset)  # tracebacks name the .md's lines
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
        if not defs:
            continue
        nodes += [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))] + defs
        found |= {n.name for n in defs}
    if found != set(names):
        raise SourceUnavailable(f"{path} does not define {sorted(set(names) - found)}")
    return _run_nodes(nodes, str(path), namespace)


