"""The write ledger: which steps of which fields were written, and its check.

A ``RolloutState`` tracks its writes in ``counts [K, T]`` (writes of each
step of each field since the last ``make_batch`` / ``finish_rollout``; row
``i`` is field ``state.names[i]``) and ``out_of_range [K]`` (writes aimed
outside ``[0, T)``, dropped); this module is the only one that updates,
reads, resets or checks them. A rollout is complete when every step of
every field was written exactly once and none outside: eagerly a failure is
an ``IncompleteRolloutError`` naming each bad field, under ``jit`` a
``checkify`` check or a host callback (``check``), and ``is_complete`` is
the traced flag. How each is reported: docs/guides/errors.md, "The write
check".
"""

from __future__ import annotations

from collections.abc import Mapping
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._state import RolloutState
from jrollout._types import Array

CHECK_MODES = ("error", "callback", "off")


class IncompleteRolloutError(ValueError):
  """A rollout was closed with a field whose steps were not each written once.

  A ``ValueError``; its message names each bad field with its missing and
  duplicated steps and its writes aimed outside ``[0, T)``.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=4), "r")
    >>> state = jr.update_at(state, 1, {"r": np.ones(2)})
    >>> try:
    ...   jr.make_batch(state)
    ... except jr.IncompleteRolloutError as e:
    ...   print(str(e).splitlines()[-1].strip())
    field 'r': missing steps [0, 2-3]
  """


class WriteCounts(NamedTuple):
  """Write tracking of one field since the last ``make_batch``.

  Attributes:
    per_step: ``[T] int32``, how many times each step was written.
    out_of_range: ``[] int32``, writes aimed outside ``[0, T)`` (dropped).

  Example:
    >>> import jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> per_step, out_of_range = jr.write_counts(state)["r"]   # a NamedTuple
    >>> per_step.shape, per_step.dtype, out_of_range.shape
    ((3,), dtype('int32'), ())
  """
  per_step: Array
  out_of_range: Array


def record(state: RolloutState, rows: Mapping[str, int], steps: Array | None,
           *, guard: bool = False) -> tuple[Array, Array]:
  """The ledger after a write: ``(counts, out_of_range)``.

  The one update of the ledger, for every write path (``jrollout._buffer``'s
  write kernel).

  Args:
    state: the state before the write.
    rows: ``{name: n}``, how many rows of each field were written, in the
      order of ``steps`` (static).
    steps: where they went. None: every step of each field once (a
      whole-rollout write; ``n`` is not read). ``[1] int32`` (traced is
      fine): every row at that one step. ``[sum(n)] int32``: the step of
      each row, field after field; a step may repeat.
    guard: only with one step: it may lie outside ``[0, T)`` (a traced
      step), and is then counted as out of range instead. Without
      ``guard`` every step must be in range (checked by the caller).

  One step updates one column of ``[K, T]`` with a dynamic slice and a
  dynamic-update-slice (in place under ``jit``, O(K)); per-row steps add a
  compare-and-sum over ``[n, T]`` per field, fused. Never a scatter.
  """
  keys = state.names
  if steps is None:
    hits = np.zeros((len(keys), 1), np.int32)
    hits[[keys.index(k) for k in rows]] = 1
    return state.counts + hits, state.out_of_range
  if steps.shape[0] == 1:
    hits = np.zeros((len(keys), 1), np.int32)
    for key, n in rows.items():
      hits[keys.index(key)] = n
    return _record_column(state, hits, steps[0], guard)
  if guard:
    raise ValueError("record: `guard` needs one step")
  t = lax.broadcasted_iota(jnp.int32, (1, state.num_steps), 1)
  per_key = {}
  offset = 0
  for key, n in rows.items():
    written = steps[offset:offset + n, None] == t                  # [n, T]
    per_key[key] = jnp.sum(written, axis=0, dtype=jnp.int32)
    offset += n
  zero = jnp.zeros((state.num_steps,), jnp.int32)
  counts = state.counts + jnp.stack([per_key.get(k, zero) for k in keys])
  return counts, state.out_of_range


