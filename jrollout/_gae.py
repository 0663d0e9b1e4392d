"""Generalized advantage estimation over a time-major rollout (``gae``) and
the normalization of advantages (``normalize_advantages``).

Dimension letters: T = num_steps, E = num_envs (see ``jrollout._types``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._types import Array
from jrollout._types import ArrayLike


def gae(
    rewards: ArrayLike,
    values: ArrayLike,
    last_value: ArrayLike,
    terminations: ArrayLike,
    *,
    truncations: ArrayLike | None = None,
    final_values: ArrayLike | None = None,
    valid: ArrayLike | None = None,
    gamma: float | ArrayLike = 0.99,
    gae_lambda: float | ArrayLike = 0.95,
) -> tuple[Array, Array]:
  r"""Generalized advantage estimates and value targets for a rollout.

  GAE(gamma, lambda) (Schulman et al., 2016) with time-limit truncation as
  in Pardo et al. (2018), by a reverse ``jax.lax.scan``. For step ``t`` of
  ``[0, T)``, with ``A_T = 0``::

    next_value_t = final_values[t]  if truncations[t]
                   values[t + 1]    elif t < T - 1
                   last_value       otherwise
    delta_t = rewards[t] + gamma * (1 - terminations[t]) * next_value_t
              - values[t]
    done_t  = terminations[t] or truncations[t]
    A_t     = valid[t] * (delta_t + gamma * gae_lambda * (1 - done_t) * A_{t+1})
    returns = A + values

  ``E`` stands for any trailing shape (``[T]`` and ``[T, E, K]`` work too).
  Gradients flow through ``values``. The autoreset modes, a worked example
  of each, and the equivalence with rlax: docs/guides/gae.md.

  Example (T=3, E=1; step 1 is truncated, step 2 terminates):

  >>> import jax.numpy as jnp, jrollout as jr
  >>> adv, ret = jr.gae(
  ...     rewards=jnp.array([[1.0], [2.0], [3.0]]),
  ...     values=jnp.array([[1.0], [2.0], [4.0]]),
  ...     last_value=jnp.array([8.0]),
  ...     terminations=jnp.array([[False], [False], [True]]),
  ...     truncations=jnp.array([[False], [True], [False]]),
  ...     final_values=jnp.array([[0.0], [6.0], [0.0]]),
  ...     gamma=0.5, gae_lambda=0.5)
  >>> adv.T   # step 1 bootstraps from final_values[1], not values[2]
  Array([[ 1.75,  3.  , -1.  ]], dtype=float32)
  >>> ret.T   # advantages + values
  Array([[2.75, 5.  , 3.  ]], dtype=float32)

  Args:
    rewards: ``[T, E]``, ``rewards[t]`` received for action ``a_t``.
    values: ``[T, E]`` floating ``V(obs_t)``, the observation at which
      ``a_t`` was taken. Its dtype is the dtype of the computation and of
      both outputs; the other inputs are cast to it.
    last_value: ``[E]`` ``V(obs_T)``, the value after the last step; it
      bootstraps the last step when that step did not end an episode.
    terminations: ``[T, E]`` flags (bool, or numeric with nonzero True; a
      NaN is refused): step ``t`` reached a terminal state, nothing is
      bootstrapped. A step both terminated and truncated counts as
      terminated.
    truncations: optional ``[T, E]`` flags: a time limit cut the episode
      after step ``t``. Requires ``final_values``.
    final_values: optional ``[T, E]``: ``V`` of the episode's true final
      observation, read only at truncated, not terminated steps (elsewhere
      it may hold anything, even NaN). After a same-step autoreset
      ``values[t + 1]`` is the next episode's first observation, hence this
      argument. Requires ``truncations``.
    valid: optional ``[T, E]`` flags: False where step ``t`` is not a
      transition (the reset steps of next-step autoreset,
      ``jr.autoreset_valid``): advantage 0, return ``values[t]``, nothing
      passed back, so the step before bootstraps from ``values[t]``. None:
      every step is valid.
    gamma: discount factor in ``[0, 1]``: a float or a 0-d real array (a
      tracer under ``jax.vmap`` too); a concrete one is range-checked.
    gae_lambda: GAE lambda in ``[0, 1]``, likewise.

  Returns:
    ``(advantages, returns)``, both ``[T, E]`` with the dtype of ``values``;
    ``returns = advantages + values`` are the value-function targets.

  Raises:
    ValueError: at trace time, if ``rewards`` has no time axis or ``T == 0``;
      if ``values``, ``terminations``, ``valid``, ``truncations`` or
      ``final_values`` do not have ``rewards.shape``, or ``last_value``
      ``rewards.shape[1:]``; if only one of ``truncations`` and
      ``final_values`` is given; if a concrete ``gamma`` or ``gae_lambda`` is
      outside ``[0, 1]`` or an array one is not 0-d. Eagerly, if concrete
      floating flags hold a NaN (under ``jit`` / ``vmap`` a ``checkify``
      check, reported when the caller wraps the function in
      ``checkify.checkify``).
    TypeError: at trace time, if ``values`` is not floating; ``rewards``,
      ``last_value`` or ``final_values`` complex or not numeric; a flag
      argument not bool or numeric; ``gamma`` or ``gae_lambda`` not a real
      number (None, a string, a bool, a complex number).
  """
  # Trace-time checks: plain Python on static shapes and dtypes.
  shape = _check_gae_args(rewards, values, last_value, terminations,
                          truncations, final_values, valid, gamma,
                          gae_lambda)
  # Floating flags: no NaN (eagerly a ValueError, traced a checkify check).
  for name, flags in (("terminations", terminations),
                      ("truncations", truncations), ("valid", valid)):
    if flags is not None:
      _checks.check_flag_values("gae", name, flags)

  # --- Computation, in values.dtype with explicit casts. ---
  values = jnp.asarray(values)
  dtype = values.dtype
  rewards = jnp.asarray(rewards).astype(dtype)
  last_value = jnp.asarray(last_value).astype(dtype)
  terminated = jnp.asarray(terminations).astype(bool)
  gamma = jnp.asarray(gamma, dtype)
  gae_lambda = jnp.asarray(gae_lambda, dtype)

  next_values = jnp.concatenate([values[1:], last_value[None]], axis=0)
  if truncations is None:
    done = terminated
  else:
    truncated = jnp.asarray(truncations).astype(bool)
    final_values = jnp.asarray(final_values).astype(dtype)
    next_values = jnp.where(truncated, final_values, next_values)
    done = terminated | truncated
  # `where`, not a product: a NaN final value at a terminated step is unused.
  bootstrap = jnp.where(terminated, jnp.zeros((), dtype), gamma * next_values)
  deltas = rewards + bootstrap - values
  trace_decay = gamma * gae_lambda

  zero = jnp.zeros((), dtype)

  def step(next_advantage: Array, xs: tuple[Array, ...]):
    delta, done_t = xs[:2]
    advantage = delta + jnp.where(done_t, zero, trace_decay * next_advantage)
    if len(xs) == 3:   # an invalid step: 0, so nothing is passed back
      advantage = jnp.where(xs[2], advantage, zero)
    return advantage, advantage

  xs: tuple[Array, ...] = (deltas, done)
  if valid is not None:
    xs += (jnp.asarray(valid).astype(bool),)
  init = jnp.zeros(shape[1:], dtype)
  _, advantages = jax.lax.scan(step, init, xs, reverse=True)
  return advantages, advantages + values


def _check_gae_args(rewards: Any, values: Any, last_value: Any,
                    terminations: Any, truncations: Any, final_values: Any,
                    valid: Any, gamma: Any, gae_lambda: Any
                    ) -> tuple[int, ...]:
  """The checks of ``gae`` (the first that fails raises); returns
  ``rewards.shape``."""
  fn = "gae"
  shape = _time_major_shape(fn, rewards)
  _check_truncation_pair(fn, shape, truncations, final_values)
  named: list[tuple[str, Any]] = [("values", values),
                                  ("terminations", terminations)]
  if valid is not None:
    named.append(("valid", valid))
  if truncations is not None:
    named += [("truncations", truncations), ("final_values", final_values)]
  for name, x in named:
    _checks.check_shape_equal(fn, name, x, shape, "rewards.shape ([T, E])")
    if name in ("terminations", "truncations", "valid"):
      _checks.check_flags(fn, name, x)
  _checks.check_shape_equal(fn, "last_value", last_value, shape[1:],
                            "rewards.shape[1:] ([E])")
  _checks.check_floating(fn, "values", values,
                         "the computation runs in values.dtype")
  _checks.check_real(fn, "rewards", rewards)
  _checks.check_real(fn, "last_value", last_value)
  if final_values is not None:
    _checks.check_real(fn, "final_values", final_values)
  _checks.check_discount(fn, "gamma", gamma)
  _checks.check_discount(fn, "gae_lambda", gae_lambda)
  return shape


def _time_major_shape(fn: str, rewards: Any) -> tuple[int, ...]:
  """``rewards.shape``, which must be ``[T, ...]`` with ``T >= 1``."""
  shape = _checks.shape_of(rewards, fn, "`rewards`")
  if len(shape) < 1:
    raise ValueError(
        f"{fn}: `rewards` has shape {shape}, expected at least one axis, "
        "[T, E] or [T]")
  if shape[0] < 1:
    raise ValueError(
        f"{fn}: `rewards` has shape {shape}, expected T = rewards.shape[0] "
        ">= 1 ([T, E])")
  return shape


def _check_truncation_pair(fn: str, shape: tuple[int, ...], truncations: Any,
                           final_values: Any) -> None:
  """``truncations`` and ``final_values`` come together or not at all."""
  if (truncations is None) == (final_values is None):
    return
  if final_values is None:
    raise ValueError(
        f"{fn}: `truncations` was given without `final_values`: a truncated "
        "step must bootstrap from V(final obs of its episode), and "
        "values[t + 1] is the next episode's first obs after the "
        "auto-reset; pass final_values with shape "
        f"{shape} = rewards.shape ([T, E]) (with next-step autoreset, "
        "where values[t + 1] is the final obs, pass "
        "valid=jr.autoreset_valid(...) and no truncations instead)")
  raise ValueError(
      f"{fn}: `final_values` was given without `truncations`: without the "
      "flags there is no step at which to use them; pass truncations with "
      f"shape {shape} = rewards.shape ([T, E]) or drop final_values")


def normalize_advantages(advantages: ArrayLike, *,
                         eps: float | ArrayLike = 1e-8,
                         valid: ArrayLike | None = None) -> Array:
  """Standardizes advantages over all elements: ``(a - mean) / (std + eps)``.

  The mean and the (population, ``ddof=0``) standard deviation are taken over
  every element, for example over the whole ``[T, E]`` rollout or one
  ``[B]`` minibatch, as in PPO implementations. Under ``jax.vmap`` each mapped
  slice is normalized on its own. With ``valid``, they are taken over the
  valid elements only and the others map to 0 (the reset steps of
  next-step autoreset, see ``jr.autoreset_valid``).

  Args:
    advantages: ``[...]`` floating advantages of any shape, at least one
      element.
    eps: non-negative constant added to the standard deviation, so a
      constant input maps to zeros instead of NaN.
    valid: optional bool or numeric mask of the shape of ``advantages``;
      only its nonzero elements count (all zeros: every output is 0). A
      NaN is refused as in ``gae``: eagerly a ``ValueError``, under ``jit``
      a ``checkify`` check.

  Returns:
    An array with the shape and dtype of ``advantages``, with mean ~0 and
    standard deviation ~1 (over the valid elements).

  Raises:
    TypeError: at trace time, if ``advantages`` is not floating or
      ``valid`` is not bool or numeric.
    ValueError: at trace time, if ``advantages`` has no element, if
      ``valid`` does not have its shape, or a concrete ``eps`` (a number
      or a 0-d array) is negative; eagerly, if a floating ``valid`` holds a
      NaN.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> adv = np.array([[1.0, 3.0], [3.0, 1.0]], np.float32)   # [T, E]
    >>> jr.normalize_advantages(adv).tolist()      # mean 2, std 1 over all
    [[-1.0, 1.0], [1.0, -1.0]]
    >>> adv = np.array([1.0, 3.0, 100.0], np.float32)
    >>> valid = np.array([True, True, False])      # 100 is not counted
    >>> jr.normalize_advantages(adv, valid=valid).tolist()
    [-1.0, 1.0, 0.0]
  """
  fn = "normalize_advantages"
  shape = _checks.shape_of(advantages, fn, "`advantages`")
  _checks.check_floating(fn, "advantages", advantages)
  if int(np.prod(shape)) == 0:
    raise ValueError(
        f"{fn}: `advantages` has shape {shape}, expected at least one "
        "element")
  _checks.check_scalar(fn, "eps", eps, low=0.0)
  if valid is not None:
    _checks.check_shape_equal(fn, "valid", valid, shape, "advantages.shape")
    _checks.check_flags(fn, "valid", valid)
    _checks.check_flag_values(fn, "valid", valid)
  advantages = jnp.asarray(advantages)
  dtype = advantages.dtype
  eps = jnp.asarray(eps, dtype)
  if valid is None:
    return (advantages - advantages.mean()) / (advantages.std() + eps)
  mask = jnp.asarray(valid).astype(bool)
  zero = jnp.zeros((), dtype)
  count = jnp.maximum(mask.sum().astype(dtype), jnp.ones((), dtype))
  mean = jnp.where(mask, advantages, zero).sum() / count
  centred = jnp.where(mask, advantages - mean, zero)
  std = jnp.sqrt((centred * centred).sum() / count)
  return centred / (std + eps)
