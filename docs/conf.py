"""Sphinx configuration for the jrollout documentation.

Build (from the repository root, warnings as errors), with the package
installed (``pip install -e ".[docs]"``: autodoc reads the installed
package's docstrings):

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib
import os

from sphinx.util import logging

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jrollout  # noqa: E402

project = "jrollout"
author = "the jrollout developers"
copyright = "2026, the jrollout developers"  # noqa: A001
release = jrollout.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# No "members" key: a default of False would override the ``:members:`` the
# class directives of docs/api/*.md give, and classes would show no methods.
autodoc_default_options: dict[str, object] = {}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"jrollout {release}"
html_static_path = ["_static"]

# Type hints name JAX/numpy/flax types that have no inventory here.
nitpicky = False

# The public names the API reference must document: a name missing from it
# fails the build (with -W).
PUBLIC_MODULES = ("jrollout", "jrollout.torch", "jrollout.compat")


def _public_names() -> list[str]:
  names = []
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    public = getattr(module, "__all__", None)
    if public is None:   # a module without __all__: what it defines itself
      public = [n for n, v in vars(module).items() if not n.startswith("_")
                and getattr(v, "__module__", None) == module_name]
    for name in public:
      names.append(f"{module_name}.{name}")
      names += [f"{module_name}.{name}.{member}"
                for member in _public_members(getattr(module, name))]
  return names


def _public_members(obj: object) -> list[str]:
  """The methods and properties a public class defines itself (not those
  of its bases, such as flax's ``replace`` or an exception's), which the
  reference must list too."""
  if not isinstance(obj, type):
    return []
  names = []
  for name, value in vars(obj).items():
    func = value.fget if isinstance(value, property) else value
    if (not name.startswith("_") and callable(func)
        and getattr(func, "__module__", "").startswith("jrollout")):
      names.append(name)
  return names


def _check_api_documented(app, env) -> None:
  documented = set(env.domaindata["py"]["objects"])
  log = logging.getLogger("jrollout.docs")
  for name in _public_names():
    if name not in documented:
      log.warning("API reference: public name %s is not documented "
                  "(add it to docs/api/*.md)", name)


def setup(app):
  app.connect("env-check-consistency", _check_api_documented)
  return {"parallel_read_safe": True}
