"""Every ``python`` block in the README and the docs runs as written.

A page's blocks run in order in one namespace (as a reader pastes them), each
page in a fresh one, from a temporary directory, under JAX's default promotion
(users', not this suite's strict one). A ``>>>`` block is a doctest. Blocks
not meant to run use another language tag (``text``, ``bash``).
"""

from __future__ import annotations

import doctest
import re
import textwrap

import jax
import pytest

from tests._helpers import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PAGES = [p for p in PAGES if "_build" not in p.parts]

# A fence of three or more backticks (or MyST colons) with its language tag,
# the block, and the same fence closing it.
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|:{3,})[ \t]*(?P<info>[^\n]*)\n"
    r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.M | re.S)
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def python_blocks(text: str) -> list[tuple[int, str]]:
  """``(line, source)`` of each fenced ``python`` block of a Markdown page."""
  blocks = []
  for m in _FENCE.finditer(text):
    info = m.group("info").strip()
    if info in ("python", "py", "{code-block} python"):
      line = text.count("\n", 0, m.start("body")) + 1
      blocks.append((line, textwrap.dedent(m.group("body"))))
  return blocks


def test_the_pages_have_examples_and_a_failing_block_fails():
  """The scan finds blocks, and a block that raises or a doctest whose
  output differs is a failure (so the test below tests something)."""
  counts = {p.relative_to(ROOT).as_posix(): len(python_blocks(p.read_text()))
            for p in PAGES}
  assert counts["README.md"] >= 1, counts
  assert counts["docs/getting-started.md"] >= 1, counts
  assert sum(counts.values()) >= 20, counts
  page = "```python\nx = 1\n```\n\n```python\n>>> x + 1\n3\n```\n"
  with pytest.raises(AssertionError, match="doctest"):
    _run_page("inline.md", page)
  with pytest.raises(ZeroDivisionError):
    _run_page("inline.md", "```python\n1 / 0\n```\n")


def _run_page(name: str, text: str) -> None:
  namespace: dict = {"__name__": "__docs__"}
  for line, source in python_blocks(text):
    where = f"{name}:{line}"
    if re.search(r"^\s*>>> ", source, re.M):
      test = doctest.DocTestParser().get_doctest(source, namespace, where,
                                                 name, line - 1)
      out: list[str] = []
      runner = doctest.DocTestRunner(optionflags=_FLAGS)
      runner.run(test, out=out.append, clear_globs=False)
      namespace.update(test.globs)   # DocTest runs on a copy of the globals
      if runner.failures:
        raise AssertionError(f"doctest failed at {where}:\n" + "".join(out))
    else:
      exec(compile(source, where, "exec"), namespace)  # noqa: S102


@pytest.mark.parametrize(
    "page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_examples_run(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with jax.numpy_dtype_promotion("standard"), \
       jax.numpy_rank_promotion("allow"):
    _run_page(page.relative_to(ROOT).as_posix(), page.read_text())
