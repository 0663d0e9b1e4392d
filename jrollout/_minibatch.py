"""PRNG-keyed minibatches with the original DictDataset's modulo-wrap semantics.

A batch is ``{key: pytree}`` whose leaves share a leading length ``L_k``
within each key; lengths may differ between keys. With ``N = max_k L_k``
and a batch size ``B`` dividing ``N``, an epoch has ``M = N // B``
minibatches; with an order ``p`` (a keyed permutation of ``range(N)``, the
identity when ``shuffle=False``) minibatch ``j`` uses ``idx = p[j*B:(j+1)*B]``
and takes rows ``idx % L_k`` from every leaf of key ``k``, so shorter arrays
wrap around.

A ``RolloutState`` is accepted wherever a batch is: its rows are the
env-major rows of ``make_batch`` (row ``i`` is step ``i % T`` of env
``i // T``), gathered straight from the ``[T, E, ...]`` storage without
materialising the flattened batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout import _permute
from jrollout._state import RolloutState
from jrollout._types import Array, PRNGKey, PyTree


def _divisors_near(n: int, b: int) -> tuple[int | None, int | None]:
  below = next((d for d in range(min(b, n), 0, -1) if n % d == 0), None)
  above = next((d for d in range(b + 1, n + 1) if n % d == 0), None)
  return below, above


def check_batch_size(fn: str, num_rows: int, batch_size: Any,
                     what: str = "N", arg: str = "batch_size") -> int:
  """Validates ``batch_size`` against ``num_rows``; returns it as an int."""
  if isinstance(batch_size, bool) or not isinstance(
      batch_size, (int, np.integer)):
    raise TypeError(f"{fn}: `{arg}` must be an int, got "
                    f"{type(batch_size).__name__} {batch_size!r}")
  batch_size = int(batch_size)
  if batch_size <= 0:
    raise ValueError(f"{fn}: `{arg}` must be positive, got {batch_size}")
  if batch_size > num_rows:
    raise ValueError(
        f"{fn}: `{arg}` {batch_size} is larger than the number of rows "
        f"{what} = {num_rows}; use a batch size of at most {num_rows}")
  if num_rows % batch_size:
    below, above = _divisors_near(num_rows, batch_size)
    near = " or ".join(str(d) for d in (below, above) if d is not None)
    raise ValueError(
        f"{fn}: `{arg}` {batch_size} does not divide the number of rows "
        f"{what} = {num_rows} ({num_rows} % {batch_size} = "
        f"{num_rows % batch_size}); the nearest valid batch sizes are {near}")
  return batch_size


def batch_lengths(fn: str, batch: Any) -> dict[str, int]:
  """``{key: L_k}`` of a batch dict or RolloutState, validated."""
  if isinstance(batch, RolloutState):
    if not batch.data:
      raise ValueError(f"{fn}: the RolloutState has no registered keys")
    n = batch.num_envs * batch.num_steps
    return {k: n for k in batch.data}
  if not isinstance(batch, Mapping):
    raise TypeError(f"{fn}: `batch` must be a dict {{key: array}} or a "
                    f"RolloutState, got {type(batch).__name__}")
  if not batch:
    raise ValueError(f"{fn}: `batch` is empty (no keys)")
  lengths = {}
  for key, value in batch.items():
    leaves = jax.tree_util.tree_leaves_with_path(value)
    if not leaves:
      raise ValueError(f"{fn}: key {key!r} holds no arrays")
    first_path, first = leaves[0]
    for path, leaf in leaves:
      shape = np.shape(leaf)
      if not shape:
        raise ValueError(
            f"{fn}: key {key!r}{jax.tree_util.keystr(path)} is a scalar; "
            "every array needs a leading row axis")
      if shape[0] != np.shape(first)[0]:
        raise ValueError(
            f"{fn}: key {key!r} has mismatched leading shapes: "
            f"{key!r}{jax.tree_util.keystr(first_path)} has "
            f"{np.shape(first)[0]} rows but "
            f"{key!r}{jax.tree_util.keystr(path)} has {shape[0]}")
    if np.shape(first)[0] == 0:
      raise ValueError(f"{fn}: key {key!r} has zero rows; every key needs at "
                       "least one")
    lengths[key] = np.shape(first)[0]
  return lengths


def check_key(fn: str, key: Any, shuffle: bool) -> None:
  """A key is required when shuffling."""
  if shuffle and key is None:
    raise ValueError(f"{fn}: `key` is None but shuffle=True; pass a PRNG key "
                     "(jax.random.key(seed)) or shuffle=False")


def _indices(key: PRNGKey | None, num_rows: int, batch_size: int,
             shuffle: bool, epoch: Array | int) -> Array:
  positions = jnp.arange(num_rows, dtype=jnp.int32)
  if shuffle:
    positions = _permute.permute(_permute.round_keys(key, epoch), positions,
                                 num_rows)
  return positions.reshape(num_rows // batch_size, batch_size)


def minibatch_indices(key: PRNGKey | None, num_rows: int, batch_size: int, *,
                      shuffle: bool = True, epoch: Array | int = 0) -> Array:
  """The row indices of every minibatch of one epoch.

  Args:
    key: a PRNG key (``jax.random.key``); may be None when not shuffling.
    num_rows: N, the number of rows (the longest key's length).
    batch_size: B, which must divide N.
    shuffle: draw the order from ``key``; else ``0..N-1`` in order.
    epoch: which epoch of ``key`` (an int or traced int scalar): epoch ``e``
      of ``scan_minibatches`` and ``minibatches`` uses these rows.

  Returns:
    ``[M, B] int32`` with ``M = N // B``; row ``j`` is minibatch ``j``. Each
    epoch's rows are a permutation of ``range(N)``.

  Raises:
    ValueError: B is not positive, larger than N, or does not divide N (the
      message names the nearest valid batch sizes).
  """
  num_rows = int(num_rows)
  if num_rows <= 0:
    raise ValueError(f"minibatch_indices: `num_rows` must be positive, got "
                     f"{num_rows}")
  batch_size = check_batch_size("minibatch_indices", num_rows, batch_size)
  check_key("minibatch_indices", key, shuffle)
  return _indices_jit(key, num_rows, batch_size, shuffle, epoch)


_indices_jit = jax.jit(_indices, static_argnums=(1, 2, 3))


def _gather(leaf: Array, rows: Array) -> Array:
  return jnp.asarray(leaf).at[rows].get(mode="promise_in_bounds")


def _take(batch: Any, idx: Array) -> dict[str, PyTree]:
  if isinstance(batch, RolloutState):
    t, e = batch.num_steps, batch.num_envs
    flat = (idx % t) * e + idx // t   # env-major row -> [T*E] storage row
    return {k: _gather(v.reshape(t * e, *v.shape[2:]), flat)
            for k, v in batch.data.items()}
  out = {}
  for key, value in batch.items():
    length = jax.tree_util.tree_leaves(value)[0].shape[0]
    rows = idx % length
    out[key] = jax.tree_util.tree_map(lambda x, rows=rows: _gather(x, rows),
                                      value)
  return out


def take(batch: Any, idx: Array) -> dict[str, PyTree]:
  """One minibatch: ``{k: batch[k][idx % len(batch[k])]}``.

  Args:
    batch: ``{key: pytree of [L_k, ...]}``, or a RolloutState (rows in the
      env-major order of ``make_batch``, gathered from storage).
    idx: integer indices, e.g. ``[B]``: one row of ``minibatch_indices``.
      Must be non-negative.

  Returns:
    ``{key: pytree of [*idx.shape, ...]}``.
  """
  batch_lengths("take", batch)
  idx = jnp.asarray(idx)
  if not jnp.issubdtype(idx.dtype, jnp.integer):
    raise TypeError(f"take: `idx` must be integers, got {idx.dtype}")
  return _take_jit(batch, idx.astype(jnp.int32))


_take_jit = jax.jit(_take)


def check_num_epochs(fn: str, num_epochs: Any) -> int:
  """A positive Python int."""
  return _checks.check_positive_int(fn, "num_epochs", num_epochs)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _take_one(gather, batch, key, epoch_j, num_rows, batch_size, shuffle):
  """Minibatch ``epoch_j = [e, j]``, computing only its own B positions."""
  epoch, j = epoch_j[0], epoch_j[1]
  positions = j * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
  if shuffle:
    positions = _permute.permute(_permute.round_keys(key, epoch), positions,
                                 num_rows)
  return gather(batch, positions)


def iterate(gather, key, batch, num_rows, batch_size, shuffle, num_epochs):
  """Generator of ``gather(batch, rows)`` for every minibatch, in order."""
  for epoch in range(num_epochs):
    for j in range(num_rows // batch_size):
      yield _take_one(gather, batch, key, np.array([epoch, j], np.int32),
                      num_rows, batch_size, shuffle)


@functools.partial(jax.jit, static_argnums=(0, 1, 5, 6, 7, 8))
def scan(gather, fn, carry, key, batch, num_rows, batch_size, shuffle,
         num_epochs):
  """``lax.scan`` of ``fn`` over ``gather(batch, rows)`` for every minibatch.

  Jitted with ``fn`` static, so calling it eagerly twice with the same ``fn``
  compiles once (a new lambda per call would recompile every time).
  """
  num_batches = num_rows // batch_size
  idx = jax.vmap(lambda e: _indices(key, num_rows, batch_size, shuffle, e))(
      jnp.arange(num_epochs, dtype=jnp.int32))
  idx = idx.reshape(num_epochs * num_batches, batch_size)
  carry, outs = lax.scan(lambda c, rows: fn(c, gather(batch, rows)), carry,
                         idx)
  outs = jax.tree_util.tree_map(
      lambda o: o.reshape(num_epochs, num_batches, *o.shape[1:]), outs)
  return carry, outs


def minibatches(key: PRNGKey | None, batch: Any, batch_size: int, *,
                shuffle: bool = True,
                num_epochs: int = 1) -> Iterator[dict[str, PyTree]]:
  """Iterates over the minibatches of ``num_epochs`` epochs.

  Each minibatch is gathered by one jit-compiled call (compiled once per
  shape: further epochs and rollouts of the same shapes compile nothing).
  Minibatch ``j`` of epoch ``e`` is
  ``take(batch, minibatch_indices(key, N, B, shuffle=shuffle, epoch=e)[j])``.

  Args:
    key: a PRNG key; may be None when ``shuffle=False``.
    batch: ``{key: pytree of [L_k, ...]}`` or a RolloutState.
    batch_size: B, which must divide ``N = max_k L_k``.
    shuffle: shuffle the rows with an order drawn from ``key``.
    num_epochs: how many epochs, each with its own order.

  Yields:
    ``{key: pytree of [B, ...]}``.

  Raises:
    ValueError, TypeError: at the call (before the first minibatch) for an
      empty batch, a zero-length or scalar array, mismatched leading shapes
      within a key, or a bad batch size.
  """
  num_rows = max(batch_lengths("minibatches", batch).values())
  batch_size = check_batch_size("minibatches", num_rows, batch_size)
  check_key("minibatches", key, shuffle)
  num_epochs = check_num_epochs("minibatches", num_epochs)
  return iterate(_take, key, batch, num_rows, batch_size, shuffle,
                 num_epochs)


def scan_minibatches(fn: Callable[[Any, dict[str, PyTree]], tuple[Any, Any]],
                     carry: Any, key: PRNGKey | None, batch: Any,
                     batch_size: int, *, num_epochs: int = 1,
                     shuffle: bool = True) -> tuple[Any, Any]:
  """Runs ``fn(carry, minibatch) -> (carry, out)`` over every minibatch.

  All ``num_epochs * M`` minibatches run inside one ``lax.scan`` (usable
  inside the caller's ``jit``); epoch ``e`` uses the rows
  ``minibatch_indices(key, N, B, shuffle=shuffle, epoch=e)``, the same as
  ``minibatches``. Each minibatch is gathered inside the scan body, so no
  shuffled copy of the batch is materialised.

  Args:
    fn: the update, ``(carry, {key: [B, ...]}) -> (carry, out)``.
    carry: the initial carry (e.g. the train state).
    key: a PRNG key; may be None when ``shuffle=False``.
    batch: ``{key: pytree of [L_k, ...]}`` or a RolloutState.
    batch_size: B, which must divide N.
    num_epochs: the number of epochs, each with a fresh order.
    shuffle: shuffle the rows.

  Returns:
    ``(carry, outs)`` with every leaf of ``outs`` stacked to
    ``[num_epochs, M, ...]``.
  """
  num_rows = max(batch_lengths("scan_minibatches", batch).values())
  batch_size = check_batch_size("scan_minibatches", num_rows, batch_size)
  check_key("scan_minibatches", key, shuffle)
  num_epochs = check_num_epochs("scan_minibatches", num_epochs)
  return scan(_take, fn, carry, key, batch, num_rows, batch_size, shuffle,
              num_epochs)
