"""The PPO pieces the examples share: config, network, loss, env step, loop.

Everything here is plain JAX/Flax and jrollout, and every example imports it
as ``from examples import ppo_core``:

- ``Config``: the PPO hyperparameters; each example subclasses it with its
  own defaults and extra fields, and ``parse_config`` turns every field into
  a command-line flag;
- the feed-forward agent: ``ActorCritic``, ``ppo_objective`` / ``ppo_loss``
  (clipped PPO), ``make_optimizer``, ``init_learner``;
- acting in gymnax CartPole: ``sample_action``, ``step_envs`` (the
  truncated-and-terminated rule), ``mask_obs``, ``register_keys`` (the
  rollout's keys) and ``make_env_step`` (the rollout's scan body);
- the rollout check's report (``raise_if_incomplete``);
- ``train``: the host loop over jitted chunks of updates, seeds vmapped;
- results: ``episode_returns``, ``final_returns``, ``save_curve``.

Run an example from the repository root, e.g.
``python -m examples.ppo_cartpole``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import time
from typing import Any, Callable, NamedTuple

import flax.linen as nn
from flax.training.train_state import TrainState
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jrollout as jr


@dataclasses.dataclass(frozen=True)
class Config:
  """PPO hyperparameters; every field is a command-line flag.

  The defaults are the CartPole agent's. An example subclasses this class,
  declaring only its new fields and the defaults it changes.
  """
  num_envs: int = 8
  num_steps: int = 128
  total_steps: int = 1_000_000
  num_epochs: int = 4
  num_minibatches: int = 4
  lr: float = 2.5e-4
  anneal_lr: bool = True
  gamma: float = 0.99
  gae_lambda: float = 0.95
  clip_eps: float = 0.2
  ent_coef: float = 0.01
  vf_coef: float = 0.5
  max_grad_norm: float = 0.5
  hidden: int = 64
  seeds: int = 4              # vmapped training runs (``train``)
  seed: int = 0
  chunks: int = 10            # host round-trips for progress printing
  mask_velocity: bool = False  # hide the velocities (a POMDP variant)
  out: str = "runs/ppo"

  @property
  def num_updates(self) -> int:
    return self.total_steps // (self.num_envs * self.num_steps)

  @property
  def batch_size(self) -> int:
    """B, the rows of a minibatch: ``E * T // num_minibatches``."""
    return self.num_envs * self.num_steps // self.num_minibatches


def mlp(hidden: int, out: int, out_scale: float) -> nn.Sequential:
  """A two-layer tanh MLP with orthogonal init: ``[..., in] -> [..., out]``."""
  init = nn.initializers.orthogonal
  return nn.Sequential([
      nn.Dense(hidden, kernel_init=init(np.sqrt(2))), nn.tanh,
      nn.Dense(hidden, kernel_init=init(np.sqrt(2))), nn.tanh,
      nn.Dense(out, kernel_init=init(out_scale))])


class ActorCritic(nn.Module):
  """Separate tanh MLPs for the policy logits and the value."""
  num_actions: int
  hidden: int = 64

  def setup(self):
    self.actor = mlp(self.hidden, self.num_actions, 0.01)
    self.critic = mlp(self.hidden, 1, 1.0)

  def __call__(self, obs):
    """obs [..., 4] -> (logits [..., A], value [...])."""
    return self.actor(obs), self.value(obs)

  def value(self, obs):
    """The critic alone: obs [..., 4] -> value [...]."""
    return jnp.squeeze(self.critic(obs), -1)


def mask_obs(obs, config: Config):
  """CartPole's obs is [x, x_dot, theta, theta_dot]; optionally hide speeds."""
  if config.mask_velocity:
    return obs * jnp.array([1.0, 0.0, 1.0, 0.0], obs.dtype)
  return obs


class Runner(NamedTuple):
  train_state: TrainState
  env_state: Any
  obs: jax.Array             # [E, 4]
  ep_return: jax.Array       # [E] running undiscounted return
  rollout: jr.RolloutState
  key: jax.Array


