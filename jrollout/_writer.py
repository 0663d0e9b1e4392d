"""RolloutWriter: host-loop writes, queued and flushed in donated dispatches.

The one in-place write path: a flush runs ``jrollout._write``'s kernel with
the state donated, then warns with a ``DonationWarning`` if JAX copied a
buffer instead (a torch DLPack view blocks donation).
"""

from __future__ import annotations

from collections.abc import Callable
import math
import sys
from typing import Any
import warnings

import jax
import numpy as np

from jrollout import _checks
from jrollout import _ledger
from jrollout import _state
from jrollout import _write
from jrollout._state import is_array
from jrollout._state import RolloutState
from jrollout._types import Array, ArrayLike, Check

_write_donated = jax.jit(_write.write, donate_argnums=0,
                         static_argnames=_write.STATIC)

Commit = Callable[[RolloutState, Array | None], None]


class DonationWarning(RuntimeWarning):
  """A host-loop write could not update some storage in place.

  JAX copied the buffers it could not donate (most often a torch tensor
  still views them through DLPack); the write itself is complete. Python's
  warning filter decides how often it shows (by default once per call site).

  Attributes:
    state: the new state the write produced (a writer already holds it).

  Example:
    >>> import warnings, numpy as np, jrollout as jr
    >>> writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "r"),
    ...                           flush_every=1)
    >>> view = np.asarray(writer.state.data["r"])  # a live view blocks it
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   writer.update_at(0, {"r": np.ones(2)})
    >>> type(caught[0].message).__name__
    'DonationWarning'
  """

  def __init__(self, message: str, state: RolloutState | None = None):
    super().__init__(message)
    self.state = state


