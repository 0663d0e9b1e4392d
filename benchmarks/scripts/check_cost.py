"""What the write check costs the PPO example's compile, by where it sits.

The example closes every rollout with ``jr.finish_rollout`` inside its
update scan, and its host loop wraps the whole run in ``checkify``
(``benchmarks.scripts.ppo_compare.build``). ``checkify`` then threads an
error value through the control flow around the check. This lowers and
compiles the jrollout PPO at the reference config three ways and prints
the StableHLO op count, trace + lower seconds and XLA compile seconds:

- ``inside``: as shipped, the check inside the update scan;
- ``none``: no check at all (``finish_rollout``'s checkify check removed);
- ``top``: no check inside, and one ``checkify.check`` on the run's
  outputs after the update scan (what a check that travels out of the
  scan as data, and is tested once, would cost).

    python -m benchmarks.scripts.check_cost [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import time
from unittest import mock

import jax
from jax.experimental import checkify
import jax.numpy as jnp

from benchmarks.scripts import ppo_compare
from jrollout import _ledger

MODES = ("inside", "none", "top")


def build(mode: str):
  config = ppo_compare.REFERENCE
  init_fn, update_fn = ppo_compare.IMPLS["jrollout"](config)

  def train(keys):
    runner = jax.lax.map(init_fn, keys)
    _, metrics = jax.vmap(lambda r: jax.lax.scan(
        lambda r, _: update_fn(r), r, None, config.num_updates))(runner)
    if mode == "top":
      checkify.check(jnp.all(metrics["episodes"] >= 0),
                     "negative episode count {n}",
                     n=jnp.min(metrics["episodes"]))
    return metrics

  keys = jax.random.split(jax.random.key(0), config.seeds)
  return jax.jit(checkify.checkify(train, errors=checkify.user_checks)), keys


def measure(mode: str) -> tuple[int, float, float]:
  """``(stablehlo ops, lower s, compile s)`` of one fresh build."""
  patch = (contextlib.nullcontext() if mode == "inside" else
           mock.patch.object(_ledger, "_checkify", lambda fn, state: None))
  with patch:
    fn, keys = build(mode)
    t0 = time.perf_counter()
    lowered = fn.lower(keys)
    t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  ops = len(re.findall(r"stablehlo\.\w+", lowered.as_text()))
  return ops, t1 - t0, t2 - t1


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--repeats", type=int, default=2)
  args = p.parse_args(argv)
  runs = {m: [] for m in MODES}
  for _ in range(args.repeats):
    for mode in MODES:
      runs[mode].append(measure(mode))
  print("| write check | StableHLO ops | lower s | compile s |")
  print("| --- | --- | --- | --- |")
  for mode, rs in runs.items():
    print(f"| {mode} | {rs[0][0]} | "
          f"{statistics.median(r[1] for r in rs):.2f} | "
          f"{statistics.median(r[2] for r in rs):.2f} |")


if __name__ == "__main__":
  main()
