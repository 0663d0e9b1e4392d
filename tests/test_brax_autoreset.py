"""examples/brax_env.AutoReset on Brax and MuJoCo Playground envs: the true
final observation, checked against the env stepped by hand, and GAE through
it against the numpy model of tests/reference.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from tests.reference import reference_gae

envs = pytest.importorskip("brax.envs")
brax_env = pytest.importorskip("examples.brax_env")

# Brax is not strict-promotion clean (see conftest's standard_promotion).
pytestmark = [
    pytest.mark.filterwarnings("ignore:Brax System, piplines:UserWarning"),
    # mujoco.mjx 3.17 read by Brax 0.14.2: not ours to fix
    pytest.mark.filterwarnings(
        "ignore:Accessing .* directly from .Data. is deprecated"),
    pytest.mark.usefixtures("standard_promotion")]

E, LIMIT = 4, 5


# Brax's inverted_pendulum terminates (the pole falls); Playground's
# CartpoleBalance never does (only truncations), and its observation here
# is a dict, {"state", "privileged_state"}: a pytree final_obs.
# (Playground's MJX compiles take minutes on 2 cores: the slow lane.)
@pytest.fixture(scope="module", params=[
    "brax", pytest.param("playground", marks=pytest.mark.slow)])
def env(request):
  if request.param == "brax":
    return envs.get_environment("inverted_pendulum", backend="positional")
  playground_env = pytest.importorskip("examples.playground_env")
  return playground_env.Privileged(playground_env.load("CartpoleBalance"))


def run(env, acts, episode_length=LIMIT):
  """The wrapper over ``acts [T, E, A]``: obs0, [(state, Transition)]."""
  wrapped = brax_env.AutoReset(env, E, episode_length)
  state, obs = wrapped.reset(jax.random.key(7))
  step = jax.jit(wrapped.step)
  outs = []
  for a in acts:
    state, out = step(state, jnp.asarray(a))
    outs.append((state, out))
  return obs, outs


def row(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def stack(trees):
  return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def close(got, want, **kw):
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5, **kw)


def test_final_obs_is_the_env_stepped_by_hand(env):
  limit = 10
  # Full force one way in envs 0 and 1 (the pendulum falls after 7 steps:
  # terminations), random signs in the others (truncations).
  acts = np.sign(np.asarray(jax.random.normal(jax.random.key(0), (25, E, 1))))
  acts[:, :2] = 1.0
  obs0, outs = run(env, acts, limit)
  # The hand model: each env stepped alone (no vmap: float32 rounding
  # differs); a finished episode restarts from env.reset with the wrapper's
  # key (split the state's key, then one key per env).
  reset, step = jax.jit(env.reset), jax.jit(env.step)
  key, k = jax.random.split(jax.random.key(7))
  hand = [reset(kk) for kk in jax.random.split(k, E)]
  close(obs0, stack([h.obs for h in hand]))
  steps = np.zeros(E, int)
  seen = {"terminated": 0, "truncated": 0}
  for t, (state, out) in enumerate(outs):
    key, k = jax.random.split(key)
    fresh = [reset(kk) for kk in jax.random.split(k, E)]
    for i in range(E):
      hand[i] = step(hand[i], jnp.asarray(acts[t, i]))
      steps[i] += 1
      close(row(out.final_obs, i), hand[i].obs,
            custom_message=f"step {t} env {i}")
      np.testing.assert_allclose(out.reward[i], hand[i].reward, rtol=1e-5)
      term = bool(hand[i].done > 0)
      trunc = steps[i] >= limit and not term
      assert bool(out.terminated[i]) == term, (t, i)
      assert bool(out.truncated[i]) == trunc, (t, i)
      seen["terminated"] += term
      seen["truncated"] += trunc
      if term or trunc:
        hand[i], steps[i] = fresh[i], 0
        # the policy sees the new episode, the final obs is kept apart
        for a, b in zip(jax.tree.leaves(row(out.obs, i)),
                        jax.tree.leaves(row(out.final_obs, i))):
          assert not np.allclose(a, b)
      close(row(out.obs, i), hand[i].obs)
    np.testing.assert_array_equal(state.steps, steps)
  # the run exercised both kinds of episode end (where the env has both)
  assert seen["truncated"] > 0, seen
  terminates = not hasattr(env, "_groups")   # Playground's Privileged not
  assert (seen["terminated"] > 0) == terminates, seen


def test_gae_bootstraps_a_truncation_from_the_final_obs(env):
  """An episode truncated mid-rollout (step 4 of 8) bootstraps from the
  value of its true final observation, not of the reset's."""
  T = 8
  acts = np.zeros((T, E, 1), np.float32)   # a still pendulum: no falls
  obs0, outs = run(env, acts)
  size = jax.tree.leaves(obs0)[0].shape[-1]   # Playground: "privileged"
  w = np.linspace(-1.2, 2.0, size).astype(np.float32)

  def value(obs):   # any fixed function of the observation
    return np.tanh(np.asarray(jax.tree.leaves(obs)[0]) @ w) * 5.0

  obs = stack([obs0] + [o.obs for _, o in outs[:-1]])     # [T, E, ...]
  final_obs = stack([o.final_obs for _, o in outs])
  rewards = np.stack([o.reward for _, o in outs])
  terminated = np.stack([o.terminated for _, o in outs])
  truncated = np.stack([o.truncated for _, o in outs])
  assert truncated[LIMIT - 1].all() and truncated.sum() == E
  assert not terminated.any()
  values, final_values = value(obs), value(final_obs)
  last_value = value(outs[-1][1].obs)
  # the reset's value is not the final obs' value: the test can tell them
  assert np.abs(final_values[LIMIT - 1] - values[LIMIT]).min() > 1e-3
  adv, target = jr.gae(rewards, values, last_value, terminated,
                       truncations=truncated, final_values=final_values,
                       gamma=0.97, gae_lambda=0.95)
  want_adv, want_target = reference_gae(rewards, values, last_value,
                                        terminated, truncated, final_values,
                                        0.97, 0.95)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(target, want_target, rtol=1e-5, atol=1e-5)
  # and it differs from reading on into the reset's value (no truncation)
  wrong, _ = reference_gae(rewards, values, last_value, terminated,
                           gamma=0.97, gae_lambda=0.95)
  assert np.abs(adv[LIMIT - 1] - wrong[LIMIT - 1]).min() > 1e-3


def test_reset_refuses_bad_sizes(env):
  with pytest.raises(ValueError, match="num_envs and episode_length"):
    brax_env.AutoReset(env, 0, 10)
