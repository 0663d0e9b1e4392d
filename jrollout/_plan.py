"""The minibatch plan: each epoch's keyed order of N rows, split into B.

An epoch's order ``p`` of ``range(N)`` is a keyed Feistel permutation on the
smallest power of two ``>= N``, restricted to ``[0, N)`` by cycle-walking
(cheaper than ``jax.random.permutation``'s sorts, and computable for one
minibatch's positions alone); its round keys come from ``fold_in(key,
epoch)``, or ``p`` is the identity when not shuffling. Minibatch ``j`` takes
positions ``j*B + i`` for ``i < B``: ``remainder="error"`` needs B to divide
N, ``"drop"`` leaves the last ``N % B`` positions out, ``"wrap"`` reads
positions modulo N (``M = ceil(N / B)``). The readers (iterator, scan) run
any gather over the plan's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import dataclasses
import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._types import Array, PRNGKey, PyTree

REMAINDERS = ("error", "drop", "wrap")
MAX_ROWS = 2**31 - 1   # row indices are int32
_ROUNDS = 6

Gather = Callable[[dict[str, PyTree], Array], Any]


def _fmix32(h: Array) -> Array:
  """MurmurHash3's 32-bit finaliser (a bijection on uint32)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def round_keys(key: PRNGKey, epoch: Array | int = 0) -> Array:
  """``[_ROUNDS] uint32`` round keys of ``epoch``, from ``fold_in(key,
  epoch)``: computed inside an epoch loop's body, not hoisted out of it."""
  return jax.random.bits(jax.random.fold_in(key, epoch), (_ROUNDS,),
                         jnp.uint32)


def _network(x: Array, keys: Array, bits: int) -> Array:
  """One pass of the Feistel network: a bijection of ``[0, 2**bits)``."""
  right_bits = bits // 2
  right_mask = jnp.uint32((1 << right_bits) - 1)
  left_mask = jnp.uint32((1 << (bits - right_bits)) - 1)
  left, right = x >> right_bits, x & right_mask
  for r in range(_ROUNDS):
    if r % 2 == 0:
      right = right ^ (_fmix32(left ^ keys[r]) & right_mask)
    else:
      left = left ^ (_fmix32(right ^ keys[r]) & left_mask)
  return (left << right_bits) | right


