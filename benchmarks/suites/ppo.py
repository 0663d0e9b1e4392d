"""End-to-end PPO on CartPole: examples/ppo_cartpole.py vs the JAX idiom.

Each implementation is one jitted function for a whole training run
(``benchmarks/scripts/ppo_compare.build``), with the same environment,
network, loss, optimiser and algorithm; ``benchmarks/baselines/ppo_idiom.py``
differs only in the data path (scan outputs, ``jax.random.permutation``,
gather, reshape, ``lax.scan``). A third, untargeted row is the idiom exactly
as the pure-JAX reference writes it: time limits treated as terminations, so
no final observations are kept or valued (less work than the other two).
Run time and compile time are separate measurements. The final returns are
not compared: the two shuffle differently, so they learn differently.
"""

from __future__ import annotations

import dataclasses

import jax

from benchmarks import harness as h
from benchmarks.scripts import ppo_compare
from examples import ppo_cartpole

JR, IDIOM = "jrollout PPO", "jax idiom PPO"
REF = "jax idiom PPO, time limits terminal (reference)"


def _config(config: h.Config, example: bool):
  base = ppo_cartpole.Config() if example else ppo_compare.REFERENCE
  if config.quick:
    base = dataclasses.replace(base, total_steps=4 * base.num_envs
                               * base.num_steps, seeds=1)
  return base


def _run_build(example: bool):
  def build(config: h.Config):
    cfg = _config(config, example)
    keys = jax.random.split(jax.random.key(0), cfg.seeds)

    def impl(make_train):
      def setup():
        compiled = ppo_compare.build(make_train, cfg).lower(keys).compile()
        return lambda: jax.block_until_ready(compiled(keys))
      return setup

    impls = [h.Impl(JR, impl(ppo_compare.IMPLS["jrollout"]), "jrollout",
                    reps=1),
             h.Impl(IDIOM, impl(ppo_compare.IMPLS["jax idiom"]), "jax-idiom",
                    reps=1)]
    if not example:   # the reference's own config only
      impls.append(h.Impl(
          REF, impl(ppo_compare.IMPLS[ppo_compare.REFERENCE_IDIOM]),
          "reference", reps=1))
    return impls
  return build


def _compile_build(config: h.Config):
  cfg = _config(config, example=False)
  keys = jax.random.split(jax.random.key(0), cfg.seeds)

  def impl(make_train):
    def setup():   # a fresh build each call: nothing comes from a cache
      return lambda: ppo_compare.build(make_train, cfg).lower(keys).compile()
    return setup

  return [h.Impl(JR + " lower+compile", impl(ppo_compare.IMPLS["jrollout"]),
                 "jrollout", reps=1),
          h.Impl(IDIOM + " lower+compile",
                 impl(ppo_compare.IMPLS["jax idiom"]), "jax-idiom", reps=1)]


MEASUREMENTS = [
    h.Measurement(
        name="ppo_run_reference",
        description="PPO CartPole training run, reference config (4 envs, "
        "128 steps, 4 epochs, 4 minibatches, 5e5 steps, 1 seed), compiled "
        "ahead",
        build=_run_build(example=False), baseline=IDIOM, max_rounds=5,
        targets=[h.Target(JR, IDIOM, 1.0, "PPO issue: run time")]),
    h.Measurement(
        name="ppo_compile_reference",
        description="PPO CartPole: trace + lower + XLA compile of the whole "
        "training run, reference config",
        build=_compile_build, baseline=IDIOM + " lower+compile",
        max_rounds=3,
        targets=[h.Target(JR + " lower+compile", IDIOM + " lower+compile",
                          1.2, "PPO issue: compile time")]),
    h.Measurement(
        name="ppo_run_example",
        description="PPO CartPole training run at the example's defaults "
        "(8 envs, 1e6 steps, 4 vmapped seeds), compiled ahead",
        build=_run_build(example=True), baseline=IDIOM, max_rounds=3),
]