def _record_column(state: RolloutState, hits: np.ndarray, step: Array,
                   guard: bool) -> tuple[Array, Array]:
  """Adds ``hits [K, 1]`` to column ``step`` of the counts (see ``record``)."""
  if not guard:
    column = lax.dynamic_slice_in_dim(state.counts, step, 1, axis=1)
    counts = lax.dynamic_update_slice_in_dim(state.counts, column + hits,
                                             step, axis=1)
    return counts, state.out_of_range
  t = state.num_steps
  in_range = ((step >= 0) & (step < t)).astype(jnp.int32)
  safe = jnp.clip(step, 0, t - 1)
  column = lax.dynamic_slice_in_dim(state.counts, safe, 1, axis=1)
  counts = lax.dynamic_update_slice_in_dim(
      state.counts, column + hits * in_range, safe, axis=1)
  return counts, state.out_of_range + hits[:, 0] * (1 - in_range)


def reset(state: RolloutState) -> RolloutState:
  """The state with every count zero: the next rollout's tracking starts."""
  # Outside any jit that returns the storage: a jitted function returning
  # the whole state would copy every storage buffer (no donation).
  return state.replace(counts=jnp.zeros_like(state.counts),
                       out_of_range=jnp.zeros_like(state.out_of_range))


def _complete(counts: Array, out_of_range: Array) -> Array:
  return jnp.all(counts == 1) & jnp.all(out_of_range == 0)


def is_complete(state: RolloutState) -> Array:
  """A bool scalar: every step of every field written once, none outside.

  Works under ``jit`` and ``vmap`` (the traced-flag form of ``make_batch``'s
  check); a stack of states is refused outside ``vmap``
  (``jax.vmap(jr.is_complete)(states)`` gives one flag per state).

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=2), "r")
    >>> state = jr.update_at(state, 0, {"r": np.ones(2)})
    >>> jr.is_complete(state).item()                 # step 1 is missing
    False
    >>> jax.jit(jr.is_complete)(jr.update_at(state, 1, {"r": np.ones(2)}))
    Array(True, dtype=bool)
  """
  _checks.check_state("is_complete", state)
  return _complete(state.counts, state.out_of_range)


def write_counts(state: RolloutState) -> dict[str, WriteCounts]:
  """``{name: WriteCounts(per_step=[T], out_of_range=[])}``.

  A stack of states is refused outside ``vmap``
  (``jax.vmap(jr.write_counts)(states)`` gives ``[S, T]`` and ``[S]``).

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_at(state, 0, {"r": np.ones(2)})
    >>> state = jr.update_at(state, 0, {"r": np.ones(2)})     # step 0 again
    >>> state = jax.jit(jr.update_at)(state, 7, {"r": np.ones(2)})  # dropped
    >>> counts = jr.write_counts(state)["r"]
    >>> counts.per_step.tolist(), counts.out_of_range.item()
    ([2, 0, 0], 1)
  """
  _checks.check_state("write_counts", state)
  return {k: WriteCounts(state.counts[i], state.out_of_range[i])
          for i, k in enumerate(state.names)}


def check(fn: str, state: RolloutState, mode: Any = "error") -> None:
  """The write check of ``fn`` (``make_batch``, ...): see the module doc.

  Args:
    fn: the public call, for messages.
    state: the state being closed.
    mode: ``"error"`` (raise eagerly; a checkify check under ``jit``),
      ``"callback"`` (raise eagerly; a host callback under ``jit``) or
      ``"off"`` (no check).

  Raises:
    IncompleteRolloutError: eagerly, if the rollout is not complete.
    ValueError: an unknown ``mode``.
  """
  if not isinstance(mode, str) or mode not in CHECK_MODES:
    hint = ""
    if isinstance(mode, bool):   # the 0.1 spelling
      hint = f" (0.1's check={mode} is check={'error' if mode else 'off'!r})"
    raise ValueError(f"{fn}: `check` must be 'error', 'callback' or 'off', "
                     f"got {mode!r}{hint}")
  if mode == "off":
    return
  tracers = [x for x in (state.counts, state.out_of_range)
             if isinstance(x, jax.core.Tracer)]
  if not tracers:
    _raise_stack(fn, state.names, *jax.device_get((state.counts,
                                                   state.out_of_range)))
  elif mode == "error":
    _checkify(fn, state)
  else:
    _callback_check(fn, state.names)(state.counts, state.out_of_range)