def write_inplace(fn: str, state: RolloutState, steps: Any,
                  runs: dict[str, Any], *, contiguous: bool = False,
                  signal: bool = False, commit: Commit | None = None
                  ) -> tuple[RolloutState, Array | None]:
  """``_write.write`` donating ``state``: ``(new, done)``.

  ``commit(new, done)`` runs before any ``DonationWarning`` (so a warning
  raised as an error loses nothing); the warning names the fields whose
  buffers were copied (a field written whole gets a new buffer anyway).
  """
  new, done = _write_donated(state, steps, runs, contiguous=contiguous,
                             signal=signal)
  if commit is not None:
    commit(new, done)
  copied = sorted(
      k for k, v in state.data.items()
      if (steps is not None or k not in runs)
      and not all(x.is_deleted() for x in jax.tree_util.tree_leaves(v)))
  if copied:
    warnings.warn(DonationWarning(
        f"{fn}: the storage of {copied} was copied, not updated in place: "
        "JAX skipped donating it, most likely because a torch tensor "
        "(DLPack view) still shares that buffer. Every step now copies the "
        "whole rollout (O(T) per step). Fix: drop the views (`del tensor`) "
        "before writing, or export with jrollout.torch.to_torch(..., "
        "copy=True).", new), stacklevel=_caller_level())
  return new, done


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
  """``np.empty`` at a 64-byte aligned address: XLA:CPU reads an aligned
  numpy argument without a copy (large numpy allocations start 16 bytes
  into a page), so a flush copies no staging block."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  start = -raw.ctypes.data % 64
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def _caller_level() -> int:
  """The ``stacklevel`` of the first frame outside jrollout."""
  frame, level = sys._getframe(1), 1
  while frame.f_back is not None and frame.f_globals.get(
      "__name__", "").partition(".")[0] == "jrollout":
    frame, level = frame.f_back, level + 1
  return level


def _refuse_traced(fn: str, what: str, tree: Any) -> None:
  if any(isinstance(x, jax.core.Tracer)
         for x in jax.tree_util.tree_leaves(tree)):
    raise TypeError(
        f"{fn}: got a traced {what}; the writer is for host loops. Inside "
        "jit/scan use jr.update_at (or jr.update_all), which XLA already "
        "performs in place")


class RolloutWriter:
  """Writes a rollout step by step from a Python loop, a few steps per dispatch.

  Each ``update_at`` is checked at once (as ``jr.update_at``) and queued;
  every ``flush_every`` calls one jitted call writes the queue into the
  donated state, in place. Reading ``.state`` (or ``make_batch``) flushes
  first. A JAX value is held until the flush; a host value (numpy,
  ``t.numpy()``) is copied at once into a staging block, so the caller may
  reuse its buffer. Steps may come in any order; a step written twice keeps
  its last value and counts twice. The state passed in, and every state
  read from ``.state``, is consumed (its buffers deleted) by the next flush.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "r"))
    >>> for t in range(3):                        # a host loop, [E] per step
    ...   writer.update_at(t, {"r": np.array([t, 10 + t], np.float32)})
    >>> writer.make_batch()["r"].tolist()         # checked, env-major
    [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
    >>> writer.pending                            # nothing queued
    0

  Args:
    state: the rollout state to write into (consumed).
    flush_every: how many ``update_at`` calls to queue per flush (default
      16). A field fed host values keeps two staging blocks of
      ``flush_every`` steps for the writer's lifetime.

  Raises:
    TypeError: not a RolloutState, or a traced one (inside ``jit`` use
      ``jr.update_at``); ``flush_every`` not an int.
    ValueError: ``flush_every`` not positive; a consumed state.
  """

  def __init__(self, state: RolloutState, *, flush_every: int = 16):
    fn = "RolloutWriter"
    _state.check_state(fn, state)
    _refuse_traced(fn, "state", state)
    self._flush_every = _checks.positive_int(fn, "flush_every", flush_every)
    self._state = state
    self._flat = frozenset(k for k, v in state.data.items() if is_array(v))
    self._passed: dict[Any, _write.WritePlan] = {}   # check_values' cache
    self._calls = 0
    # Per field: the queued steps, and its held JAX rows unless its rows
    # are in a host staging block (row i: the i-th queued step).
    self._steps: dict[str, list[int]] = {}
    self._rows: dict[str, list[Any]] = {}
    self._contiguous = True            # every field's steps run s, s + 1, ...
    # Two sets of staging blocks for alternate flushes: JAX may read a
    # numpy argument while the call runs, so a set is refilled only once
    # the flush that read it is done.
    self._blocks: tuple[dict[str, Any], ...] = ({}, {})
    self._done: list[Array | None] = [None, None]
    self._set = 0

  @property
  def pending(self) -> int:
    """How many ``update_at`` calls are queued, not yet written."""
    return self._calls

  @property
  def state(self) -> RolloutState:
    """The state with every queued write applied (consumed by next flush).

    Example:
      >>> import numpy as np, jrollout as jr
      >>> writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "r"))
      >>> writer.update_at(1, {"r": np.array([5.0, 6.0])})
      >>> writer.state.data["r"].tolist()         # flushed first
      [[0.0, 0.0], [5.0, 6.0], [0.0, 0.0]]
    """
    self.flush()
    return self._state

  def __repr__(self) -> str:
    s = self._state
    return (f"RolloutWriter(num_envs={s.num_envs}, num_steps={s.num_steps}, "
            f"names={list(s.names)}, pending={self.pending}, "
            f"flush_every={self._flush_every})")

  def update_at(self, step: int, data: dict[str, ArrayLike]) -> None:
    """Queues ``storage[k][step] = data[k]``; flushes every ``flush_every``.

    Args:
      step: a concrete int in ``[0, T)``.
      data: ``{name: [E, *shape]}`` for any subset of the fields.

    Raises:
      KeyError, ValueError, TypeError, IndexError: as ``jr.update_at``, at
        once; nothing is queued.
      TypeError: a traced step or value (inside ``jit`` use ``jr.update_at``).
      ValueError: the writer's state was consumed by another call.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "r"))
      >>> writer.update_at(0, {"r": np.ones(2)})   # copied now, queued
      >>> writer.pending
      1
    """
    fn = "RolloutWriter.update_at"
    state = self._state
    if type(data) is not dict:
      data = _state.as_values(data)
    if not (type(step) is int and 0 <= step < state.num_steps):
      if isinstance(step, jax.core.Tracer):
        raise TypeError(f"{fn}: `step` must be concrete (a Python int); "
                        "inside jit/scan use jr.update_at")
      step = _write.check_step(fn, state, step)  # type: ignore[assignment]
    _write.check_values(fn, state, data, (state.num_envs,), "[E]",
                        self._passed)
    if not data:
      return
    for key, value in data.items():
      if isinstance(value, jax.core.Tracer) or key not in self._flat:
        _refuse_traced(fn, "value", value)
    was_contiguous, queued = self._contiguous, []
    try:
      for key, value in data.items():
        self._queue(key, step, value)
        queued.append(key)
      self._calls += 1
      if self._calls >= self._flush_every:
        self.flush()
    except BaseException:
      if len(queued) < len(data) or self._calls:   # nothing was written
        self._contiguous = was_contiguous
        self._calls -= len(queued) == len(data)
        for key in queued:   # take this call's rows back
          steps = self._steps[key]
          steps.pop()
          if key in self._rows:
            self._rows[key].pop()
          if not steps:
            del self._steps[key]
            self._rows.pop(key, None)
      raise   # else the flush is done (a DonationWarning raised after it)

  def _queue(self, key: str, step: int, value: Any) -> None:
    """Adds the row ``value`` of field ``key`` at ``step``."""
    steps = self._steps.get(key)
    if steps is None:
      steps = self._steps[key] = []
      if all(isinstance(x, jax.Array)
             for x in jax.tree_util.tree_leaves(value)):
        self._rows[key] = []   # the first row decides: held JAX rows
    held = self._rows.get(key)
    if held is not None:   # a host value among JAX rows is copied now
      held.append(jax.tree_util.tree_map(
          lambda v, s: v if isinstance(v, jax.Array) else np.array(v, s.dtype),
          value, self._state.data[key]))
    elif key in self._flat:   # into the staging block
      self._staging(key)[len(steps)] = value
    else:
      row = len(steps)
      jax.tree_util.tree_map(lambda block, v: block.__setitem__(row, v),
                             self._staging(key), value)
    if steps and steps[-1] + 1 != step:
      self._contiguous = False
    steps.append(step)

  def _staging(self, key: str) -> Any:
    """The field's staging block(s) ``[flush_every, E, ...]`` of the current
    set, once the last flush that read this set is done."""
    done = self._done[self._set]
    if done is not None:
      done.block_until_ready()
      self._done[self._set] = None
    blocks = self._blocks[self._set]
    if key not in blocks:
      blocks[key] = jax.tree_util.tree_map(
          lambda x: aligned_empty((self._flush_every, *x.shape[1:]), x.dtype),
          self._state.data[key])
    return blocks[key]

  def flush(self) -> None:
    """Writes every queued step into the state now (one dispatch).

    Raises:
      ValueError: the writer's state was consumed by another call that
        donated it (e.g. a second writer given the same state).

    Example:
      >>> import numpy as np, jrollout as jr
      >>> writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "r"))
      >>> writer.update_at(0, {"r": np.ones(2)})
      >>> writer.flush()
      >>> writer.pending
      0
    """
    if not self._calls:
      return
    blocks = self._blocks[self._set]
    runs = {}
    for key in sorted(self._steps):   # the order jit flattens a dict in
      held, n = self._rows.get(key), len(self._steps[key])
      runs[key] = (tuple(held) if held is not None else (
          jax.tree_util.tree_map(lambda b, n=n: b[:n], blocks[key]),))
    steps = np.asarray([t for k in runs for t in self._steps[k]], np.int32)
    staged = len(runs) > len(self._rows)
    consumed = _state.consumed_keys(self._state)
    if consumed:
      raise ValueError(
          f"RolloutWriter: the writer's state was consumed by another call "
          f"that donated it (the buffers of {consumed} are deleted): a "
          "second RolloutWriter was given the same state. Give each writer "
          "its own state (e.g. the other's `writer.state`); nothing was "
          "written")

    def commit(state: RolloutState, done: Array | None) -> None:
      self._state = state
      if staged:   # the next flush stages into the other set
        self._done[self._set] = done
        self._set ^= 1
      self._calls = 0
      self._steps, self._rows, self._contiguous = {}, {}, True

    write_inplace("RolloutWriter", self._state, steps, runs,
                  contiguous=self._contiguous, signal=staged, commit=commit)

  def update_all(self, data: dict[str, ArrayLike]) -> None:
    """Writes whole rollouts of some fields (``data[k]``: ``[T, E, *shape]``).

    Checked first (nothing changes on an error); queued writes are flushed
    before it, so the order of writes is kept. Numpy arrays are copied.

    Raises:
      KeyError, ValueError, TypeError: as ``jr.update_all``; a traced value.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "r"))
      >>> writer.update_all({"r": np.ones((3, 2))})   # [T, E]
      >>> jr.write_counts(writer.state)["r"].per_step.tolist()
      [1, 1, 1]
    """
    fn = "RolloutWriter.update_all"
    s = self._state
    data = _state.as_values(data)
    plan = _write.check_values(fn, s, data, (s.num_steps, s.num_envs),
                               "[T, E]")
    _refuse_traced(fn, "value", data)
    self.flush()
    if not data:
      return
    runs = {k: (v,) for k, v in _write.stage(s, data, plan).items()}

    def commit(state: RolloutState, done: Array | None) -> None:
      del done   # a whole-rollout write reads no staging block
      self._state = state

    write_inplace(fn, self._state, None, runs, commit=commit)

  def finish_rollout(self, *, check: Check = "error") -> RolloutState:
    """``jr.finish_rollout`` of the flushed state; the writer goes on from it
    (the returned state is consumed by the next flush).

    Raises:
      IncompleteRolloutError: if the write check fails; nothing changes.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "r"))
      >>> writer.update_all({"r": np.ones((3, 2))})
      >>> jr.write_counts(writer.finish_rollout())["r"].per_step.tolist()
      [0, 0, 0]
    """
    _, self._state = _ledger.close("RolloutWriter.finish_rollout", self.state,
                                  check)
    return self._state

  def make_batch(self, *, check: Check = "error") -> Any:
    """``jr.make_batch`` of the flushed state: the env-major batch ``{name:
    [E * T, *shape]}`` in new buffers; the writer keeps the reset state.

    Raises:
      IncompleteRolloutError: if the write check fails; nothing changes.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> writer = jr.RolloutWriter(jr.register(jr.init(2, 2), "r"))
      >>> writer.update_all({"r": np.array([[0, 10], [1, 11]], np.float32)})
      >>> writer.make_batch()["r"].tolist()      # [E * T], env-major
      [0.0, 1.0, 10.0, 11.0]
    """
    batch, self._state = _ledger.close("RolloutWriter.make_batch", self.state,
                                      check, flatten=True)
    return batch
