"""Recurrent (GRU) PPO on CartPole-v1 with the velocities hidden, on jrollout.

With only the cart position and pole angle observed, a feed-forward policy
cannot tell which way the pole is moving; a recurrent one can. This example
trains a GRU actor-critic on jrollout's **sequence minibatches**
(``jr.scan_minibatches(..., seq_len=L)``: shuffle and split whole
sequences, keep their time order) and resets the hidden state at episode starts.

The policy's carry (the GRU state before each step) is stored at every step
in the field ``"carry"``. With ``--seq-len 0`` (the default) a sequence is an
env's whole rollout, ``[T, E/M]`` per minibatch, replayed from
``mb["carry"][0]``, the carry at step 0. With ``--seq-len L`` (L divides T)
each env's rollout is cut into ``T / L`` chunks of L steps and a minibatch
is ``[L, S/M]`` chunks (``S = E * T / L``), each replayed from its own stored
carry ``mb["carry"][0]`` (the state the policy had when it collected the
chunk's first step); an episode start inside a chunk resets the carry there,
as in the whole-sequence case. With
``--compare`` (the default) it then trains the feed-forward agent of
``examples/ppo_cartpole.py`` on the same masked task with the same budget
and plots both learning curves in one PNG. This file holds the GRU, its
env step (which stores the carry), its sequence loss and its update; the
PPO objective, the gymnax stepping and the host loop are in
``examples/common/``. From the repository root:

    python -m examples.ppo_recurrent
"""

from __future__ import annotations

import dataclasses
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
from examples.common import agent
from examples.common import cli
from examples.common import gymnax_envs
from examples.common import loss
from examples.common import reporting
from examples.common import training


@dataclasses.dataclass(frozen=True)
class Config(cli.Config):
  """Recurrent PPO settings (every field is a flag); velocities masked."""
  num_envs: int = 16
  num_steps: int = 128
  total_steps: int = 500_000
  num_minibatches: int = 4      # each minibatch: [T, E/4] or [L, S/4]
  seq_len: int = 0              # 0: whole rollouts; L: chunks of L steps
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
  carry: jax.Array      # [E, H] GRU state before the current obs
  reset: jax.Array      # [E] the current obs starts an episode
  ep_return: jax.Array  # [E]
  rollout: jr.RolloutState
  key: jax.Array


