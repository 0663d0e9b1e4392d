"""Reward scaling: rewards divided by the running std of the discounted return.

``RewardScaler`` holds each env's discounted return and the running
statistics (``jrollout._running_stats``) of every return seen; it divides
each reward by their standard deviation, as gymnasium's ``NormalizeReward``
wrappers do; see ``scale_rewards`` for the exact formula.

Dimension letters: E = num_envs, T = num_steps (see ``jrollout._types``).
"""

from __future__ import annotations

from typing import Any

from flax import struct
import jax
import jax.numpy as jnp

from jrollout import _checks
from jrollout._checks import shape_of
from jrollout._running_stats import clip_symmetric
from jrollout._running_stats import init_running_stats
from jrollout._running_stats import RunningStats
from jrollout._running_stats import update_running_stats
from jrollout._types import Array
from jrollout._types import ArrayLike
from jrollout._types import AxisName


class RewardScaler(struct.PyTreeNode):
  """Per-env discounted returns and their running statistics.

  A frozen pytree (``jit``, ``scan``, ``vmap``, ``flax.serialization``);
  create it with ``jr.init_reward_scaler(num_envs)`` and advance it with
  ``jr.scale_rewards`` (one step) or ``jr.scale_rollout_rewards`` (T steps).

  Attributes:
    returns: ``[E]`` float, each env's discounted return ``G`` so far.
    stats: ``RunningStats`` of scalar samples, over every ``G`` seen (all
      envs, all steps).

  Example:
    >>> import jax, jax.numpy as jnp, jrollout as jr
    >>> scaler = jr.init_reward_scaler(3)
    >>> scaler.returns.shape, scaler.stats.shape     # [E]; scalar samples
    ((3,), ())
    >>> seeds = jax.vmap(lambda _: jr.init_reward_scaler(3))(jnp.arange(4))
    >>> seeds.returns.shape                          # a pytree: one per seed
    (4, 3)
  """
  returns: Array
  stats: RunningStats


def init_reward_scaler(num_envs: int | tuple[int, ...],
                       dtype: Any = jnp.float32) -> RewardScaler:
  """A fresh reward scaler: zero returns, empty statistics.

  Args:
    num_envs: E, a positive int (or a tuple of them for an env grid).
    dtype: the floating dtype of the returns and statistics.

  Returns:
    A ``RewardScaler`` with ``returns`` zeros ``[E]``.

  Raises:
    TypeError: ``num_envs`` is not an int (a bool included), or ``dtype``
      is not floating.
    ValueError: ``num_envs`` is not positive.

  Example:
    >>> import jrollout as jr
    >>> scaler = jr.init_reward_scaler(4)
    >>> scaler.returns.tolist(), scaler.stats.exact_count()
    ([0.0, 0.0, 0.0, 0.0], 0)
  """
  fn = "init_reward_scaler"
  shape = _checks.positive_ints(fn, "num_envs", num_envs)
  dtype = _checks.check_float_dtype(fn, "dtype", dtype)
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
  r"""Scales one step's rewards by the running std of the discounted return.

  The formula of gymnasium's ``NormalizeReward`` wrappers and purejaxrl's
  ``NormalizeVecReward``, for each env ``e``::

    done[e] = terminations[e] | truncations[e]
    G[e]    <- G[e] * gamma * (1 - done[e]) + rewards[e]
    stats   <- stats updated with the E samples G[0..E-1]
    scaled[e] = rewards[e] / sqrt(Var(G) + eps)

  ``Var(G)`` is the exact population variance of every ``G`` seen so far
  (all envs and steps, this one included); the mean is not subtracted. At
  the step that ends an episode ``G`` restarts from that step's reward
  alone. The ``G`` samples a NaN or inf reward makes non-finite are left
  out of the statistics and counted in ``scaler.stats.nonfinite``. How this
  differs from gymnasium's wrappers: docs/guides/running-stats.md, "Reward
  scaling".

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> scaler = jr.init_reward_scaler(2)
    >>> r, term = jnp.array([1., 3.]), jnp.array([False, False])
    >>> scaled, scaler = jr.scale_rewards(scaler, r, term, gamma=0.5)
    >>> scaler.returns.tolist(), scaler.stats.std.tolist()
    ([1.0, 3.0], 1.0)
    >>> scaled.tolist()                  # r / sqrt(1 + 1e-8)
    [1.0, 3.0]

  Args:
    scaler: the scaler.
    rewards: ``[E]`` floating rewards of this step.
    terminations: ``[E]`` bool, True where this step ended the episode
      (terminal state).
    truncations: optional ``[E]`` bool, True where this step's episode was
      cut short (time limit); the return resets there too.
    gamma: the discount of the return, in ``[0, 1]`` (a float or a scalar
      array); 0.99 by default, as in ``gae``.
    eps: non-negative constant added to the variance.
    clip: optional positive bound on the scaled rewards (Stable-Baselines3
      clips to 10).
    axis_name: a mapped axis name when the envs are split over devices:
      the statistics combine every device's ``G`` (see
      ``update_running_stats``).

  Returns:
    ``(scaled, scaler)``: ``scaled`` ``[E]`` with ``rewards``' dtype and
    the new scaler.

  Raises:
    TypeError: ``rewards`` is not floating or ``terminations`` /
      ``truncations`` is not bool; ``gamma``, ``eps`` or ``clip`` is not a
      real number.
    ValueError: ``rewards``, ``terminations`` or ``truncations`` is not
      ``[E]`` (``scaler.returns``' shape), or a concrete ``gamma`` (a
      number or a 0-d array; traced ones are not checked) is outside
      ``[0, 1]``.
  """
  fn = "scale_rewards"
  done = _check_scaler_args(fn, scaler, rewards, terminations, truncations,
                            gamma, eps, clip, 0)
  return _scale_step(scaler, jnp.asarray(rewards), done, gamma, eps, clip,
                     axis_name)


