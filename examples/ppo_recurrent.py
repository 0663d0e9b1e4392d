"""Recurrent (GRU) PPO on CartPole-v1 with the velocities hidden, on jrollout.

With only the cart position and pole angle observed, a feed-forward policy
cannot tell which way the pole is moving; a recurrent one can. This example
trains a GRU actor-critic on jrollout's **sequence minibatches**
(``jr.scan_sequence_minibatches``: shuffle and split the env axis, keep each
env's time order) and resets the hidden state at episode starts. With
``--compare`` (the default) it then trains the feed-forward agent of
``examples/ppo_cartpole.py`` on the same masked task with the same budget
and plots both learning curves in one PNG. The shared PPO pieces (loss,
optimiser, host loop) are in ``examples/ppo_core.py``. From the repository
root:

    python -m examples.ppo_recurrent
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

import flax.linen as nn
from flax.training.train_state import TrainState
import gymnax
import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr
from examples import ppo_cartpole   # the feed-forward agent compared
from examples import ppo_core


@dataclasses.dataclass(frozen=True)
class Config(ppo_core.Config):
  """Recurrent PPO settings (every field is a flag); velocities masked."""
  num_envs: int = 16
  num_steps: int = 128
  total_steps: int = 500_000
  num_minibatches: int = 4      # of envs: each minibatch is [T, E/4] sequences
  lr: float = 5e-4
  gru_size: int = 64
  mask_velocity: bool = True
  compare: bool = True          # also train the feed-forward agent
  out: str = "runs/ppo_recurrent"


class RecurrentActorCritic(nn.Module):
  """A GRU torso shared by the policy and value heads."""
  num_actions: int
  hidden: int = 64
  gru_size: int = 64

  @nn.compact
  def __call__(self, h, obs, reset):
    """One step. h [..., H], obs [..., 4], reset [...] -> (h, logits, value)."""
    init = nn.initializers.orthogonal
    h = jnp.where(reset[..., None], jnp.zeros_like(h), h)
    x = nn.tanh(nn.Dense(self.hidden, kernel_init=init(np.sqrt(2)))(obs))
    h, y = nn.GRUCell(self.gru_size)(h, x)
    a = nn.tanh(nn.Dense(self.hidden, kernel_init=init(np.sqrt(2)))(y))
    logits = nn.Dense(self.num_actions, kernel_init=init(0.01))(a)
    v = nn.tanh(nn.Dense(self.hidden, kernel_init=init(np.sqrt(2)))(y))
    value = nn.Dense(1, kernel_init=init(1.0))(v)
    return h, logits, jnp.squeeze(value, -1)


class Runner(NamedTuple):
  train_state: TrainState
  env_state: Any
  obs: jax.Array        # [E, 4]
  hidden: jax.Array     # [E, H] before the current obs
  reset: jax.Array      # [E] the current obs starts an episode
  ep_return: jax.Array  # [E]
  rollout: jr.RolloutState
  key: jax.Array


def make_train(config: Config):
  """``(init_fn, update_fn)`` for recurrent PPO, as ``ppo_core.train`` takes."""
  env, env_params = gymnax.make("CartPole-v1")
  network = RecurrentActorCritic(env.action_space(env_params).n,
                                 config.hidden, config.gru_size)
  num_envs, num_steps = config.num_envs, config.num_steps
  envs_per_batch = num_envs // config.num_minibatches

  def register_keys(state):
    state = ppo_core.register_keys(state)
    state = jr.register(state, "hidden", (config.gru_size,))
    return jr.register(state, "reset", (), jnp.bool_)

  def init_fn(key):
    key, k_net, k_env = jax.random.split(key, 3)
    h0 = jnp.zeros((config.gru_size,))
    params = network.init(k_net, h0, jnp.zeros((4,)), jnp.array(True))
    train_state = TrainState.create(apply_fn=network.apply, params=params,
                                    tx=ppo_core.make_optimizer(config))
    obs, env_state = jax.vmap(env.reset, (0, None))(
        jax.random.split(k_env, num_envs), env_params)
    return Runner(train_state, env_state, ppo_core.mask_obs(obs, config),
                  jnp.zeros((num_envs, config.gru_size)),
                  jnp.ones(num_envs, bool), jnp.zeros(num_envs),
                  register_keys(jr.init(num_envs, num_steps)), key)

  def env_step(carry, t):
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    params = runner.train_state.params
    hidden, logits, value = network.apply(params, runner.hidden, runner.obs,
                                          runner.reset)
    action, logp = ppo_core.sample_action(k_act, logits)
    obs, env_state, reward, terminated, truncated, info = ppo_core.step_envs(
        env, env_params, k_env, runner.env_state, action)
    # The value of the true final observation, continuing the same episode.
    _, _, final_value = network.apply(
        params, hidden, ppo_core.mask_obs(info["final_observation"], config),
        jnp.zeros(num_envs, bool))
    rollout = jr.update_at(runner.rollout, t, {
        "obs": runner.obs, "action": action, "logp": logp, "value": value,
        "reward": reward, "terminated": terminated, "truncated": truncated,
        "final_value": final_value, "hidden": runner.hidden,
        "reset": runner.reset})
    done = terminated | truncated
    ep_return = runner.ep_return + reward
    done_return = done_return + jnp.where(done, ep_return, 0.0).sum()
    done_count = done_count + done.sum()
    runner = runner._replace(
        env_state=env_state, obs=ppo_core.mask_obs(obs, config), hidden=hidden,
        reset=done, ep_return=jnp.where(done, 0.0, ep_return),
        rollout=rollout, key=key)
    return (runner, done_return, done_count), None

  def sequence_loss(params, mb):
    """PPO loss on sequences ``{key: [T, Eb, ...]}``, replaying the GRU."""
    def step(h, xs):
      obs, reset = xs
      h, logits, value = network.apply(params, h, obs, reset)
      return h, (logits, value)

    _, (logits, value) = jax.lax.scan(step, mb["hidden"][0],
                                      (mb["obs"], mb["reset"]))
    return ppo_core.ppo_objective(logits, value, mb, config)

  def update_fn(runner: Runner):
    (runner, done_return, done_count), _ = jax.lax.scan(
        env_step, (runner, jnp.float32(0), jnp.int32(0)),
        jnp.arange(num_steps))
    _, _, last_value = network.apply(runner.train_state.params,
                                     runner.hidden, runner.obs, runner.reset)
    data = runner.rollout.data
    advantages, targets = jr.gae(
        data["reward"], data["value"], last_value, data["terminated"],
        truncations=data["truncated"], final_values=data["final_value"],
        gamma=config.gamma, gae_lambda=config.gae_lambda)
    rollout = jr.update_all(runner.rollout, {"advantage": advantages,
                                             "target": targets})

    def sgd_step(train_state, mb):
      (loss, aux), grads = jax.value_and_grad(sequence_loss, has_aux=True)(
          train_state.params, mb)
      return train_state.apply_gradients(grads=grads), (loss, *aux)

    key, k_epochs = jax.random.split(runner.key)
    train_state, losses = jr.scan_sequence_minibatches(
        sgd_step, runner.train_state, k_epochs, rollout, envs_per_batch,
        num_epochs=config.num_epochs)
    rollout = jr.finish_rollout(rollout)   # checked: see ppo_core.train
    metrics = {"episode_return_sum": done_return, "episodes": done_count,
               "loss": losses[0].mean(), "pg_loss": losses[1].mean(),
               "v_loss": losses[2].mean(), "entropy": losses[3].mean()}
    return runner._replace(train_state=train_state, rollout=rollout,
                           key=key), metrics

  return init_fn, update_fn


def main(argv=None) -> dict[str, Any]:
  config = ppo_core.parse_config(argv, Config, __doc__)
  os.makedirs(config.out, exist_ok=True)
  print(f"Recurrent PPO on masked CartPole-v1: {config.seeds} seeds x "
        f"{config.num_updates} updates of {config.num_envs} envs x "
        f"{config.num_steps} steps")
  results = {"GRU (sequence minibatches)": ppo_core.train(config,
                                                           make_train)}
  if config.compare:
    ff_fields = {f.name for f in dataclasses.fields(ppo_cartpole.Config)}
    ff_config = ppo_cartpole.Config(**{
        k: v for k, v in dataclasses.asdict(config).items() if k in ff_fields})
    print("\nFeed-forward PPO on the same masked task, same budget:")
    results["feed-forward"] = ppo_cartpole.train(ff_config)
  steps_per_update = config.num_envs * config.num_steps
  window = max(1, config.num_updates // 50)
  png = os.path.join(config.out, "recurrent_vs_feedforward.png")
  ppo_core.save_curve(
      {name: ppo_core.episode_returns(r["metrics"], window)
       for name, r in results.items()}, steps_per_update, png,
      "PPO on CartPole-v1 with velocities hidden")
  summary = {"config": dataclasses.asdict(config)}
  print("\nagent | final return per seed (last 10% of updates) | mean | "
        "run s")
  for name, r in results.items():
    final = ppo_core.final_returns(r["metrics"])
    print(f"{name} | {np.array2string(final, precision=1)} | "
          f"{final.mean():.1f} | {r['run_s']:.1f}")
    summary[name] = {"final_returns": final.tolist(), "run_s": r["run_s"],
                     "compile_s": r["compile_s"],
                     "finite_losses": bool(
                         np.isfinite(r["metrics"]["loss"]).all())}
  print(f"learning curves: {png}")
  with open(os.path.join(config.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


if __name__ == "__main__":
  main()
