"""Advantages and targets of a rollout: ``jr.gae`` against the usual code.

gae_W2 (``gae(name)`` for any workload: the GPU run adds gae_GPU): the
``[T, E]`` rewards, values, final values, terminations (about 5% of the
steps) and truncations (about 2%) of a rollout, through

- ``jr.gae`` under ``jit``;
- the JAX idiom's reverse ``lax.scan`` (``benchmarks/baselines/ppo_idiom``);
- the reverse Python loop of torch PPO code (``torch_ref.gae``), on the
  torch device.

The three agree to 1e-4 (float32, different summation orders). No target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jrollout as jr
from benchmarks import harness as h
from benchmarks import workloads as wl
from benchmarks.baselines import ppo_idiom
from benchmarks.baselines import torch_ref
from benchmarks.suites import _common as c

GAMMA, LAMBDA = 0.99, 0.95
TORCH = "torch reverse Python loop"


def inputs(w: wl.Workload, seed: int = 0) -> dict[str, np.ndarray]:
  """``[T, E]`` rewards, values, flags and final values; ``last_value [E]``.

  About 5% of the steps terminate and 2% are truncated (never both).
  """
  rng = np.random.default_rng(seed)
  shape = (w.num_steps, w.num_envs)
  terminated = rng.random(shape) < 0.05
  return {"reward": rng.standard_normal(shape, np.float32),
          "value": rng.standard_normal(shape, np.float32),
          "final_value": rng.standard_normal(shape, np.float32),
          "last_value": rng.standard_normal(shape[1:], np.float32),
          "terminated": terminated,
          "truncated": (rng.random(shape) < 0.02) & ~terminated}


def _build(name: str, config: h.Config) -> list[h.Impl]:
  w = wl.get(name, config.quick)
  d = inputs(w)
  j = jax.block_until_ready({k: jnp.asarray(v) for k, v in d.items()})
  t = {k: torch.from_numpy(v).to(config.torch_device) for k, v in d.items()}
  sync = c.torch_sync(config.torch_device)

  def jr_gae():
    f = jax.jit(functools.partial(jr.gae, gamma=GAMMA, gae_lambda=LAMBDA))
    return lambda: jax.block_until_ready(f(
        j["reward"], j["value"], j["last_value"], j["terminated"],
        truncations=j["truncated"], final_values=j["final_value"]))

  def idiom_gae():
    zeros = jnp.zeros_like(j["value"])
    traj = ppo_idiom.Transition(zeros, zeros, zeros, j["value"],
                                j["reward"], j["terminated"],
                                j["truncated"], None)
    f = jax.jit(functools.partial(ppo_idiom.gae, gamma=GAMMA,
                                  gae_lambda=LAMBDA))
    return lambda: jax.block_until_ready(f(traj, j["last_value"],
                                           j["final_value"]))

  def torch_gae():
    def run():
      out = torch_ref.gae(t["reward"], t["value"], t["last_value"],
                          t["terminated"], t["truncated"], t["final_value"],
                          GAMMA, LAMBDA)
      sync()
      return out
    return run

  return [h.Impl("jr.gae (jit)", jr_gae, "jrollout", c.same),
          h.Impl("jax idiom reverse lax.scan (jit)", idiom_gae, "jax-idiom",
                 c.same),
          h.Impl(TORCH, torch_gae, "torch", c.same)]


def gae(name: str) -> h.Measurement:
  """GAE of a rollout of workload ``name``."""
  w = wl.get(name, False)
  return h.Measurement(
      name=f"gae_{name}",
      description=(f"advantages and targets of a [T, E] rollout with "
                   f"terminations and truncations, {w.label()}"),
      build=functools.partial(_build, name), baseline=TORCH,
      rtol=1e-4, atol=1e-4)


MEASUREMENTS = [gae("W2")]
