"""Host vector envs' autoreset modes: which ``[T, E]`` steps are transitions
(the ``valid`` of ``jr.gae`` and ``jr.normalize_advantages``)."""

from __future__ import annotations

from typing import Literal

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._gae import check_flags
from jrollout._types import Array
from jrollout._types import ArrayLike, AutoresetMode

AUTORESET_MODES = ("next_step", "same_step")


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