def scale_rollout_rewards(scaler: RewardScaler, rewards: ArrayLike,
                          terminations: ArrayLike, *,
                          truncations: ArrayLike | None = None,
                          gamma: float | ArrayLike = 0.99,
                          eps: float | ArrayLike = 1e-8, clip: Any = None,
                          axis_name: AxisName | None = None
                          ) -> tuple[Array, RewardScaler]:
  """``scale_rewards`` over a rollout, step by step (a ``lax.scan``).

  Equals T successive ``scale_rewards`` calls: step ``t`` is divided by the
  statistics that include every ``G`` up to step ``t``.

  Args:
    scaler: the scaler.
    rewards: ``[T, E]`` floating rewards.
    terminations: ``[T, E]`` bool, True where step ``t`` ended the episode.
    truncations: optional ``[T, E]`` bool, True where step ``t``'s episode
      was cut short; the return resets there too.
    gamma: the discount of the return, in ``[0, 1]`` (0.99 by default).
    eps: non-negative constant added to the variance.
    clip: optional positive bound on the scaled rewards.
    axis_name: a mapped axis name when the envs are split over devices.

  Returns:
    ``(scaled, scaler)``: ``scaled`` ``[T, E]`` with ``rewards``' dtype.

  Raises:
    TypeError: ``rewards`` is not floating or ``terminations`` /
      ``truncations`` is not bool; ``gamma``, ``eps`` or ``clip`` is not a
      real number.
    ValueError: ``rewards``, ``terminations`` or ``truncations`` is not
      ``[T, E]``, or a concrete
      ``gamma`` is outside ``[0, 1]``.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> rewards = jnp.ones((3, 2))                                # [T, E]
    >>> term = jnp.array([[False, False], [False, True], [False, False]])
    >>> scaled, scaler = jr.scale_rollout_rewards(
    ...     jr.init_reward_scaler(2), rewards, term, gamma=1.0)
    >>> scaled.shape, scaler.returns.tolist()  # env 1's G restarted at t=1
    ((3, 2), [3.0, 2.0])
    >>> scaler.stats.exact_count()             # every G of every step
    6
  """
  fn = "scale_rollout_rewards"
  done = _check_scaler_args(fn, scaler, rewards, terminations, truncations,
                            gamma, eps, clip, 1)

  def step(carry: RewardScaler, xs: tuple[Array, Array]):
    scaled, carry = _scale_step(carry, xs[0], xs[1], gamma, eps, clip,
                                axis_name)
    return carry, scaled

  scaler, scaled = jax.lax.scan(step, scaler, (jnp.asarray(rewards), done))
  return scaled, scaler


def _check_scaler_args(fn: str, scaler: Any, rewards: Any,
                       terminations: Any, truncations: Any, gamma: Any,
                       eps: Any, clip: Any, time_axes: int) -> Array:
  """Checks the arguments; returns ``terminations | truncations``."""
  _checks.check_instance(fn, "scaler", scaler, RewardScaler,
                         "init_reward_scaler")
  _checks.check_floating(fn, "rewards", rewards)
  flags = {"terminations": terminations}
  if truncations is not None:
    flags["truncations"] = truncations
  for name, x in flags.items():
    _checks.check_bool_array(fn, name, x)
  env_shape = shape_of(scaler.returns)
  doc = "[T, E]" if time_axes else "[E]"
  for name, x in (("rewards", rewards), *flags.items()):
    got = shape_of(x, fn, f"`{name}`")
    if len(got) != time_axes + len(env_shape) or got[time_axes:] != env_shape:
      want = ("(T, " + ", ".join(map(str, env_shape)) + ")" if time_axes
              else str(env_shape))
      raise ValueError(
          f"{fn}: `{name}` has shape {got}, expected {want} = {doc} with E "
          f"from scaler.returns {env_shape}")
  _checks.check_discount(fn, "gamma", gamma)
  _checks.check_scalar(fn, "eps", eps, low=0.0)
  if clip is not None:
    _checks.check_scalar(fn, "clip", clip, low=0.0, low_open=True)
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
