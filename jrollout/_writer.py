"""RolloutWriter: host-loop writes combined into few donated dispatches."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _buffer
from jrollout import _checks
from jrollout._state import RolloutState
from jrollout._types import Array, ArrayLike


def _flush(state: RolloutState, steps: Array,
           values: dict[str, tuple[Any, ...]]) -> RolloutState:
  """Writes queued steps in order: ``values[k][i]`` to step ``steps[...]``.

  ``steps`` holds the steps of all keys, concatenated in sorted key order
  (the pytree order of ``values``). Steps were range-checked on the host.
  Each key's writes are applied in the order they were made, so a step
  written twice keeps its last value, as sequential ``update_at`` would.
  """
  data = dict(state.data)
  keys = state.keys
  rows = []
  offset = 0
  for key in sorted(values):
    buf = data[key]
    for i, value in enumerate(values[key]):
      buf = lax.dynamic_update_index_in_dim(
          buf, jnp.asarray(value, buf.dtype), steps[offset + i], 0)
    data[key] = buf
    rows += [keys.index(key)] * len(values[key])
    offset += len(values[key])
  counts = state.counts.at[np.asarray(rows, np.int32), steps].add(1)
  return state.replace(data=data, counts=counts)


_flush_donated = jax.jit(_flush, donate_argnums=0)


def _pack(steps: dict[str, list[int]], values: dict[str, list[Any]]
          ) -> tuple[np.ndarray, dict[str, tuple[Any, ...]]]:
  """``_flush``'s arguments from per-key queues of steps and values.

  Keys go in sorted order (the pytree order of the values dict), so the
  concatenated ``steps`` line up with ``values[k][i]``.
  """
  keys = sorted(values)
  packed_steps = np.fromiter((t for k in keys for t in steps[k]), np.int32)
  return packed_steps, {k: tuple(values[k]) for k in keys}


class RolloutWriter:
  """Writes a rollout step by step from a Python loop, a few steps per dispatch.

  The host-loop path for simulators driven from Python (e.g. in torch).
  ``update_at_inplace`` costs one JAX dispatch per step, and a dispatch
  costs more than a torch ``copy_`` of a small step. The writer checks
  each write at once (same checks and errors as ``jr.update_at``) but
  queues it, and writes ``flush_every`` queued steps with one jitted call
  that donates the state, so the storage is updated in place: O(1) work per
  step beyond copying its data, and one dispatch per ``flush_every`` steps.
  Reading ``.state`` (or ``make_batch``/``finish_rollout``) writes what is
  queued first, so what you read is always what you wrote.

  The writer owns its state: the state passed in, and every state read
  from ``.state``, is consumed (its buffers deleted) by the next write that
  flushes. Read what you need from it before writing on.

  Queued values are held until their flush. JAX arrays are immutable, so
  that is safe; NumPy values are copied when queued. A JAX array that
  views memory someone else mutates (a zero-copy ``from_torch`` of a tensor
  your simulator overwrites in place) would be read at flush time: export
  such steps with ``from_torch(..., copy=True)``, or call ``flush()``
  before the memory changes.

  Example::

    writer = jr.RolloutWriter(state)
    for t in range(T):
      writer.update_at(t, {"obs": obs, "reward": reward})   # [E, ...] each
    batch = writer.make_batch()           # {key: [E * T, ...]}, checked

  Args:
    state: the rollout state to write into (consumed).
    flush_every: how many ``update_at`` calls to queue before writing them
      (default 16). Larger amortises the dispatch further and keeps that
      many steps' inputs alive meanwhile. Each distinct pattern of queued
      keys compiles once.
  """

  def __init__(self, state: RolloutState, *, flush_every: int = 16):
    if not isinstance(state, RolloutState):
      raise TypeError(f"RolloutWriter: `state` must be a RolloutState, got "
                      f"{type(state).__name__}")
    self._flush_every = _checks.check_positive_int(
        "RolloutWriter", "flush_every", flush_every)
    self._state = state
    self._values: dict[str, list[Any]] = {}
    self._steps: dict[str, list[int]] = {}
    self._calls = 0

  @property
  def pending(self) -> int:
    """How many ``update_at`` calls are queued, not yet written."""
    return self._calls

  @property
  def state(self) -> RolloutState:
    """The state with every queued write applied (consumed by the next flush)."""
    self.flush()
    return self._state

  def __repr__(self) -> str:
    s = self._state
    return (f"RolloutWriter(num_envs={s.num_envs}, num_steps={s.num_steps}, "
            f"keys={list(s.keys)}, pending={self._calls}, "
            f"flush_every={self._flush_every})")

  def update_at(self, step: int, values: dict[str, ArrayLike]) -> None:
    """Queues ``storage[k][step] = values[k]``; flushes every ``flush_every``.

    Args:
      step: a concrete int in ``[0, T)``.
      values: ``{key: [E, *shape]}`` for any subset of the registered keys.

    Raises:
      KeyError, ValueError, TypeError, IndexError: as ``jr.update_at``, at
        once; nothing is queued.
      TypeError: a traced step or value (inside ``jit`` use ``jr.update_at``).
    """
    fn = "RolloutWriter.update_at"
    step = _buffer._prepare_step(fn, self._state, step, values)
    if step is None:
      raise TypeError(f"{fn}: `step` must be concrete (a Python int); "
                      "inside jit/scan use jr.update_at")
    if any(isinstance(v, jax.core.Tracer) for v in values.values()):
      raise TypeError(f"{fn}: got a traced value; the writer is for host "
                      "loops. Inside jit/scan use jr.update_at, which XLA "
                      "already performs in place")
    if not values:
      return
    for key, value in values.items():
      if not isinstance(value, jax.Array):
        value = jnp.array(value)   # a copy: the caller may reuse its buffer
      self._values.setdefault(key, []).append(value)
      self._steps.setdefault(key, []).append(step)
    self._calls += 1
    if self._calls >= self._flush_every:
      try:
        self.flush()
      except _buffer.DonationWarning:
        raise   # raised as an error after a completed flush: nothing to undo
      except BaseException:
        self._unqueue(values)   # a failed call leaves nothing queued
        raise

  def _unqueue(self, values: dict[str, Any]) -> None:
    for key in values:
      self._values[key].pop()
      self._steps[key].pop()
      if not self._values[key]:
        del self._values[key], self._steps[key]
    self._calls -= 1

  def flush(self) -> None:
    """Writes every queued step into the state now (one dispatch)."""
    if not self._calls:
      return
    old = self._state
    new = _flush_donated(old, *_pack(self._steps, self._values))
    self._state = new
    self._values, self._steps, self._calls = {}, {}, 0
    _buffer._warn_if_not_donated("RolloutWriter", old, new)

  def update_all(self, values: dict[str, ArrayLike]) -> None:
    """Writes whole rollouts of some keys (``values[k]``: ``[T, E, *shape]``).

    Checked first (nothing changes on an error); then queued writes are
    flushed, so the order of writes is kept.
    """
    s = self._state
    _checks.check_values("RolloutWriter.update_all", s, values,
                         (s.num_steps, s.num_envs), "[T, E]")
    self.flush()
    self._state = _buffer.update_all_inplace(self._state, values,
                                             fn="RolloutWriter.update_all")

  def finish_rollout(self, *, check: bool = True) -> RolloutState:
    """``jr.finish_rollout`` of the flushed state; the writer goes on from it.

    Returns the state (storage as written, tracking reset) for the no-copy
    path (minibatch straight from it); it is consumed by the next write
    that flushes, so finish reading it first.

    Raises:
      IncompleteRolloutError: if the write check fails; nothing changes.
    """
    self._state = _buffer._finish(self.state, check,
                                  "RolloutWriter.finish_rollout")
    return self._state

  def make_batch(self, *, check: bool = True) -> dict[str, Array]:
    """``jr.make_batch`` of the flushed state; the writer keeps the reset state.

    Returns:
      ``{key: [E * T, *shape]}``, env-major, in new buffers (later writes
      do not touch it).

    Raises:
      IncompleteRolloutError: if the write check fails; nothing changes.
    """
    batch, self._state = _buffer._make_batch(self.state, check,
                                             "RolloutWriter.make_batch")
    return batch