def register_keys(state: jr.RolloutState, *,
                  final: str = "value") -> jr.RolloutState:
  """The rollout's keys. ``final="obs"`` stores each step's true final
  observation ``[E, 4]`` (valued in one batched forward after the rollout);
  ``final="value"`` stores its value ``[E]`` (for recurrent or host-driven
  agents, which value it during the step)."""
  for name, shape, dtype in [
      ("obs", (4,), jnp.float32), ("action", (), jnp.int32),
      ("logp", (), jnp.float32), ("value", (), jnp.float32),
      ("reward", (), jnp.float32), ("terminated", (), jnp.bool_),
      ("truncated", (), jnp.bool_),
      ("final_" + final, (4,) if final == "obs" else (), jnp.float32),
      ("advantage", (), jnp.float32), ("target", (), jnp.float32)]:
    state = jr.register(state, name, shape, dtype)
  return state


def ppo_objective(logits, value, mb, config: Config):
  """The clipped PPO objective from network outputs on a minibatch.

  Args:
    logits: ``[..., A]`` policy logits at ``mb["obs"]``.
    value: ``[...]`` values at ``mb["obs"]``.
    mb: ``{"action", "logp", "value", "advantage", "target": [...]}``.
    config: the coefficients.

  Returns:
    ``(total_loss, (pg_loss, v_loss, entropy))``.
  """
  logp_all = jax.nn.log_softmax(logits)
  logp = jnp.take_along_axis(logp_all, mb["action"][..., None], -1)[..., 0]
  ratio = jnp.exp(logp - mb["logp"])
  adv = jr.normalize_advantages(mb["advantage"])
  pg_loss = -jnp.minimum(
      ratio * adv,
      jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv).mean()
  v_clipped = mb["value"] + jnp.clip(value - mb["value"], -config.clip_eps,
                                     config.clip_eps)
  v_loss = 0.5 * jnp.maximum((value - mb["target"]) ** 2,
                             (v_clipped - mb["target"]) ** 2).mean()
  entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
  total = pg_loss + config.vf_coef * v_loss - config.ent_coef * entropy
  return total, (pg_loss, v_loss, entropy)


def ppo_loss(params, apply_fn, mb, config: Config):
  """Clipped PPO loss of the feed-forward network on ``{key: [B, ...]}``."""
  logits, value = apply_fn(params, mb["obs"])
  return ppo_objective(logits, value, mb, config)


def make_optimizer(config: Config):
  """Adam with global-norm clipping; the learning rate anneals to 0."""
  def lr_schedule(count):
    steps_per_update = config.num_epochs * config.num_minibatches
    frac = 1.0 - (count // steps_per_update) / config.num_updates
    return config.lr * frac

  lr = lr_schedule if config.anneal_lr else config.lr
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                     optax.adam(lr, eps=1e-5))


def init_learner(key, config: Config, env, env_params, network: ActorCritic):
  """A fresh network, optimiser state and envs.

  Returns ``(key, train_state, obs, env_state)`` with ``obs [E, 4]`` masked
  as ``config`` says and ``key`` the rest of the stream.
  """
  key, k_net, k_env = jax.random.split(key, 3)
  params = network.init(k_net, jnp.zeros((4,), jnp.float32))
  train_state = TrainState.create(apply_fn=network.apply, params=params,
                                  tx=make_optimizer(config))
  obs, env_state = jax.vmap(env.reset, (0, None))(
      jax.random.split(k_env, config.num_envs), env_params)
  return key, train_state, mask_obs(obs, config), env_state


def sample_action(key, logits):
  """Samples actions from ``logits [E, A]``.

  Returns:
    ``(action, logp)``, both ``[E]``.
  """
  action = jax.random.categorical(key, logits)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None],
                             -1)[:, 0]
  return action, logp


def step_envs(env, env_params, key, env_state, action):
  """Steps every env once (gymnax, auto-reset), ``action [E]``.

  Returns ``(obs, env_state, reward, terminated, truncated, info)`` with
  ``truncated`` cleared where the step also terminated: a terminal state is
  never bootstrapped, even at the time limit.
  """
  obs, env_state, reward, terminated, truncated, info = jax.vmap(
      env.step, (0, 0, 0, None))(jax.random.split(key, action.shape[0]),
                                 env_state, action, env_params)
  return obs, env_state, reward, terminated, truncated & ~terminated, info


