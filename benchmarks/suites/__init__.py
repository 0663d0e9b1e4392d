"""The registry of measurement modules.

Each module ``benchmarks/suites/<name>.py`` exposes ``MEASUREMENTS``, a list
of ``benchmarks.harness.Measurement``. To add one, drop a module here and
add its name to ``SUITES`` (the order is the run order and the report's).
"""

from __future__ import annotations

import importlib

from benchmarks import harness as h

SUITES = [
    "writes",
    "batch",
    "epoch",
    "sequence",
    "compile",
    "bridge",
    "ppo",
    "hostloop",
]


def load(names=SUITES) -> list[h.Measurement]:
  """Every registered measurement, in order; names must be unique."""
  out, seen = [], set()
  for name in names:
    module = importlib.import_module(f"benchmarks.suites.{name}")
    for m in module.MEASUREMENTS:
      if m.name in seen:
        raise ValueError(f"duplicate measurement name {m.name!r} in {name}")
      seen.add(m.name)
      m.suite = name
      out.append(m)
  return out
