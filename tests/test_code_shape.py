"""The library's shape: no function in jrollout/ over 60 code lines.

A code line is a line of the function (``def`` line to last line) that is
not blank, not only a comment and not part of a docstring (the function's
own or a nested function's or class's). A nested function's lines count in
its parent too, and the nested function is checked on its own.
"""

import ast
import io
import tokenize

import pytest

from tests._helpers import ROOT

PACKAGE = ROOT / "jrollout"
MAX_CODE_LINES = 60
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
             tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING}
_SCOPES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _code_lines(source):
  """The numbers of the lines that hold code, docstrings left out."""
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in _NOT_CODE:
      lines.update(range(tok.start[0], tok.end[0] + 1))
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, _SCOPES) and ast.get_docstring(node, False) is not None:
      doc = node.body[0]
      lines.difference_update(range(doc.lineno, doc.end_lineno + 1))
  return lines


def function_sizes(source):
  """``[(name, def line, code lines)]`` of every function in ``source``,
  methods and nested functions included (``name`` is dotted: ``Cls.meth``,
  ``outer.inner``)."""
  code = _code_lines(source)
  out = []

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      name = prefix
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        name = prefix + child.name
        span = range(child.lineno, child.end_lineno + 1)
        out.append((name, child.lineno, len(code.intersection(span))))
      elif isinstance(child, ast.ClassDef):
        name = prefix + child.name
      visit(child, name + "." if name != prefix else prefix)

  visit(ast.parse(source), "")
  return out


def test_the_line_count_leaves_out_blanks_comments_and_docstrings():
  source = '''
def outer(x):
  """Doc.

  More doc.
  """
  # a comment

  y = """not a docstring,
  but code"""

  def inner():
    """Inner doc."""
    return (x +
            1)   # trailing comment

  class Local:
    """Class doc."""
    z = 1
  return inner, y, Local


class Cls:
  """Doc."""

  async def meth(self):
    return 1
'''
  assert function_sizes(source) == [
      ("outer", 2, 9), ("outer.inner", 12, 3), ("Cls.meth", 26, 2)]


def test_no_library_function_has_more_than_60_code_lines():
  files = sorted(PACKAGE.rglob("*.py"))
  assert len(files) > 5, f"no sources found under {PACKAGE}"
  offenders = []
  for path in files:
    sizes = function_sizes(path.read_text())
    offenders += [f"{path.relative_to(PACKAGE.parent)}:{line} {name}: {n}"
                  for name, line, n in sizes if n > MAX_CODE_LINES]
  if offenders:
    pytest.fail(f"functions over {MAX_CODE_LINES} code lines (not blank, "
                "comment or docstring), file:line name: count:\n  "
                + "\n  ".join(offenders))
