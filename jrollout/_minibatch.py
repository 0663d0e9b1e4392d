"""PRNG-keyed minibatches: row indices, one gather, an iterator, a scan.

A batch is ``{name: pytree of [L_k, ...]}`` (lengths may differ between
fields; ``N = max_k L_k``) or a ``RolloutState`` (the rows of its
``make_batch``, gathered from storage by ``jrollout._rows``). Minibatch
``j`` of an epoch takes the rows ``idx`` its plan gives (``jrollout._plan``)
and reads rows ``idx % L_k`` of field ``k``, so shorter fields wrap around,
as the original ``DictDataset`` did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout import _plan
from jrollout import _rows
from jrollout._types import Array, PRNGKey, PyTree, Remainder

Gather = Callable[[dict[str, PyTree], Array], dict[str, PyTree]]


def minibatch_indices(key: PRNGKey | None, num_rows: int, batch_size: int, *,
                      shuffle: bool = True, epoch: Array | int = 0,
                      remainder: Remainder = "error") -> Array:
  """The row indices of every minibatch of one epoch.

  Args:
    key: a PRNG key (``jax.random.key``); may be None when not shuffling.
    num_rows: N, the number of rows (the longest field's length).
    batch_size: B; it must divide N unless ``remainder`` says otherwise.
    shuffle: draw the order from ``key``; else ``0..N-1`` in order.
    epoch: which epoch of ``key``, an int in ``[0, 2**31)`` or a traced
      integer scalar: epoch ``e`` of ``scan_minibatches`` and
      ``minibatches`` uses these rows.
    remainder: ``"error"`` (default: B must divide N), ``"drop"`` (``M = N //
      B``, the last ``N % B`` rows of the order unused) or ``"wrap"`` (``M =
      ceil(N / B)``, the last minibatch completed with the first rows of the
      order). The order itself does not depend on B or the mode.

  Returns:
    ``[M, B] int32``; row ``j`` is minibatch ``j``. With the default, each
    epoch's rows are a permutation of ``range(N)``.

  Raises:
    TypeError: N or B is not an int, ``shuffle`` is not a bool, ``key`` is
      not a PRNG key, or ``epoch`` is not an integer (a bool or a float).
    ValueError: N or B is not positive, ``N >= 2**31``, ``B > N``, (with
      ``remainder="error"``) B does not divide N (the message names the
      nearest valid batch sizes), or a concrete ``epoch`` is negative.

  Example:
    >>> import jrollout as jr
    >>> jr.minibatch_indices(None, 5, 2, shuffle=False, remainder="wrap")
    Array([[0, 1],
           [2, 3],
           [4, 0]], dtype=int32)
  """
  fn = "minibatch_indices"
  plan = _plan.plan(fn, num_rows, batch_size, key=key, shuffle=shuffle,
                    remainder=remainder)
  return _plan.epoch_indices(plan, key, _checks.check_epoch(fn, epoch))


@functools.partial(jax.jit, static_argnums=0)
def _take(gather: Gather, data: dict[str, PyTree], idx: Array):
  return gather(data, idx)


def gather_rows(gather: Gather, data: dict[str, PyTree], idx: Array
                ) -> dict[str, PyTree]:
  """``take``'s jitted gather without its index check: for ``[B] int32``
  indices known to be in ``[0, N)`` (a plan's, as ``compat.DictDataset``
  holds), so that no index is read back to the host."""
  return _take(gather, data, idx)


def take(batch: Any, idx: Array) -> dict[str, PyTree]:
  """One minibatch: ``{k: batch[k][idx % len(batch[k])]}``.

  A RolloutState gives what its ``make_batch`` batch gives, for every
  index. ``N = max_k L_k`` (``E * T`` for a state).

  Args:
    batch: ``{name: pytree of [L_k, ...]}``, or a RolloutState (rows in the
      env-major order of ``make_batch``, gathered from storage).
    idx: integer indices in ``[0, N)``, e.g. ``[B]``: one row of
      ``minibatch_indices``. Concrete indices (Python, numpy, JAX) outside
      ``[0, N)`` are refused; traced ones (under ``jit`` or ``vmap``) are
      read modulo N, then modulo ``L_k`` per field.

  Returns:
    ``{name: pytree of [*idx.shape, ...]}``.

  Raises:
    TypeError: ``idx`` is not integers (floats, bools); ``batch`` is
      neither a dict nor a RolloutState, has a key that is not a str (at
      any depth), or a leaf that is not an array of numbers (a str, a
      numpy array of str or objects).
    IndexError: concrete indices outside ``[0, N)``.
    ValueError: an empty batch, mismatched leading shapes within a key, a
      stack of states or a consumed state.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> batch = {"x": np.arange(6), "y": np.arange(10, 13)}   # L_k = 6 and 3
    >>> mb = jr.take(batch, np.array([1, 4]))
    >>> mb["x"].tolist(), mb["y"].tolist()          # y's rows are idx % 3
    ([1, 4], [11, 11])
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "t")
    >>> steps = np.array([[0, 10], [1, 11], [2, 12]], np.float32)  # [T, E]
    >>> state = jr.update_all(state, {"t": steps})
    >>> jr.take(state, np.array([0, 3, 5]))["t"].tolist()   # row e * T + t
    [0.0, 10.0, 12.0]
  """
  layout, data, lengths = _rows.rows("take", batch)
  idx = _checks.check_indices("take", "idx", idx, max(lengths.values()))
  return _take(layout, data, idx)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _take_one(gather: Gather, plan: _plan.Plan, data: dict[str, PyTree],
              key: PRNGKey | None, epoch_j: Array) -> dict[str, PyTree]:
  """Minibatch ``epoch_j = [e, j]``, computing only its own B rows."""
  return gather(data, plan.minibatch(key, epoch_j[0], epoch_j[1]))


def iterate(gather: Gather, plan: _plan.Plan, key: PRNGKey | None,
            data: dict[str, PyTree]) -> Iterator[dict[str, PyTree]]:
  """Generator of ``gather(data, rows)`` for every minibatch, in order."""
  for epoch in range(plan.num_epochs):
    for j in range(plan.num_batches):
      yield _take_one(gather, plan, data, key,
                      np.array([epoch, j], np.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2),
                   static_argnames=("name",))
def scan(gather: Gather, fn: Callable[[Any, Any], tuple[Any, Any]],
         plan: _plan.Plan, carry: Any, key: PRNGKey | None,
         data: dict[str, PyTree], *,
         name: str = "scan_minibatches_sharded") -> tuple[Any, Any]:
  """``fn`` over ``gather(data, rows)`` for every minibatch of every epoch.

  Jitted with ``gather``, ``fn``, ``plan`` and ``name`` static, so eager
  calls with the same ``fn`` compile once. Used by the flat, sequence and
  sharded scans; ``name``, the public function, names the error raised at
  trace time when ``fn`` does not return a ``(carry, out)`` pair.

  Two nested ``lax.scan``: epochs outside, each computing its own ``[M, B]``
  rows (``plan.epoch_indices``), minibatches inside. That is the pure-JAX
  PPO idiom's loop structure, which keeps XLA:CPU from spinning its thread
  pool over the minibatch body (benchmarks/notes/findings.md, "PPO on a
  multi-core CPU").
  """
  def step(c, rows):
    return _checks.check_step_output(name, "fn", fn(c, gather(data, rows)))

  def epoch(carry, e):
    return lax.scan(step, carry, plan.epoch_indices(key, e))

  return lax.scan(epoch, carry,
                  jnp.arange(plan.num_epochs, dtype=jnp.int32))


def _request(fn: str, key: PRNGKey | None, batch: Any, batch_size: Any,
             shuffle: bool, num_epochs: Any, remainder: Any):
  """``(gather, plan, data)`` of a flat minibatch call, validated."""
  layout, data, lengths = _rows.rows(fn, batch)
  plan = _plan.plan(fn, max(lengths.values()), batch_size, key=key,
                    shuffle=shuffle, num_epochs=num_epochs,
                    remainder=remainder)
  return layout, plan, data


def minibatches(key: PRNGKey | None, batch: Any, batch_size: int, *,
                num_epochs: int = 1, shuffle: bool = True,
                remainder: Remainder = "error") -> Iterator[dict[str, PyTree]]:
  """Iterates over the minibatches of ``num_epochs`` epochs.

  Each minibatch is gathered by one jit-compiled call (compiled once per
  shape: further epochs and rollouts of the same shapes compile nothing).
  Minibatch ``j`` of epoch ``e`` is ``take(batch, minibatch_indices(key, N,
  B, shuffle=shuffle, epoch=e, remainder=remainder)[j])``.

  Args:
    key: a PRNG key; may be None when ``shuffle=False``.
    batch: ``{name: pytree of [L_k, ...]}`` or a RolloutState.
    batch_size: B; it must divide ``N = max_k L_k`` unless ``remainder``
      says otherwise.
    shuffle: shuffle the rows with an order drawn from ``key``.
    num_epochs: how many epochs, each with its own order.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"`` (``minibatch_indices``).

  Yields:
    ``{name: pytree of [B, ...]}``.

  Raises:
    ValueError, TypeError: at the call (before the first minibatch) for an
      empty batch, a zero-length or scalar array, mismatched leading shapes
      within a key, a bad batch size, a key that is not a str or a leaf that
      is not an array of numbers (``take``).

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> batch = {"x": np.arange(6), "y": np.arange(10, 13)}   # L_k = 6 and 3
    >>> for mb in jr.minibatches(None, batch, 4, shuffle=False,
    ...                          remainder="wrap"):   # M = ceil(6 / 4)
    ...   print(mb["x"].tolist(), mb["y"].tolist())
    [0, 1, 2, 3] [10, 11, 12, 10]
    [4, 5, 0, 1] [11, 12, 10, 11]
    >>> mbs = list(jr.minibatches(jax.random.key(0), batch, 3, num_epochs=2))
    >>> len(mbs), sorted(np.concatenate([m["x"] for m in mbs[2:]]).tolist())
    (4, [0, 1, 2, 3, 4, 5])
    >>> all((m["y"] == m["x"] % 3 + 10).all() for m in mbs)  # shuffled, wrapped
    True
  """
  gather, plan, data = _request("minibatches", key, batch, batch_size,
                                shuffle, num_epochs, remainder)
  return iterate(gather, plan, key, data)


def scan_minibatches(fn: Callable[[Any, dict[str, PyTree]], tuple[Any, Any]],
                     carry: Any, key: PRNGKey | None, batch: Any,
                     batch_size: int, *, num_epochs: int = 1,
                     shuffle: bool = True,
                     remainder: Remainder = "error") -> tuple[Any, Any]:
  """Runs ``fn(carry, minibatch) -> (carry, out)`` over every minibatch.

  All ``num_epochs * M`` minibatches run inside one compiled loop nest
  (epochs, then minibatches; usable inside the caller's ``jit``); epoch
  ``e`` uses the rows
  ``minibatch_indices(key, N, B, shuffle=shuffle, epoch=e,
  remainder=remainder)``, the same as ``minibatches``. Each minibatch is
  gathered inside the scan body, so no shuffled copy of the batch is
  materialised.

  Args:
    fn: the update, ``(carry, {name: [B, ...]}) -> (carry, out)``.
    carry: the initial carry (e.g. the train state).
    key: a PRNG key; may be None when ``shuffle=False``.
    batch: ``{name: pytree of [L_k, ...]}`` or a RolloutState.
    batch_size: B; it must divide N unless ``remainder`` says otherwise.
    num_epochs: the number of epochs, each with a fresh order.
    shuffle: shuffle the rows.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"`` (``minibatch_indices``).

  Returns:
    ``(carry, outs)`` with every leaf of ``outs`` stacked to
    ``[num_epochs, M, ...]``.

  Raises:
    TypeError: at the call, as ``minibatches``, or if ``fn`` is not a
      function or the carry holds something other than arrays and numbers;
      at trace time, if ``fn`` does not return a ``(carry, out)`` pair (the
      message says what it returned).
    ValueError: at the call, as ``minibatches``.

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> batch = {"r": np.arange(6, dtype=np.float32)}        # N = 6
    >>> def fn(total, mb):                      # mb["r"]: [B]
    ...   return total + mb["r"].sum(), mb["r"].sum()
    >>> total, outs = jr.scan_minibatches(fn, np.float32(0), jax.random.key(0),
    ...                                   batch, 2, num_epochs=3)
    >>> float(total), outs.shape                # outs: [num_epochs, M]
    (45.0, (3, 3))
    >>> outs.sum(axis=1).tolist()               # every row once per epoch
    [15.0, 15.0, 15.0]
  """
  name = "scan_minibatches"
  _checks.check_callable(name, "fn", fn)
  _checks.check_arrays(name, "carry", carry)
  gather, plan, data = _request(name, key, batch, batch_size, shuffle,
                                num_epochs, remainder)
  return scan(gather, fn, plan, carry, key, data, name=name)
