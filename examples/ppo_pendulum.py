"""PPO with a Gaussian policy on gymnax Pendulum-v1, with running statistics.

Observations are normalised with ``jr.running_stats`` /
``jr.update_running_stats`` / ``jr.normalize`` and rewards are divided by the
running standard deviation of the discounted return
(``jr.reward_scaler`` / ``jr.scale_rewards``), all inside the jitted,
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
unscaled ones). The agent (``ppo_core.ActorCritic`` with its Gaussian head),
the loss, the env step, the update and the host loop are those of
``examples/ppo_core.py``; this file adds the statistics (``observe``, the
env step's hook) and the torque clipping. Run from the repository root:

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

from examples import ppo_core
import jrollout as jr

ACT = 1   # Pendulum-v1: obs [cos, sin, theta_dot], one torque in [-2, 2]
GOAL = -300.0


@dataclasses.dataclass(frozen=True)
class Config(ppo_core.Config):
  """PPO on Pendulum-v1; every field is a flag (see ``ppo_core.Config``).

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
  """``ppo_core.Runner`` with the running statistics."""
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
  runs one PPO update (``ppo_core.make_update``: rollout, GAE, epochs)
  with a Gaussian policy, the statistics folded in during the rollout.
  """
  if config.mask_velocity:
    raise ValueError("--mask-velocity hides CartPole's velocities; it does "
                     "not apply to Pendulum-v1")
  env, env_params = gymnax.make("Pendulum-v1")
  max_torque = env_params.max_torque
  network = ppo_core.ActorCritic(ACT, config.hidden, gaussian=True)

  def normalize(stats, raw):
    """Folds raw observations ``[E, 3]`` in; returns the policy's input."""
    if not config.normalize:
      return stats, raw
    stats = jr.update_running_stats(stats, raw)
    return stats, jr.normalize(stats, raw, clip=config.obs_clip)

  def init_fn(key):
    runner = ppo_core.init_runner(key, config, env, env_params, network)
    obs_stats, obs = normalize(jr.running_stats(runner.obs.shape[1:]),
                               runner.obs)
    return Runner(runner.train_state, runner.env_state, obs, obs_stats,
                  jr.reward_scaler(config.num_envs), runner.ep_return,
                  runner.rollout, runner.key)

  def observe(runner, raw, final_obs, reward, done):
    """The policy sees, and the rollout stores, normalised observations
    and scaled rewards (the episodic returns stay raw)."""
    if not config.normalize:
      return runner, raw, final_obs, reward
    obs_stats, obs = normalize(runner.obs_stats, raw)
    final_obs = jr.normalize(obs_stats, final_obs, clip=config.obs_clip)
    reward, scaler = jr.scale_rewards(
        runner.scaler, reward, done, gamma=config.gamma,
        clip=config.reward_clip)
    runner = runner._replace(obs_stats=obs_stats, scaler=scaler)
    return runner, obs, final_obs, reward

  env_step = ppo_core.make_env_step(
      config, env, env_params, network, observe=observe,
      to_env=lambda action: jnp.clip(action, -max_torque, max_torque))
  ppo_update = ppo_core.make_update(config, env_step,
                                    ppo_core.final_obs_bootstrap(network))

  def update_fn(runner: Runner):
    runner, metrics = ppo_update(runner)
    return runner, {**metrics, "reward_std": runner.scaler.stats.std}

  return init_fn, update_fn


def train(config: Config, verbose: bool = True,
          make_train_fn=make_train) -> dict[str, Any]:
  """``ppo_core.train`` of this agent (or of ``make_train_fn``'s).

  Raises:
    jr.IncompleteRolloutError: an update closed a rollout with a step not
      written exactly once (``jr.finish_rollout``'s check).
  """
  return ppo_core.train(config, make_train_fn, verbose)


def save_curves(curves: dict[str, np.ndarray], steps_per_update: int,
                path: str) -> None:
  """``ppo_core.save_curve`` with the goal line (-300)."""
  ppo_core.save_curve(curves, steps_per_update, path,
                      "PPO on Pendulum-v1 (gymnax)", goal=GOAL,
                      legend="lower right")


def parse_config(argv=None) -> Config:
  """A ``Config`` from command-line flags, one per dataclass field."""
  return ppo_core.parse_config(argv, Config, __doc__)


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  ppo_core.use_compile_cache(config)   # --compile-cache, before compiling
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
    final = ppo_core.final_returns(metrics)
    curves[label] = ppo_core.episode_returns(
        metrics, max(1, cfg.num_updates // 40))
    print(f"final return per seed (last 10% of updates): "
          f"{np.array2string(final, precision=1)}; compile "
          f"{result['compile_s']:.1f} s, run {result['run_s']:.1f} s, wall "
          f"{result['wall_s']:.1f} s\n", flush=True)
    summary[label] = {
        "final_returns": final.tolist(),
        "goal_met": bool((final >= GOAL).all()),
        "compile_s": result["compile_s"], "run_s": result["run_s"],
        "wall_s": result["wall_s"],
        "finite_losses": bool(np.isfinite(metrics["loss"]).all()),
        "reward_std_last": metrics["reward_std"][:, -1].tolist(),
    }
  png = os.path.join(config.out, "ppo_pendulum.png")
  save_curves(curves, steps_per_update, png)
  path = ppo_core.write_summary(config.out, summary)
  print(f"curves: {png}\nsummary: {path}")
  return summary


if __name__ == "__main__":
  main()
