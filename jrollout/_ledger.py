"""The write check: which steps were written, and closing a rollout.

A rollout is complete when every step of every field was written exactly
once since the last ``make_batch``/``finish_rollout`` and no write was aimed
outside ``[0, T)``. Eagerly a failure is an ``IncompleteRolloutError``
naming each bad field; under ``jit`` a ``checkify`` check, or a host
callback that runs only on failure; ``is_complete`` is the traced flag.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout import _rows
from jrollout import _state
from jrollout._state import RolloutState
from jrollout._types import Array, Check


class IncompleteRolloutError(ValueError):
  """A rollout was closed with a field whose steps were not each written once.

  The message names each bad field with its missing and duplicated steps and
  its writes aimed outside ``[0, T)``.

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
    >>> per_step, out_of_range = jr.write_counts(jr.register(jr.init(2, 3),
    ...                                                      "r"))["r"]
    >>> per_step.tolist(), out_of_range.item()
    ([0, 0, 0], 0)
  """
  per_step: Array
  out_of_range: Array


def _complete(counts: Array, out_of_range: Array) -> Array:
  return jnp.all(counts == 1) & jnp.all(out_of_range == 0)


def is_complete(state: RolloutState) -> Array:
  """A bool scalar: every step of every field written once, none outside.

  The traced-flag form of ``make_batch``'s check; works under ``jit`` and
  ``vmap`` (a stack of states is refused outside ``vmap``).

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=2), "r")
    >>> jr.is_complete(jr.update_at(state, 0, {"r": np.ones(2)})).item()
    False
  """
  _state.check_state("is_complete", state)
  return _complete(state.counts, state.out_of_range)


def write_counts(state: RolloutState) -> dict[str, WriteCounts]:
  """``{name: WriteCounts(per_step=[T], out_of_range=[])}``.

  A stack of states is refused outside ``vmap``.

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_at(state, 0, {"r": np.ones(2)})
    >>> state = jax.jit(jr.update_at)(state, 7, {"r": np.ones(2)})  # dropped
    >>> counts = jr.write_counts(state)["r"]
    >>> counts.per_step.tolist(), counts.out_of_range.item()
    ([1, 0, 0], 1)
  """
  _state.check_state("write_counts", state)
  return {k: WriteCounts(state.counts[i], state.out_of_range[i])
          for i, k in enumerate(state.names)}


def check_complete(fn: str, state: RolloutState, mode: Any = "error") -> None:
  """The write check of ``fn``: eagerly an ``IncompleteRolloutError``;
  traced, a ``checkify`` check (``mode="error"``) or a host callback that
  runs only on failure (``"callback"``); ``"off"`` checks nothing.

  Raises:
    IncompleteRolloutError: eagerly, if the rollout is not complete.
    ValueError: an unknown ``mode``.
  """
  if not isinstance(mode, str) or mode not in ("error", "callback", "off"):
    hint = ""
    if isinstance(mode, bool):   # the 0.1 spelling
      hint = f" (0.1's check={mode} is check={'error' if mode else 'off'!r})"
    raise ValueError(f"{fn}: `check` must be 'error', 'callback' or 'off', "
                     f"got {mode!r}{hint}")
  if mode == "off":
    return
  if not isinstance(state.counts, jax.core.Tracer) and not isinstance(
      state.out_of_range, jax.core.Tracer):
    raise_stack(fn, state.names, *jax.device_get((state.counts,
                                                  state.out_of_range)))
  elif mode == "error":
    names = repr(state.names).replace("{", "{{").replace("}", "}}")
    checkify.debug_check(
        _complete(state.counts, state.out_of_range),
        f"{fn}: the rollout is not complete (every step of every field must "
        "be written exactly once since the last make_batch or "
        f"finish_rollout); per field of {names}: steps never written "
        "{missing}, steps written more than once {duplicated}, writes aimed "
        f"outside [0, {state.num_steps}) {{out_of_range}}",
        missing=jnp.sum(state.counts == 0, axis=-1),
        duplicated=jnp.sum(state.counts > 1, axis=-1),
        out_of_range=state.out_of_range)
  else:
    _callback_check(fn, state.names)(state.counts, state.out_of_range)


def _ranges(steps: list[int]) -> str:
  """``[0, 2-3]`` for steps 0, 2, 3."""
  runs = []
  for _, run in itertools.groupby(enumerate(steps), lambda p: p[1] - p[0]):
    first, *rest = [step for _, step in run]
    runs.append(f"{first}-{rest[-1]}" if rest else str(first))
  return "[" + ", ".join(runs) + "]"


def raise_stack(fn: str, names: tuple[str, ...], counts: Any,
                out_of_range: Any) -> None:
  """Raises ``IncompleteRolloutError`` for host counts ``[..., K, T]``, one
  line per field not written exactly once per step; the leading axes are a
  ``vmap``-ed stack, and the first bad state is named."""
  counts, out_of_range = np.asarray(counts), np.asarray(out_of_range)
  if (counts == 1).all() and not out_of_range.any():
    return   # complete: the common case, without the per-field report
  for index in np.ndindex(counts.shape[:-2]):
    lines = []
    for key, c, oor in zip(names, counts[index], out_of_range[index]):
      missing, dup = np.flatnonzero(c == 0).tolist(), np.flatnonzero(c > 1)
      parts = [f"missing steps {_ranges(missing)}"] if missing else []
      if dup.size:
        parts.append("duplicated steps " + ", ".join(
            f"{t} (x{int(c[t])})" for t in dup[:20])
            + (" ..." if dup.size > 20 else ""))
      if oor:
        parts.append(f"{int(oor)} write(s) aimed outside [0, {c.shape[-1]}) "
                     "(dropped)")
      if parts:
        lines.append(f"field {key!r}: " + "; ".join(parts))
    if lines:
      where = f" (buffer {index} of a vmapped stack)" if index else ""
      raise IncompleteRolloutError(
          f"{fn}: the rollout{where} is not complete (every step of every "
          "field must be written exactly once since the last make_batch or "
          "finish_rollout):\n  " + "\n  ".join(lines))


@functools.lru_cache(maxsize=None)
def _callback_check(fn: str, names: tuple[str, ...]) -> Any:
  """``check="callback"``: ``lax.cond`` calls back only on failure. Under
  ``vmap`` the custom rule reduces the predicate over the whole stack and
  calls back once (a batched cond would become a select that always calls
  back). Cached so that each (fn, names) traces one custom_vmap."""
  def report(counts: Any, out_of_range: Any) -> None:
    raise_stack(fn, names, counts, out_of_range)

  @jax.custom_batching.custom_vmap
  def callback_check(counts: Array, out_of_range: Array) -> Array:
    lax.cond(_complete(counts, out_of_range), lambda c, o: None,
             lambda c, o: jax.debug.callback(report, c, o),
             counts, out_of_range)
    return _complete(counts, out_of_range)

  @callback_check.def_vmap
  def check_stack(axis_size: int, in_batched: Any, counts: Array,
                  out_of_range: Array) -> Any:
    counts, out_of_range = (
        x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        for x, batched in zip((counts, out_of_range), in_batched))
    callback_check(counts, out_of_range)    # one cond for the whole stack
    per_state = (jnp.all(counts == 1, axis=(1, 2))
                 & jnp.all(out_of_range == 0, axis=1))
    return per_state, True

  return callback_check


@jax.jit
def _flatten(data: dict[str, Any]) -> dict[str, Any]:
  return jax.tree_util.tree_map(_rows.env_major, data)


def close(fn: str, state: RolloutState, check: Any = "error", *,
          flatten: bool = False) -> tuple[Any, RolloutState]:
  """``(batch or None, state)``: the write check, then the tracking reset
  (the body of ``make_batch`` with ``flatten``, and ``finish_rollout``)."""
  _state.check_state(fn, state)
  check_complete(fn, state, check)
  batch = _flatten(state.data) if flatten else None
  if batch is not None and state.container is not None:
    batch = state.container.rebuild(batch)
  return batch, state.replace(counts=jnp.zeros_like(state.counts),
                              out_of_range=jnp.zeros_like(state.out_of_range))


def finish_rollout(state: RolloutState, *,
                   check: Check = "error") -> RolloutState:
  """Runs the write check and restarts write tracking, without flattening.

  The no-copy path: minibatch straight from the state, then close it. The
  check: every step of every field written exactly once since the last
  ``make_batch``/``finish_rollout``, and no write aimed outside ``[0, T)``.
  Eagerly a failure raises ``IncompleteRolloutError`` naming each bad field;
  under ``jit`` it is a ``checkify`` check (wrap the function in
  ``checkify.checkify``; ``jr.is_complete`` is the flag to test without);
  ``check="callback"`` raises under ``jit`` through a host callback (which
  makes dispatch synchronous); ``check="off"`` skips it.

  Args:
    state: the rollout state.
    check: ``"error"`` (default), ``"callback"`` or ``"off"``.

  Returns:
    The state with the same storage and every write count zero.

  Raises:
    IncompleteRolloutError: eagerly, if the write check fails.

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> from jax.experimental import checkify
    >>> state = jr.register(jr.init(num_envs=2, num_steps=2), "r")
    >>> state = jr.update_at(state, 0, {"r": np.ones(2)})   # step 1 missing
    >>> err, _ = jax.jit(checkify.checkify(jr.finish_rollout))(state)
    >>> print(err.get().split(" (")[0])
    finish_rollout: the rollout is not complete
  """
  return close("finish_rollout", state, check)[1]


def make_batch(state: RolloutState, *, check: Check = "error"
               ) -> tuple[Any, RolloutState]:
  """Flattens the rollout into an env-major batch and restarts tracking.

  ``batch[k][e * T + t] == state.data[k][t, e]``. The write check is that
  of ``finish_rollout``.

  Args:
    state: the rollout state.
    check: ``"error"`` (default), ``"callback"`` or ``"off"``.

  Returns:
    ``(batch, new_state)``: ``batch = {name: [E * T, *shape]}`` (in the
    container type of ``init(like=)``), ``new_state`` with the storage kept
    and every write count zero.

  Raises:
    IncompleteRolloutError: eagerly, if the write check fails.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "t")
    >>> steps = np.array([[0, 10], [1, 11], [2, 12]], np.float32)  # [T, E]
    >>> batch, state = jr.make_batch(jr.update_all(state, {"t": steps}))
    >>> batch["t"].tolist()      # env 0's steps, then env 1's
    [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
  """
  batch, state = close("make_batch", state, check, flatten=True)
  return batch, state
