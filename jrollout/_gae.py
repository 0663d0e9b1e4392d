"""Advantages of a time-major rollout: generalized advantage estimation
(``gae``), their normalization (``normalize_advantages``) and, for host
vector envs, which ``[T, E]`` steps of an autoreset mode are transitions
(``autoreset_valid``, the ``valid`` of the other two)."""

from __future__ import annotations

from typing import Any, Literal

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._types import Array, ArrayLike, AutoresetMode

AUTORESET_MODES = ("next_step", "same_step")


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
  r"""Generalized advantage estimates and value targets of a rollout.

  GAE(gamma, lambda) with time-limit truncation, by a reverse ``lax.scan``;
  for ``t < T``, with ``A_T = 0``::

    next_t  = final_values[t] if truncations[t] else values[t + 1]
              (last_value for t = T - 1)
    delta_t = rewards[t] + gamma * (1 - terminations[t]) * next_t - values[t]
    done_t  = terminations[t] or truncations[t]
    A_t     = valid[t] * (delta_t + gamma * gae_lambda * (1 - done_t) * A_{t+1})

  ``E`` is any trailing shape (``[T]``, ``[T, E, K]``); gradients flow
  through ``values`` (autoreset modes: docs/guides/gae.md).

  Args:
    rewards: ``[T, E]`` real, ``rewards[t]`` received for action ``a_t``.
    values: ``[T, E]`` floating ``V(obs_t)``, in the outputs' dtype.
    last_value: ``[E]`` ``V(obs_T)``.
    terminations: ``[T, E]`` flags (bool, or numeric with nonzero True).
    truncations: optional ``[T, E]`` flags, with ``final_values``: ``[T, E]``
      ``V`` of the episode's true final obs, read at truncated, not
      terminated steps only (anything, NaN included, elsewhere).
    valid: optional ``[T, E]`` flags: False where step ``t`` is no
      transition (``jr.autoreset_valid``).
    gamma, gae_lambda: in ``[0, 1]``, floats or 0-d arrays.

  Returns:
    ``(advantages, returns)``, ``[T, E]``, ``returns = advantages + values``.

  Raises:
    ValueError: at trace time, ``T == 0``, an array of another shape, only
      one of ``truncations`` and ``final_values``, a concrete discount out
      of range; eagerly, NaN flags (under ``jit`` a ``checkify`` check).
    TypeError: ``values`` not floating, an array complex or not numeric,
      flags not bool or numeric, a discount not a real number.

  Example (step 1 truncated, step 2 terminated):

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
  >>> ret.T
  Array([[2.75, 5.  , 3.  ]], dtype=float32)
  """
  fn = "gae"
  shape = _checks.shape_of(rewards, fn, "`rewards`")
  if not shape or shape[0] < 1:
    raise ValueError(f"{fn}: `rewards` has shape {shape}, expected [T, E] "
                     "or [T] with T = rewards.shape[0] >= 1")
  if (truncations is None) != (final_values is None):
    given, missing = (("truncations", "final_values") if final_values is None
                      else ("final_values", "truncations"))
    raise ValueError(
        f"{fn}: `{given}` was given without `{missing}`: a truncated step "
        "bootstraps from final_values[t], V(final obs of its episode), since "
        "values[t + 1] is the next episode's first obs after the auto-reset; "
        f"pass both with shape {shape} = rewards.shape ([T, E]) (with "
        "next-step autoreset, where values[t + 1] is the final obs, pass "
        "valid=jr.autoreset_valid(...) and no truncations instead)")
  whole = "rewards.shape ([T, E])"
  for name, x in (("values", values), ("final_values", final_values)):
    if x is not None:
      _checks.check_shape_equal(fn, name, x, shape, whole)
  _checks.check_shape_equal(fn, "last_value", last_value, shape[1:],
                            "rewards.shape[1:] ([E])")
  _checks.check_floating(fn, "values", values,
                         "the computation runs in values.dtype")
  for name, x in (("rewards", rewards), ("last_value", last_value),
                  ("final_values", final_values)):
    if x is not None:
      _checks.check_real(fn, name, x)
  _checks.check_discount(fn, "gamma", gamma)
  _checks.check_discount(fn, "gae_lambda", gae_lambda)
  for name, x in (("terminations", terminations),
                  ("truncations", truncations), ("valid", valid)):
    if x is not None:
      check_flags(fn, name, x, shape, whole)
  values = jnp.asarray(values)
  dtype = values.dtype
  rewards = jnp.asarray(rewards).astype(dtype)
  last_value = jnp.asarray(last_value).astype(dtype)
  terminated = jnp.asarray(terminations).astype(bool)
  gamma = jnp.asarray(gamma, dtype)
  trace_decay = gamma * jnp.asarray(gae_lambda, dtype)

  next_values = jnp.concatenate([values[1:], last_value[None]], axis=0)
  done = terminated
  if truncations is not None:
    truncated = jnp.asarray(truncations).astype(bool)
    final_values = jnp.asarray(final_values).astype(dtype)
    next_values = jnp.where(truncated, final_values, next_values)
    done = terminated | truncated
  # `where`, not a product: a NaN final value at a terminated step is unused.
  deltas = rewards + jnp.where(terminated, 0, gamma * next_values) - values
  carries = ~done
  if valid is not None:   # an invalid step: 0, so nothing is passed back
    valid = jnp.asarray(valid).astype(bool)
    deltas = jnp.where(valid, deltas, 0)
    carries = carries & valid

  def step(next_advantage: Array, xs: tuple[Array, Array]):
    delta, carried = xs
    advantage = delta + jnp.where(carried, trace_decay * next_advantage, 0)
    return advantage, advantage

  _, advantages = jax.lax.scan(step, jnp.zeros(shape[1:], dtype),
                               (deltas, carries), reverse=True)
  return advantages, advantages + values


