"""Reward scaling: each reward divided by the running std of the discounted
return (gymnasium's ``NormalizeReward``), with ``jrollout._running_stats``."""

from __future__ import annotations

from typing import Any

from flax import struct
import jax
import jax.numpy as jnp

from jrollout import _casts
from jrollout import _checks
from jrollout._running_stats import check_axis_name
from jrollout._running_stats import clip_symmetric
from jrollout._running_stats import init_running_stats
from jrollout._running_stats import RunningStats
from jrollout._running_stats import update_running_stats
from jrollout._types import Array
from jrollout._types import ArrayLike
from jrollout._types import AxisName


class RewardScaler(struct.PyTreeNode):
  """Per-env discounted returns and their running statistics: a frozen
  pytree made by ``jr.init_reward_scaler``.

  Attributes:
    returns: ``[E]`` float, each env's discounted return ``G`` so far.
    stats: ``RunningStats`` of scalar samples: every ``G`` seen.
  """
  returns: Array
  stats: RunningStats


def init_reward_scaler(num_envs: int | tuple[int, ...],
                       dtype: Any = jnp.float32) -> RewardScaler:
  """A fresh reward scaler: ``returns`` zeros ``[E]``, empty statistics.

  Raises:
    TypeError: ``num_envs`` (E, or a tuple for an env grid) not an int (a
      bool included), ``dtype`` not floating.
    ValueError: ``num_envs`` not positive.

  Example:
    >>> import jrollout as jr
    >>> scaler = jr.init_reward_scaler(4)
    >>> isinstance(scaler, jr.RewardScaler)
    True
    >>> scaler.returns.tolist(), scaler.stats.exact_count()
    ([0.0, 0.0, 0.0, 0.0], 0)
  """
  fn = "init_reward_scaler"
  shape = _checks.positive_ints(fn, "num_envs", num_envs)
  dtype = _casts.check_float_dtype(fn, "dtype", dtype)
  _checks.check_size(fn, shape, dtype)
  return RewardScaler(returns=_checks.zeros(fn, shape, dtype),
                      stats=init_running_stats((), dtype))


def scale_rewards(scaler: RewardScaler, rewards: ArrayLike,
                  terminations: ArrayLike, *,
                  truncations: ArrayLike | None = None,
                  gamma: float | ArrayLike = 0.99,
                  eps: float | ArrayLike = 1e-8, clip: Any = None,
                  axis_name: AxisName | None = None
                  ) -> tuple[Array, RewardScaler]:
  """Scales one step's rewards by the running std of the discounted return.

  For each env ``e``, with ``done = terminations | truncations``::

    G[e]      <- G[e] * gamma * (1 - done[e]) + rewards[e]
    stats     <- stats updated with the E samples G
    scaled[e] =  clip(rewards[e] / sqrt(Var(G) + eps))

  ``Var(G)`` is the population variance of every ``G`` so far; a ``G`` that
  is not finite is left out of it and counted in ``stats.nonfinite``.

  Args:
    rewards: ``[E]`` floating rewards.
    terminations, truncations: ``[E]`` bool (``truncations`` optional).
    gamma: the return's discount in ``[0, 1]``; ``eps`` >= 0, ``clip`` > 0.
    axis_name: a mapped axis when the envs are split over devices.

  Returns:
    ``(scaled, scaler)``: ``scaled`` ``[E]`` in ``rewards``' dtype.

  Raises:
    TypeError: ``rewards`` not floating, flags not bool, ``gamma``, ``eps``
      or ``clip`` not a real number.
    ValueError: an array not ``[E]``, a concrete number out of range, an
      unbound ``axis_name``.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> scaled, scaler = jr.scale_rewards(
    ...     jr.init_reward_scaler(2), jnp.array([1., 3.]),
    ...     jnp.array([False, False]), gamma=0.5)
    >>> scaler.returns.tolist(), scaler.stats.std.tolist(), scaled.tolist()
    ([1.0, 3.0], 1.0, [1.0, 3.0])
  """
  fn = "scale_rewards"
  done = _check_scaler_args(fn, scaler, rewards, terminations, truncations,
                            gamma, eps, clip, axis_name, 0)
  return _scale_step(scaler, jnp.asarray(rewards), done, gamma, eps, clip,
                     axis_name)


