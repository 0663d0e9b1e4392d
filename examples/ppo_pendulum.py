"""PPO with a Gaussian policy on gymnax Pendulum-v1, with running statistics.

Observations are normalised with ``jr.init_running_stats`` /
``jr.update_running_stats`` / ``jr.normalize`` and rewards are divided by the
running standard deviation of the discounted return
(``jr.init_reward_scaler`` / ``jr.scale_rewards``), all inside the jitted,
seed-vmapped training run:

- each rollout is a ``lax.scan`` that folds every new observation ``[E, 3]``
  into the observation statistics, feeds the policy the normalised one, scales
  the reward and writes the step into a ``RolloutState`` with ``jr.update_at``;
- ``jr.gae`` bootstraps time-limit truncations (Pendulum's only episode end,
  every 200 steps) from the value of the true final observation;
- ``jr.scan_minibatches`` runs the epochs straight from the state, and
  ``jr.finish_rollout``'s write check comes back from the jitted chunk as a
  ``checkify`` error value (no host callback), raised on the host.

The same agent is trained a second time without either normalisation, and a
PNG compares the two learning curves (episodic returns are always the raw,
unscaled ones). This file holds the statistics, in its env step (collect);
the advantages, minibatches and gradient steps are ``ppo_cartpole``'s
(``ppo_cartpole.make_update``), the agent is ``examples/common/agent.py``'s
``ActorCritic`` with its Gaussian head. Run from the repository root:

    python -m examples.ppo_pendulum                  # both variants, 4 seeds
    python -m examples.ppo_pendulum --no-compare     # normalised agent only
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

from flax.training.train_state import TrainState
import gymnax
import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr
from examples import ppo_cartpole
from examples.common import agent
from examples.common import cli
from examples.common import gymnax_envs
from examples.common import reporting
from examples.common import training

ACT = 1   # Pendulum-v1: obs [cos, sin, theta_dot], one torque in [-2, 2]
GOAL = -300.0


@dataclasses.dataclass(frozen=True)
class Config(cli.Config):
  """PPO on Pendulum-v1; every field is a flag (see ``cli.Config``).

  ``--mask-velocity`` does not apply (it is CartPole's).
  """
  num_envs: int = 16
  total_steps: int = 409_600
  num_epochs: int = 10
  num_minibatches: int = 8
  lr: float = 1e-3
  gamma: float = 0.95
  ent_coef: float = 0.0
  normalize: bool = True       # observation normalisation + reward scaling
  obs_clip: float = 10.0       # bound on normalised observations
  reward_clip: float = 10.0    # bound on scaled rewards
  compare: bool = True         # also train without normalisation and plot
  out: str = "runs/ppo_pendulum"


class Runner(NamedTuple):
  """``ppo_cartpole.Runner`` with the running statistics."""
  train_state: TrainState
  env_state: Any
  obs: jax.Array                # [E, 3] the policy's input (normalised)
  obs_stats: jr.RunningStats    # of the raw observations, shape (3,)
  scaler: jr.RewardScaler       # per-env discounted returns [E] + stats
  ep_return: jax.Array          # [E] running raw (unscaled) return
  rollout: jr.RolloutState
  key: jax.Array


def make_train(config: Config):
  """Returns ``(init_fn, update_fn)``; both are pure and vmappable.

  ``init_fn(key) -> Runner``; ``update_fn(runner) -> (runner, metrics)``
  runs one PPO update with a Gaussian policy: this file's env step, which
  folds in the statistics, then ``ppo_cartpole.make_update``'s advantages,
  minibatches and gradient steps.
  """
  if config.mask_velocity:
    raise ValueError("--mask-velocity hides CartPole's velocities; it does "
                     "not apply to Pendulum-v1")
  env, env_params = gymnax.make("Pendulum-v1")
  max_torque = env_params.max_torque
  network = agent.ActorCritic(ACT, config.hidden, gaussian=True)

  def normalize(stats, raw):
    """Folds raw observations ``[E, 3]`` in; returns the policy's input."""
    if not config.normalize:
      return stats, raw
    stats = jr.update_running_stats(stats, raw)
    return stats, jr.normalize(stats, raw, clip=config.obs_clip)

  def init_fn(key):
    runner = ppo_cartpole.init_runner(key, config, env, env_params, network)
    obs_stats, obs = normalize(jr.init_running_stats(runner.obs.shape[1:]),
                               runner.obs)
    return Runner(runner.train_state, runner.env_state, obs, obs_stats,
                  jr.init_reward_scaler(config.num_envs), runner.ep_return,
                  runner.rollout, runner.key)

  def env_step(carry, t):
    """1. Collect, as ``ppo_cartpole``'s env step, with the torque clipped
    and the statistics folded in: the policy sees, and the rollout stores,
    normalised observations and scaled rewards (the returns stay raw)."""
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    policy, value = network.apply(runner.train_state.params, runner.obs)
    action, logp = policy.sample(k_act)
    torque = jnp.clip(action, -max_torque, max_torque)
    raw, env_state, reward, terminated, truncated, info = (
        gymnax_envs.step_envs(env, env_params, k_env, runner.env_state,
                              torque))
    done = terminated | truncated
    obs_stats, scaler = runner.obs_stats, runner.scaler
    obs, final_obs, scaled = raw, info["final_observation"], reward
    if config.normalize:
      obs_stats, obs = normalize(obs_stats, raw)
      final_obs = jr.normalize(obs_stats, final_obs, clip=config.obs_clip)
      scaled, scaler = jr.scale_rewards(
          scaler, reward, terminated, truncations=truncated,
          gamma=config.gamma, clip=config.reward_clip)
    rollout = jr.update_at(runner.rollout, t, {
        "obs": runner.obs, "action": action, "logp": logp, "value": value,
        "reward": scaled, "terminated": terminated, "truncated": truncated,
        "final_obs": final_obs})
    ep_return, done_return, done_count = gymnax_envs.count_episodes(
        runner.ep_return, reward, done, done_return, done_count)
    runner = runner._replace(env_state=env_state, obs=obs,
                             obs_stats=obs_stats, scaler=scaler,
                             ep_return=ep_return, rollout=rollout, key=key)
    return (runner, done_return, done_count), None

  ppo_update = ppo_cartpole.make_update(config, network, env_step)

  def update_fn(runner: Runner):
    runner, metrics = ppo_update(runner)
    return runner, {**metrics, "reward_std": runner.scaler.stats.std}

  return init_fn, update_fn


def train(config: Config, verbose: bool = True,
          make_train_fn=make_train) -> dict[str, Any]:
  """``training.train`` of this agent (or of ``make_train_fn``'s).

  Raises:
    jr.IncompleteRolloutError: an update closed a rollout with a step not
      written exactly once (``jr.finish_rollout``'s check).
  """
  return training.train(config, make_train_fn, verbose)


def save_curves(curves: dict[str, np.ndarray], steps_per_update: int,
                path: str) -> None:
  """``reporting.save_curve`` with the goal line (-300)."""
  reporting.save_curve(curves, steps_per_update, path,
                      "PPO on Pendulum-v1 (gymnax)", goal=GOAL,
                      legend="lower right")


def parse_config(argv=None) -> Config:
  """A ``Config`` from command-line flags, one per dataclass field."""
  return cli.parse_config(argv, Config, __doc__)


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  cli.use_compile_cache(config)   # --compile-cache, before compiling
  variants = {"normalised obs + scaled rewards": config}
  if config.compare:
    variants["raw obs and rewards"] = dataclasses.replace(config,
                                                          normalize=False)
  os.makedirs(config.out, exist_ok=True)
  steps_per_update = config.num_envs * config.num_steps
  summary: dict[str, Any] = {"config": dataclasses.asdict(config)}
  curves = {}
  for label, cfg in variants.items():
    print(f"PPO Pendulum-v1 on jrollout, {label}: {cfg.seeds} seeds x "
          f"{cfg.num_updates} updates of {cfg.num_envs} envs x "
          f"{cfg.num_steps} steps ({jax.devices()[0].platform})", flush=True)
    result = train(cfg)
    metrics = result["metrics"]
    final = reporting.final_returns(metrics)
    curves[label] = reporting.episode_returns(
        metrics, max(1, cfg.num_updates // 40))
    print(f"final return per seed (last 10% of updates): "
          f"{reporting.show(final)}; compile "
          f"{result['compile_s']:.1f} s, run {result['run_s']:.1f} s, wall "
          f"{result['wall_s']:.1f} s\n", flush=True)
    summary[label] = {
        "final_returns": reporting.or_none(final),
        "goal_met": bool((final >= GOAL).all()),
        "compile_s": result["compile_s"], "run_s": result["run_s"],
        "wall_s": result["wall_s"],
        "finite_losses": bool(np.isfinite(metrics["loss"]).all()),
        "reward_std_last": metrics["reward_std"][:, -1].tolist(),
    }
  png = os.path.join(config.out, "ppo_pendulum.png")
  save_curves(curves, steps_per_update, png)
  path = reporting.write_summary(config.out, summary)
  print(f"curves: {png}\nsummary: {path}")
  return summary


if __name__ == "__main__":
  main()
