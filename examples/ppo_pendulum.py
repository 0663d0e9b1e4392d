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
unscaled ones). Run from the repository root:

    python -m examples.ppo_pendulum                  # both variants, 4 seeds
    python -m examples.ppo_pendulum --no-compare     # normalised agent only
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, NamedTuple

import flax.linen as nn
from flax.training.train_state import TrainState
import gymnax
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax

from examples import ppo_core
import jrollout as jr

OBS, ACT = 3, 1   # Pendulum-v1: obs [cos, sin, theta_dot], torque in [-2, 2]


@dataclasses.dataclass(frozen=True)
class Config:
  """PPO hyperparameters; every field is a command-line flag."""
  num_envs: int = 16
  num_steps: int = 128
  total_steps: int = 409_600
  num_epochs: int = 10
  num_minibatches: int = 8
  lr: float = 1e-3
  anneal_lr: bool = True
  gamma: float = 0.95
  gae_lambda: float = 0.95
  clip_eps: float = 0.2
  ent_coef: float = 0.0
  vf_coef: float = 0.5
  max_grad_norm: float = 0.5
  hidden: int = 64
  normalize: bool = True       # observation normalisation + reward scaling
  obs_clip: float = 10.0       # bound on normalised observations
  reward_clip: float = 10.0    # bound on scaled rewards
  compare: bool = True         # also train without normalisation and plot
  seeds: int = 4
  seed: int = 0
  chunks: int = 10             # host round-trips for progress printing
  out: str = "runs/ppo_pendulum"

  @property
  def num_updates(self) -> int:
    return self.total_steps // (self.num_envs * self.num_steps)

  @property
  def batch_size(self) -> int:
    return self.num_envs * self.num_steps // self.num_minibatches


class ActorCritic(nn.Module):
  """A Gaussian policy (state-independent log-std) and a value: two MLPs."""
  hidden: int = 64

  def setup(self):
    self.actor = ppo_core.mlp(self.hidden, ACT, 0.01)
    self.critic = ppo_core.mlp(self.hidden, 1, 1.0)
    self.log_std = self.param("log_std", nn.initializers.zeros, (ACT,))

  def __call__(self, obs):
    """obs [..., 3] -> (mean [..., 1], log_std [1], value [...])."""
    return self.actor(obs), self.log_std, self.value(obs)

  def value(self, obs):
    """The critic alone: obs [..., 3] -> value [...]."""
    return jnp.squeeze(self.critic(obs), -1)


def gaussian_logp(action, mean, log_std):
  """Log-density of a diagonal Gaussian, summed over the action dims."""
  z = (action - mean) * jnp.exp(-log_std)
  return jnp.sum(-0.5 * z**2 - log_std - 0.5 * np.log(2 * np.pi), -1)


class Runner(NamedTuple):
  train_state: TrainState
  env_state: Any
  obs: jax.Array                # [E, 3] the policy's input (normalised)
  obs_stats: jr.RunningStats    # of the raw observations, shape (3,)
  scaler: jr.RewardScaler       # per-env discounted returns [E] + stats
  ep_return: jax.Array          # [E] running raw (unscaled) return
  rollout: jr.RolloutState
  key: jax.Array


def register_keys(state: jr.RolloutState) -> jr.RolloutState:
  for name, shape, dtype in [
      ("obs", (OBS,), jnp.float32), ("action", (ACT,), jnp.float32),
      ("logp", (), jnp.float32), ("value", (), jnp.float32),
      ("reward", (), jnp.float32), ("terminated", (), jnp.bool_),
      ("truncated", (), jnp.bool_), ("final_obs", (OBS,), jnp.float32),
      ("advantage", (), jnp.float32), ("target", (), jnp.float32)]:
    state = jr.register(state, name, shape, dtype)
  return state


