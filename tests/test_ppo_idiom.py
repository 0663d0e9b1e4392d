"""benchmarks/baselines/ppo_idiom.py, the peer of examples/ppo_cartpole.py
in the PPO run-time comparison, computes jr.gae's advantages (time-limit
bootstrapping included): the comparison times one algorithm."""

import numpy as np
import pytest

pytest.importorskip("gymnax")

import jax.numpy as jnp  # noqa: E402

import jrollout as jr  # noqa: E402
from benchmarks.baselines import ppo_idiom  # noqa: E402


def _episode_ends(rng, t, e):
  """Random rewards/values and episode ends of both kinds ``[T, E]``."""
  terminated = rng.random((t, e)) < 0.1
  truncated = (rng.random((t, e)) < 0.1) & ~terminated
  return dict(
      reward=rng.normal(size=(t, e)).astype(np.float32),
      value=rng.normal(size=(t, e)).astype(np.float32),
      terminated=terminated, truncated=truncated,
      final_values=rng.normal(size=(t, e)).astype(np.float32),
      last_value=rng.normal(size=(e,)).astype(np.float32))


def _traj(d):
  zeros = np.zeros_like(d["reward"])
  return ppo_idiom.Transition(zeros, zeros, zeros, d["value"], d["reward"],
                              d["terminated"], d["truncated"], None)


@pytest.mark.parametrize("seed", range(3))
def test_idiom_gae_bootstraps_truncations_like_jr_gae(seed):
  d = _episode_ends(np.random.default_rng(seed), 37, 5)
  assert d["terminated"].any() and d["truncated"].any()
  adv, target = ppo_idiom.gae(_traj(d), d["last_value"], d["final_values"],
                              0.99, 0.95)
  ref_adv, ref_target = jr.gae(
      d["reward"], d["value"], d["last_value"], d["terminated"],
      truncations=d["truncated"], final_values=d["final_values"],
      gamma=0.99, gae_lambda=0.95)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(target, ref_target, rtol=1e-5, atol=1e-5)


def test_idiom_gae_without_final_values_treats_every_end_as_terminal():
  d = _episode_ends(np.random.default_rng(7), 29, 3)
  adv, _ = ppo_idiom.gae(_traj(d), d["last_value"], None, 0.99, 0.95)
  ref_adv, _ = jr.gae(d["reward"], d["value"], d["last_value"],
                      jnp.asarray(d["terminated"] | d["truncated"]),
                      gamma=0.99, gae_lambda=0.95)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
  with_bootstrap, _ = ppo_idiom.gae(_traj(d), d["last_value"],
                                    d["final_values"], 0.99, 0.95)
  assert not np.allclose(adv, with_bootstrap)   # the two really differ
