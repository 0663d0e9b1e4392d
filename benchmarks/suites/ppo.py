"""End-to-end PPO on CartPole: examples/ppo_cartpole.py vs the JAX idiom.

Each implementation is one jitted function for a whole training run
(``build``), with the same environment, network, loss, optimiser and
algorithm; ``benchmarks/baselines/ppo_idiom.py`` differs only in the data
path (scan outputs, ``jax.random.permutation``, gather, reshape,
``lax.scan``). A third, untargeted row is the idiom exactly as the pure-JAX
reference writes it: time limits treated as terminations, so no final
observations are kept or valued (less work than the other two). Run time
and compile time are separate measurements; run rows also report env steps
per second. The final returns are not compared: the two shuffle
differently, so they learn differently.

``run(name, config)`` makes a run measurement of any configuration (the
``ppo_sweep`` suite's; ``seeds(S, U)``: the GPU run's S vmapped seeds).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import checkify

from benchmarks import harness as h
from benchmarks.baselines import ppo_idiom
from examples import ppo_cartpole

JR, IDIOM = "jrollout PPO", "jax idiom PPO"
REF = "jax idiom PPO, time limits terminal (reference)"

# The widely used pure-JAX PPO reference's CartPole hyperparameters.
REFERENCE = ppo_cartpole.Config(
    num_envs=4, num_steps=128, total_steps=500_000, num_epochs=4,
    num_minibatches=4, lr=2.5e-4, anneal_lr=True, gamma=0.99,
    gae_lambda=0.95, clip_eps=0.2, seeds=1)
IMPLS = {JR: ppo_cartpole.make_train,
         IDIOM: ppo_idiom.make_train,
         REF: functools.partial(ppo_idiom.make_train,
                                bootstrap_truncation=False)}
KINDS = {JR: "jrollout", IDIOM: "jax-idiom", REF: "reference"}


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


def env_steps(config: ppo_cartpole.Config) -> int:
  """Env steps of one training run, all seeds: ``S * U * E * T``."""
  return (config.seeds * config.num_updates * config.num_envs
          * config.num_steps)


def _quick(cfg: ppo_cartpole.Config, config: h.Config) -> ppo_cartpole.Config:
  """``cfg``, or in quick mode 4 updates of one seed."""
  if not config.quick:
    return cfg
  return dataclasses.replace(cfg, total_steps=4 * cfg.num_envs
                             * cfg.num_steps, seeds=1)


def _run_build(cfg: ppo_cartpole.Config, names: tuple[str, ...]):
  def build_impls(config: h.Config):
    c = _quick(cfg, config)
    keys = jax.random.split(jax.random.key(0), c.seeds)

    def impl(make_train):
      def setup():
        compiled = build(make_train, c).lower(keys).compile()
        return lambda: jax.block_until_ready(compiled(keys))
      return setup

    return [h.Impl(n, impl(IMPLS[n]), KINDS[n], reps=1) for n in names]
  return build_impls


def run(name: str, cfg: ppo_cartpole.Config, description: str, *,
        names: tuple[str, ...] = (JR, IDIOM), max_rounds: int = 5,
        targets=()) -> h.Measurement:
  """One compiled training run of ``cfg`` per implementation in ``names``."""
  return h.Measurement(
      name=name, description=description, build=_run_build(cfg, names),
      baseline=IDIOM, max_rounds=max_rounds, targets=targets,
      work=lambda config: env_steps(_quick(cfg, config)),
      work_unit="env steps")


def _compile_build(config: h.Config):
  cfg = _quick(REFERENCE, config)
  keys = jax.random.split(jax.random.key(0), cfg.seeds)

  def impl(make_train):
    def setup():   # a fresh build each call: nothing comes from a cache
      return lambda: build(make_train, cfg).lower(keys).compile()
    return setup

  return [h.Impl(JR + " lower+compile", impl(IMPLS[JR]), "jrollout", reps=1),
          h.Impl(IDIOM + " lower+compile", impl(IMPLS[IDIOM]), "jax-idiom",
                 reps=1)]


def seeds(num_seeds: int, updates: int) -> h.Measurement:
  """The example's agent and defaults, ``num_seeds`` vmapped, ``updates``
  long (the GPU run). Quick: 4 envs x 32 steps, one epoch of 2
  minibatches, jrollout only."""
  def config_of(config: h.Config) -> ppo_cartpole.Config:
    cfg = ppo_cartpole.Config(seeds=num_seeds)
    if config.quick:
      cfg = dataclasses.replace(cfg, num_envs=4, num_steps=32,
                                num_minibatches=2, num_epochs=1)
    return dataclasses.replace(
        cfg, total_steps=updates * cfg.num_envs * cfg.num_steps)

  def build_impls(config: h.Config):
    cfg = config_of(config)
    keys = jax.random.split(jax.random.key(0), cfg.seeds)
    names = (JR,) if config.quick else (JR, IDIOM)

    def impl(make_train):
      def setup():
        compiled = build(make_train, cfg).lower(keys).compile()
        return lambda: jax.block_until_ready(compiled(keys))
      return setup

    return [h.Impl(n, impl(IMPLS[n]), KINDS[n], reps=1) for n in names]

  return h.Measurement(
      name=f"ppo_seeds_{num_seeds}",
      description=(f"PPO CartPole training run of the example's agent and "
                   f"defaults (8 envs x 128 steps per seed), {num_seeds} "
                   f"vmapped seeds x {updates} updates, compiled ahead"),
      build=build_impls, baseline=IDIOM, max_rounds=3,
      work=lambda config: env_steps(config_of(config)),
      work_unit="env steps")


MEASUREMENTS = [
    run("ppo_run_reference", REFERENCE,
        "PPO CartPole training run, reference config (4 envs, 128 steps, 4 "
        "epochs, 4 minibatches, 5e5 steps, 1 seed), compiled ahead",
        names=(JR, IDIOM, REF),
        targets=[h.Target(JR, IDIOM, 1.0, "PPO issue: run time")]),
    h.Measurement(
        name="ppo_compile_reference",
        description="PPO CartPole: trace + lower + XLA compile of the whole "
        "training run, reference config",
        build=_compile_build, baseline=IDIOM + " lower+compile",
        max_rounds=3,
        targets=[h.Target(JR + " lower+compile", IDIOM + " lower+compile",
                          1.2, "PPO issue: compile time")]),
    run("ppo_run_example", ppo_cartpole.Config(),
        "PPO CartPole training run at the example's defaults (8 envs, 1e6 "
        "steps, 4 vmapped seeds), compiled ahead", max_rounds=3),
]
SMOKE = "ppo_run_example"