def make_train(config: Config):
  """``(init_fn, update_fn)`` for recurrent PPO, as ``training.train`` takes.

  One update: 1. collect (``env_step``: ``jr.update_at`` with the GRU's
  carry), 2. advantages (``jr.gae``), 3. sequence minibatches
  (``jr.scan_minibatches`` with ``seq_len``), each taking 4. a gradient step on
  ``sequence_loss``, which replays the GRU over the sequence.
  """
  env, env_params = gymnax.make("CartPole-v1")
  network = RecurrentActorCritic(env.action_space(env_params).n,
                                 config.hidden, config.gru_size)
  num_envs, num_steps = config.num_envs, config.num_steps
  # Whole rollouts (seq_len T) or chunks of seq_len steps: S sequences.
  seq_len = config.seq_len or num_steps
  if num_steps % seq_len:
    raise ValueError(f"--seq-len {seq_len} does not divide --num-steps "
                     f"{num_steps}")
  num_sequences = num_envs * (num_steps // seq_len)
  if num_sequences % config.num_minibatches:
    raise ValueError(f"--num-minibatches {config.num_minibatches} does not "
                     f"divide the {num_sequences} sequences")
  per_batch = num_sequences // config.num_minibatches

  def init_fn(key):
    h0 = jnp.zeros((config.gru_size,))
    key, train_state, obs, env_state = gymnax_envs.init_learner(
        key, config, env, env_params, network,
        inputs=lambda obs: (h0, obs, jnp.array(True)))
    rollout = jr.init(num_envs, num_steps)
    for name, shape, dtype in agent.rollout_fields(extra=[
        ("carry", (config.gru_size,), jnp.float32), ("reset", (), jnp.bool_)]):
      rollout = jr.register(rollout, name, shape, dtype)
    return Runner(train_state, env_state, obs,
                  jnp.zeros((num_envs, config.gru_size)),
                  jnp.ones(num_envs, bool), jnp.zeros(num_envs), rollout, key)

  def env_step(carry, t):
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    params = runner.train_state.params
    h, logits, value = network.apply(params, runner.carry, runner.obs,
                                     runner.reset)
    action, logp = agent.Categorical(logits).sample(k_act)
    obs, env_state, reward, terminated, truncated, info = (
        gymnax_envs.step_envs(env, env_params, k_env, runner.env_state,
                              action))
    # The value of the true final observation, continuing the same episode.
    _, _, final_value = network.apply(
        params, h, gymnax_envs.mask_obs(info["final_observation"], config),
        jnp.zeros(num_envs, bool))
    rollout = jr.update_at(runner.rollout, t, {
        "obs": runner.obs, "action": action, "logp": logp, "value": value,
        "reward": reward, "terminated": terminated, "truncated": truncated,
        "final_value": final_value, "carry": runner.carry,
        "reset": runner.reset})
    done = terminated | truncated
    ep_return, done_return, done_count = gymnax_envs.count_episodes(
        runner.ep_return, reward, done, done_return, done_count)
    runner = runner._replace(
        env_state=env_state, obs=gymnax_envs.mask_obs(obs, config),
        carry=h, reset=done, ep_return=ep_return, rollout=rollout, key=key)
    return (runner, done_return, done_count), None

  def sequence_loss(params, apply_fn, mb, config):
    """PPO loss on sequences ``{name: [L, Sb, ...]}``, replaying the GRU.

    Each sequence (a whole rollout, or a chunk) starts from the carry the
    policy had at its first step, ``mb["carry"][0]``; ``mb["reset"]`` zeroes
    it at every episode start inside the sequence.
    """
    def step(h, xs):
      obs, reset = xs
      h, logits, value = apply_fn(params, h, obs, reset)
      return h, (logits, value)

    _, (logits, value) = jax.lax.scan(step, mb["carry"][0],
                                      (mb["obs"], mb["reset"]))
    policy = agent.Categorical(logits)
    total, aux = loss.ppo_objective(policy, value, mb, config)
    # How far the replayed log-probabilities moved from the stored ones (a
    # diagnostic like PPO's approximate KL): 0 to float rounding before the
    # update's first gradient step, as the replay starts from stored carries.
    logp = policy.log_prob(mb["action"])
    return total, (*aux, jnp.abs(logp - mb["logp"]).max())

  sgd_step = loss.make_sgd_step(config, sequence_loss)

  def update_fn(runner):
    runner, episodes = training.collect(env_step, runner, num_steps)
    # The value after the rollout continues each env's sequence; a
    # truncation bootstraps from the final value stored during the step.
    data = runner.rollout.data
    _, _, last_value = network.apply(runner.train_state.params,
                                     runner.carry, runner.obs, runner.reset)
    advantages, targets = jr.gae(
        data["reward"], data["value"], last_value, data["terminated"],
        truncations=data["truncated"], final_values=data["final_value"],
        gamma=config.gamma, gae_lambda=config.gae_lambda)
    rollout = jr.update_all(runner.rollout,
                            {"advantage": advantages, "target": targets})
    key, k_epochs = jax.random.split(runner.key)
    # Minibatches of whole sequences (or chunks), [L, per_batch, ...] each.
    train_state, losses = jr.scan_minibatches(
        sgd_step, runner.train_state, k_epochs, rollout, per_batch,
        num_epochs=config.num_epochs, seq_len=seq_len)
    runner = runner._replace(train_state=train_state,
                             rollout=jr.finish_rollout(rollout), key=key)
    return runner, {**episodes, **loss.loss_metrics(losses),
                    "logp_change_max": losses[4].max(),
                    "logp_change_first": losses[4][0, 0]}

  return init_fn, update_fn


def main(argv=None) -> dict[str, Any]:
  config = cli.parse_config(argv, Config, __doc__)
  cli.use_compile_cache(config)   # --compile-cache, before compiling
  os.makedirs(config.out, exist_ok=True)
  print(f"Recurrent PPO on masked CartPole-v1: {config.seeds} seeds x "
        f"{config.num_updates} updates of {config.num_envs} envs x "
        f"{config.num_steps} steps, sequences of "
        f"{config.seq_len or config.num_steps} steps")
  results = {"GRU (sequence minibatches)": training.train(config,
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
  reporting.save_curve(
      {name: reporting.episode_returns(r["metrics"], window)
       for name, r in results.items()}, steps_per_update, png,
      "PPO on CartPole-v1 with velocities hidden")
  summary = {"config": dataclasses.asdict(config)}
  print("\nagent | final return per seed (last 10% of updates) | mean | "
        "run s")
  for name, r in results.items():
    final = reporting.final_returns(r["metrics"])
    print(f"{name} | {reporting.show(final)} | "
          f"{reporting.show(final.mean())} | {r['run_s']:.1f}")
    summary[name] = {"final_returns": reporting.or_none(final),
                     "run_s": r["run_s"],
                     "compile_s": r["compile_s"],
                     "finite_losses": bool(
                         np.isfinite(r["metrics"]["loss"]).all())}
  print(f"learning curves: {png}")
  reporting.write_summary(config.out, summary)
  return summary


if __name__ == "__main__":
  main()
