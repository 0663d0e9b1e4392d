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


@pytest.mark.parametrize("name", ["jrollout", *MODULES])
def test_docstring_examples(name, capsys):
  """The examples pass, and a module defining a public name has some."""
  if name == "jrollout.torch":
    pytest.importorskip("torch")
  result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS,
                           raise_on_error=False, report=True)
  assert result.failed == 0, capsys.readouterr().out
  homes = {getattr(obj, "__module__", None) for _, obj in _public_api()
           if not (isinstance(obj, type) and issubclass(obj, BaseException))}
  assert result.attempted > 0 or name not in homes, name


def _public_api():
  """``(qualified name, object)`` of every public function, class and
  public method or property (its getter) of a public class:
  ``jrollout.__all__``, ``jrollout.compat.__all__`` and ``jrollout.torch``'s
  own functions."""
  import inspect  # noqa: PLC0415
  compat = importlib.import_module("jrollout.compat")
  modules = [(jrollout, jrollout.__all__), (compat, compat.__all__)]
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
        if isinstance(member, property):
          member = member.fget
        # (a field without a docstring is documented in the class's)
        if inspect.isfunction(member) and member.__doc__ is not None:
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
  examples = "\n".join(line for _, obj in api
                       for line in _example_lines(obj.__doc__))
  missing = [name for name, obj in api
             if not (isinstance(obj, type) and issubclass(obj, BaseException))
             and not _example_lines(obj.__doc__)
             and not re.search(rf"\b{re.escape(name.rsplit('.', 1)[1])}\b",
                               examples)]
  assert not missing, missing
