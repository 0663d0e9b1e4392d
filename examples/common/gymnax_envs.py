"""Acting in gymnax envs, E at once: a fresh learner and its envs, one
step of every env, and the returns of the episodes that end."""

from __future__ import annotations

from flax.training.train_state import TrainState
import jax
import jax.numpy as jnp

from examples.common.agent import make_optimizer
from examples.common.cli import Config


def mask_obs(obs, config: Config):
  """CartPole's obs is [x, x_dot, theta, theta_dot]; optionally hide speeds."""
  if config.mask_velocity:
    return obs * jnp.array([1.0, 0.0, 1.0, 0.0], obs.dtype)
  return obs


def init_learner(key, config: Config, env, env_params, network, inputs=None):
  """A fresh network, optimiser state and envs.

  ``inputs(obs)`` gives ``network.init``'s arguments after the key for one
  zero observation ``[*obs_shape]`` (default ``(obs,)``). Returns ``(key,
  train_state, obs, env_state)`` with ``obs [E, *obs_shape]`` masked as
  ``config`` says and ``key`` the rest of the stream.
  """
  key, k_net, k_env = jax.random.split(key, 3)
  obs0 = jnp.zeros(env.observation_space(env_params).shape, jnp.float32)
  params = network.init(k_net, *(inputs(obs0) if inputs else (obs0,)))
  train_state = TrainState.create(apply_fn=network.apply, params=params,
                                  tx=make_optimizer(config))
  obs, env_state = jax.vmap(env.reset, (0, None))(
      jax.random.split(k_env, config.num_envs), env_params)
  return key, train_state, mask_obs(obs, config), env_state


def step_envs(env, env_params, key, env_state, action):
  """Steps every env once (gymnax, auto-reset), ``action [E, ...]``.

  Returns ``(obs, env_state, reward, terminated, truncated, info)`` with
  ``truncated`` cleared where the step also terminated: a terminal state is
  never bootstrapped, even at the time limit.
  """
  obs, env_state, reward, terminated, truncated, info = jax.vmap(
      env.step, (0, 0, 0, None))(jax.random.split(key, action.shape[0]),
                                 env_state, action, env_params)
  return obs, env_state, reward, terminated, truncated & ~terminated, info


def count_episodes(ep_return, reward, done, done_return, done_count):
  """Adds ``reward [E]`` to the running returns ``ep_return [E]``; the
  episodes that end (``done [E]``) add theirs to ``done_return`` and one
  each to ``done_count``, and restart from 0. Returns ``(ep_return,
  done_return, done_count)``."""
  ep_return = ep_return + reward
  return (jnp.where(done, 0.0, ep_return),
          done_return + jnp.where(done, ep_return, 0.0).sum(),
          done_count + done.sum())
