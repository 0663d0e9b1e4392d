"""The package's docstring examples (``>>>``) run as tests.

They run under this suite's settings (8 fake CPU devices, strict dtype and
rank promotion), so an example that relies on implicit promotion fails here.
"""

import doctest
import importlib
import re
import pkgutil

import pytest

import jrollout

MODULES = sorted(m.name for m in pkgutil.walk_packages(jrollout.__path__,
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
  for name in ("jrollout._ledger", "jrollout._minibatch",
               "jrollout._sharding", "jrollout.compat",
               "jrollout._checkpoint"):
    assert attempted[name] > 0, name
  assert sum(attempted.values()) >= 20, attempted


def _public_api():
  """``(qualified name, object)`` of every public function, class and
  public method or property of a public class: ``jrollout.__all__``,
  ``jrollout.compat.__all__`` and ``jrollout.torch``'s own functions."""
  import inspect  # noqa: PLC0415
  modules = [(jrollout, jrollout.__all__)]
  compat = importlib.import_module("jrollout.compat")
  modules.append((compat, compat.__all__))
  try:
    bridge = importlib.import_module("jrollout.torch")
  except ImportError:
    pass
  else:
    modules.append((bridge, [n for n, v in vars(bridge).items()
                             if not n.startswith("_") and inspect.isfunction(v)
                             and v.__module__ == bridge.__name__]))
  for module, names in modules:
    for name in names:
      obj = getattr(module, name)
      yield f"{module.__name__}.{name}", obj
      if not inspect.isclass(obj):
        continue
      for attr, member in vars(obj).items():
        if attr.startswith("_") or attr == "replace":   # flax's own replace
          continue
        if isinstance(member, property) or inspect.isfunction(member):
          doc = (member.fget if isinstance(member, property)
                 else member).__doc__
          if doc is not None:   # fields documented in the class's Attributes
            yield f"{module.__name__}.{name}.{attr}", member


def _example_lines(doc):
  return [line for line in (doc or "").splitlines()
          if line.strip().startswith((">>>", "..."))]


def test_every_public_name_has_an_example():
  """Each public function, class, method and property is shown running in
  an example (a ``>>>`` line): its own docstring's, or another public
  name's (``denormalize`` beside ``normalize``); exceptions are shown where
  they are raised."""
  api = list(_public_api())
  examples = "\n".join(line for _, obj in api for line in _example_lines(
      (obj.fget if isinstance(obj, property) else obj).__doc__))
  missing = [name for name, obj in api
             if not (isinstance(obj, type) and issubclass(obj, BaseException))
             and not _example_lines(
                 (obj.fget if isinstance(obj, property) else obj).__doc__)
             and not re.search(rf"\b{re.escape(name.rsplit('.', 1)[1])}\b",
                               examples)]
  assert not missing, missing