def ppo_loss(params, apply_fn, mb, config: Config):
  """Clipped PPO loss on a minibatch ``{key: [B, ...]}``."""
  mean, log_std, value = apply_fn(params, mb["obs"])
  logp = gaussian_logp(mb["action"], mean, log_std)
  ratio = jnp.exp(logp - mb["logp"])
  adv = jr.normalize_advantages(mb["advantage"])
  pg_loss = -jnp.minimum(
      ratio * adv,
      jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv).mean()
  v_clipped = mb["value"] + jnp.clip(value - mb["value"], -config.clip_eps,
                                     config.clip_eps)
  v_loss = 0.5 * jnp.maximum((value - mb["target"]) ** 2,
                             (v_clipped - mb["target"]) ** 2).mean()
  entropy = jnp.sum(log_std + 0.5 * np.log(2 * np.pi * np.e))
  total = pg_loss + config.vf_coef * v_loss - config.ent_coef * entropy
  return total, (pg_loss, v_loss, entropy)


def make_train(config: Config):
  """Returns ``(init_fn, update_fn)``; both are pure and vmappable.

  ``init_fn(key) -> Runner``; ``update_fn(runner) -> (runner, metrics)``
  runs one PPO update (rollout, GAE, epochs).
  """
  env, env_params = gymnax.make("Pendulum-v1")
  max_torque = env_params.max_torque
  network = ActorCritic(config.hidden)
  num_envs, num_steps = config.num_envs, config.num_steps

  def observe(stats, raw):
    """Folds raw observations ``[E, 3]`` in; returns the policy's input."""
    if not config.normalize:
      return stats, raw
    stats = jr.update_running_stats(stats, raw)
    return stats, jr.normalize(stats, raw, clip=config.obs_clip)

  def lr_schedule(count):
    steps_per_update = config.num_epochs * config.num_minibatches
    frac = 1.0 - (count // steps_per_update) / config.num_updates
    return config.lr * frac

  tx = optax.chain(
      optax.clip_by_global_norm(config.max_grad_norm),
      optax.adam(lr_schedule if config.anneal_lr else config.lr, eps=1e-5))

  def init_fn(key):
    key, k_net, k_env = jax.random.split(key, 3)
    params = network.init(k_net, jnp.zeros((OBS,), jnp.float32))
    train_state = TrainState.create(apply_fn=network.apply, params=params,
                                    tx=tx)
    raw, env_state = jax.vmap(env.reset, (0, None))(
        jax.random.split(k_env, num_envs), env_params)
    obs_stats, obs = observe(jr.running_stats((OBS,)), raw)
    rollout = register_keys(jr.init(num_envs, num_steps))
    return Runner(train_state, env_state, obs, obs_stats,
                  jr.reward_scaler(num_envs), jnp.zeros(num_envs), rollout,
                  key)

  def env_step(carry, t):
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    mean, log_std, value = network.apply(runner.train_state.params,
                                         runner.obs)
    action = mean + jnp.exp(log_std) * jax.random.normal(k_act, mean.shape)
    logp = gaussian_logp(action, mean, log_std)
    raw, env_state, reward, terminated, truncated, info = jax.vmap(
        env.step, (0, 0, 0, None))(jax.random.split(k_env, num_envs),
                                   runner.env_state,
                                   jnp.clip(action, -max_torque, max_torque),
                                   env_params)
    truncated = truncated & ~terminated
    done = terminated | truncated
    obs_stats, obs = observe(runner.obs_stats, raw)
    final_obs = info["final_observation"]
    scaler = runner.scaler
    if config.normalize:
      final_obs = jr.normalize(obs_stats, final_obs, clip=config.obs_clip)
      train_reward, scaler = jr.scale_rewards(
          scaler, reward, done, gamma=config.gamma, clip=config.reward_clip)
    else:
      train_reward = reward
    rollout = jr.update_at(runner.rollout, t, {
        "obs": runner.obs, "action": action, "logp": logp, "value": value,
        "reward": train_reward, "terminated": terminated,
        "truncated": truncated, "final_obs": final_obs})
    ep_return = runner.ep_return + reward
    done_return = done_return + jnp.where(done, ep_return, 0.0).sum()
    done_count = done_count + done.sum()
    runner = runner._replace(env_state=env_state, obs=obs,
                             obs_stats=obs_stats, scaler=scaler,
                             ep_return=jnp.where(done, 0.0, ep_return),
                             rollout=rollout, key=key)
    return (runner, done_return, done_count), None

  def update_fn(runner: Runner):
    (runner, done_return, done_count), _ = jax.lax.scan(
        env_step, (runner, jnp.float32(0), jnp.int32(0)),
        jnp.arange(num_steps))
    rollout = runner.rollout
    data = rollout.data   # [T, E, ...] storage, no copy
    params = runner.train_state.params
    last_value = network.apply(params, runner.obs, method=ActorCritic.value)
    final_values = network.apply(params, data["final_obs"],
                                 method=ActorCritic.value)   # [T, E]
    advantages, targets = jr.gae(
        data["reward"], data["value"], last_value, data["terminated"],
        truncations=data["truncated"], final_values=final_values,
        gamma=config.gamma, gae_lambda=config.gae_lambda)
    rollout = jr.update_all(rollout, {"advantage": advantages,
                                      "target": targets})

    def sgd_step(train_state, mb):
      grad_fn = jax.value_and_grad(ppo_loss, has_aux=True)
      (loss, aux), grads = grad_fn(train_state.params, train_state.apply_fn,
                                   mb, config)
      return train_state.apply_gradients(grads=grads), (loss, *aux)

    key, k_epochs = jax.random.split(runner.key)
    train_state, losses = jr.scan_minibatches(
        sgd_step, runner.train_state, k_epochs, rollout, config.batch_size,
        num_epochs=config.num_epochs)
    rollout = jr.finish_rollout(rollout)   # the write check (checkify)
    metrics = {
        "episode_return_sum": done_return,
        "episodes": done_count,
        "loss": losses[0].mean(),
        "v_loss": losses[2].mean(),
        "entropy": losses[3].mean(),
        "reward_std": runner.scaler.stats.std,
    }
    runner = runner._replace(train_state=train_state, rollout=rollout, key=key)
    return runner, metrics

  return init_fn, update_fn


def train(config: Config, verbose: bool = True,
          make_train_fn=make_train) -> dict[str, Any]:
  """Trains ``config.seeds`` seeds at once; returns per-update metrics.

  Raises:
    jr.IncompleteRolloutError: an update closed a rollout with a step not
      written exactly once (``jr.finish_rollout``'s check).
  """
  init_fn, update_fn = make_train_fn(config)
  num_updates = config.num_updates
  if num_updates < 1:
    raise ValueError(f"--total-steps {config.total_steps} is less than one "
                     f"rollout ({config.num_envs * config.num_steps} steps)")
  # Equal chunks compile once: the divisor of num_updates nearest the ask.
  target = num_updates / max(1, config.chunks)
  size = min((d for d in range(1, num_updates + 1) if num_updates % d == 0),
             key=lambda d: abs(d - target))

  def chunk(runner):
    return jax.lax.scan(lambda r, _: update_fn(r), runner, None, length=size)

  t_start = time.perf_counter()
  keys = jax.random.split(jax.random.key(config.seed), config.seeds)
  runner = jax.jit(jax.vmap(init_fn))(keys)
  # checkify returns jr.finish_rollout's write check as an error value next
  # to the outputs: (err, (runner, metrics)).
  compiled = jax.jit(
      checkify.checkify(jax.vmap(chunk), errors=checkify.user_checks),
      donate_argnums=0).lower(runner).compile()
  compile_s = time.perf_counter() - t_start
  steps_per_update = config.num_envs * config.num_steps
  history, run_s = [], 0.0
  for i in range(num_updates // size):
    t0 = time.perf_counter()
    err, (runner, metrics) = compiled(runner)
    metrics = jax.device_get(metrics)
    dt = time.perf_counter() - t0
    run_s += dt
    done = (i + 1) * size
    if err.get():
      raise jr.IncompleteRolloutError(
          f"train: updates {done - size}-{done - 1}: {err.get()}")
    history.append(metrics)
    if verbose:
      ret = metrics["episode_return_sum"].sum(1) / np.maximum(
          metrics["episodes"].sum(1), 1)
      print(f"update {done:4d}/{num_updates}  env steps "
            f"{done * steps_per_update:>8,d}/seed  return mean "
            f"{ret.mean():7.1f} [min {ret.min():7.1f}, max {ret.max():7.1f}]"
            f"  {config.seeds * size * steps_per_update / dt:,.0f} steps/s",
            flush=True)
  metrics = {k: np.concatenate([h[k] for h in history], axis=1)
             for k in history[0]}
  return {"metrics": metrics, "compile_s": compile_s, "run_s": run_s,
          "wall_s": time.perf_counter() - t_start}


def episode_returns(metrics, window: int = 1) -> np.ndarray:
  """``[seeds, updates]`` mean episodic return, pooled over ``window``."""
  s, n = metrics["episode_return_sum"], metrics["episodes"].astype(np.float64)
  kernel = np.ones(window)
  s = np.stack([np.convolve(r, kernel)[:r.size] for r in s])
  n = np.stack([np.convolve(r, kernel)[:r.size] for r in n])
  return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def final_returns(metrics, frac: float = 0.1) -> np.ndarray:
  """Per seed: mean return of the episodes that ended in the last ``frac``."""
  s, n = metrics["episode_return_sum"], metrics["episodes"]
  last = max(1, int(round(s.shape[1] * frac)))
  return s[:, -last:].sum(1) / np.maximum(n[:, -last:].sum(1), 1)


def save_curves(curves: dict[str, np.ndarray], steps_per_update: int,
                path: str) -> None:
  """Mean return vs env steps with the seeds' min-max band, one line each."""
  # Lazily, when plotting: the Agg backend must be chosen before pyplot is
  # imported, and training needs none of it.
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, ret in curves.items():
    x = np.arange(1, ret.shape[1] + 1) * steps_per_update
    ok = ~np.isnan(ret).any(0)
    ax.plot(x[ok], ret[:, ok].mean(0),
            label=f"{label} (mean of {ret.shape[0]} seeds)")
    ax.fill_between(x[ok], ret[:, ok].min(0), ret[:, ok].max(0), alpha=0.25)
  ax.axhline(-300, color="gray", ls="--", lw=1, label="goal: -300")
  ax.set_xlabel("env steps per seed")
  ax.set_ylabel("episodic return")
  ax.set_title("PPO on Pendulum-v1 (gymnax)")
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def parse_config(argv=None) -> Config:
  """A ``Config`` from command-line flags, one per dataclass field."""
  return ppo_core.parse_config(argv, Config, __doc__)


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
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
    final = final_returns(metrics)
    curves[label] = episode_returns(metrics, max(1, cfg.num_updates // 40))
    print(f"final return per seed (last 10% of updates): "
          f"{np.array2string(final, precision=1)}; compile "
          f"{result['compile_s']:.1f} s, run {result['run_s']:.1f} s, wall "
          f"{result['wall_s']:.1f} s\n", flush=True)
    summary[label] = {
        "final_returns": final.tolist(),
        "goal_met": bool((final >= -300).all()),
        "compile_s": result["compile_s"], "run_s": result["run_s"],
        "wall_s": result["wall_s"],
        "finite_losses": bool(np.isfinite(metrics["loss"]).all()),
        "reward_std_last": metrics["reward_std"][:, -1].tolist(),
    }
  png = os.path.join(config.out, "ppo_pendulum.png")
  save_curves(curves, steps_per_update, png)
  with open(os.path.join(config.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"curves: {png}\nsummary: {os.path.join(config.out, 'summary.json')}")
  return summary


if __name__ == "__main__":
  main()