def check_flags(fn: str, name: str, x: Any, shape: tuple[int, ...],
                doc: str) -> None:
  """Flags of ``shape`` (``doc`` says whose), bool or numeric, never NaN:
  eagerly a ValueError, under ``jit`` a ``checkify`` check."""
  _checks.check_shape_equal(fn, name, x, shape, doc)
  _checks.check_flags(fn, name, x)
  _checks.check_flag_values(fn, name, x)


def normalize_advantages(advantages: ArrayLike, *,
                         eps: float | ArrayLike = 1e-8,
                         valid: ArrayLike | None = None) -> Array:
  """Standardizes advantages over all elements: ``(a - mean) / (std + eps)``.

  The mean and population std are over every element (the whole ``[T, E]``
  rollout, or one ``[B]`` minibatch), with ``valid`` (flags of
  ``advantages``' shape) over the valid ones only, the others mapping to 0.

  Raises:
    TypeError: ``advantages`` not floating, ``valid`` not bool or numeric.
    ValueError: no element, ``valid`` of another shape or NaN (under
      ``jit`` a ``checkify`` check), a concrete ``eps`` < 0.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> adv = np.array([1.0, 3.0, 100.0], np.float32)
    >>> jr.normalize_advantages(adv, valid=np.array([1, 1, 0])).tolist()
    [-1.0, 1.0, 0.0]
  """
  fn = "normalize_advantages"
  shape = _checks.shape_of(advantages, fn, "`advantages`")
  _checks.check_floating(fn, "advantages", advantages)
  if int(np.prod(shape)) == 0:
    raise ValueError(f"{fn}: `advantages` has shape {shape}, expected at "
                     "least one element")
  _checks.check_scalar(fn, "eps", eps, low=0.0)
  advantages = jnp.asarray(advantages)
  dtype = advantages.dtype
  eps = jnp.asarray(eps, dtype)
  if valid is None:
    return (advantages - advantages.mean()) / (advantages.std() + eps)
  check_flags(fn, "valid", valid, shape, "advantages.shape")
  mask = jnp.asarray(valid).astype(bool)
  count = jnp.maximum(mask.sum().astype(dtype), 1)
  mean = jnp.where(mask, advantages, 0).sum() / count
  centred = jnp.where(mask, advantages - mean, 0)
  std = jnp.sqrt((centred * centred).sum() / count)
  return centred / (std + eps)


