"""PPO on CartPole: jrollout vs the same agent in today's JAX idiom.

All are one jitted function for the whole training run, with identical
environment, network, loss, optimiser and algorithm
(``benchmarks/baselines/ppo_idiom.py`` differs only in the data path). A
third row is the idiom exactly as the pure-JAX reference writes it, which
treats time limits as terminations and so skips the valuing of final
observations: less work, reported beside the comparison, not its peer.
Compile time (``lower().compile()``) and run time are measured apart,
interleaved round by round in one process, and reported as medians with
min-max and the jrollout/idiom ratio.

    python -m benchmarks.scripts.ppo_compare            # reference, 1 seed
    python -m benchmarks.scripts.ppo_compare --example  # + example defaults
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
from jax.experimental import checkify
import numpy as np

from benchmarks import harness
from benchmarks.baselines import ppo_idiom
from examples import ppo_cartpole
from examples import ppo_core

# The widely used pure-JAX PPO reference's CartPole hyperparameters.
REFERENCE = ppo_cartpole.Config(
    num_envs=4, num_steps=128, total_steps=500_000, num_epochs=4,
    num_minibatches=4, lr=2.5e-4, anneal_lr=True, gamma=0.99,
    gae_lambda=0.95, clip_eps=0.2, seeds=1)
REFERENCE_IDIOM = "jax idiom, time limits terminal (reference)"
IMPLS = {"jrollout": ppo_cartpole.make_train,
         "jax idiom": ppo_idiom.make_train,
         REFERENCE_IDIOM: functools.partial(ppo_idiom.make_train,
                                            bootstrap_truncation=False)}


def build(make_train_fn, config: ppo_cartpole.Config):
  """A jitted ``train(keys) -> (err, metrics)`` for the run, vmapped seeds.

  Functionalised with ``checkify`` as the example's host loop is, so the
  jrollout row pays for its write checks (the idioms have none to report).
  """
  init_fn, update_fn = make_train_fn(config)

  def train(keys):
    # Seeds are initialised with lax.map, not vmap: a vmapped orthogonal
    # initialiser (batched QR) deadlocked XLA:CPU (jax 0.10.2) in our runs.
    runner = jax.lax.map(init_fn, keys)
    _, metrics = jax.vmap(lambda r: jax.lax.scan(
        lambda r, _: update_fn(r), r, None, config.num_updates))(runner)
    return metrics

  return jax.jit(checkify.checkify(train, errors=checkify.user_checks))


def _rotated(names: list[str], r: int) -> list[str]:
  return names[r % len(names):] + names[:r % len(names)]


def measure(config: ppo_cartpole.Config, rounds: int, compiles: int,
            impls=None):
  """``{impl: {"compile": [s], "compile_cpu": [s], "run": [s], "cpu": [ratio],
  "final": [...]}}``.

  ``impls`` maps names to ``make_train`` functions (default ``IMPLS``).
  Compiles and runs are interleaved, the order rotated by one each round.
  ``compile_cpu`` is the process's CPU time during each compile (on a busy
  machine a compile's wall time can be mostly waiting).
  ``cpu`` is the process's CPU time (user + system) over the wall time of
  each run: 1.0 means one busy thread, 2.0 two (see benchmarks/README.md,
  "PPO on a multi-core CPU").
  """
  impls = IMPLS if impls is None else impls
  names = list(impls)
  keys = jax.random.split(jax.random.key(0), config.seeds)
  out = {name: {"compile": [], "compile_cpu": [], "run": [], "cpu": [],
                "final": None} for name in names}
  compiled = {}
  for c in range(compiles):
    for name in _rotated(names, c):
      fn = build(impls[name], config)
      c0, t0 = harness.cpu_seconds(), time.perf_counter()
      compiled[name] = fn.lower(keys).compile()
      out[name]["compile"].append(time.perf_counter() - t0)
      out[name]["compile_cpu"].append(harness.cpu_seconds() - c0)
  for name in names:   # warm-up run (first execution allocates)
    err, metrics = jax.block_until_ready(compiled[name](keys))
    err.throw()
    out[name]["final"] = ppo_core.final_returns(jax.device_get(metrics))
  for r in range(rounds):
    for name in _rotated(names, r):
      c0, t0 = harness.cpu_seconds(), time.perf_counter()
      jax.block_until_ready(compiled[name](keys))
      wall = time.perf_counter() - t0
      out[name]["run"].append(wall)
      out[name]["cpu"].append((harness.cpu_seconds() - c0) / wall)
  return out


def report(title: str, config: ppo_cartpole.Config, out) -> str:
  steps = config.seeds * config.num_updates * config.num_envs * config.num_steps
  lines = [f"### {title}", "",
           f"{config.seeds} seed(s) x {config.num_updates} updates of "
           f"{config.num_envs} envs x {config.num_steps} steps, "
           f"{config.num_epochs} epochs x {config.num_minibatches} minibatches",
           "",
           "| implementation | compile s (median [min-max]) | run s (median "
           "[min-max]) | CPU time / wall time | env steps/s | final return "
           "per seed |",
           "| --- | --- | --- | --- | --- | --- |"]
  for name, m in out.items():
    c, r = m["compile"], m["run"]
    lines.append(
        f"| {name} | {statistics.median(c):.2f} [{min(c):.2f}-{max(c):.2f}] "
        f"| {statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}] | "
        f"{statistics.median(m['cpu']):.2f} | "
        f"{steps / statistics.median(r):,.0f} | "
        f"{np.array2string(np.asarray(m['final']), precision=1)} |")
  ours, idiom = out["jrollout"], out["jax idiom"]
  run_ratio = statistics.median(
      [a / b for a, b in zip(ours["run"], idiom["run"])])
  compile_ratio = statistics.median(
      [a / b for a, b in zip(ours["compile"], idiom["compile"])])
  ref_ratio = statistics.median(
      [a / b for a, b in zip(ours["run"], out[REFERENCE_IDIOM]["run"])])
  lines += ["",
            f"jrollout / idiom: run {run_ratio:.2f}x (target <= 1.0x: "
            f"{'PASS' if run_ratio <= 1.0 else 'MISS'}), compile "
            f"{compile_ratio:.2f}x (target <= 1.2x: "
            f"{'PASS' if compile_ratio <= 1.2 else 'MISS'}); ratios are "
            "medians of per-round ratios; against the reference idiom "
            f"(time limits terminal, less work): run {ref_ratio:.2f}x", ""]
  return "\n".join(lines)


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--compiles", type=int, default=3)
  parser.add_argument("--example", action="store_true",
                      help="also compare at the example's default config")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny budget (smoke test; numbers meaningless)")
  args = parser.parse_args(argv)
  configs = [("Reference configuration (pure-JAX PPO CartPole)", REFERENCE)]
  if args.example:
    configs.append(("The example's defaults", ppo_cartpole.Config()))
  if args.quick:
    configs = [("Quick smoke run", dataclasses.replace(
        REFERENCE, total_steps=4 * 512))]
    args.rounds, args.compiles = 1, 1
  text = []
  for title, config in configs:
    out = measure(config, args.rounds, args.compiles)
    text.append(report(title, config, out))
    print(text[-1], flush=True)
  return "\n".join(text)


if __name__ == "__main__":
  main()