def scale_rollout_rewards(scaler: RewardScaler, rewards: ArrayLike,
                          terminations: ArrayLike, *,
                          truncations: ArrayLike | None = None,
                          gamma: float | ArrayLike = 0.99,
                          eps: float | ArrayLike = 1e-8, clip: Any = None,
                          axis_name: AxisName | None = None
                          ) -> tuple[Array, RewardScaler]:
  """``scale_rewards`` over a rollout, ``[T, E]`` arrays, in a ``lax.scan``:
  step ``t`` is divided by the statistics of every ``G`` up to step ``t``.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> term = jnp.array([[False, False], [False, True], [False, False]])
    >>> scaled, scaler = jr.scale_rollout_rewards(
    ...     jr.init_reward_scaler(2), jnp.ones((3, 2)), term, gamma=1.0)
    >>> scaler.returns.tolist(), scaler.stats.exact_count()
    ([3.0, 2.0], 6)
  """
  fn = "scale_rollout_rewards"
  done = _check_scaler_args(fn, scaler, rewards, terminations, truncations,
                            gamma, eps, clip, axis_name, 1)

  def step(carry: RewardScaler, xs: tuple[Array, Array]):
    scaled, carry = _scale_step(carry, *xs, gamma, eps, clip, axis_name)
    return carry, scaled

  scaler, scaled = jax.lax.scan(step, scaler, (jnp.asarray(rewards), done))
  return scaled, scaler


def _check_scaler_args(fn: str, scaler: Any, rewards: Any,
                       terminations: Any, truncations: Any, gamma: Any,
                       eps: Any, clip: Any, axis_name: Any,
                       time_axes: int) -> Array:
  """Checks the arguments; returns ``terminations | truncations``."""
  _checks.check_instance(fn, "scaler", scaler, RewardScaler,
                         "init_reward_scaler")
  given = {"rewards": rewards, "terminations": terminations}
  if truncations is not None:
    given["truncations"] = truncations
  _checks.check_floating(fn, "rewards", rewards)
  for name in list(given)[1:]:
    _checks.check_bool_array(fn, name, given[name])
  env_shape = _casts.shape_of(scaler.returns)
  doc = "[T, E]" if time_axes else "[E]"
  want = ("(T, " + ", ".join(map(str, env_shape)) + ")" if time_axes
          else str(env_shape))
  for name, x in given.items():
    got = _casts.shape_of(x, fn, f"`{name}`")
    if len(got) != time_axes + len(env_shape) or got[time_axes:] != env_shape:
      raise ValueError(
          f"{fn}: `{name}` has shape {got}, expected {want} = {doc} with E "
          f"from scaler.returns {env_shape}")
  _checks.check_discount(fn, "gamma", gamma)
  _checks.check_scalar(fn, "eps", eps, low=0.0)
  if clip is not None:
    _checks.check_scalar(fn, "clip", clip, low=0.0, low_open=True)
  check_axis_name(fn, axis_name)
  done = jnp.asarray(terminations)
  return done if truncations is None else done | jnp.asarray(truncations)


def _scale_step(scaler: RewardScaler, rewards: Array, done: Array,
                gamma: Any, eps: Any, clip: Any,
                axis_name: AxisName | None) -> tuple[Array, RewardScaler]:
  dtype = scaler.returns.dtype
  gamma = jnp.asarray(gamma, dtype)
  r = rewards.astype(dtype)
  returns = jnp.where(done, jnp.zeros((), dtype), scaler.returns * gamma) + r
  stats = update_running_stats(scaler.stats, returns, axis_name=axis_name)
  scale = jnp.sqrt(stats.variance + jnp.asarray(eps, dtype))
  scaled = clip_symmetric(r / scale, clip)
  return scaled.astype(rewards.dtype), RewardScaler(returns=returns,
                                                    stats=stats)
