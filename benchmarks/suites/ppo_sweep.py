"""PPO by envs and seeds: jrollout against the same-algorithm JAX idiom.

The ``ppo`` suite's run measurement at the pure-JAX reference's
hyperparameters (128 steps per rollout, 4 epochs x 4 minibatches) at 4, 64
and 256 envs with one seed and at 4 envs with 16 vmapped seeds; each run
reports env steps per second. ``total_steps`` per seed is chosen so that a
run lasts about 3-5 s on a quiet 2-core machine: the PPO update's epochs
scale with the rows, so env steps/s grows little with ``num_envs`` on a CPU
(runs 4x as long gave the same env steps/s within noise,
``benchmarks/results/ppo_sweep/RESULTS.md``). Not in the default run (about
8 minutes on 2 cores): ``python -m benchmarks --only ppo_sweep``. Compile
times are ``ppo_compile_reference``'s.
"""

from __future__ import annotations

import dataclasses

from benchmarks.suites import ppo


def _sweep(name: str, num_envs: int, seeds: int, total_steps: int):
  cfg = dataclasses.replace(ppo.REFERENCE, num_envs=num_envs, seeds=seeds,
                            total_steps=total_steps)
  return ppo.run(
      f"ppo_sweep_{name}", cfg,
      f"PPO CartPole training run, reference config at {num_envs} envs, "
      f"{seeds} vmapped seed(s), {cfg.num_updates} updates, compiled ahead")


MEASUREMENTS = [
    _sweep("E4", 4, 1, 2**18),       # 512 updates
    _sweep("E64", 64, 1, 2**19),     # 64 updates
    _sweep("E256", 256, 1, 2**19),   # 16 updates
    _sweep("S16", 4, 16, 2**15),     # 64 updates of 16 seeds
]
# The same build as the ppo suite's runs, whose smoke case covers it.
SMOKE = None
