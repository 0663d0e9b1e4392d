"""RolloutWriter: host-loop writes combined into few donated dispatches."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jrollout import _buffer
from jrollout import _checks
from jrollout import _write_check
from jrollout import _containers
from jrollout._state import is_array
from jrollout._state import RolloutState
from jrollout._types import Array, ArrayLike, Check


class RolloutWriter:
  """Writes a rollout step by step from a Python loop, a few steps per dispatch.

  The host-loop path for simulators driven from Python (EnvPool, gymnasium,
  torch). ``update_at_inplace`` costs one JAX dispatch per step, and a
  dispatch costs more than a numpy copy of a small step. The writer checks
  each write at once (same checks and errors as ``jr.update_at``) but
  queues it, and every ``flush_every`` calls writes what is queued with one
  jitted call that donates the state, so the storage is updated in place:
  O(1) work per step beyond copying its data. Reading ``.state`` (or
  ``make_batch``/``finish_rollout``) writes what is queued first, so what
  you read is always what you wrote.

  How a value is queued depends on what it is:

  - a JAX array is held as it is (no copy, no wait: it may still be being
    computed, and it stays on its device);
  - anything else (a numpy array, or a numpy view of a CPU torch tensor,
    ``t.numpy()``) is copied at once into a host staging block of the
    field's dtype, one row per step, and the block goes into JAX with the
    flush. No dispatch and no device transfer per step, and the caller
    may reuse its buffers as soon as ``update_at`` returns. A torch tensor
    itself is refused (``TypeError`` naming ``t.numpy()``).

  A pytree field (``register(like=)``) is queued leaf by leaf the same way:
  held if every leaf is a JAX array, else each leaf copied into its own
  staging block.

  Values are cast to the field's dtype by the rule of ``jr.update_at``: a
  narrowing cast (float64 rewards into a float32 key, int64 into int32)
  checks every value, which costs two numpy reductions per such key and
  step (a few microseconds for ``[1024]``); values of the field's own dtype
  are not looked at.

  Steps may come in any order (gaps, repeats: a step written twice keeps
  its last value and counts twice, as with ``jr.update_at``). When each
  key's queued steps run ``t, t + 1, ...`` (a host loop), a field's staging
  block is written with one in-place update; otherwise row by row.

  The writer owns its state: the state passed in, and every state read
  from ``.state``, is consumed (its buffers deleted) by the next write that
  flushes. Read what you need from it before writing on.

  A queued JAX array is read when its flush runs: one that views memory
  someone else mutates (a zero-copy ``from_torch`` of a tensor your
  simulator overwrites in place) must be queued as ``t.numpy()`` (copied
  now) or imported with ``from_torch(..., copy=True)``.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> writer = jr.RolloutWriter(state)
    >>> for t in range(3):                        # a host loop, [E] per step
    ...   writer.update_at(t, {"r": np.array([t, 10 + t], np.float32)})
    >>> batch = writer.make_batch()               # checked, env-major
    >>> batch["r"].tolist()                       # env 0's steps, then env 1's
    [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]

  Args:
    state: the rollout state to write into (consumed).
    flush_every: how many ``update_at`` calls to queue before writing them
      (default 16). Larger amortises the dispatch further and keeps that
      many steps' inputs alive meanwhile; each field fed host values also
      keeps two staging blocks of ``flush_every`` steps (``2 *
      flush_every * E * prod(shape)`` elements) for the writer's lifetime.
      Each distinct pattern of queued keys and row counts compiles once.
  """

  def __init__(self, state: RolloutState, *, flush_every: int = 16):
    _checks.check_state("RolloutWriter", state)
    self._flush_every = _checks.positive_int("RolloutWriter", "flush_every",
                                             flush_every)
    self._state = state
    # Every state this writer holds has this layout: the write checks key
    # their cache with it instead of reading the storage arrays each step.
    self._layout = _write_check.write_layout(state)
    # The fields stored as one array (the others are pytrees), so a step
    # asks no storage or value what it is.
    self._flat = frozenset(k for k, v in state.data.items() if is_array(v))
    self._calls = 0                    # queued update_at calls
    # Per key, the steps queued in order, and its JAX rows (a list) unless
    # its rows are in a host staging block (row i: the i-th queued step).
    self._steps: dict[str, list[int]] = {}
    self._rows: dict[str, list[Array | np.ndarray]] = {}
    self._contiguous = True            # every field's steps run s, s + 1, ...
    # Two sets of staging blocks, used by alternate flushes; a set is
    # reused once the flush that read it is done (`_done`), since JAX may
    # read numpy arguments while the jitted call runs.
    self._blocks: tuple[dict[str, np.ndarray], ...] = ({}, {})
    self._done: list[Array | None] = [None, None]
    self._set = 0

  @property
  def pending(self) -> int:
    """How many ``update_at`` calls are queued, not yet written.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
      >>> writer = jr.RolloutWriter(state, flush_every=2)
      >>> writer.update_at(0, {"r": np.ones(2)})
      >>> writer.pending
      1
      >>> writer.update_at(1, {"r": np.ones(2)})   # the 2nd call flushes
      >>> writer.pending
      0
    """
    return self._calls

  @property
  def state(self) -> RolloutState:
    """The state with every queued write applied (consumed by next flush).

    Example:
      >>> import numpy as np, jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
      >>> writer = jr.RolloutWriter(state)
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
      data: ``{name: [E, *shape]}`` for any subset of the registered fields.
        JAX arrays are held until the flush; other arrays are copied now.

    Raises:
      KeyError, ValueError, TypeError, IndexError: as ``jr.update_at``, at
        once (the same casts and value checks); nothing is queued.
      TypeError: a traced step or value (inside ``jit`` use ``jr.update_at``).
      ValueError: the writer's state was consumed by another call that
        donated it (a second writer on the same state, at a flush).

    Example:
      >>> import numpy as np, jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "obs", (4,))
      >>> writer = jr.RolloutWriter(state)
      >>> obs = np.ones((2, 4))                   # [E, 4]
      >>> writer.update_at(0, {"obs": obs})       # copied now: obs is reusable
      >>> writer.update_at(3, {"obs": obs})
      Traceback (most recent call last):
      ...
      IndexError: RolloutWriter.update_at: step 3 is outside the rollout ...
    """
    fn = "RolloutWriter.update_at"
    state = self._state
    if type(data) is not dict:   # a container of fields (a dict: as it is)
      data = _containers.as_values(fn, data)
    if type(step) is int and 0 <= step < state.num_steps:
      # The hot loop's case: the write checks alone (cached by signature;
      # the state's liveness is checked at the flush).
      _write_check.check_values(fn, state, data, (state.num_envs,),
                                "[E]", self._layout)
    else:
      concrete, _ = _buffer.prepare_step(fn, state, step, data)
      if concrete is None:
        raise TypeError(f"{fn}: `step` must be concrete (a Python int); "
                        "inside jit/scan use jr.update_at")
      step = concrete
    if not data:
      return
    queued = self._steps
    was_contiguous = contiguous = self._contiguous
    flat = self._flat
    for key, value in data.items():
      if isinstance(value, jax.core.Tracer) or key not in flat and any(
          isinstance(x, jax.core.Tracer)
          for x in jax.tree_util.tree_leaves(value)):
        raise TypeError(f"{fn}: got a traced value; the writer is for host "
                        "loops. Inside jit/scan use jr.update_at, which XLA "
                        "already performs in place")
      steps = queued.get(key)
      contiguous &= not steps or steps[-1] + 1 == step
    self._queue(step, data)
    self._contiguous = contiguous
    self._calls += 1
    if self._calls >= self._flush_every:
      try:
        self.flush()
      except BaseException:
        if self._calls:   # nothing was written: take this call back
          self._unqueue(data)
          self._contiguous = was_contiguous
          self._calls -= 1
        raise   # else the flush is done (a DonationWarning raised after it)

  def _queue(self, step: int, values: dict[str, ArrayLike]) -> None:
    """Adds one row per field; on an error takes back what it added."""
    queued, rows = self._steps, self._rows
    added = []
    try:
      for key, value in values.items():
        steps = queued.get(key)
        flat = key in self._flat
        if steps is None:   # the field's first row decides where rows go
          steps = []
          if isinstance(value, jax.Array) if flat else all(
              isinstance(x, jax.Array)
              for x in jax.tree_util.tree_leaves(value)):
            rows[key] = []
        run = rows.get(key)
        if run is None and flat:   # host rows: into the field's staging
          self._staging(key)[len(steps)] = value   # block, cast to its dtype
        elif run is None:   # a pytree field: each leaf into its leaf's block
          for block, v in zip(jax.tree_util.tree_leaves(self._staging(key)),
                              jax.tree_util.tree_leaves(value)):
            block[len(steps)] = v
        elif flat:   # JAX rows, held; a host value is copied now
          run.append(value if isinstance(value, jax.Array)
                     else _buffer.host_copy(value, self._state.spec(key)[1]))
        else:   # a pytree field's rows, held (host leaves copied now)
          run.append(jax.tree_util.tree_map(
              lambda v, b: v if isinstance(v, jax.Array)
              else _buffer.host_copy(v, np.dtype(b.dtype)), value,
              self._state.data[key]))
        steps.append(step)
        queued[key] = steps
        added.append(key)
    except BaseException:
      self._unqueue(added)
      for key in values:   # a key whose first row failed
        if key not in queued:
          rows.pop(key, None)
      raise

  def _staging(self, key: str) -> np.ndarray:
    """Key's staging block ``[flush_every, E, *shape]`` in the current set,
    once the last flush that read this set is done."""
    done = self._done[self._set]
    if done is not None:
      done.block_until_ready()
      self._done[self._set] = None
    blocks = self._blocks[self._set]
    block = blocks.get(key)
    if block is None:
      storage = self._state.data[key]   # a pytree field: a block per leaf
      block = blocks[key] = jax.tree_util.tree_map(
          lambda x: _buffer.aligned_empty(
              (self._flush_every, *x.shape[1:]), x.dtype), storage)
    return block

  def _unqueue(self, keys) -> None:
    """Takes back the last row queued for each of ``keys``."""
    for key in keys:
      steps = self._steps[key]
      steps.pop()
      if key in self._rows:
        self._rows[key].pop()
      if not steps:
        del self._steps[key]
        self._rows.pop(key, None)

  def flush(self) -> None:
    """Writes every queued step into the state now (one dispatch).

    Example:
      >>> import numpy as np, jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
      >>> writer = jr.RolloutWriter(state)
      >>> writer.update_at(0, {"r": np.ones(2)})
      >>> writer.flush()
      >>> writer.pending, state.data["r"].is_deleted()   # written in place
      (0, True)
    """
    if not self._calls:
      return
    blocks = self._blocks[self._set]
    runs = {}
    for key in sorted(self._steps):   # the order jit flattens a dict in
      rows = self._rows.get(key)
      n = len(self._steps[key])
      runs[key] = (tuple(rows) if rows is not None
                   else jax.tree_util.tree_map(lambda b, n=n: b[:n],
                                               blocks[key]))
    steps = np.asarray([t for k in runs for t in self._steps[k]], np.int32)
    staged = len(runs) > len(self._rows)
    consumed = _checks.consumed_keys(self._state)
    if consumed:   # e.g. two writers given the same state: one flushed
      raise ValueError(
          f"RolloutWriter: the writer's state was consumed by another call "
          f"that donated it (the buffers of {consumed} are deleted): a "
          "second RolloutWriter, or update_at_inplace, was given the same "
          "state. Give each writer its own state (the one the other call "
          "returned, e.g. `writer.state`); nothing was written")

    def commit(state: RolloutState, done: Array | None) -> None:
      self._state = state
      if staged:   # the next flush stages into the other set
        self._done[self._set] = done
        self._set ^= 1
      self._calls = 0
      self._steps, self._rows, self._contiguous = {}, {}, True

    _buffer.write_inplace("RolloutWriter", self._state, steps, runs,
                          contiguous=self._contiguous, signal=staged,
                          commit=commit)

  def _commit(self, state: RolloutState, done: Array | None) -> None:
    del done   # a whole-rollout write reads no staging block
    self._state = state

  def update_all(self, data: dict[str, ArrayLike]) -> None:
    """Writes whole rollouts of some fields (``data[k]``: ``[T, E, *shape]``).

    Checked first (nothing changes on an error); then queued writes are
    flushed, so the order of writes is kept. Numpy arrays are copied.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
      >>> writer = jr.RolloutWriter(state)
      >>> writer.update_all({"r": np.ones((3, 2))})   # [T, E]
      >>> jr.write_counts(writer.state)["r"].per_step.tolist()
      [1, 1, 1]
    """
    fn = "RolloutWriter.update_all"
    s = self._state
    data = _containers.as_values(fn, data)
    _write_check.check_values(fn, s, data, (s.num_steps, s.num_envs),
                              "[T, E]", self._layout)
    self.flush()
    _buffer.write_all(fn, self._state, data, commit=self._commit)

  def finish_rollout(self, *, check: Check = "error") -> RolloutState:
    """``jr.finish_rollout`` of the flushed state; the writer goes on from it.

    Returns the state (storage as written, tracking reset) for the no-copy
    path (minibatch straight from it); it is consumed by the next write
    that flushes, so finish reading it first.

    Raises:
      IncompleteRolloutError: if the write check fails; nothing changes.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
      >>> writer = jr.RolloutWriter(state)
      >>> writer.update_all({"r": np.ones((3, 2))})
      >>> state = writer.finish_rollout()   # checked; minibatch from it
      >>> state.data["r"].shape, jr.write_counts(state)["r"].per_step.tolist()
      ((3, 2), [0, 0, 0])
    """
    _, self._state = _buffer.close("RolloutWriter.finish_rollout", self.state,
                                   check)
    return self._state

  def make_batch(self, *, check: Check = "error") -> Any:
    """``jr.make_batch`` of the flushed state; the writer keeps the reset state.

    Returns:
      ``{name: [E * T, *shape]}``, env-major, in new buffers (later writes
      do not touch it).

    Raises:
      IncompleteRolloutError: if the write check fails; nothing changes.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=2), "r")
      >>> writer = jr.RolloutWriter(state)
      >>> writer.update_all({"r": np.array([[0, 10], [1, 11]], np.float32)})
      >>> writer.make_batch()["r"].tolist()      # [E * T], env-major
      [0.0, 1.0, 10.0, 11.0]
      >>> jr.is_complete(writer.state).item()    # the next rollout starts
      False
    """
    batch, self._state = _buffer.close("RolloutWriter.make_batch", self.state,
                                       check, flatten=True)
    assert batch is not None
    return batch