def _checkify(fn: str, state: RolloutState) -> None:
  keys = repr(state.names).replace("{", "{{").replace("}", "}}")
  checkify.debug_check(
      is_complete(state),
      f"{fn}: the rollout is not complete (every step of every field must be "
      "written exactly once since the last make_batch or finish_rollout); "
      f"per field of {keys}: steps never written {{missing}}, steps written "
      "more than once {duplicated}, writes aimed outside "
      f"[0, {state.num_steps}) {{out_of_range}}",
      missing=jnp.sum(state.counts == 0, axis=-1),
      duplicated=jnp.sum(state.counts > 1, axis=-1),
      out_of_range=state.out_of_range)


def describe_problems(counts: Mapping[str, np.ndarray],
                      out_of_range: Mapping[str, np.ndarray]) -> list[str]:
  """Human-readable lines for every field not written exactly once per step."""
  lines = []
  for key in sorted(counts):
    c = np.asarray(counts[key])
    oor = int(np.asarray(out_of_range[key]))
    missing = np.flatnonzero(c == 0).tolist()
    dup = np.flatnonzero(c > 1).tolist()
    if not missing and not dup and not oor:
      continue
    parts = []
    if missing:
      parts.append(f"missing steps {_ranges(missing)}")
    if dup:
      parts.append("duplicated steps " + ", ".join(
          f"{t} (x{int(c[t])})" for t in dup[:20]) +
                   (" ..." if len(dup) > 20 else ""))
    if oor:
      parts.append(f"{oor} write(s) aimed outside [0, {c.shape[-1]}) "
                   "(dropped)")
    lines.append(f"field {key!r}: " + "; ".join(parts))
  return lines


def _ranges(steps: list[int]) -> str:
  out, start, prev = [], steps[0], steps[0]
  for s in steps[1:] + [None]:
    if s is not None and s == prev + 1:
      prev = s
      continue
    out.append(str(start) if start == prev else f"{start}-{prev}")
    if s is not None:
      start = prev = s
  return "[" + ", ".join(out) + "]"


def raise_if_incomplete(counts: Mapping[str, np.ndarray],
                        out_of_range: Mapping[str, np.ndarray],
                        fn: str = "make_batch", where: str = "") -> None:
  """Raises IncompleteRolloutError for concrete (host) per-field counts.

  ``fn`` names the public call for the message; ``where`` says which buffer
  of a stack (empty for a single buffer).
  """
  lines = describe_problems(counts, out_of_range)
  if lines:
    raise IncompleteRolloutError(
        f"{fn}: the rollout{where} is not complete (every step of every field "
        "must be written exactly once since the last make_batch or "
        "finish_rollout):\n  " + "\n  ".join(lines))


def _raise_stack(fn: str, keys: tuple[str, ...], counts, out_of_range) -> None:
  """``raise_if_incomplete`` for host counts ``[..., K, T]``.

  Leading axes, if any, are a ``vmap``-ed stack of buffers; the message
  names the first incomplete one.
  """
  counts, out_of_range = np.asarray(counts), np.asarray(out_of_range)
  for index in np.ndindex(counts.shape[:-2]):
    raise_if_incomplete(
        {k: counts[index][i] for i, k in enumerate(keys)},
        {k: out_of_range[index][i] for i, k in enumerate(keys)}, fn,
        f" (buffer {index} of a vmapped stack)" if index else "")


@functools.lru_cache(maxsize=None)
def _callback_check(fn: str, keys: tuple[str, ...]):
  """``check="callback"`` for traced counts: a host callback, only on failure.

  ``lax.cond`` skips the callback when the rollout is complete. Under
  ``vmap`` a batched predicate would turn the cond into a select that always
  calls back; the custom vmap rule instead reduces the predicate over the
  whole stack (recursively for nested vmaps) and calls back once, with the
  stack, only if some buffer is incomplete.
  """
  def report(counts, out_of_range):
    _raise_stack(fn, keys, counts, out_of_range)

  @jax.custom_batching.custom_vmap
  def callback_check(counts, out_of_range):
    lax.cond(_complete(counts, out_of_range),
             lambda c, o: None,
             lambda c, o: jax.debug.callback(report, c, o),
             counts, out_of_range)
    return _complete(counts, out_of_range)

  @callback_check.def_vmap
  def check_stack(axis_size, in_batched, counts, out_of_range):
    counts, out_of_range = (
        x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        for x, batched in zip((counts, out_of_range), in_batched))
    callback_check(counts, out_of_range)    # one cond for the whole stack
    per_buffer = (jnp.all(counts == 1, axis=(1, 2))
                  & jnp.all(out_of_range == 0, axis=1))
    return per_buffer, True

  return callback_check
