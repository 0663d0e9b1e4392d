"""The package's docstring examples (``>>>``) run as tests.

They run under this suite's settings (8 fake CPU devices, strict dtype and
rank promotion), so an example that relies on implicit promotion fails here.
"""

import doctest
import importlib
import pkgutil

import pytest

import jrollout

MODULES = sorted(m.name for m in pkgutil.iter_modules(jrollout.__path__,
                                                      "jrollout."))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _run(name: str) -> doctest.TestResults:
  if name == "jrollout.torch":
    pytest.importorskip("torch")
  return doctest.testmod(importlib.import_module(name), optionflags=FLAGS,
                         raise_on_error=False, report=True)


@pytest.mark.parametrize("name", ["jrollout", *MODULES])
def test_docstring_examples(name, capsys):
  result = _run(name)
  assert result.failed == 0, capsys.readouterr().out


def test_the_examples_exist():
  """The public entry points carry examples (so the test above tests some)."""
  attempted = {name: _run(name).attempted for name in MODULES}
  for name in ("jrollout._buffer", "jrollout._minibatch",
               "jrollout._sharding", "jrollout.compat"):
    assert attempted[name] > 0, name
  assert sum(attempted.values()) >= 20, attempted
