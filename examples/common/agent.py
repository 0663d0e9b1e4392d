"""The feed-forward PPO agent: ``ActorCritic`` with a ``Categorical`` or
``Gaussian`` policy, its optimiser, and the fields its rollout stores."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.common.cli import Config


def mlp(hidden: int, out: int, out_scale: float) -> nn.Sequential:
  """A two-layer tanh MLP with orthogonal init: ``[..., in] -> [..., out]``."""
  init = nn.initializers.orthogonal
  return nn.Sequential([
      nn.Dense(hidden, kernel_init=init(np.sqrt(2))), nn.tanh,
      nn.Dense(hidden, kernel_init=init(np.sqrt(2))), nn.tanh,
      nn.Dense(out, kernel_init=init(out_scale))])


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


def make_optimizer(config: Config):
  """Adam with global-norm clipping; the learning rate anneals to 0."""
  def lr_schedule(count):
    steps_per_update = config.num_epochs * config.num_minibatches
    frac = 1.0 - (count // steps_per_update) / config.num_updates
    return config.lr * frac

  lr = lr_schedule if config.anneal_lr else config.lr
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                     optax.adam(lr, eps=1e-5))


def rollout_fields(obs_shape: tuple[int, ...] = (4,),
                   action: tuple[tuple[int, ...], Any] = ((), jnp.int32), *,
                   final: str | None = "value",
                   extra=()) -> list[tuple[str, tuple[int, ...], Any]]:
  """``(name, shape, dtype)`` of each field a PPO rollout stores per env
  step, in the order to ``jr.register`` them.

  ``obs`` ``[*obs_shape]``, ``action`` (shape and dtype ``action``, see
  ``action_spec``), ``logp``, ``value``, ``reward``, ``terminated``,
  ``truncated``, the final field, ``advantage``, ``target``, then
  ``extra`` triples. ``final="obs"`` stores each step's true final
  observation (valued in one batched forward after the rollout);
  ``final="value"`` its value ``()`` (for recurrent or host-driven agents,
  which value it during the step); ``None`` neither (next-step autoreset: a
  truncation bootstraps from the next step's stored value).
  """
  f32 = jnp.float32
  fields = [("obs", obs_shape, f32), ("action", *action), ("logp", (), f32),
            ("value", (), f32), ("reward", (), f32),
            ("terminated", (), jnp.bool_), ("truncated", (), jnp.bool_)]
  if final is not None:
    fields.append(("final_" + final, obs_shape if final == "obs" else (),
                   f32))
  return [*fields, ("advantage", (), f32), ("target", (), f32), *extra]