def autoreset_valid(
    terminations: ArrayLike,
    truncations: ArrayLike,
    *,
    mode: AutoresetMode,
    prev_done: ArrayLike | None = None,
    check: Literal["error", "off"] = "error",
) -> Array:
  r"""``valid [T, E]``: True where step ``t`` is a transition of the policy.

  ``"same_step"``: every step. ``"next_step"``: all but the reset steps::

    valid[0] = not prev_done
    valid[t] = not (terminations[t - 1] or truncations[t - 1]),  t >= 1

  A reset step never has a flag set in next-step data; ``check="error"``
  reports one: eagerly a ``ValueError`` naming the steps, under ``jit`` a
  ``checkify`` check (nothing unless the caller wraps in ``checkify``).

  Args:
    terminations, truncations: ``[T, E]`` flags (bool or numeric, not NaN).
    mode: ``"next_step"`` (EnvPool, gymnasium >= 1.0: the step after an
      episode's end returns the reset obs) or ``"same_step"`` (gymnax,
      in-JAX envs), or gymnasium's ``AutoresetMode`` members.
    prev_done: optional ``[E]`` flags, next_step only: the step before step
      0 ended an episode. None: the rollout starts after ``env.reset()``.
    check: ``"error"`` or ``"off"``.

  Returns:
    ``valid``, ``[T, E]`` bool.

  Raises:
    ValueError: an unknown ``mode`` or ``check``; ``T == 0``; an array of
      another shape, or ``prev_done`` with same_step; NaN flags (under
      ``jit`` a ``checkify`` check); eagerly, a reset step with a flag set.
    TypeError: flags neither bool nor numeric.

  Example (env 0 terminates at step 1; env 1's step 0 is a reset step):

  >>> import jax.numpy as jnp, jrollout as jr
  >>> term = jnp.array([[0, 0], [1, 0], [0, 0], [0, 0]], bool)
  >>> valid = jr.autoreset_valid(term, jnp.zeros((4, 2), bool),
  ...                            mode="next_step",
  ...                            prev_done=jnp.array([False, True]))
  >>> valid.T.astype(int)
  Array([[1, 1, 0, 1],
         [0, 1, 1, 1]], dtype=int32)
  """
  fn = "autoreset_valid"
  name = getattr(mode, "name", mode)   # gymnasium's AutoresetMode members
  if not (isinstance(name, str) and name.lower() in AUTORESET_MODES):
    raise ValueError(
        f"{fn}: `mode` must be one of {AUTORESET_MODES} (or gymnasium's "
        f"AutoresetMode.NEXT_STEP / SAME_STEP), got {mode!r}")
  kind = name.lower()
  if not isinstance(check, str) or check not in ("error", "off"):
    raise ValueError(f"{fn}: `check` must be 'error' or 'off', got "
                     f"{check!r}")
  shape = _checks.shape_of(terminations, fn, "`terminations`")
  if len(shape) < 1 or shape[0] < 1:
    raise ValueError(f"{fn}: `terminations` has shape {shape}, expected "
                     "[T, E] with T >= 1")
  check_flags(fn, "terminations", terminations, shape, "[T, E]")
  check_flags(fn, "truncations", truncations, shape,
              "terminations.shape ([T, E])")
  if prev_done is not None:
    if kind != "next_step":
      raise ValueError(
          f"{fn}: `prev_done` was given with mode={kind!r}; only next_step "
          "autoreset has reset steps (pass prev_done=None)")
    check_flags(fn, "prev_done", prev_done, shape[1:],
                "terminations.shape[1:] ([E])")
  if kind == "same_step":
    return jnp.ones(shape, bool)
  done = (jnp.asarray(terminations).astype(bool)
          | jnp.asarray(truncations).astype(bool))
  first = (jnp.zeros(shape[1:], bool) if prev_done is None
           else jnp.asarray(prev_done).astype(bool))
  reset = jnp.concatenate([first[None], done[:-1]], axis=0)
  if check == "off":
    return ~reset
  bad = reset & done
  what = ("a reset step (the step after an episode ended, whose action the "
          "env ignores) has terminations or truncations set")
  hint = ("next-step autoreset never does that: is this same-step data "
          "(pass mode='same_step'), or is `prev_done` wrong?")
  if isinstance(bad, jax.core.Tracer):
    checkify.debug_check(
        ~jnp.any(bad),
        f"{fn}: mode='next_step': {what} at {{count}} (step, env) pairs, "
        f"the first at flat index {{first}} of [T, E]; {hint}",
        count=jnp.sum(bad), first=jnp.argmax(bad.reshape(-1)))
    return ~reset
  where = np.argwhere(np.asarray(bad))
  if len(where):
    pairs = ", ".join(f"(t={i[0]}, e={', '.join(map(str, i[1:]))})"
                      for i in where[:5].tolist())
    more = f" and {len(where) - 5} more" if len(where) > 5 else ""
    raise ValueError(
        f"{fn}: mode='next_step': {what} at {pairs}{more}; {hint}")
  return ~reset
