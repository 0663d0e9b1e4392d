"""The clipped PPO objective, one gradient step on it, and its metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jrollout as jr
from examples.common.cli import Config

LOSSES = ("loss", "pg_loss", "v_loss", "entropy")


def ppo_objective(policy, value, mb, config: Config):
  """The clipped PPO objective from network outputs on a minibatch.

  Args:
    policy: the policy at ``mb["obs"]``, a ``Categorical`` or ``Gaussian``.
    value: ``[...]`` values at ``mb["obs"]``.
    mb: ``{"action", "logp", "value", "advantage", "target": [...]}``
      (``[B]``, or ``[L, S]`` for sequences). With a ``"weight"`` field
      ``[...]`` every mean is weighted by it (0 drops a row, as
      ``ppo_envpool`` does with next-step autoreset's reset steps) and the
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
  """Clipped PPO loss of the feed-forward network on ``{name: [B, ...]}``."""
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


def loss_metrics(losses) -> dict[str, jax.Array]:
  """``{"loss", "pg_loss", "v_loss", "entropy"}``: means over the steps of
  the stacked ``(loss, *aux)`` a minibatch scan of ``sgd_step`` returns."""
  return {name: x.mean() for name, x in zip(LOSSES, losses)}
