"""The PPO example written in today's JAX idiom, without jrollout.

Same environment, network, loss, optimiser and algorithm as
examples/ppo_cartpole.py (the pieces of examples/common/); only the data
path differs, as in the widely used
pure-JAX PPO reference: the rollout is the stacked output of a ``lax.scan``,
GAE is a plain reverse ``lax.scan``, and each epoch is
``jax.random.permutation`` + gather + reshape into ``[M, B, ...]`` +
``lax.scan``. Like the example, it bootstraps time-limit truncations from the
value of the true final observation (one batched forward over the
rollout's ``[T, E]`` final observations).

``make_train(config, bootstrap_truncation=False)`` is the reference exactly:
every episode end is terminal, no final observations are kept or valued. It
does less work than the example, so it is reported beside the comparison,
not as its peer. Used by ``benchmarks/suites/ppo.py`` and ``gae.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flax.training.train_state import TrainState
import gymnax
import jax
import jax.numpy as jnp

from examples.common import agent
from examples.common import cli
from examples.common import gymnax_envs
from examples.common.loss import ppo_loss


class Transition(NamedTuple):
  obs: jax.Array
  action: jax.Array
  logp: jax.Array
  value: jax.Array
  reward: jax.Array
  terminated: jax.Array
  truncated: jax.Array        # time limit, not also terminated
  final_obs: jax.Array | None   # [E, 4] true final observation, or None


class Runner(NamedTuple):
  train_state: TrainState
  env_state: Any
  obs: jax.Array
  ep_return: jax.Array
  key: jax.Array


def gae(traj: Transition, last_value, final_values, gamma: float,
        gae_lambda: float):
  """GAE as a plain reverse ``lax.scan`` over time-major ``[T, E]`` steps.

  With ``final_values`` (``[T, E]``, the value of each step's true final
  observation) a truncated step bootstraps from it; with None every episode
  end is terminal, as in the reference. Returns ``(advantages, targets)``.
  """
  bootstrap = final_values is not None
  if not bootstrap:
    final_values = jnp.zeros_like(traj.value)

  def step(carry, x):
    advantage, next_value = carry
    t, final_value = x
    done = (t.terminated | t.truncated).astype(t.value.dtype)
    if bootstrap:
      next_value = jnp.where(t.truncated, final_value, next_value)
      nonterminal = 1.0 - t.terminated.astype(t.value.dtype)
    else:
      nonterminal = 1.0 - done
    delta = t.reward + gamma * next_value * nonterminal - t.value
    advantage = delta + gamma * gae_lambda * (1.0 - done) * advantage
    return (advantage, t.value), advantage

  _, advantages = jax.lax.scan(
      step, (jnp.zeros_like(last_value), last_value), (traj, final_values),
      reverse=True)
  return advantages, advantages + traj.value


def make_train(config: cli.Config, bootstrap_truncation: bool = True):
  """``(init_fn, update_fn)`` with the contract of ppo_cartpole.make_train.

  ``bootstrap_truncation=False``: the reference's GAE, which treats a time
  limit as a termination.
  """
  env, env_params = gymnax.make("CartPole-v1")
  network = agent.ActorCritic(env.action_space(env_params).n, config.hidden)
  num_envs, num_steps = config.num_envs, config.num_steps
  num_rows = num_envs * num_steps

  def init_fn(key):
    key, train_state, obs, env_state = gymnax_envs.init_learner(
        key, config, env, env_params, network)
    return Runner(train_state, env_state, obs, jnp.zeros(num_envs), key)

  def env_step(carry, _):
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    logits, value = network.apply(runner.train_state.params, runner.obs)
    action, logp = agent.sample_action(k_act, logits)
    obs, env_state, reward, terminated, truncated, info = (
        gymnax_envs.step_envs(env, env_params, k_env, runner.env_state,
                              action))
    done = terminated | truncated
    ep_return = runner.ep_return + reward
    done_return = done_return + jnp.where(done, ep_return, 0.0).sum()
    done_count = done_count + done.sum()
    final_obs = (gymnax_envs.mask_obs(info["final_observation"], config)
                 if bootstrap_truncation else None)
    transition = Transition(runner.obs, action, logp, value, reward,
                            terminated, truncated, final_obs)
    runner = runner._replace(env_state=env_state,
                             obs=gymnax_envs.mask_obs(obs, config),
                             ep_return=jnp.where(done, 0.0, ep_return),
                             key=key)
    return (runner, done_return, done_count), transition

  def update_fn(runner: Runner):
    (runner, done_return, done_count), traj = jax.lax.scan(
        env_step, (runner, jnp.float32(0), jnp.int32(0)), None, num_steps)
    params = runner.train_state.params
    last_value = network.apply(params, runner.obs,
                               method=agent.ActorCritic.value)
    final_values = (network.apply(params, traj.final_obs,
                                  method=agent.ActorCritic.value)   # [T, E]
                    if bootstrap_truncation else None)
    advantages, targets = gae(traj, last_value, final_values, config.gamma,
                              config.gae_lambda)
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
        grad_fn = jax.value_and_grad(ppo_loss, has_aux=True)
        (loss, aux), grads = grad_fn(train_state.params, train_state.apply_fn,
                                     mb, config)
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
