"""The registry of measurement modules.

Each module ``benchmarks/suites/<name>.py`` exposes ``MEASUREMENTS``, a list
of ``benchmarks.harness.Measurement``, and may name its cheapest
measurement ``SMOKE`` (the case ``python -m benchmarks --smoke`` runs;
default: its first; None: covered by another suite's smoke case). To add
one, drop a module here and add its name to ``SUITES`` (the default run, in
run order) or ``EXTRA`` (run only when ``--only`` names it).
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
    "gae",
    "bridge",
    "checkpoint",
    "ppo",
    "hostloop",
]
# Long runs, left out of `python -m benchmarks`: `--only ppo_sweep`.
EXTRA = [
    "ppo_sweep",
]


def load(names=SUITES) -> list[h.Measurement]:
  """Every measurement of the suites ``names``, in order; names are unique."""
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


def smoke_cases(measurements: list[h.Measurement]) -> list[h.Measurement]:
  """Each suite's smoke case (its ``SMOKE``, else its first measurement)."""
  out, done = [], set()
  for m in measurements:
    if m.suite in done:
      continue
    done.add(m.suite)
    module = importlib.import_module(f"benchmarks.suites.{m.suite}")
    name = getattr(module, "SMOKE", m.name)
    if name is not None:
      out.append(next(x for x in measurements if x.name == name))
  return out
