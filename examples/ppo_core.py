"""The PPO pieces the examples share: config, agent, update, loops, results.

Everything here is plain JAX/Flax and jrollout, and every example imports it
as ``from examples import ppo_core``:

- ``Config``: the PPO hyperparameters; each example subclasses it with its
  own defaults and extra fields, and ``parse_config`` turns every field into
  a command-line flag;
- the feed-forward agent, for any observation shape: ``ActorCritic`` with a
  categorical (``Categorical``, CartPole) or Gaussian (``Gaussian``,
  Pendulum) policy head, ``make_optimizer``, ``init_learner``;
- one PPO update: ``ppo_objective`` / ``ppo_loss`` (clipped PPO, optionally
  row-weighted), ``make_sgd_step``, ``write_advantages`` (``jr.gae`` into
  the rollout), ``ppo_epochs`` (the minibatch epochs and
  ``jr.finish_rollout``) and ``make_update`` (a whole in-JAX update:
  rollout scan, GAE, epochs);
- acting in a gymnax env: ``step_envs`` (the truncated-and-terminated
  rule), ``mask_obs``, ``register_keys`` (the rollout's keys) and
  ``make_env_step`` (the rollout's scan body);
- ``train``: the host loop over jitted chunks of updates, seeds vmapped,
  with the rollout check's report (``raise_if_incomplete``);
- ``HostLearner``: the jitted policy and update of a host loop (an env
  stepped outside JAX, written through a ``jr.RolloutWriter``);
- results: ``episode_returns``, ``final_returns``, ``save_curve``,
  ``write_summary``; and ``RunCheckpoint``, a whole run saved and resumed;
- ``use_compile_cache``: JAX's persistent compilation cache, which every
  example's ``main`` turns on (``--compile-cache DIR``, off with
  ``--no-compile-cache``), so a second run loads its executables from disk
  instead of compiling them again.

Run an example from the repository root, e.g.
``python -m examples.ppo_cartpole``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import math
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

COMPILE_CACHE_ENV = "JROLLOUT_COMPILE_CACHE"


def default_compile_cache() -> str:
  """``--compile-cache``'s default: ``$JROLLOUT_COMPILE_CACHE`` if set (an
  empty value turns the cache off), else ``~/.cache/jrollout/jax``."""
  return os.environ.get(
      COMPILE_CACHE_ENV,
      os.path.join(os.path.expanduser("~"), ".cache", "jrollout", "jax"))


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
  mask_velocity: bool = False  # CartPole: hide the velocities (a POMDP)
  out: str = "runs/ppo"
  # JAX's persistent compilation cache ("": off, --no-compile-cache);
  # see use_compile_cache
  compile_cache: str = dataclasses.field(default_factory=default_compile_cache)

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


# ------------------------------------------------------------ the agent

class Categorical(NamedTuple):
  """A categorical policy, ``logits [..., A]``; actions ``[...]`` int32."""
  logits: jax.Array

  def log_prob(self, action):
    """``[...]``: the log-probability of ``action [...]``."""
    return jnp.take_along_axis(jax.nn.log_softmax(self.logits),
                               action[..., None], -1)[..., 0]

  def entropy(self):
    """``[...]``."""
    logp_all = jax.nn.log_softmax(self.logits)
    return -(jnp.exp(logp_all) * logp_all).sum(-1)

  def sample(self, key):
    """``(action, logp)``, both ``[...]``."""
    action = jax.random.categorical(key, self.logits)
    return action, self.log_prob(action)

  def log_prob_entropy(self, action):
    """``(log_prob(action), entropy())`` from one ``log_softmax`` (one
    gradient path through it, as a hand-written PPO loss has)."""
    logp_all = jax.nn.log_softmax(self.logits)
    logp = jnp.take_along_axis(logp_all, action[..., None], -1)[..., 0]
    return logp, -(jnp.exp(logp_all) * logp_all).sum(-1)


class Gaussian(NamedTuple):
  """A diagonal Gaussian policy, ``mean [..., A]`` with a state-independent
  ``log_std [A]``; actions ``[..., A]`` float32, unbounded (the env clips)."""
  mean: jax.Array
  log_std: jax.Array

  def log_prob(self, action):
    """``[...]``: the log-density of ``action [..., A]``, summed over A."""
    z = (action - self.mean) * jnp.exp(-self.log_std)
    return jnp.sum(-0.5 * z**2 - self.log_std - 0.5 * math.log(2 * math.pi),
                   -1)

  def entropy(self):
    """``[...]``, the same in every row (the std is state-independent)."""
    per_dim = self.log_std + 0.5 * math.log(2 * math.pi * math.e)
    return jnp.broadcast_to(per_dim.sum(-1), self.mean.shape[:-1])

  def sample(self, key):
    """``(action [..., A], logp [...])``."""
    noise = jax.random.normal(key, self.mean.shape)
    action = self.mean + jnp.exp(self.log_std) * noise
    return action, self.log_prob(action)

  def log_prob_entropy(self, action):
    """``(log_prob(action), entropy())``."""
    return self.log_prob(action), self.entropy()


class ActorCritic(nn.Module):
  """Separate tanh MLPs for the policy and the value, on ``obs [..., O]``.

  ``gaussian=False``: a ``Categorical`` policy over ``num_actions``
  actions; ``True``: a ``Gaussian`` over ``num_actions`` dimensions, whose
  log-std is one parameter per dimension (initialised to 0).
  """
  num_actions: int
  hidden: int = 64
  gaussian: bool = False

  def setup(self):
    self.actor = mlp(self.hidden, self.num_actions, 0.01)
    self.critic = mlp(self.hidden, 1, 1.0)
    if self.gaussian:
      self.log_std = self.param("log_std", nn.initializers.zeros,
                                (self.num_actions,))

  def __call__(self, obs):
    """obs [..., O] -> (policy, value [...]) with policy a ``Categorical``
    (logits [..., A]) or a ``Gaussian`` (mean [..., A], log_std [A])."""
    out = self.actor(obs)
    policy = Gaussian(out, self.log_std) if self.gaussian else Categorical(out)
    return policy, self.value(obs)

  def value(self, obs):
    """The critic alone: obs [..., O] -> value [...]."""
    return jnp.squeeze(self.critic(obs), -1)


def action_spec(network: ActorCritic) -> tuple[tuple[int, ...], Any]:
  """``(shape, dtype)`` of one env's action under ``network``'s policy."""
  if network.gaussian:
    return (network.num_actions,), jnp.float32
  return (), jnp.int32


def sample_action(key, policy):
  """``policy.sample(key)``: ``(action, logp)`` (for code written against
  ``network.apply``'s outputs, e.g. benchmarks/baselines/ppo_idiom.py)."""
  return policy.sample(key)


def mask_obs(obs, config: Config):
  """CartPole's obs is [x, x_dot, theta, theta_dot]; optionally hide speeds."""
  if config.mask_velocity:
    return obs * jnp.array([1.0, 0.0, 1.0, 0.0], obs.dtype)
  return obs


class Runner(NamedTuple):
  train_state: TrainState
  env_state: Any
  obs: jax.Array             # [E, *obs_shape] the policy's input
  ep_return: jax.Array       # [E] running undiscounted return
  rollout: jr.RolloutState
  key: jax.Array


def register_keys(state: jr.RolloutState, *, final: str | None = "value",
                  obs_shape: tuple[int, ...] = (4,),
                  action: tuple[tuple[int, ...], Any] = ((), jnp.int32),
                  extra=()) -> jr.RolloutState:
  """The rollout's keys: ``obs`` ``[E, *obs_shape]``, ``action`` (shape
  and dtype ``action``, see ``action_spec``), ``logp``, ``value``,
  ``reward``, ``terminated``, ``truncated``, the final key, ``advantage``,
  ``target``, then ``extra`` ``(name, shape, dtype)`` triples.

  ``final="obs"`` stores each step's true final observation (valued in one
  batched forward after the rollout); ``final="value"`` stores its value
  ``[E]`` (for recurrent or host-driven agents, which value it during the
  step); ``None`` neither (next-step autoreset: a truncation bootstraps
  from the next step's stored value).
  """
  f32 = jnp.float32
  keys = [("obs", obs_shape, f32), ("action", *action), ("logp", (), f32),
          ("value", (), f32), ("reward", (), f32),
          ("terminated", (), jnp.bool_), ("truncated", (), jnp.bool_)]
  if final is not None:
    keys.append(("final_" + final, obs_shape if final == "obs" else (), f32))
  keys += [("advantage", (), f32), ("target", (), f32), *extra]
  for name, shape, dtype in keys:
    state = jr.register(state, name, shape, dtype)
  return state


def make_optimizer(config: Config):
  """Adam with global-norm clipping; the learning rate anneals to 0."""
  def lr_schedule(count):
    steps_per_update = config.num_epochs * config.num_minibatches
    frac = 1.0 - (count // steps_per_update) / config.num_updates
    return config.lr * frac

  lr = lr_schedule if config.anneal_lr else config.lr
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                     optax.adam(lr, eps=1e-5))


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


def init_runner(key, config: Config, env, env_params,
                network: ActorCritic) -> Runner:
  """A fresh ``Runner`` (``init_learner``) with an empty rollout holding
  the keys ``make_env_step`` writes."""
  key, train_state, obs, env_state = init_learner(key, config, env,
                                                  env_params, network)
  rollout = register_keys(jr.init(config.num_envs, config.num_steps),
                          final="obs", obs_shape=obs.shape[1:],
                          action=action_spec(network))
  return Runner(train_state, env_state, obs, jnp.zeros(config.num_envs),
                rollout, key)


# ------------------------------------------------------- the PPO update

LOSSES = ("loss", "pg_loss", "v_loss", "entropy")


def ppo_objective(policy, value, mb, config: Config):
  """The clipped PPO objective from network outputs on a minibatch.

  Args:
    policy: the policy at ``mb["obs"]``, a ``Categorical`` or ``Gaussian``.
    value: ``[...]`` values at ``mb["obs"]``.
    mb: ``{"action", "logp", "value", "advantage", "target": [...]}``
      (``[B]``, or ``[L, S]`` for sequences). With a ``"weight"`` key
      ``[...]`` every mean is weighted by it (0 drops a row, as
      ``HostLearner`` does with next-step autoreset's reset steps) and the
      advantages are normalised over the rows of positive weight only.
    config: the coefficients.

  Returns:
    ``(total_loss, (pg_loss, v_loss, entropy))``.
  """
  weight = mb.get("weight")
  if weight is None:
    mean = jnp.mean
    adv = jr.normalize_advantages(mb["advantage"])
  else:
    count = jnp.maximum(weight.sum(), jnp.ones((), weight.dtype))

    def mean(x):
      return (weight * x).sum() / count

    adv = jr.normalize_advantages(mb["advantage"], valid=weight > 0)
  logp, entropy = policy.log_prob_entropy(mb["action"])
  ratio = jnp.exp(logp - mb["logp"])
  pg_loss = -mean(jnp.minimum(
      ratio * adv,
      jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv))
  v_clipped = mb["value"] + jnp.clip(value - mb["value"], -config.clip_eps,
                                     config.clip_eps)
  v_loss = 0.5 * mean(jnp.maximum((value - mb["target"]) ** 2,
                                  (v_clipped - mb["target"]) ** 2))
  entropy = mean(entropy)
  total = pg_loss + config.vf_coef * v_loss - config.ent_coef * entropy
  return total, (pg_loss, v_loss, entropy)


def ppo_loss(params, apply_fn, mb, config: Config):
  """Clipped PPO loss of the feed-forward network on ``{key: [B, ...]}``."""
  policy, value = apply_fn(params, mb["obs"])
  return ppo_objective(policy, value, mb, config)


def make_sgd_step(config: Config, loss_fn=ppo_loss, *, reduce=None):
  """``sgd_step(train_state, mb) -> (train_state, (loss, *aux))``.

  One gradient step on ``loss_fn(params, apply_fn, mb, config) -> (loss,
  aux)``. ``reduce((loss, aux)) -> (loss, aux)`` is applied before
  differentiating (``ppo_sharded``'s mean over devices).
  """
  def sgd_step(train_state, mb):
    def objective(params):
      out = loss_fn(params, train_state.apply_fn, mb, config)
      return out if reduce is None else reduce(out)

    (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(
        train_state.params)
    return train_state.apply_gradients(grads=grads), (loss, *aux)

  return sgd_step


def write_advantages(rollout: jr.RolloutState, last_value, config: Config, *,
                     final_values=None, valid=None, extra=None, place=None):
  """``jr.gae``'s advantages and targets, written into ``rollout``.

  Args:
    rollout: a written rollout (``[T, E]`` storage, read without a copy).
    last_value: ``[E]`` the value of the observation after the rollout.
    config: ``gamma`` and ``gae_lambda``.
    final_values: ``[T, E]`` values of the true final observations: a
      truncated step bootstraps from it (same-step autoreset).
    valid: ``[T, E]`` next-step autoreset's mask (``jr.autoreset_valid``)
      instead: no advantage on reset steps, none chained across them.
    extra: more ``{key: [T, E]}`` values to write with them.
    place: applied to the values before ``jr.update_all``
      (``ppo_sharded`` lays them out over the devices).

  Returns:
    The rollout with ``advantage``, ``target`` (and ``extra``) written.
  """
  data = rollout.data
  if valid is None:
    ends = {"truncations": data["truncated"], "final_values": final_values}
  else:
    ends = {"valid": valid}
  advantages, targets = jr.gae(
      data["reward"], data["value"], last_value, data["terminated"], **ends,
      gamma=config.gamma, gae_lambda=config.gae_lambda)
  values = {"advantage": advantages, "target": targets, **(extra or {})}
  return jr.update_all(rollout, values if place is None else place(values))


def ppo_epochs(config: Config, train_state, rollout: jr.RolloutState, key, *,
               loss_fn=ppo_loss, reduce=None, minibatches=None):
  """The PPO epochs, straight from the rollout's storage, then its close.

  ``minibatches(sgd_step, train_state, key, rollout) -> (train_state,
  losses)`` runs the epochs; the default is ``jr.scan_minibatches`` over
  ``config.num_epochs`` epochs of ``B = config.batch_size`` shuffled rows.
  ``loss_fn`` and ``reduce``: see ``make_sgd_step``. The rollout is closed
  with ``jr.finish_rollout``, whose write check ``train`` (a ``checkify``
  error value) or ``HostLearner.update`` reports.

  Returns:
    ``(train_state, rollout, losses)``, ``losses`` the stacked ``(loss,
    *aux)`` of every step (``loss_metrics`` takes their means).
  """
  sgd_step = make_sgd_step(config, loss_fn, reduce=reduce)
  if minibatches is None:
    train_state, losses = jr.scan_minibatches(
        sgd_step, train_state, key, rollout, config.batch_size,
        num_epochs=config.num_epochs)
  else:
    train_state, losses = minibatches(sgd_step, train_state, key, rollout)
  return train_state, jr.finish_rollout(rollout), losses


def loss_metrics(losses) -> dict[str, jax.Array]:
  """``{"loss", "pg_loss", "v_loss", "entropy"}``: means over the steps."""
  return {name: x.mean() for name, x in zip(LOSSES, losses)}


def final_obs_bootstrap(network: ActorCritic):
  """``bootstrap(runner) -> (last_value [E], final_values [T, E])`` of a
  feed-forward agent: the values of the observation after the rollout and
  of every stored true final observation (one batched forward)."""
  value = functools.partial(network.apply, method=ActorCritic.value)

  def bootstrap(runner):
    params = runner.train_state.params
    return (value(params, runner.obs),
            value(params, runner.rollout.data["final_obs"]))

  return bootstrap


def make_update(config: Config, env_step, bootstrap, *, loss_fn=ppo_loss,
                reduce=None, minibatches=None, place=None,
                summarize=loss_metrics):
  """``update_fn(runner) -> (runner, metrics)``: one PPO update in JAX.

  A ``lax.scan`` of ``env_step`` over the T steps of a rollout (see
  ``make_env_step``), ``write_advantages`` with ``bootstrap(runner) ->
  (last_value, final_values)`` (``final_obs_bootstrap``) and ``place``,
  then ``ppo_epochs`` with ``loss_fn``, ``reduce`` and ``minibatches``.
  ``metrics``: ``episode_return_sum`` and ``episodes`` (of the episodes
  that ended) and ``summarize(losses)`` (``loss_metrics``). Pure and
  vmappable, as ``train`` takes it.
  """
  def update_fn(runner):
    (runner, done_return, done_count), _ = jax.lax.scan(
        env_step, (runner, jnp.float32(0), jnp.int32(0)),
        jnp.arange(config.num_steps))
    last_value, final_values = bootstrap(runner)
    rollout = write_advantages(runner.rollout, last_value, config,
                               final_values=final_values, place=place)
    key, k_epochs = jax.random.split(runner.key)
    train_state, rollout, losses = ppo_epochs(
        config, runner.train_state, rollout, k_epochs, loss_fn=loss_fn,
        reduce=reduce, minibatches=minibatches)
    metrics = {"episode_return_sum": done_return, "episodes": done_count,
               **summarize(losses)}
    runner = runner._replace(train_state=train_state, rollout=rollout, key=key)
    return runner, metrics

  return update_fn


# ------------------------------------------------- acting in gymnax envs

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


def make_env_step(config: Config, env, env_params, network: ActorCritic, *,
                  observe=None, to_env=None):
  """The rollout's scan body: one step of every env, written with update_at.

  ``env_step((runner, done_return, done_count), t)`` acts, steps the envs
  (auto-reset), writes step ``t`` of the rollout (``init_runner``'s keys)
  and accumulates the undiscounted returns of the episodes that ended.

  ``observe(runner, obs, final_obs, reward, done) -> (runner, obs,
  final_obs, reward)`` turns what the env returned into what the policy
  sees next and what is stored; by default both observations are masked
  (``mask_obs``) and the reward kept (``ppo_pendulum`` normalises and
  scales). ``to_env(action)`` is the env's action (default: the sampled
  one; ``ppo_pendulum`` clips the torque).
  """
  def keep(runner, obs, final_obs, reward, done):
    del done
    return runner, mask_obs(obs, config), mask_obs(final_obs, config), reward

  observe = observe or keep

  def env_step(carry, t):
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    policy, value = network.apply(runner.train_state.params, runner.obs)
    action, logp = policy.sample(k_act)
    obs, env_state, reward, terminated, truncated, info = step_envs(
        env, env_params, k_env, runner.env_state,
        action if to_env is None else to_env(action))
    done = terminated | truncated
    # The true final observation (before the auto-reset): valued after the
    # rollout in one batched forward, used only where truncated.
    runner, obs, final_obs, stored_reward = observe(
        runner, obs, info["final_observation"], reward, done)
    rollout = jr.update_at(runner.rollout, t, {
        "obs": runner.obs, "action": action, "logp": logp, "value": value,
        "reward": stored_reward, "terminated": terminated,
        "truncated": truncated, "final_obs": final_obs})
    ep_return, done_return, done_count = count_episodes(
        runner.ep_return, reward, done, done_return, done_count)
    runner = runner._replace(env_state=env_state, obs=obs,
                             ep_return=ep_return, rollout=rollout, key=key)
    return (runner, done_return, done_count), None

  return env_step


# ------------------------------------------------------- the host loop

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
    CheckpointFailed: if a checkpoint could not be saved (its message
      names the directory, the update and the cause); the run stops there.
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


class HostLearner:
  """The jitted policy and PPO update of a host loop, shared by its seeds.

  For envs stepped outside JAX (EnvPool, gymnasium, a torch simulator)
  whose steps go into the rollout through a ``jr.RolloutWriter``; a
  feed-forward ``ActorCritic`` on ``obs [E, *obs_shape]``. ``autoreset``
  is how the env restarts a finished episode:

  - ``"same_step"``: the step that ends it returns the reset observation;
    the loop stores the value of the true final one under ``final_value``
    (``zero_value`` where nothing was truncated), and a truncated step
    bootstraps from it;
  - ``"next_step"``: the step after it is a reset step, not a transition.
    ``jr.autoreset_valid`` marks it, ``jr.gae(valid=...)`` gives it no
    advantage and chains nothing across it, and the loss weighs it 0
    (key ``weight``).

  Attributes:
    act: ``act(params, obs, key) -> (action, logp, value, key)``, jitted:
      samples actions for ``obs`` (a host or JAX array, read during the
      call) and returns the next key (no host work).
    value_fn: ``value_fn(params, obs) -> value [E]``, jitted.
    update: ``update(train_state, rollout, last_obs, prev_done, key) ->
      (err, (train_state, rollout, metrics))``: one PPO update, jitted and
      ``checkify``-wrapped (``err`` carries the write check and the
      autoreset flag check), donating the train state and the rollout.
      ``prev_done [E]``: whether the step before the rollout ended an
      episode (``None`` with same-step autoreset). ``metrics``: the
      ``LOSSES`` means and ``valid_frac``.
    zero_value: ``[E]`` zeros (same-step's ``final_value`` where nothing
      was truncated).
    tx: the optimiser, one for every seed: it is a static field of the
      ``TrainState``, so a new one per seed would recompile the update.

  ``device``: commit ``init``'s state and ``zero_value`` to it. A loop that
  brings in committed arrays (torch's, through DLPack) gets committed
  outputs from the jitted functions, and an uncommitted initial state
  would then make the second update and rollout recompile.
  """

  def __init__(self, config: Config, *, autoreset: str = "same_step",
               obs_shape: tuple[int, ...] = (4,), num_actions: int = 2,
               device: jax.Device | None = None):
    self.config = config
    self.autoreset = autoreset
    self.obs_shape = obs_shape
    self.network = network = ActorCritic(num_actions, config.hidden)
    self.tx = make_optimizer(config)
    self.device = device
    next_step = autoreset == "next_step"

    @jax.jit
    def act(params, obs, key):
      key, k_act = jax.random.split(key)
      policy, value = network.apply(params, obs)
      action, logp = policy.sample(k_act)
      return action, logp, value, key

    value_fn = jax.jit(functools.partial(network.apply,
                                         method=ActorCritic.value))

    def update(train_state, rollout, last_obs, prev_done, key):
      data = rollout.data   # [T, E, ...] storage, no copy
      valid = jr.autoreset_valid(
          data["terminated"], data["truncated"], mode=autoreset,
          prev_done=prev_done if next_step else None)
      last_value = value_fn(train_state.params, last_obs)
      if next_step:
        rollout = write_advantages(rollout, last_value, config, valid=valid,
                                   extra={"weight": valid.astype(jnp.float32)})
      else:
        rollout = write_advantages(rollout, last_value, config,
                                   final_values=data["final_value"])
      train_state, rollout, losses = ppo_epochs(config, train_state, rollout,
                                                key)
      return train_state, rollout, {
          **loss_metrics(losses), "valid_frac": valid.mean(dtype=jnp.float32)}

    self.act = act
    self.value_fn = value_fn
    self.update = jax.jit(checkify.checkify(update,
                                            errors=checkify.user_checks),
                          donate_argnums=(0, 1))
    self.zero_value = jax.device_put(
        jnp.zeros((config.num_envs,), jnp.float32), device)

  def init(self, key) -> tuple[TrainState, jr.RolloutState]:
    """A fresh train state (its step counter an array, as the update's
    output has it) and an empty rollout, on ``device`` if given."""
    config = self.config
    params = self.network.init(key, jnp.zeros(self.obs_shape, jnp.float32))
    train_state = TrainState.create(apply_fn=self.network.apply,
                                    params=params, tx=self.tx)
    next_step = self.autoreset == "next_step"
    rollout = register_keys(
        jr.init(config.num_envs, config.num_steps),
        final=None if next_step else "value", obs_shape=self.obs_shape,
        extra=[("weight", (), jnp.float32)] if next_step else ())
    state = (train_state.replace(step=jnp.zeros((), jnp.int32)), rollout)
    return state if self.device is None else jax.device_put(state,
                                                            self.device)


# ------------------------------------------------------------ results

def episode_returns(metrics, window: int = 1) -> np.ndarray:
  """``[seeds, updates]`` mean episodic return, pooled over the ``window``
  updates up to each one: NaN where no episode ended in the window (no
  return to show; ``save_curve`` leaves those updates out)."""
  s, n = metrics["episode_return_sum"], metrics["episodes"].astype(np.float64)
  if window > 1:
    kernel = np.ones(window)
    s = np.stack([np.convolve(r, kernel)[:r.size] for r in s])
    n = np.stack([np.convolve(r, kernel)[:r.size] for r in n])
  return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def final_returns(metrics, frac: float = 0.1) -> np.ndarray:
  """Per seed: mean return of the episodes that ended in the last ``frac``
  of the updates (0 if none ended)."""
  s, n = metrics["episode_return_sum"], metrics["episodes"]
  last = max(1, int(round(s.shape[1] * frac)))
  return s[:, -last:].sum(1) / np.maximum(n[:, -last:].sum(1), 1)


def save_curve(curves: dict[str, np.ndarray], steps_per_update: int,
               path: str, title: str, *, goal: float | None = None,
               legend: str = "upper left") -> None:
  """Mean return vs env steps with the seeds' min-max band, one line each
  (``[seeds, updates]`` curves; updates where a seed has NaN are left out),
  and a dashed line at ``goal`` if given."""
  import matplotlib  # noqa: PLC0415 - optional dependency, plots only
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, ret in curves.items():
    x = np.arange(1, ret.shape[1] + 1) * steps_per_update
    ok = ~np.isnan(ret).any(0)
    ax.plot(x[ok], ret[:, ok].mean(0),
            label=f"{label} (mean of {ret.shape[0]} seeds)")
    ax.fill_between(x[ok], ret[:, ok].min(0), ret[:, ok].max(0), alpha=0.25)
  if goal is not None:
    ax.axhline(goal, color="gray", ls="--", lw=1, label=f"goal: {goal:g}")
  ax.set_xlabel("env steps per seed")
  ax.set_ylabel("episodic return")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(loc=legend)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# Compilations shorter than this are not written to the cache. JAX's own
# default, 1 s, leaves out the examples' smaller jits; any threshold makes
# what is cached depend on how busy the machine was, 0 caches every program.
CACHE_MIN_COMPILE_S = 0.0


def use_compile_cache(config: Config) -> str | None:
  """Turns on JAX's persistent compilation cache in
  ``config.compile_cache`` (nothing if it is ``""``); returns the absolute
  directory, or None.

  Every compilation (``CACHE_MIN_COMPILE_S``) is written there, keyed by
  the program, the JAX/XLA versions, the flags and the devices; a later run
  (another process) that compiles the same program loads the executable
  instead. The executables are the same, so are the results. Call it before
  the first compilation: each example's ``main`` does, right after parsing
  its flags. It sets JAX's global config (the jrollout library never does).
  The directory grows with every new program (JAX evicts nothing by
  default); delete it to clear the cache.
  """
  if not config.compile_cache:
    return None
  path = os.path.abspath(os.path.expanduser(config.compile_cache))
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    CACHE_MIN_COMPILE_S)
  return path


def write_summary(out: str, summary: dict[str, Any]) -> str:
  """Writes ``summary`` to ``out``/summary.json (creating ``out``); returns
  the path."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "summary.json")
  with open(path, "w") as f:
    json.dump(summary, f, indent=2)
  return path


def parse_config(argv=None, cls=Config, doc=None, choices=None):
  """A ``cls`` instance from command-line flags, one per dataclass field.

  ``doc`` is the calling example's docstring (its first line describes the
  command); ``choices`` maps a field name to its allowed values (argparse
  checks them). ``--compile-cache DIR`` (``Config.compile_cache``) also has
  ``--no-compile-cache``, which sets it to ``""`` (no cache).
  """
  parser = argparse.ArgumentParser(
      description=(doc or __doc__).split("\n")[0])
  for field in dataclasses.fields(cls):
    flag = "--" + field.name.replace("_", "-")
    default = (field.default_factory()
               if field.default is dataclasses.MISSING else field.default)
    if field.type in ("bool", bool):
      parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                          default=default)
    else:
      typ = {"int": int, "float": float, "str": str}[str(field.type)]
      parser.add_argument(flag, type=typ, default=default,
                          choices=(choices or {}).get(field.name))
  if any(f.name == "compile_cache" for f in dataclasses.fields(cls)):
    parser.add_argument("--no-compile-cache", dest="compile_cache",
                        action="store_const", const="",
                        help="no persistent compilation cache")
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

  A save that fails (a full disk, a file-size limit, no permission:
  ``jr.CheckpointSaveError`` or another ``OSError``, seen when the next
  save starts or at ``close``) stops the run with ``CheckpointFailed``: one
  line naming the directory, the update and the cause. Orbax never renames
  a failed save into place, so the last complete checkpoint is the latest
  one, and a rerun of the same command once the cause is fixed resumes
  from it.
  """

  IGNORED = ("out", "checkpoint_dir", "checkpoint_every",   # may change
             "compile_cache")
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
    self._pending = None   # the update of the save in flight
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
    """Starts an asynchronous save if one is due (see the class), once
    the previous one is complete; ``CheckpointFailed`` if either fails."""
    if (done_updates - self._last < self._every
        and done_updates < self._num_updates):
      return
    metrics = {k: np.concatenate([h[k] for h in history],
                                 axis=self.HISTORY_AXIS)
               for k in history[0]}
    self._wait()
    self._pending = done_updates
    try:
      self._mngr.save(done_updates, args=ocp.args.Composite(
          runner=jr.RolloutSave(runner), history=jr.RolloutSave(metrics),
          settings=ocp.args.JsonSave(self._settings)))
    except OSError as e:
      raise self._failed(e) from None
    self._last = done_updates

  def _wait(self) -> None:
    """Waits for the save in flight; ``CheckpointFailed`` if it failed."""
    try:
      self._mngr.wait_until_finished()
    except OSError as e:
      raise self._failed(e) from None

  def _failed(self, error: OSError) -> CheckpointFailed:
    """The error that stops the run after the save in flight failed."""
    with contextlib.suppress(Exception):
      self._mngr.close()
    kept = "none"
    with contextlib.suppress(Exception):
      self._mngr.reload()
      latest = self._mngr.latest_step()
      kept = "none" if latest is None else f"update {latest}"
    if error.errno:
      cause = (f"{error.strerror} "
               f"({errno.errorcode.get(error.errno, error.errno)})")
    else:
      cause = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return CheckpointFailed(
        f"--checkpoint-dir {self._directory}: saving the checkpoint at "
        f"update {self._pending} failed: {cause}; the last complete "
        f"checkpoint ({kept}) is kept: fix the cause (free space) and rerun "
        "the same command to resume from it")

  def close(self) -> None:
    """Waits for the last save to be complete (``CheckpointFailed`` if it
    failed)."""
    self._wait()
    self._mngr.close()


class CheckpointFailed(SystemExit):
  """A run's checkpoint could not be saved: the run stops.

  A ``SystemExit``, so that the command prints its one-line message on
  stderr, without a traceback, and exits with status 1.
  """


class _DamagedSettings(ValueError):
  """A checkpoint's settings item cannot be read."""


def params_sha256(params) -> str:
  """SHA-256 of the parameters' bytes (leaves in tree order): equal
  hashes mean bit-identical parameters."""
  digest = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(params):
    digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
  return digest.hexdigest()
