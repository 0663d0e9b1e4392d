"""Host vector envs' autoreset modes: which ``[T, E]`` steps are transitions.

With next-step autoreset (EnvPool, gymnasium >= 1.0's default) the step after
an episode's end ignores its action and returns the reset observation with
reward 0 and both flags False: it is no transition of the policy.
``autoreset_valid`` marks the other steps, the ``valid`` of ``jr.gae``,
``jr.normalize_advantages`` and the loss weight; with same-step autoreset
(gymnax, every in-JAX env) every step is valid. The two modes, what GAE needs
in each and the consistency check: docs/guides/gae.md, "Autoreset modes".

Dimension letters: T = num_steps, E = num_envs (see ``jrollout._types``).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._types import Array
from jrollout._types import ArrayLike, AutoresetMode

AUTORESET_MODES = ("next_step", "same_step")


def autoreset_mode(fn: str, mode: Any) -> str:
  """``mode`` as one of ``AUTORESET_MODES``.

  Accepts the strings and gymnasium's ``AutoresetMode`` members (by their
  ``name``), so ``env.metadata["autoreset_mode"]`` can be passed as is.

  Raises:
    ValueError: any other mode (``DISABLED`` included: without autoreset
      there is nothing to mark).
  """
  name = getattr(mode, "name", mode)
  if isinstance(name, str) and name.lower() in AUTORESET_MODES:
    return name.lower()
  raise ValueError(
      f"{fn}: `mode` must be one of {AUTORESET_MODES} (or gymnasium's "
      f"AutoresetMode.NEXT_STEP / SAME_STEP), got {mode!r}")


def _check_flags(fn: str, name: str, x: Any, shape: tuple[int, ...],
                 doc: str) -> None:
  """Flags of ``shape`` (``doc`` names it in messages), bool or numeric,
  never NaN (the rule of ``gae``'s flags: ``_checks.check_flags``)."""
  got = _checks.shape_of(x, fn, f"`{name}`")
  if got != shape:
    raise ValueError(
        f"{fn}: `{name}` has shape {got}, expected {shape} = {doc}")
  _checks.check_flags(fn, name, x)
  _checks.check_flag_values(fn, name, x)


def autoreset_valid(
    terminations: ArrayLike,
    truncations: ArrayLike,
    *,
    mode: AutoresetMode,
    prev_done: ArrayLike | None = None,
    check: Literal["error", "off"] = "error",
) -> Array:
  r"""``valid [T, E]``: True where step ``t`` is a transition of the policy.

  ``"same_step"``: every step. ``"next_step"``: every step but the reset
  steps, those right after a step that ended an episode::

    valid[0] = not prev_done
    valid[t] = not (terminations[t - 1] or truncations[t - 1]),  t >= 1

  A reset step returns the reset observation with reward 0 and both flags
  False whatever the action was, so a reset step with a flag set means the
  data is not next-step data (same-step data has episodes of length 1
  there, next-step data never). ``check`` reports that: eagerly (concrete
  flags) a ``ValueError`` naming the steps; under ``jit``/``vmap``/``scan``
  a ``jax.experimental.checkify`` check, like ``jr.finish_rollout``'s, that
  compiles to nothing unless the caller wraps the function in
  ``checkify.checkify``.

  Example (next_step, T=5, E=2). Env 0's episode terminates at step 1, so
  step 2 is its reset step; env 1 was truncated at the previous rollout's
  last step (``prev_done``), so its step 0 is a reset step, and it is
  truncated again at step 3:

  >>> import jax.numpy as jnp, jrollout as jr
  >>> term = jnp.array([[0, 0], [1, 0], [0, 0], [0, 0], [0, 0]], bool)
  >>> trunc = jnp.array([[0, 0], [0, 0], [0, 0], [0, 1], [0, 0]], bool)
  >>> valid = jr.autoreset_valid(term, trunc, mode="next_step",
  ...                            prev_done=jnp.array([False, True]))
  >>> valid.T.astype(int)
  Array([[1, 1, 0, 1, 1],
         [0, 1, 1, 1, 0]], dtype=int32)
  >>> bool(jr.autoreset_valid(term, trunc, mode="same_step").all())
  True

  Args:
    terminations: ``[T, E]`` bool or numeric; True where step ``t`` reached
      a terminal state.
    truncations: ``[T, E]`` bool or numeric; True where a time limit cut
      the episode at step ``t``.
    mode: ``"next_step"`` or ``"same_step"``, or gymnasium's
      ``AutoresetMode.NEXT_STEP`` / ``SAME_STEP``.
    prev_done: optional ``[E]`` bool or numeric, next_step only: whether
      the step before step 0 ended an episode (the previous rollout's
      ``terminations[-1] | truncations[-1]``). None: no env's step 0 is a
      reset step (the rollout starts right after ``env.reset()``).
    check: ``"error"`` (default) checks that no reset step has a flag set
      (next_step); ``"off"`` skips that check.

  Returns:
    ``valid``, ``[T, E]`` bool.

  Raises:
    ValueError: at trace time, an unknown ``mode``; ``terminations`` with no
      time axis or ``T == 0``; ``truncations`` not of its shape;
      ``prev_done`` not ``[E]``; ``check`` not ``"error"`` or ``"off"``.
      Eagerly (concrete flags, ``check="error"``), a reset step with
      ``terminations`` or ``truncations`` set.
    TypeError: at trace time, flags that are neither bool nor numeric.
    ValueError: floating flags holding a NaN (eagerly; under ``jit`` a
      ``checkify`` check), which ``astype(bool)`` would read as True.
  """
  fn = "autoreset_valid"
  kind = autoreset_mode(fn, mode)
  if not isinstance(check, str) or check not in ("error", "off"):
    raise ValueError(f"{fn}: `check` must be 'error' or 'off', got "
                     f"{check!r}")
  shape = _checks.shape_of(terminations, fn, "`terminations`")
  if len(shape) < 1 or shape[0] < 1:
    raise ValueError(
        f"{fn}: `terminations` has shape {shape}, expected [T, E] with "
        "T >= 1")
  _check_flags(fn, "terminations", terminations, shape, "[T, E]")
  _check_flags(fn, "truncations", truncations, shape,
               "terminations.shape ([T, E])")
  if prev_done is not None:
    if kind != "next_step":
      raise ValueError(
          f"{fn}: `prev_done` was given with mode={kind!r}; only "
          "next_step autoreset has reset steps (pass prev_done=None)")
    _check_flags(fn, "prev_done", prev_done, shape[1:],
                 "terminations.shape[1:] ([E])")
  if kind == "same_step":
    return jnp.ones(shape, bool)
  done = (jnp.asarray(terminations).astype(bool)
          | jnp.asarray(truncations).astype(bool))
  first = (jnp.zeros(shape[1:], bool) if prev_done is None
           else jnp.asarray(prev_done).astype(bool))
  reset = jnp.concatenate([first[None], done[:-1]], axis=0)
  if check == "error":
    _check_reset_steps(fn, reset, done)
  return ~reset


def _check_reset_steps(fn: str, reset: Array, done: Array) -> None:
  """No reset step may end an episode (see ``autoreset_valid``)."""
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
    return
  host = np.asarray(bad)
  if host.any():
    where = np.argwhere(host)
    pairs = ", ".join(f"(t={i[0]}, e={', '.join(map(str, i[1:]))})"
                      for i in where[:5].tolist())
    more = f" and {len(where) - 5} more" if len(where) > 5 else ""
    raise ValueError(
        f"{fn}: mode='next_step': {what} at {pairs}{more}; {hint}")
