"""PRNG-keyed minibatches of rows or sequences: indices, take, iterator, scan.

A batch is ``{name: pytree of [L_k, ...]}`` (``N = max_k L_k``; field ``k``
reads row ``i % L_k``, so shorter fields wrap around) or a ``RolloutState``
(the env-major rows of its ``make_batch``, gathered from storage). With
``seq_len=L`` the units shuffled are time-major chunks of a ``[T, E, ...]``
batch instead: chunk ``s`` is env ``s // C``, steps ``[c*L, (c+1)*L)`` with
``c = s % C``, ``C = T // L`` (``L = T``: whole rollouts), so a recurrent
policy replays each chunk in time order. With ``mesh=`` the scan runs
data-parallel (``jrollout._sharding``). Which rows each minibatch takes:
``jrollout._plan``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import dataclasses
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout import _plan
from jrollout import _rows
from jrollout import _sharding
from jrollout._types import Array, AxisName, PRNGKey, PyTree, Remainder
from jrollout._types import ShardMode


@dataclasses.dataclass(frozen=True)
class ChunkRows(_rows.RolloutRows):
  """``{name: pytree of [T, E, ...]}`` read as chunks of ``L`` steps.

  Gathered straight from the ``[C, L, E, ...]`` view of each leaf (a free
  reshape): one XLA gather per leaf, written time-major, no copy. Sharded
  as a rollout is: each device, its ``E / D`` envs.
  """

  seq_len: int

  def gather(self, batch: dict[str, PyTree], idx: Array
             ) -> dict[str, PyTree]:
    """``out[l, *i] = batch[c*L + l, e]`` for chunk ``idx[*i]`` in ``[0,
    S)``: leaves ``[L, *idx.shape, ...]``."""
    length = self.seq_len
    num_chunks = self.num_steps // length
    starts = jnp.stack([idx % num_chunks, idx // num_chunks], axis=-1)
    n = idx.ndim

    def leaf(x):
      x = jnp.asarray(x)
      rest = x.shape[2:]
      view = x.reshape(num_chunks, length, x.shape[1], *rest)
      dims = lax.GatherDimensionNumbers(
          offset_dims=(0,) + tuple(range(n + 1, n + 1 + len(rest))),
          collapsed_slice_dims=(0, 2), start_index_map=(0, 2))
      return lax.gather(view, starts, dims, (1, length, 1, *rest),
                        mode="promise_in_bounds")

    return jax.tree_util.tree_map(leaf, dict(batch))


def _layout(fn: str, batch: Any, seq_len: Any):
  """``(layout, data, lengths, S, what)`` of a batch: its rows (``seq_len``
  None; ``lengths`` ``{name: L_k}``) or its chunks (``lengths`` None)."""
  if seq_len is None:
    layout, data, lengths = _rows.rows(fn, batch)
    return layout, data, lengths, max(lengths.values()), "N"
  container, data, (num_steps, num_envs) = _rows.env_rows(fn, batch)
  length = _checks.positive_int(fn, "seq_len", seq_len)
  if num_steps % length:
    divisors = _plan.divisors(num_steps)
    valid = (", ".join(map(str, divisors.tolist())) if divisors.size <= 12
             else f"the {divisors.size} divisors of T, nearest "
             f"{_plan.nearest(num_steps, length)}")
    raise ValueError(
        f"{fn}: `seq_len` {length} does not divide the rollout length T = "
        f"{num_steps}; valid lengths are {valid} (T: whole rollouts)")
  chunks = ChunkRows(num_steps, num_envs, length, container=container)
  what = "E" if length == num_steps else "S = E * T / seq_len"
  return chunks, data, None, num_envs * (num_steps // length), what


def _some(values: np.ndarray) -> str:
  """The first few values, for messages: ``[5, 7]``, ``[1, 2, 3, 4, ...]``."""
  head = ", ".join(str(v) for v in values[:4].tolist())
  return f"[{head}{', ...' if values.size > 4 else ''}]"


def _indices(fn: str, idx: Any, num: int) -> Array:
  """``idx`` as int32 in ``[0, num)``: checked if concrete, else ``% num``."""
  if isinstance(idx, jax.core.Tracer):
    if not jnp.issubdtype(idx.dtype, jnp.integer):
      raise TypeError(f"{fn}: `idx` must be integers, got {idx.dtype}")
    if jnp.iinfo(idx.dtype).bits < 32:   # num may not fit int8 or int16
      idx = idx.astype(jnp.int32)
    return (idx % num).astype(jnp.int32)
  try:
    arr = np.asarray(idx)
  except (TypeError, ValueError) as e:   # e.g. a ragged list
    raise TypeError(f"{fn}: `idx` must be an integer array, got "
                    f"{type(idx).__name__} ({e})") from None
  if not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{fn}: `idx` must be integers, got "
                    f"{arr.dtype.name} {_some(arr.ravel())}")
  bad = (arr < 0) | (arr >= num)
  if bad.any():
    raise IndexError(
        f"{fn}: `idx` must be in [0, {num}), got {_some(arr[bad])} "
        f"({int(bad.sum())} out of range); under jit, traced indices are "
        f"read modulo {num}")
  if isinstance(idx, jax.Array) and idx.dtype == jnp.int32:
    return idx
  return jnp.asarray(arr.astype(np.int32, copy=False))


def _no_mesh(fn: str, **options: Any) -> None:
  """Refuses the sharding options given without their ``mesh`` (or D)."""
  given = [k for k, v in options.items()
           if v is not None and v not in ("local", True)]
  if given:
    raise ValueError(f"{fn}: `{given[0]}` applies to sharded minibatches "
                     "only; pass `mesh=` (or `num_shards=` for "
                     "minibatch_indices) as well, or leave it out")


def minibatch_indices(key: PRNGKey | None, num_rows: int, batch_size: int, *,
                      shuffle: bool = True, remainder: Remainder = "error",
                      epoch: Array | int = 0, num_shards: int | None = None,
                      mode: ShardMode = "local") -> Array:
  """The row indices of every minibatch of one epoch.

  ``minibatches`` and ``scan_minibatches`` (rows, or sequences with N = S)
  use these rows in epoch ``epoch``; with ``num_shards=D``, those of
  ``scan_minibatches(..., mesh=)`` on D devices.

  Args:
    key: a PRNG key (``jax.random.key``); may be None when not shuffling.
    num_rows: N, the number of rows (the longest field's length).
    batch_size: B; it must divide N unless ``remainder`` says otherwise.
    shuffle: draw the order from ``key``; else ``0..N-1`` in order.
    remainder: ``"error"`` (B must divide N), ``"drop"`` (``M = N // B``,
      the last ``N % B`` rows of the order unused) or ``"wrap"`` (``M =
      ceil(N / B)``, the last minibatch completed with the first rows of
      the order). The order does not depend on B or the mode.
    epoch: an int in ``[0, 2**31)`` or a traced integer scalar.
    num_shards: D devices, each taking ``B / D`` rows of every minibatch.
    mode: with ``num_shards``, ``"local"`` (device ``d`` minibatches its
      own ``N / D`` rows with the key ``fold_in(key, d)``) or ``"global"``
      (each one-device minibatch split into D consecutive parts).

  Returns:
    ``[M, B] int32`` (row ``j``: minibatch ``j``), or ``[D, M, B/D]``
    global rows per device with ``num_shards``.

  Raises:
    TypeError: N, B or D not an int, ``shuffle`` not a bool, ``key`` not a
      PRNG key, ``epoch`` not an integer.
    ValueError: N, B or D not positive, ``N >= 2**31``, ``B > N``, B not
      dividing N with ``remainder="error"`` (naming the nearest valid
      sizes), D not dividing N or B, an unknown mode, a negative epoch.

  Example:
    >>> import jrollout as jr
    >>> jr.minibatch_indices(None, 5, 2, shuffle=False, remainder="wrap")
    Array([[0, 1],
           [2, 3],
           [4, 0]], dtype=int32)
    >>> jr.minibatch_indices(None, 8, 4, shuffle=False, num_shards=2,
    ...                      mode="global").tolist()       # [D, M, B/D]
    [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
  """
  fn = "minibatch_indices"
  if num_shards is None:
    _no_mesh(fn, mode=mode)
  else:
    num_shards = _checks.positive_int(fn, "num_shards", num_shards)
    _sharding.check_mode(fn, mode)
  plan = _plan.plan(fn, num_rows, batch_size, key=key, shuffle=shuffle,
                    remainder=remainder, num_shards=num_shards,
                    axis="(num_shards)")
  epoch = _plan.check_epoch(fn, epoch)
  return _plan.indices(plan, key, epoch, num_shards, mode)


def take(batch: Any, idx: Array, *, seq_len: int | None = None) -> Any:
  """Some rows of a batch, or (with ``seq_len``) some of its sequences.

  Rows: ``{k: batch[k][idx % L_k]}`` (a RolloutState gives what its
  ``make_batch`` batch gives). Sequences of ``[T, E, ...]`` leaves:
  ``out[l, b] = batch[c*L + l, e]`` for chunk ``idx[b] = e*C + c``.

  Args:
    batch: ``{name: pytree of [L_k, ...]}``; with ``seq_len``, of ``[T, E,
      ...]``; or a RolloutState, read in place.
    idx: integer indices of any shape in ``[0, N)`` (``[0, S)``, ``S = E *
      T // L``), e.g. a row of ``minibatch_indices``. Concrete ones outside
      are refused; traced ones are read modulo N (S).
    seq_len: L, a divisor of T; None for rows.

  Returns:
    ``{name: pytree of [*idx.shape, ...]}``, or ``[L, *idx.shape, ...]``
    with ``seq_len``, in the batch's container type if it has one.

  Raises:
    TypeError: ``idx`` not integers; ``batch`` not a dict or RolloutState,
      a key that is not a str, a leaf that is not an array of numbers.
    IndexError: concrete indices out of range.
    ValueError: an empty batch or field, mismatched leading shapes,
      ``seq_len`` not dividing T (the message lists the valid lengths).

  Example:
    >>> import numpy as np, jrollout as jr
    >>> mb = jr.take({"x": np.arange(6), "y": np.arange(10, 13)},
    ...              np.array([1, 4]))
    >>> mb["x"].tolist(), mb["y"].tolist()          # y's rows are idx % 3
    ([1, 4], [11, 11])
    >>> seqs = {"v": np.arange(4)[:, None] + 10 * np.arange(3)}  # [T=4, E=3]
    >>> # L = 2, C = 2: chunk 1 is env 0, steps 2-3; chunk 4 is env 2, steps 0-1
    >>> jr.take(seqs, np.array([1, 4]), seq_len=2)["v"].tolist()
    [[2, 20], [3, 21]]
  """
  layout, data, _, num, _ = _layout("take", batch, seq_len)
  idx = _indices("take", idx, num)
  return _plan.gather(layout, None, data, None, idx)


def minibatches(key: PRNGKey | None, batch: Any, batch_size: int, *,
                num_epochs: int = 1, shuffle: bool = True,
                remainder: Remainder = "error",
                seq_len: int | None = None) -> Iterator[Any]:
  """Iterates over the minibatches of ``num_epochs`` epochs.

  Minibatch ``j`` of epoch ``e`` is ``take(batch, minibatch_indices(key,
  N, B, shuffle=shuffle, remainder=remainder, epoch=e)[j],
  seq_len=seq_len)`` (N is S with ``seq_len``), gathered by one jitted call
  compiled once per shape.

  Args:
    key: a PRNG key; may be None when ``shuffle=False``.
    batch: as ``take``'s.
    batch_size: B, rows (or sequences) per minibatch; it must divide N
      unless ``remainder`` says otherwise.
    num_epochs: how many epochs, each with its own order.
    shuffle: shuffle with an order drawn from ``key``.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"`` (``minibatch_indices``).
    seq_len: L: minibatches of B chunks of L steps (``seq_len=T``: whole
      rollouts); None for rows.

  Yields:
    ``{name: pytree of [B, ...]}``, or ``[L, B, ...]`` with ``seq_len``.

  Raises:
    ValueError, TypeError: at the call, as ``take`` and
      ``minibatch_indices``.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> batch = {"x": np.arange(6), "y": np.arange(10, 13)}   # L_k = 6 and 3
    >>> for mb in jr.minibatches(None, batch, 4, shuffle=False,
    ...                          remainder="wrap"):   # M = ceil(6 / 4)
    ...   print(mb["x"].tolist(), mb["y"].tolist())
    [0, 1, 2, 3] [10, 11, 12, 10]
    [4, 5, 0, 1] [11, 12, 10, 11]
  """
  fn = "minibatches"
  layout, data, _, num, what = _layout(fn, batch, seq_len)
  plan = _plan.plan(fn, num, batch_size, key=key, shuffle=shuffle,
                    num_epochs=num_epochs, remainder=remainder, what=what)
  return _plan.iterate(layout, plan, key, data)


def scan_minibatches(fn: Callable[[Any, Any], tuple[Any, Any]], carry: Any,
                     key: PRNGKey | None, batch: Any, batch_size: int, *,
                     num_epochs: int = 1, shuffle: bool = True,
                     remainder: Remainder = "error",
                     seq_len: int | None = None, mesh: Any = None,
                     axis_name: AxisName | None = None,
                     mode: ShardMode = "local",
                     check_vma: bool = True) -> tuple[Any, Any]:
  """Runs ``fn(carry, minibatch) -> (carry, out)`` over every minibatch.

  The minibatches of ``minibatches`` (same arguments, same order) in one
  compiled loop nest, epochs then minibatches, each gathered inside the loop
  body (no shuffled copy of the batch); usable inside the caller's ``jit``.

  With ``mesh``, ``fn`` runs data-parallel in one ``jax.shard_map`` over
  ``axis_name``, each of the D devices on ``B / D`` rows of every minibatch,
  and may use collectives over ``axis_name``. ``carry`` is replicated: every
  device must end each step with the same carry (differentiate
  ``jax.lax.pmean(loss, axis_name)`` to average gradients; with
  ``check_vma=False`` gradients are per-device, as under ``pmap``). In
  ``mode="local"`` device ``d`` runs exactly ``scan_minibatches(fn, carry,
  fold_in(key, d), shard_d, B // D)`` on its own rows (no data moves); in
  ``"global"`` the devices split the one-device minibatches, after an
  all-gather of the batch. ``minibatch_indices(..., num_shards=D,
  mode=mode)`` gives each device's rows. Inputs laid out by ``shard`` or
  ``shard_rows`` move no data; others are resharded first.

  Args:
    fn: the update, ``(carry, minibatch) -> (carry, out)``.
    carry: the initial carry (e.g. the train state).
    key, batch, batch_size, num_epochs, shuffle, remainder, seq_len: as
      ``minibatches``' (with ``mesh``, B is global and D must divide it;
      local mode applies ``remainder`` to each device's rows).
    mesh: a ``jax.sharding.Mesh``, to run data-parallel.
    axis_name: the mesh axis (or axes) the rows or envs are split over;
      None for a 1-D mesh's axis.
    mode: ``"local"`` or ``"global"``, with ``mesh``.
    check_vma: passed to ``jax.shard_map``, with ``mesh``.

  Returns:
    ``(carry, outs)``, the leaves of ``outs`` ``[num_epochs, M, ...]``; with
    ``mesh``, ``[D, num_epochs, M, ...]`` sharded ``P(axis_name)``.

  Raises:
    TypeError: as ``minibatches``; ``fn`` not a function, a carry of other
      than arrays and numbers; at trace time, ``fn`` not returning a
      ``(carry, out)`` pair.
    ValueError: as ``minibatches``; a length, E or B not divisible by D, an
      unknown mode or axis, a sharding option without ``mesh``, a carry
      that varies across devices (``check_vma=True``).

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> batch = {"r": np.arange(6, dtype=np.float32)}        # N = 6
    >>> def fn(total, mb):                      # mb["r"]: [B]
    ...   return total + mb["r"].sum(), mb["r"].sum()
    >>> total, outs = jr.scan_minibatches(fn, np.float32(0), jax.random.key(0),
    ...                                   batch, 2, num_epochs=3)
    >>> float(total), outs.shape, outs.sum(axis=1).tolist()  # [epochs, M]
    (45.0, (3, 3), [15.0, 15.0, 15.0])
  """
  name = "scan_minibatches"
  if not callable(fn):
    raise TypeError(f"{name}: `fn` must be a function (carry, minibatch) -> "
                    f"(carry, out), got {type(fn).__name__}")
  _checks.check_arrays(name, "carry", carry)
  axis = size = None
  if mesh is None:
    _no_mesh(name, axis_name=axis_name, mode=mode, check_vma=check_vma)
  else:
    axis, size = _sharding.axis(name, mesh, axis_name)
    _sharding.check_mode(name, mode)
    check_vma = _checks.check_bool(name, "check_vma", check_vma)
  layout, data, lengths, num, what = _layout(name, batch, seq_len)
  if mesh is not None:
    layout.check_shardable(name, lengths, size, axis)
  plan = _plan.plan(name, num, batch_size, key=key, shuffle=shuffle,
                    num_epochs=num_epochs, remainder=remainder, what=what,
                    num_shards=size, axis=axis)
  if mesh is None:
    return _plan.scan(layout, fn, plan, carry, key, data, name=name)
  assert axis is not None and size is not None   # set with the mesh
  return _sharding.scan(name, fn, carry, key, data, layout=layout,
                        plan=plan, mesh=mesh, axis_name=axis,
                        num_shards=size, mode=mode, check_vma=check_vma)