def make_env_step(config: Config, env, env_params, network: ActorCritic):
  """The rollout's scan body: one step of every env, written with update_at.

  ``env_step((runner, done_return, done_count), t)`` acts, steps the envs
  (auto-reset), writes step ``t`` of the rollout and accumulates the returns
  of the episodes that ended.
  """
  def env_step(carry, t):
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    params = runner.train_state.params
    logits, value = network.apply(params, runner.obs)
    action, logp = sample_action(k_act, logits)
    obs, env_state, reward, terminated, truncated, info = step_envs(
        env, env_params, k_env, runner.env_state, action)
    # The true final observation (before the auto-reset): valued after the
    # rollout in one batched forward, used only where truncated.
    rollout = jr.update_at(runner.rollout, t, {
        "obs": runner.obs, "action": action, "logp": logp, "value": value,
        "reward": reward, "terminated": terminated, "truncated": truncated,
        "final_obs": mask_obs(info["final_observation"], config)})
    ep_return = runner.ep_return + reward
    done = terminated | truncated
    done_return = done_return + jnp.where(done, ep_return, 0.0).sum()
    done_count = done_count + done.sum()
    runner = runner._replace(env_state=env_state, obs=mask_obs(obs, config),
                             ep_return=jnp.where(done, 0.0, ep_return),
                             rollout=rollout, key=key)
    return (runner, done_return, done_count), None

  return env_step


def raise_if_incomplete(err: checkify.Error, first_update: int,
                        num_updates: int) -> None:
  """Raises if an update of a chunk closed an incomplete rollout.

  ``err`` is the error value of the chunk's ``checkify.checkify``: the
  library's write check (``jr.finish_rollout``'s default under ``jit``)
  reported it without a host callback, so every call dispatched
  asynchronously.
  """
  message = err.get()
  if message:
    raise jr.IncompleteRolloutError(
        f"train: updates {first_update}-{first_update + num_updates - 1}: "
        f"{message}")


def make_chunk(config: Config, update_fn, num_updates: int):
  """A jitted, seed-vmapped function running ``num_updates`` updates."""

  def chunk(runner):
    return jax.lax.scan(lambda r, _: update_fn(r), runner, None,
                        length=num_updates)

  # checkify turns the write checks of jr.finish_rollout into an error value
  # returned next to the outputs: (err, (runner, metrics)).
  return jax.jit(checkify.checkify(jax.vmap(chunk),
                                   errors=checkify.user_checks),
                 donate_argnums=0)


