"""Sequence minibatches for recurrent policies: time order kept.

Instead of shuffling rows, these functions shuffle and split whole sequences
of time-major arrays: one env's whole rollout (``seq_len=None``), or chunks
of ``L`` steps numbered env-major like rows (chunk ``s`` is env
``s // C``, steps ``[c*L, (c+1)*L)`` with ``c = s % C``, ``C = T // L``).
The hidden state a chunk starts from is data like any other (a field such as
``"carry"``, read as ``mb["carry"][0]``). Indices given to
``take_sequences`` follow ``take``'s rule for rows. The layout, with
pictures: docs/guides/sequences.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import dataclasses
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout import _minibatch
from jrollout import _plan
from jrollout import _rows
from jrollout._types import Array, PRNGKey, PyTree, Remainder


@dataclasses.dataclass(frozen=True)
class ChunkRows:
  """``{name: pytree of [T, E, ...]}`` cut into chunks of ``L`` steps.

  "Row" ``s`` is chunk ``s``: env ``s // C``, steps ``[c*L, (c+1)*L)`` with
  ``c = s % C`` and ``C = T // L``. Gathered straight from the ``[T, E, ...]``
  arrays (viewed as ``[C, L, E, ...]``, a free reshape): no copy of the batch.
  """

  num_steps: int
  seq_len: int

  def __call__(self, batch: dict[str, PyTree], idx: Array
               ) -> dict[str, PyTree]:
    """``out[l, *i] = batch[c*L + l, e]`` for the chunk ``idx[*i]``.

    Leaves ``[L, *idx.shape, ...]``; ``idx`` must be in ``[0, S)``. One XLA
    gather per leaf of ``Sb`` slices ``[L, ...]`` of the ``[C, L, E, ...]``
    view, written time-major: no transpose, no flattened copy.
    """
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


def _seq_len(fn: str, seq_len: Any, num_steps: int) -> int | None:
  """``seq_len`` validated; None when the sequences are whole rollouts."""
  if seq_len is None:
    return None
  length = _checks.positive_int(fn, "seq_len", seq_len)
  if num_steps % length:
    raise ValueError(
        f"{fn}: `seq_len` {length} does not divide the rollout length T = "
        f"{num_steps}; {_valid_lengths(num_steps, length)}, or None for "
        "whole rollouts")
  return None if length == num_steps else length


def _valid_lengths(num_steps: int, length: int) -> str:
  """The divisors of T for messages, in ``O(sqrt(T))``."""
  small = [d for d in range(1, math.isqrt(num_steps) + 1)
           if num_steps % d == 0]
  divisors = sorted(set(small + [num_steps // d for d in small]))
  if len(divisors) <= 12:
    return "valid lengths are " + ", ".join(str(d) for d in divisors)
  below = max((d for d in divisors if d < length), default=None)
  above = min((d for d in divisors if d > length), default=None)
  near = " or ".join(str(d) for d in (below, above) if d is not None)
  return f"valid lengths are the {len(divisors)} divisors of T, nearest {near}"


def _layout(fn: str, batch: Any, seq_len: Any
            ) -> tuple[Any, dict[str, PyTree], int, str]:
  """``(gather, batch, S, what)``: the sequences of ``batch``, their count."""
  layout, batch, (num_steps, num_envs) = _rows.env_rows(fn, batch)
  length = _seq_len(fn, seq_len, num_steps)
  if length is None:
    return layout, batch, num_envs, "E"
  chunks: Any = ChunkRows(num_steps, length)
  if isinstance(layout, _rows.Rebuilt):   # minibatches in the batch's type
    chunks = _rows.Rebuilt(chunks, layout.container)
  return (chunks, batch, num_envs * (num_steps // length),
          "S = E * T / seq_len")


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
  if bad.any():   # IndexError, as take's (_checks.check_indices)
    raise IndexError(
        f"{fn}: `idx` must be in [0, {num}), got {_some(arr[bad])} "
        f"({int(bad.sum())} out of range); under jit, traced indices are "
        f"read modulo {num}")
  return jnp.asarray(arr, jnp.int32)


def take_sequences(batch: Any, idx: Array, *,
                   seq_len: int | None = None) -> dict[str, PyTree]:
  """Some sequences, time-major.

  Without ``seq_len``: the whole rollouts of the envs ``idx``,
  ``{k: batch[k][:, idx]}``. With ``seq_len=L``: the chunks ``idx``
  (chunk ``s`` is env ``e = s // C``, steps ``[c*L, (c+1)*L)``, ``c = s % C``,
  ``C = T // L``), ``out[l, b] = batch[c_b*L + l, e_b]``.

  Args:
    batch: ``{name: pytree of [T, E, ...]}`` or a RolloutState (read in place).
    idx: ``[Sb]`` integer indices in ``[0, S)`` with ``S = E`` (no
      ``seq_len``) or ``S = E * T // L``, e.g. one row of
      ``minibatch_indices(key, S, Sb)``. Any shape works; its axes replace
      the env axis. Under ``jit`` or ``vmap`` (traced indices) index ``i``
      means ``i % S``, the rule of ``take`` for rows.
    seq_len: L, a divisor of T, or None (whole rollouts; ``seq_len=T`` is the
      same).

  Returns:
    ``{name: pytree of [T, Sb, ...]}``, or ``[L, Sb, ...]`` with ``seq_len``.

  Raises:
    TypeError: ``idx`` is not integers (floats, bools); ``batch`` has a
      key that is not a str or a leaf that is not an array of numbers.
    IndexError: concrete indices outside ``[0, S)`` (as ``take``).
    ValueError: ``seq_len`` not a divisor of T (the message lists the valid
      lengths).

  Example:
    >>> import numpy as np, jrollout as jr
    >>> t, e = np.arange(4), np.arange(3)
    >>> batch = {"v": t[:, None] + 10 * e}            # [T=4, E=3]: 10 * e + t
    >>> jr.take_sequences(batch, np.array([2, 0]))["v"].tolist()   # [T, Eb]
    [[20, 0], [21, 1], [22, 2], [23, 3]]
    >>> # L = 2, C = 2: chunk 1 is env 0, steps 2-3; chunk 4 is env 2, steps 0-1
    >>> jr.take_sequences(batch, np.array([1, 4]), seq_len=2)["v"].tolist()
    [[2, 20], [3, 21]]
  """
  gather, batch, num, _ = _layout("take_sequences", batch, seq_len)
  idx = _indices("take_sequences", idx, num)
  return _minibatch.gather_rows(gather, batch, idx)


def _request(fn: str, key: PRNGKey | None, batch: Any, per_batch: Any,
             shuffle: bool, num_epochs: Any, remainder: Any, seq_len: Any):
  """``(gather, plan, batch)`` of a sequence minibatch call, validated."""
  gather, batch, num, what = _layout(fn, batch, seq_len)
  plan = _plan.plan(fn, num, per_batch, key=key, shuffle=shuffle,
                    num_epochs=num_epochs, remainder=remainder, what=what,
                    arg="batch_size")
  return gather, plan, batch


def sequence_minibatches(key: PRNGKey | None, batch: Any, batch_size: int,
                         *, num_epochs: int = 1, shuffle: bool = True,
                         remainder: Remainder = "error",
                         seq_len: int | None = None
                         ) -> Iterator[dict[str, PyTree]]:
  """Iterates over sequence minibatches, time order kept.

  Minibatch ``j`` of epoch ``ep`` is ``take_sequences(batch, idx,
  seq_len=seq_len)`` with ``idx = minibatch_indices(key, S, Sb,
  shuffle=shuffle, epoch=ep, remainder=remainder)[j]``; ``S = E`` whole
  rollouts, or ``S = E * T // L`` chunks of ``seq_len=L`` steps. Each is
  gathered by one jit-compiled call, compiled once per shape.

  Args:
    key: a PRNG key; may be None when ``shuffle=False``.
    batch: ``{name: pytree of [T, E, ...]}`` (time-major) or a RolloutState.
    batch_size: sequences per minibatch: Eb envs, or Sb chunks with
      ``seq_len``; it must divide S unless ``remainder`` says otherwise.
    shuffle: shuffle the sequences.
    num_epochs: number of epochs, each with its own order.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"``, applied to the S
      sequences as ``minibatch_indices`` applies it to rows.
    seq_len: L, a divisor of T: cut each env's rollout into ``T // L``
      chunks. None (default) or T: whole rollouts.

  Yields:
    ``{name: pytree of [T, Eb, ...]}``, or ``[L, Sb, ...]`` with ``seq_len``.

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> t, e = np.arange(4), np.arange(3)
    >>> batch = {"v": t[:, None] + 10 * e}            # [T=4, E=3]: 10 * e + t
    >>> for mb in jr.sequence_minibatches(None, batch, 3, shuffle=False,
    ...                                   seq_len=2):  # S = 3 envs * 2 chunks
    ...   print(mb["v"].tolist())                      # [L=2, Sb=3]
    [[0, 2, 10], [1, 3, 11]]
    [[12, 20, 22], [13, 21, 23]]
    >>> mbs = list(jr.sequence_minibatches(jax.random.key(0), batch, 1))
    >>> mbs[0]["v"].shape, sorted(int(m["v"][0, 0]) for m in mbs)  # whole envs
    ((4, 1), [0, 10, 20])
  """
  gather, plan, batch = _request("sequence_minibatches", key, batch,
                                batch_size, shuffle, num_epochs,
                                remainder, seq_len)
  return _minibatch.iterate(gather, plan, key, batch)


def scan_sequence_minibatches(
    fn: Callable[[Any, dict[str, PyTree]], tuple[Any, Any]], carry: Any,
    key: PRNGKey | None, batch: Any, batch_size: int, *,
    num_epochs: int = 1, shuffle: bool = True,
    remainder: Remainder = "error", seq_len: int | None = None
) -> tuple[Any, Any]:
  """``scan_minibatches`` for sequence minibatches.

  Runs ``fn(carry, minibatch) -> (carry, out)`` over every sequence
  minibatch (``[T, Eb, ...]``, or ``[L, Sb, ...]`` with ``seq_len``) of
  ``num_epochs`` epochs in one compiled loop, in the order of
  ``sequence_minibatches`` (same arguments).

  Returns:
    ``(carry, outs)`` with ``outs`` leaves stacked ``[num_epochs, M, ...]``,
    ``M = S // Sb`` (``ceil(S / Sb)`` with ``remainder="wrap"``).

  Raises:
    TypeError, ValueError: as ``scan_minibatches``.

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> t, e = np.arange(4), np.arange(3)
    >>> batch = {"v": t[:, None] + 10 * e}            # [T=4, E=3]: 10 * e + t
    >>> def fn(n, mb):                               # mb["v"]: [L=2, Sb=2]
    ...   return n + 1, mb["v"][1] - mb["v"][0]      # a chunk's steps in order
    >>> n, outs = jr.scan_sequence_minibatches(
    ...     fn, np.int32(0), jax.random.key(0), batch, 2, num_epochs=2,
    ...     seq_len=2)
    >>> int(n), outs.shape, np.unique(outs).tolist()  # outs: [epochs, M, Sb]
    (6, (2, 3, 2), [1])
  """
  name = "scan_sequence_minibatches"
  _checks.check_callable(name, "fn", fn)
  _checks.check_arrays(name, "carry", carry)
  gather, plan, batch = _request(name, key, batch, batch_size, shuffle,
                                num_epochs, remainder, seq_len)
  return _minibatch.scan(gather, fn, plan, carry, key, batch, name=name)