def permute(keys: Array, positions: Array, n: int) -> Array:
  """``p[positions]`` (int32, the shape of ``positions``) for the keyed
  permutation ``p`` of ``[0, n)``; ``positions`` in ``[0, n)``, n static."""
  bits = max(1, (n - 1).bit_length())
  x = _network(positions.astype(jnp.uint32), keys, bits)
  if (1 << bits) != n:
    limit = jnp.uint32(n)
    x = lax.while_loop(
        lambda x: jnp.any(x >= limit),
        lambda x: jnp.where(x >= limit, _network(x, keys, bits), x), x)
  return x.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Plan:
  """A validated plan of N rows in minibatches of B; hashable (static).

  Attributes:
    num_rows: N, rows (or sequences) per epoch.
    batch_size: B, rows per minibatch.
    shuffle: draw each epoch's order from the key (else the identity).
    num_epochs: how many epochs.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"``.
  """

  num_rows: int
  batch_size: int
  shuffle: bool
  num_epochs: int = 1
  remainder: str = "error"

  @property
  def num_batches(self) -> int:
    """M, minibatches per epoch."""
    if self.remainder == "wrap":
      return -(-self.num_rows // self.batch_size)
    return self.num_rows // self.batch_size

  def _order(self, key: PRNGKey | None, epoch: Array | int,
             positions: Array) -> Array:
    """``p[positions]`` for the order ``p`` of ``epoch``."""
    if self.num_batches * self.batch_size > self.num_rows:   # wrap only
      positions = positions % self.num_rows
    if not self.shuffle:
      return positions
    assert key is not None   # plan() refuses shuffle=True without a key
    return permute(round_keys(key, epoch), positions, self.num_rows)

  def epoch_indices(self, key: PRNGKey | None,
                    epoch: Array | int = 0) -> Array:
    """``[M, B] int32``: the rows of every minibatch of ``epoch``."""
    m, b = self.num_batches, self.batch_size
    positions = jnp.arange(m * b, dtype=jnp.int32)
    return self._order(key, epoch, positions).reshape(m, b)

  def minibatch(self, key: PRNGKey | None, epoch: Array | int,
                j: Array | int) -> Array:
    """``[B] int32``: minibatch ``j`` of ``epoch``, computing only its rows."""
    positions = j * self.batch_size + jnp.arange(self.batch_size,
                                                 dtype=jnp.int32)
    return self._order(key, epoch, positions)

  def split(self, num_shards: int) -> Plan:
    """One device's plan when D devices each take ``B / D`` of ``N / D``
    rows: the same M as this plan, in every mode."""
    return dataclasses.replace(self, num_rows=self.num_rows // num_shards,
                               batch_size=self.batch_size // num_shards)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def indices(plan: Plan, key: PRNGKey | None, epoch: Array | int,
            num_shards: int | None, mode: str) -> Array:
  """``minibatch_indices``' rows, compiled once per plan: ``[M, B] int32``,
  or with D = ``num_shards`` ``[D, M, B/D]``, the global rows device ``d``
  takes of each minibatch in ``mode``."""
  if num_shards is None or mode == "global":
    idx = plan.epoch_indices(key, epoch)
    if num_shards is None:
      return idx
    return jnp.swapaxes(idx.reshape(plan.num_batches, num_shards, -1), 0, 1)
  local = plan.split(num_shards)

  def device_rows(d):
    device_key = (jax.random.fold_in(key, d)
                  if key is not None and plan.shuffle else None)
    return d * local.num_rows + local.epoch_indices(device_key, epoch)

  return jax.vmap(device_rows)(jnp.arange(num_shards, dtype=jnp.int32))


def divisors(n: int) -> np.ndarray:
  """The divisors of ``n``, sorted, in one vectorised ``O(sqrt(n))`` pass."""
  small = np.arange(1, math.isqrt(n) + 1, dtype=np.int64)
  small = small[n % small == 0]
  return np.union1d(small, n // small)


def nearest(n: int, b: int) -> str:
  """The divisors of ``n`` nearest ``b`` (at most and above), for messages:
  ``"32 or 64"``."""
  d = divisors(n)
  return " or ".join(map(str, [*d[d <= b][-1:], *d[d > b][:1]]))


def multiples(n: int, d: int) -> str:
  """The multiples of ``d`` nearest ``n``, for messages (``"8 or 16"``)."""
  below, above = (n // d) * d, -(-n // d) * d
  return " or ".join(str(m) for m in dict.fromkeys((below, above)) if m > 0)


def plan(fn: str, num_rows: Any, batch_size: Any, *, key: Any,
         shuffle: Any = True, num_epochs: Any = 1, remainder: Any = "error",
         what: str = "N", num_shards: int | None = None,
         axis: Any = None) -> Plan:
  """Validates a minibatch request of ``fn`` and returns its ``Plan``.

  ``what`` is N's letter in messages (``"N"``, ``"E"``); ``num_shards`` is
  D for sharded minibatching (D must divide N and B), ``axis`` its mesh
  axis for messages.

  Raises:
    TypeError: a size that is not an int (bools included), ``shuffle`` not
      a bool, a ``key`` that is not a PRNG key.
    ValueError: a size that is not positive, ``N >= 2**31``, ``B > N``, B
      not dividing N with ``remainder="error"`` (naming the nearest valid
      sizes and the other modes), an unknown remainder, D not dividing N or
      B, no key when shuffling.
  """
  num_rows = _checks.positive_int(fn, "num_rows", num_rows)
  if num_rows > MAX_ROWS:
    raise ValueError(
        f"{fn}: the number of rows {what} = {num_rows} is more than "
        f"{MAX_ROWS} (2**31 - 1), the largest count of int32 row indices")
  shuffle = _checks.check_bool(fn, "shuffle", shuffle)
  if key is not None:
    _checks.check_key(fn, key)
  if not isinstance(remainder, str) or remainder not in REMAINDERS:
    raise ValueError(f"{fn}: `remainder` must be one of {REMAINDERS}, got "
                     f"{remainder!r}")
  batch_size = _checks.positive_int(fn, "batch_size", batch_size)
  if num_shards is not None and num_rows % num_shards:
    raise ValueError(
        f"{fn}: the number of rows {what} = {num_rows} is not divisible by "
        f"the size D = {num_shards} of mesh axis {axis!r}: every device "
        "must hold the same number of rows")
  if num_shards is not None and batch_size % num_shards:
    raise ValueError(
        f"{fn}: `batch_size` B = {batch_size} (the global minibatch size) is "
        f"not divisible by the size D = {num_shards} of mesh axis {axis!r};"
        " each device takes B/D rows of every minibatch, so use B = "
        f"{multiples(batch_size, num_shards)}")
  if batch_size > num_rows:
    raise ValueError(
        f"{fn}: `batch_size` {batch_size} is larger than the number of rows "
        f"{what} = {num_rows}; use a batch size of at most {num_rows}")
  if remainder == "error" and num_rows % batch_size:
    near = nearest(num_rows, batch_size)
    left = num_rows % batch_size
    raise ValueError(
        f"{fn}: `batch_size` {batch_size} does not divide the number of rows "
        f"{what} = {num_rows} ({num_rows} % {batch_size} = {left}); the "
        f"nearest valid batch sizes are {near}; or pass remainder='drop' "
        f"(leave the last {left} rows of each epoch's order out) or "
        "remainder='wrap' (complete the last minibatch with the first rows "
        "of the order)")
  if shuffle and key is None:
    raise ValueError(f"{fn}: `key` is None but shuffle=True; pass a PRNG key "
                     "(jax.random.key(seed)) or shuffle=False")
  num_epochs = _checks.positive_int(fn, "num_epochs", num_epochs)
  return Plan(num_rows, batch_size, shuffle, num_epochs, remainder)


@functools.partial(jax.jit, static_argnums=(0, 1))
def gather(layout: Gather, plan_: Plan | None, data: dict[str, PyTree],
           key: PRNGKey | None, idx: Array) -> Any:
  """``layout(data, rows)``, compiled once per layout and shapes: ``idx``
  is the rows (``plan_`` None) or ``[epoch, j]`` of ``plan_``."""
  if plan_ is None:
    return layout(data, idx)
  return layout(data, plan_.minibatch(key, idx[0], idx[1]))


def iterate(layout: Gather, plan_: Plan, key: PRNGKey | None,
            data: dict[str, PyTree]) -> Iterator[Any]:
  """Generator of every minibatch of every epoch of ``plan_``, in order."""
  for epoch in range(plan_.num_epochs):
    for j in range(plan_.num_batches):
      yield gather(layout, plan_, data, key, np.array([epoch, j], np.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2),
                   static_argnames=("name",))
def scan(layout: Gather, fn: Callable[[Any, Any], tuple[Any, Any]],
         plan_: Plan, carry: Any, key: PRNGKey | None,
         data: dict[str, PyTree], *, name: str) -> tuple[Any, Any]:
  """``fn`` over ``layout(data, rows)`` for every minibatch of every epoch.

  Two nested ``lax.scan``, epochs outside (each computing its ``[M, B]``
  rows), minibatches inside: the pure-JAX PPO idiom's loop structure, which
  keeps XLA:CPU from spinning its thread pool over the minibatch body.
  ``name`` (the public function) names the trace-time error raised when
  ``fn`` does not return a ``(carry, out)`` pair.
  """
  def step(c, rows):
    return check_step_output(name, "fn", fn(c, layout(data, rows)))

  def epoch(carry, e):
    return lax.scan(step, carry, plan_.epoch_indices(key, e))

  return lax.scan(epoch, carry,
                  jnp.arange(plan_.num_epochs, dtype=jnp.int32))


def check_epoch(fn: str, value: Any) -> Any:
  """A concrete int in ``[0, 2**31)`` or a traced integer scalar; else a
  TypeError (not an integer scalar) or a ValueError (out of range)."""
  if isinstance(value, (jax.Array, np.ndarray)):
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
      raise TypeError(f"{fn}: `epoch` must be an integer scalar, got a "
                      f"{value.dtype} array of shape {value.shape}")
    if isinstance(value, jax.core.Tracer):
      return value
  epoch = _checks.check_int(fn, "epoch", value, minimum=0)
  if epoch >= 2**31:
    raise ValueError(f"{fn}: `epoch` must be below 2**31, got {epoch}")
  return epoch


def check_step_output(fn: str, name: str, out: Any) -> Any:
  """The ``(carry, out)`` pair a scan's step function returned, else a
  TypeError describing what it returned (never its contents)."""
  if isinstance(out, (tuple, list)) and len(out) == 2:
    return out
  if isinstance(out, (tuple, list)):
    what = f"a {type(out).__name__} of length {len(out)}"
  elif hasattr(out, "shape") and hasattr(out, "dtype"):
    what = f"an array of dtype {out.dtype} and shape {tuple(out.shape)}"
  else:
    what = "None" if out is None else f"a {type(out).__name__}"
  raise TypeError(f"{fn}: `{name}` must return a pair (carry, out), it "
                  f"returned {what}; return (carry, None) if there is no "
                  "output")