def train(config: Config, make_train_fn: Callable[[Config], tuple[Any, Any]],
          verbose: bool = True, checkpoint: Any = None) -> dict[str, Any]:
  """Trains ``config.seeds`` seeds at once; returns per-update metrics.

  Args:
    config: the run's settings (``seeds``, ``seed``, ``chunks`` and the
      sizes are read here).
    make_train_fn: ``make_train_fn(config) -> (init_fn, update_fn)`` with
      ``init_fn(key) -> runner`` and ``update_fn(runner) -> (runner,
      metrics)``, both pure and vmappable; ``metrics`` holds
      ``episode_return_sum`` and ``episodes``; ``update_fn`` closes each
      rollout with ``jr.finish_rollout``, whose check is reported here.
    verbose: print one progress line per chunk.
    checkpoint: None, or what saves and resumes the run (``RunCheckpoint``
      below): ``checkpoint.resume(runner)`` returns
      ``(runner, history, done_updates)`` to go on from (the fresh runner,
      ``[]`` and 0 if there is nothing to resume); ``checkpoint.save(
      done_updates, runner, history)`` is called after every chunk and
      ``checkpoint.close()`` at the end.

  Returns:
    ``{"metrics": {name: [seeds, updates]}, "runner": the final runner,
    "compile_s", "run_s", "init_s", "wall_s"}``.

  Raises:
    ValueError: if ``total_steps`` is less than one rollout.
    jr.IncompleteRolloutError: if an update closed an incomplete rollout.
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
  sizes = [size] * (num_updates // size)
  keys = jax.random.split(jax.random.key(config.seed), config.seeds)
  t0 = time.perf_counter()
  # lax.map, not vmap: a jitted vmap of the GRU's orthogonal initialisers
  # (batched QR) hung on XLA:CPU with jax 0.10.2 in our runs.
  runner = jax.block_until_ready(
      jax.jit(lambda ks: jax.lax.map(init_fn, ks))(keys))
  init_s = time.perf_counter() - t0
  steps_per_update = config.num_envs * config.num_steps
  history: list[dict[str, np.ndarray]] = []
  compile_s, run_s, done_updates = 0.0, 0.0, 0
  if checkpoint is not None:
    runner, history, done_updates = checkpoint.resume(runner)
  compiled = {}
  t_start = time.perf_counter()
  remaining = sizes[done_updates // size:]   # all of them unless resumed
  for size in remaining:
    if size not in compiled:
      t0 = time.perf_counter()
      fn = make_chunk(config, update_fn, size)
      compiled[size] = fn.lower(runner).compile()
      compile_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    err, (runner, metrics) = compiled[size](runner)
    metrics = jax.device_get(metrics)
    dt = time.perf_counter() - t0
    run_s += dt
    raise_if_incomplete(err, done_updates, size)
    history.append(metrics)
    done_updates += size
    if checkpoint is not None:
      checkpoint.save(done_updates, runner, history)
    if verbose:
      ret = metrics["episode_return_sum"].sum(1) / np.maximum(
          metrics["episodes"].sum(1), 1)
      rate = config.seeds * size * steps_per_update / dt
      print(f"update {done_updates:5d}/{num_updates}  env steps "
            f"{done_updates * steps_per_update:>9,d}/seed  return "
            f"mean {ret.mean():6.1f} [min {ret.min():6.1f}, max "
            f"{ret.max():6.1f}]  {rate:,.0f} steps/s", flush=True)
  if checkpoint is not None:
    checkpoint.close()
  metrics = {k: np.concatenate([h[k] for h in history], axis=1)
             for k in history[0]}
  return {"metrics": metrics, "runner": runner, "compile_s": compile_s,
          "run_s": run_s,
          "init_s": init_s,
          "wall_s": time.perf_counter() - t_start}


def episode_returns(metrics, window: int = 1) -> np.ndarray:
  """``[seeds, updates]`` mean episodic return, smoothed over ``window``."""
  s, n = metrics["episode_return_sum"], metrics["episodes"].astype(np.float64)
  if window > 1:
    kernel = np.ones(window)
    s = np.stack([np.convolve(r, kernel)[:r.size] for r in s])
    n = np.stack([np.convolve(r, kernel)[:r.size] for r in n])
  return s / np.maximum(n, 1)


def final_returns(metrics, frac: float = 0.1) -> np.ndarray:
  """Per seed: mean return of the episodes that ended in the last ``frac``."""
  s, n = metrics["episode_return_sum"], metrics["episodes"]
  last = max(1, int(round(s.shape[1] * frac)))
  return s[:, -last:].sum(1) / np.maximum(n[:, -last:].sum(1), 1)


def save_curve(curves: dict[str, np.ndarray], steps_per_update: int,
               path: str, title: str) -> None:
  """Mean return vs env steps with the seeds' min-max band, one line each."""
  import matplotlib  # noqa: PLC0415 - optional dependency, plots only
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, ret in curves.items():
    x = np.arange(1, ret.shape[1] + 1) * steps_per_update
    ax.plot(x, ret.mean(0), label=f"{label} (mean of {ret.shape[0]} seeds)")
    ax.fill_between(x, ret.min(0), ret.max(0), alpha=0.25)
  ax.set_xlabel("env steps per seed")
  ax.set_ylabel("episodic return")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def parse_config(argv=None, cls=Config, doc=None, choices=None):
  """A ``cls`` instance from command-line flags, one per dataclass field.

  ``doc`` is the calling example's docstring (its first line describes the
  command); ``choices`` maps a field name to its allowed values (argparse
  checks them).
  """
  parser = argparse.ArgumentParser(
      description=(doc or __doc__).split("\n")[0])
  for field in dataclasses.fields(cls):
    flag = "--" + field.name.replace("_", "-")
    if field.type in ("bool", bool):
      parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                          default=field.default)
    else:
      typ = {"int": int, "float": float, "str": str}[str(field.type)]
      parser.add_argument(flag, type=typ, default=field.default,
                          choices=(choices or {}).get(field.name))
  return cls(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------- checkpoints

class RunCheckpoint:
  """Saves a whole run with orbax and resumes it exactly.

  Each checkpoint, numbered by the updates done, holds the runner (the
  parameters, optimiser state, env state, rollout and PRNG key of every
  seed) as ``jr.RolloutSave``, the metrics history so far, and the
  settings. An ``ocp.CheckpointManager`` writes them asynchronously (the
  next chunk runs meanwhile) into temporary directories renamed when
  complete, keeps the last ``KEEP``, and resumes from the latest complete
  one that verifies. Checkpoints are taken at chunk ends, once
  ``checkpoint_every`` updates have passed since the last, and after the
  last update.

  A checkpoint damaged after it was written (``jr.CorruptCheckpointError``:
  a leaf whose bytes differ from their checksum, a file missing or cut
  short; or a settings item that cannot be read) is reported on stderr
  with its update and what is damaged, moved aside to ``<update>.damaged``
  in the same directory (never deleted), and the next older checkpoint is
  tried, down to starting afresh.
  """

  IGNORED = ("out", "checkpoint_dir", "checkpoint_every")  # may change
  KEEP = 3   # checkpoints kept: a damaged latest one leaves older ones
  HISTORY_AXIS = 1   # metrics are [seeds, updates]: joined along updates
  CLEANUP_TMP = False   # leave an interrupted save's temporary directory

  def __init__(self, config):
    path = config.checkpoint_dir
    self._directory = path if "://" in path else os.path.abspath(path)
    if config.checkpoint_every < 1:
      raise ValueError(f"--checkpoint-every must be a positive number of "
                       f"updates, got {config.checkpoint_every}")
    self._every = config.checkpoint_every
    self._num_updates = config.num_updates
    self._settings = {k: v for k, v in dataclasses.asdict(config).items()
                      if k not in self.IGNORED}
    self._last = 0
    self._mngr = ocp.CheckpointManager(
        self._directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=self.KEEP, enable_async_checkpointing=True,
            cleanup_tmp_directories=self.CLEANUP_TMP))

  def resume(self, runner):
    """``(runner, history, updates done)`` of the latest checkpoint that
    verifies (the fresh runner, ``[]`` and 0 if there is none)."""
    for step in sorted(self._mngr.all_steps(), reverse=True):
      try:
        got = self._restore(step, runner)
      except (jr.CorruptCheckpointError, _DamagedSettings) as e:
        self._set_aside(step, e)
        continue
      self._say(f"resumed from {self._directory} at update {step}")
      self._last = step
      return got["runner"], [got["history"]], step
    return runner, [], 0

  def _say(self, message: str) -> None:
    print(message, flush=True)

  def _restore(self, step: int, runner):
    try:
      settings = self._mngr.restore(step, args=ocp.args.Composite(
          settings=ocp.args.JsonRestore()))["settings"]
    except (ValueError, OSError) as e:   # JSON unreadable, file missing
      raise _DamagedSettings(f"its settings cannot be read ({e})") from None
    if settings != self._settings:
      diff = {k: (settings.get(k), v) for k, v in self._settings.items()
              if settings.get(k) != v}
      raise ValueError(
          f"--checkpoint-dir {self._directory}: its checkpoint at update "
          f"{step} was written with other settings ({{flag: (saved, now)}}: "
          f"{diff}); use another directory or the same flags")
    return self._mngr.restore(step, args=ocp.args.Composite(
        runner=jr.RolloutRestore(runner), history=jr.RolloutRestore()))

  def _set_aside(self, step: int, error: Exception) -> None:
    """Reports a damaged checkpoint on stderr and moves it aside."""
    path = os.path.join(self._directory, str(step))
    aside = f"{path}.damaged"
    n = 1
    while os.path.exists(aside):
      n += 1
      aside = f"{path}.damaged{n}"
    what = ("; ".join(error.problems)
            if isinstance(error, jr.CorruptCheckpointError) else str(error))
    os.rename(path, aside)
    self._mngr.reload()
    print(f"--checkpoint-dir {self._directory}: the checkpoint at update "
          f"{step} is damaged: {what}; moved it to {aside}, trying the one "
          "before", file=sys.stderr, flush=True)

  def save(self, done_updates: int, runner, history) -> None:
    """Starts an asynchronous save if one is due (see the class)."""
    if (done_updates - self._last < self._every
        and done_updates < self._num_updates):
      return
    metrics = {k: np.concatenate([h[k] for h in history],
                                 axis=self.HISTORY_AXIS)
               for k in history[0]}
    self._mngr.save(done_updates, args=ocp.args.Composite(
        runner=jr.RolloutSave(runner), history=jr.RolloutSave(metrics),
        settings=ocp.args.JsonSave(self._settings)))
    self._last = done_updates

  def close(self) -> None:
    """Waits for the last save to be complete."""
    self._mngr.wait_until_finished()
    self._mngr.close()


class _DamagedSettings(ValueError):
  """A checkpoint's settings item cannot be read."""


def params_sha256(params) -> str:
  """SHA-256 of the parameters' bytes (leaves in tree order): equal
  hashes mean bit-identical parameters."""
  digest = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(params):
    digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
  return digest.hexdigest()
