"""The PPO example written in today's JAX idiom, without jrollout.

Same environment, network, loss and optimiser as examples/ppo_cartpole.py;
only the data path differs, as in the widely used pure-JAX PPO reference:
the rollout is the stacked output of a ``lax.scan``, GAE is a reverse scan
that treats every episode end as terminal, and each epoch is
``jax.random.permutation`` + gather + reshape into ``[M, B, ...]`` +
``lax.scan``. Used by ``benchmarks/ppo_compare.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

from flax.training.train_state import TrainState
import gymnax
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "examples"))
import ppo_cartpole as ff  # noqa: E402


class Transition(NamedTuple):
  obs: jax.Array
  action: jax.Array
  logp: jax.Array
  value: jax.Array
  reward: jax.Array
  done: jax.Array


class Runner(NamedTuple):
  train_state: TrainState
  env_state: Any
  obs: jax.Array
  ep_return: jax.Array
  key: jax.Array


def make_train(config: ff.Config):
  """``(init_fn, update_fn)`` with the same contract as ppo_cartpole's."""
  env, env_params = gymnax.make("CartPole-v1")
  network = ff.ActorCritic(env.action_space(env_params).n, config.hidden)
  num_envs, num_steps = config.num_envs, config.num_steps
  num_rows = num_envs * num_steps

  def init_fn(key):
    key, train_state, obs, env_state = ff.init_learner(key, config, env,
                                                       env_params, network)
    return Runner(train_state, env_state, obs, jnp.zeros(num_envs), key)

  def env_step(carry, _):
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    logits, value = network.apply(runner.train_state.params, runner.obs)
    action = jax.random.categorical(k_act, logits)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None],
                               -1)[:, 0]
    obs, env_state, reward, terminated, truncated, _ = jax.vmap(
        env.step, (0, 0, 0, None))(jax.random.split(k_env, num_envs),
                                   runner.env_state, action, env_params)
    done = terminated | truncated
    ep_return = runner.ep_return + reward
    done_return = done_return + jnp.where(done, ep_return, 0.0).sum()
    done_count = done_count + done.sum()
    transition = Transition(runner.obs, action, logp, value, reward, done)
    runner = runner._replace(env_state=env_state, obs=obs,
                             ep_return=jnp.where(done, 0.0, ep_return),
                             key=key)
    return (runner, done_return, done_count), transition

  def gae(traj: Transition, last_value):
    def step(carry, t):
      advantage, next_value = carry
      delta = t.reward + config.gamma * next_value * (1 - t.done) - t.value
      advantage = delta + config.gamma * config.gae_lambda * (
          1 - t.done) * advantage
      return (advantage, t.value), advantage

    _, advantages = jax.lax.scan(
        step, (jnp.zeros_like(last_value), last_value), traj, reverse=True)
    return advantages, advantages + traj.value

  def update_fn(runner: Runner):
    (runner, done_return, done_count), traj = jax.lax.scan(
        env_step, (runner, jnp.float32(0), jnp.int32(0)), None, num_steps)
    _, last_value = network.apply(runner.train_state.params, runner.obs)
    advantages, targets = gae(traj, last_value)
    data = {"obs": traj.obs, "action": traj.action, "logp": traj.logp,
            "value": traj.value, "advantage": advantages, "target": targets}

    def epoch(carry, _):
      train_state, key = carry
      key, k_perm = jax.random.split(key)
      perm = jax.random.permutation(k_perm, num_rows)
      flat = jax.tree_util.tree_map(
          lambda x: x.reshape(num_rows, *x.shape[2:]), data)
      shuffled = jax.tree_util.tree_map(lambda x: jnp.take(x, perm, 0), flat)
      minibatches = jax.tree_util.tree_map(
          lambda x: x.reshape(config.num_minibatches, -1, *x.shape[1:]),
          shuffled)

      def sgd_step(train_state, mb):
        (loss, aux), grads = jax.value_and_grad(ff.ppo_loss, has_aux=True)(
            train_state.params, train_state.apply_fn, mb, config)
        return train_state.apply_gradients(grads=grads), (loss, *aux)

      train_state, losses = jax.lax.scan(sgd_step, train_state, minibatches)
      return (train_state, key), losses

    key, k_epochs = jax.random.split(runner.key)
    (train_state, _), losses = jax.lax.scan(
        epoch, (runner.train_state, k_epochs), None, config.num_epochs)
    metrics = {"episode_return_sum": done_return, "episodes": done_count,
               "loss": losses[0].mean(), "pg_loss": losses[1].mean(),
               "v_loss": losses[2].mean(), "entropy": losses[3].mean()}
    return runner._replace(train_state=train_state, key=key), metrics

  return init_fn, update_fn
