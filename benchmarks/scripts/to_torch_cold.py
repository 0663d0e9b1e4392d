"""``to_torch`` of a fresh policy output, right after the policy's call.

In a host loop with a torch simulator (``examples/torch_simulator.py``),
each step exports the jitted policy's actions with ``jrollout.torch.
to_torch`` right after the policy ran, when the caches hold the policy's
data, not the bridge's code and data. This times that call, and the same
call again at once (warm), against ``torch.from_numpy(np.asarray(a))``,
the least a CPU export can do; with ``--baseline REV``, also
``jrollout/torch.py`` as it was at git revision REV, loaded in this process.
The rows rotate within each round, so drifts hit them alike.

    python -m benchmarks.scripts.to_torch_cold [--num-envs 16384,1024]
        [--rounds 300] [--baseline REV]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np

import jrollout as jr

# As the example does, before torch loads (a no-op if torch already has).
if "torch" not in sys.modules:
  jr.share_cpu_with_torch()

import torch  # noqa: E402

from benchmarks.scripts.checkpoint_bench import load_baseline  # noqa: E402
from benchmarks.scripts.torch_jax_cores import learner_fixture  # noqa: E402
from jrollout.torch import to_torch  # noqa: E402


def measure(num_envs: int, rounds: int, fns: dict) -> dict[str, tuple]:
  """``{name: (median us right after the policy, median us again)}``."""
  learner, params, key = learner_fixture(num_envs)
  obs = np.random.default_rng(0).uniform(
      -0.05, 0.05, (num_envs, 4)).astype(np.float32)
  cold: dict[str, list[float]] = {k: [] for k in fns}
  warm: dict[str, list[float]] = {k: [] for k in fns}
  names = list(fns)
  for r in range(rounds + 1):            # round 0 warms up, not counted
    for k in names[r % len(names):] + names[:r % len(names)]:
      action = jax.block_until_ready(learner.act(params, obs, key))[0]
      t0 = time.perf_counter()
      fns[k](action)
      t1 = time.perf_counter()
      fns[k](action)
      t2 = time.perf_counter()
      if r:
        cold[k].append(1e6 * (t1 - t0))
        warm[k].append(1e6 * (t2 - t1))
  return {k: (statistics.median(cold[k]), statistics.median(warm[k]))
          for k in fns}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--num-envs", default="16384,1024")
  parser.add_argument("--rounds", type=int, default=300)
  parser.add_argument("--baseline", default=None, metavar="REV")
  args = parser.parse_args(argv)
  fns = {"to_torch": to_torch}
  if args.baseline:
    old = load_baseline(args.baseline, "jrollout/torch.py")
    fns[f"to_torch at {args.baseline}"] = old.to_torch
  fns["torch.from_numpy(np.asarray(a))"] = (
      lambda a: torch.from_numpy(np.asarray(a)))
  print("| E | export | right after the policy (us) | again at once (us) |")
  print("|---|---|---|---|")
  for e in (int(n) for n in args.num_envs.split(",")):
    for k, (cold, warm) in measure(e, args.rounds, fns).items():
      print(f"| {e} | {k} | {cold:.1f} | {warm:.1f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
