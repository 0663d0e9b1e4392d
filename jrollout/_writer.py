"""RolloutWriter: host-loop writes combined into few donated dispatches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _buffer
from jrollout import _checks
from jrollout._state import RolloutState
from jrollout._types import Array, ArrayLike


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
    self._flush_every = _checks.positive_int("RolloutWriter", "flush_every",
                                             flush_every)
    self._state = state
    self._steps: list[int] = []               # one entry per queued call
    self._values: list[dict[str, Any]] = []

  @property
  def pending(self) -> int:
    """How many ``update_at`` calls are queued, not yet written."""
    return len(self._steps)

  @property
  def state(self) -> RolloutState:
    """The state with every queued write applied (consumed by next flush)."""
    self.flush()
    return self._state

  def __repr__(self) -> str:
    s = self._state
    return (f"RolloutWriter(num_envs={s.num_envs}, num_steps={s.num_steps}, "
            f"keys={list(s.keys)}, pending={self.pending}, "
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
    step = _buffer.prepare_step(fn, self._state, step, values)
    if step is None:
      raise TypeError(f"{fn}: `step` must be concrete (a Python int); "
                      "inside jit/scan use jr.update_at")
    if any(isinstance(v, jax.core.Tracer) for v in values.values()):
      raise TypeError(f"{fn}: got a traced value; the writer is for host "
                      "loops. Inside jit/scan use jr.update_at, which XLA "
                      "already performs in place")
    if not values:
      return
    # A copy of non-JAX values: the caller may reuse its buffer.
    self._values.append({k: v if isinstance(v, jax.Array) else jnp.array(v)
                         for k, v in values.items()})
    self._steps.append(step)
    if len(self._steps) >= self._flush_every:
      try:
        self.flush()
      except _buffer.DonationWarning:
        raise   # raised as an error after a completed flush: nothing to undo
      except BaseException:
        self._steps.pop()   # a failed call leaves nothing queued
        self._values.pop()
        raise

  def flush(self) -> None:
    """Writes every queued step into the state now (one dispatch)."""
    if not self._steps:
      return
    steps = np.asarray(self._steps, np.int32)
    try:
      self._state = _buffer.write_steps_inplace(
          "RolloutWriter", self._state, steps, tuple(self._values))
    except _buffer.DonationWarning as warning:   # warnings raised as errors
      self._state = warning.state   # the write is done: keep its result
      self._steps, self._values = [], []
      raise
    self._steps, self._values = [], []

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
    _, self._state = _buffer.close("RolloutWriter.finish_rollout", self.state,
                                   check)
    return self._state

  def make_batch(self, *, check: bool = True) -> dict[str, Array]:
    """``jr.make_batch`` of the flushed state; the writer keeps the reset state.

    Returns:
      ``{key: [E * T, *shape]}``, env-major, in new buffers (later writes
      do not touch it).

    Raises:
      IncompleteRolloutError: if the write check fails; nothing changes.
    """
    batch, self._state = _buffer.close("RolloutWriter.make_batch", self.state,
                                       check, flatten=True)
    return batch

