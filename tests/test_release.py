"""Release hygiene: one version everywhere, a changelog entry for it."""

import importlib.metadata
import pathlib
import re

import jrollout
from tests._helpers import ROOT


def test_version_is_the_package_and_pyproject_version():
  text = (ROOT / "pyproject.toml").read_text()
  version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
  assert jrollout.__version__ == version
  assert jrollout.__version__ == importlib.metadata.version("jrollout")


def test_changelog_has_a_section_for_the_version():
  text = (ROOT / "CHANGELOG.md").read_text()
  assert re.search(rf"^## \[{re.escape(jrollout.__version__)}\] - "
                   r"\d{4}-\d{2}-\d{2}$", text, re.M), text[:500]
  assert "## [Unreleased]" in text


def test_the_package_ships_py_typed():
  assert (pathlib.Path(jrollout.__file__).parent / "py.typed").is_file()


def test_the_license_file_is_the_declared_apache_2_0():
  text = (ROOT / "pyproject.toml").read_text()
  assert 'license = { text = "Apache-2.0" }' in text
  license_text = (ROOT / "LICENSE").read_text()
  assert license_text.lstrip().startswith("Apache License\n")
  assert "Version 2.0, January 2004" in license_text
  assert "END OF TERMS AND CONDITIONS" in license_text
