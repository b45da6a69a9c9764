"""Sphinx configuration: Markdown pages (myst-parser), an API reference from the Google-style docstrings (autodoc,
napoleon). Build: ``sphinx-build -W -b html docs docs/_build/html`` (warnings are errors, as in CI)."""

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports jaxamp; no accelerator needed
# The checkout, before any installed jaxamp.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

project = "jaxamp"
author = "the jaxamp authors"
copyright = "the jaxamp authors, Apache-2.0"
release = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Markdown: heading anchors for links such as [FP8](guide/fp8.md#diagnostics).
myst_heading_anchors = 3

# The docstrings are Google style and write names in single backticks, as code.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False  # the return type, where a docstring names one, beside its description
default_role = "code"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "signature"

html_theme = "alabaster"
html_title = "jaxamp"


# The library's docstrings are plain text in the Google style, Markdown-flavoured: code in single backticks (`x`,
# `{"loss": f32[]}`), bars as text (`|x|`), the odd Markdown table. Before napoleon reads them, make that valid
# reStructuredText: single-backtick spans become literals (so a colon inside one is not taken for napoleon's
# "name: description" split), a bar outside a literal is text, not a substitution reference, and a table a
# list-table.
_SPAN = re.compile(r"``.+?``|(?<![`\\])`([^`\n]+?)`(?!`)")


def _rst_line(line: str) -> str:
    out, pos = [], 0
    for m in _SPAN.finditer(line):
        out.append(line[pos:m.start()].replace("|", r"\|"))
        if m.group(1) is None:  # already a literal
            out.append(m.group(0))
        else:
            before = line[m.start() - 1] if m.start() else " "
            after = line[m.end()] if m.end() < len(line) else " "
            out.append(("\\ " if before.isalnum() else "") + f"``{m.group(1)}``" + ("\\ " if after.isalnum() else ""))
        pos = m.end()
    out.append(line[pos:].replace("|", r"\|"))
    return "".join(out)


def _first_lines(*docs) -> set[str]:
    return {doc.strip().split("\n")[0].strip() for doc in docs if isinstance(doc, str) and doc.strip()}


def _plain_docstring_to_rst(app, what, name, obj, options, lines):
    if what == "data" and lines and lines[0].strip() in _first_lines(type(obj).__doc__, getattr(obj, "__doc__", None)):
        lines[:] = []  # module data: not the docstring of its type (dict's, ndarray's); the API page describes it
        return
    lines[:] = _tables_and_spans(lines)


# A Markdown table (a header row, a `| --- |` row, body rows; `\|` a bar inside a cell) becomes a list-table.
_ROW = re.compile(r"^(\s*)\|(.*)\|\s*$")
_RULE = re.compile(r"^\s*\|(\s*:?-{3,}:?\s*\|)+\s*$")


def _cells(line: str) -> list[str]:
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", _ROW.match(line).group(2))]


def _tables_and_spans(lines: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(lines):
        head = _ROW.match(lines[i])
        if not (head and i + 1 < len(lines) and _RULE.match(lines[i + 1])):
            out.append(_rst_line(lines[i]))
            i += 1
            continue
        indent, rows, j = head.group(1), [], i
        while j < len(lines) and _ROW.match(lines[j]):
            if not _RULE.match(lines[j]):
                rows.append(_cells(lines[j]))
            j += 1
        out += ["", f"{indent}.. list-table::", f"{indent}   :header-rows: 1", ""]
        for row in rows:
            out += [f"{indent}   {'* -' if k == 0 else '  -'} {_rst_line(cell)}".rstrip() for k, cell in enumerate(row)]
        out.append("")
        i = j
    return out


def setup(app):
    app.connect("autodoc-process-docstring", _plain_docstring_to_rst, priority=400)  # napoleon runs at 500
