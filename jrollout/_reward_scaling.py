"""Reward scaling: each reward divided by the running std of the discounted
return (gymnasium's ``NormalizeReward``): a ``RewardScaler`` is the per-env
return and the ``RunningStats`` of every return seen."""

from __future__ import annotations

from typing import Any

from flax import struct
import jax
import jax.numpy as jnp

from jrollout import _checks
from jrollout import _running_stats
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
  stats: _running_stats.RunningStats


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
  dtype = _checks.check_dtype(fn, None, dtype, floating=True)
  return RewardScaler(returns=_checks.zeros(fn, shape, dtype),
                      stats=_running_stats.init_running_stats((), dtype))


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
    scaler: the ``RewardScaler``.
    rewards: ``[E]`` floating rewards.
    terminations, truncations: ``[E]`` bool (``truncations`` optional).
    gamma: the return's discount in ``[0, 1]``; ``eps`` >= 0, ``clip`` > 0.
    axis_name: a mapped axis when the envs are split over devices.

  Returns:
    ``(scaled, scaler)``: ``scaled`` ``[E]`` in ``rewards``' dtype.

  Raises:
    TypeError: ``scaler`` not a ``RewardScaler``, ``rewards`` not floating,
      flags not bool, ``gamma``, ``eps`` or ``clip`` not a real number.
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
  return _scale("scale_rewards", 0, scaler, rewards, terminations,
                truncations, gamma, eps, clip, axis_name)


def scale_rollout_rewards(scaler: RewardScaler, rewards: ArrayLike,
                          terminations: ArrayLike, *,
                          truncations: ArrayLike | None = None,
                          gamma: float | ArrayLike = 0.99,
                          eps: float | ArrayLike = 1e-8, clip: Any = None,
                          axis_name: AxisName | None = None
                          ) -> tuple[Array, RewardScaler]:
  """``scale_rewards`` over a rollout, ``[T, E]`` arrays, in a ``lax.scan``:
  step ``t`` is divided by the statistics of every ``G`` up to step ``t``.
  Arguments, results and errors as ``scale_rewards``', with ``[T, E]`` for
  ``[E]``.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> term = jnp.array([[False, False], [False, True], [False, False]])
    >>> scaled, scaler = jr.scale_rollout_rewards(
    ...     jr.init_reward_scaler(2), jnp.ones((3, 2)), term, gamma=1.0)
    >>> scaler.returns.tolist(), scaler.stats.exact_count()
    ([3.0, 2.0], 6)
  """
  return _scale("scale_rollout_rewards", 1, scaler, rewards, terminations,
                truncations, gamma, eps, clip, axis_name)


def _scale(fn: str, time_axes: int, scaler: Any, rewards: Any,
           terminations: Any, truncations: Any, gamma: Any, eps: Any,
           clip: Any, axis_name: Any) -> tuple[Array, RewardScaler]:
  """Checks the arguments, then scales one step (``time_axes=0``) or scans
  over the leading axis of ``[T, E]`` (``time_axes=1``)."""
  _checks.check_instance(fn, "scaler", scaler, RewardScaler,
                         "init_reward_scaler")
  given = {"rewards": rewards, "terminations": terminations}
  if truncations is not None:
    given["truncations"] = truncations
  _checks.check_floating(fn, "rewards", rewards)
  for name in list(given)[1:]:
    _checks.check_bool_array(fn, name, given[name])
  env_shape = _checks.shape_of(scaler.returns)
  doc = "[T, E]" if time_axes else "[E]"
  want = ("(T, " + ", ".join(map(str, env_shape)) + ")" if time_axes
          else str(env_shape))
  for name, x in given.items():
    got = _checks.shape_of(x, fn, f"`{name}`")
    if len(got) != time_axes + len(env_shape) or got[time_axes:] != env_shape:
      raise ValueError(
          f"{fn}: `{name}` has shape {got}, expected {want} = {doc} with E "
          f"from scaler.returns {env_shape}")
  _checks.check_discount(fn, "gamma", gamma)
  _running_stats.check_eps_clip(fn, eps, clip)
  _running_stats.check_axis_name(fn, axis_name)
  done = jnp.asarray(terminations)
  done = done if truncations is None else done | jnp.asarray(truncations)
  dtype = scaler.returns.dtype
  gamma, eps = jnp.asarray(gamma, dtype), jnp.asarray(eps, dtype)

  def step(scaler: RewardScaler, xs: tuple[Array, Array]
           ) -> tuple[RewardScaler, Array]:
    rewards, done = xs
    r = rewards.astype(dtype)
    returns = jnp.where(done, jnp.zeros((), dtype), scaler.returns * gamma) + r
    stats = _running_stats.update_running_stats(scaler.stats, returns,
                                                axis_name=axis_name)
    scaled = _running_stats.clip_symmetric(r / jnp.sqrt(stats.variance + eps),
                                           clip)
    return RewardScaler(returns, stats), scaled.astype(rewards.dtype)

  xs = (jnp.asarray(rewards), done)
  if time_axes:
    scaler, scaled = jax.lax.scan(step, scaler, xs)
  else:
    scaler, scaled = step(scaler, xs)
  return scaled, scaler
