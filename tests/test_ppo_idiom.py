"""benchmarks/baselines/ppo_idiom.py, the peer of examples/ppo_cartpole.py
in the PPO run-time comparison, computes jr.gae's advantages (time-limit
bootstrapping included): the comparison times one algorithm."""

import functools

import numpy as np
import pytest

pytest.importorskip("gymnax")

import jrollout as jr  # noqa: E402
from benchmarks.baselines import ppo_idiom  # noqa: E402
from tests.reference import call  # noqa: E402
from tests.reference import random_rollout  # noqa: E402

close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_idiom_gae_is_jr_gae_with_and_without_final_values(seed):
  """With final values a truncation bootstraps from them; without, every
  episode end is terminal."""
  d = random_rollout(seed, (37, 5))
  assert d["terminations"].any() and d["truncations"].any()
  zeros = np.zeros_like(d["rewards"])
  traj = ppo_idiom.Transition(zeros, zeros, zeros, d["values"], d["rewards"],
                              d["terminations"], d["truncations"], None)
  adv, target = ppo_idiom.gae(traj, d["last_value"], d["final_values"],
                              0.99, 0.95)
  want_adv, want_target = call(jr.gae, d, gamma=0.99, gae_lambda=0.95)
  close(adv, want_adv)
  close(target, want_target)
  terminal, _ = ppo_idiom.gae(traj, d["last_value"], None, 0.99, 0.95)
  want, _ = jr.gae(d["rewards"], d["values"], d["last_value"],
                   d["terminations"] | d["truncations"], gamma=0.99,
                   gae_lambda=0.95)
  close(terminal, want)
  assert not np.allclose(terminal, adv)   # the two really differ
