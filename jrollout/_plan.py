"""The minibatch plan: how each epoch's N rows split into minibatches of B.

Every minibatch entry point (flat, sequence, sharded, ``compat.DictDataset``)
validates its sizes here and reads its indices from a ``Plan``, so the
rules below are written once.

Let ``p`` be an epoch's order of ``range(N)``: a keyed permutation
(``jrollout._permute``), the same for every B and remainder mode, or the
identity when not shuffling. Minibatch ``j`` of that epoch is:

- ``remainder="error"`` (default): B must divide N; ``M = N // B``
  minibatches, ``p[j*B:(j+1)*B]``.
- ``remainder="drop"``: ``M = N // B``, ``p[j*B:(j+1)*B]``; the last
  ``N % B`` rows of the order (different ones each epoch) are not used.
- ``remainder="wrap"``: ``M = ceil(N / B)``, ``p[(j*B + i) % N]`` for
  ``i < B``: the last minibatch is completed with the first rows of the same
  epoch's order, so every row is used once or twice per epoch and every
  minibatch has exactly B rows (static shapes under ``jit``).

``B > N`` is an error in every mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout import _permute
from jrollout._types import Array, PRNGKey

REMAINDERS = ("error", "drop", "wrap")
MAX_ROWS = 2**31 - 1   # row indices are int32


@dataclasses.dataclass(frozen=True)
class Plan:
  """A validated minibatch plan; hashable, so a static ``jit`` argument.

  Attributes:
    num_rows: N, rows per epoch.
    batch_size: B, rows per minibatch.
    shuffle: draw each epoch's order from the key (else the identity).
    num_epochs: how many epochs.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"`` (module docstring).
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
    return _permute.permute(_permute.round_keys(key, epoch), positions,
                            self.num_rows)

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
    """One device's plan when D devices each take ``B / D`` of ``N / D`` rows.

    It has the same number of minibatches M as this plan, in every mode.
    """
    return dataclasses.replace(self, num_rows=self.num_rows // num_shards,
                               batch_size=self.batch_size // num_shards)


@functools.partial(jax.jit, static_argnums=0)
def epoch_indices(plan: Plan, key: PRNGKey | None,
                  epoch: Array | int = 0) -> Array:
  """``plan.epoch_indices(key, epoch)``, compiled once per plan."""
  return plan.epoch_indices(key, epoch)


def _divisors_near(n: int, b: int) -> tuple[int | None, int | None]:
  """The divisors of ``n`` nearest ``b`` (at most ``b``, above ``b``).

  Every divisor pairs with one at most ``sqrt(n)``, so one vectorised pass
  over ``[1, isqrt(n)]`` finds them all: at most 46341 candidates for the
  largest N (``2**31 - 1``), whatever N and B.
  """
  small = np.arange(1, math.isqrt(n) + 1, dtype=np.int64)
  small = small[n % small == 0]
  divisors = np.union1d(small, n // small)
  below = divisors[divisors <= b]
  above = divisors[divisors > b]
  return (int(below[-1]) if below.size else None,
          int(above[0]) if above.size else None)


def multiples(n: int, d: int) -> str:
  """The multiples of ``d`` nearest ``n``, for messages (``"8 or 16"``)."""
  below, above = (n // d) * d, -(-n // d) * d
  return " or ".join(str(m) for m in dict.fromkeys((below, above)) if m > 0)


def plan(fn: str, num_rows: Any, batch_size: Any, *, key: Any,
         shuffle: bool = True, num_epochs: Any = 1, remainder: Any = "error",
         what: str = "N", arg: str = "batch_size",
         num_shards: int | None = None, axis: Any = None) -> Plan:
  """Validates a minibatch request and returns its ``Plan``.

  Args:
    fn: the public function, for messages.
    num_rows: N (the longest key's length, or E for sequences).
    batch_size: B.
    key: the PRNG key (required when shuffling).
    shuffle: shuffle each epoch.
    num_epochs: a positive int.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"``.
    what: the letter of N in messages (``"N"``, ``"E"``).
    arg: the name of B's argument in messages.
    num_shards: D, for sharded minibatching: each device takes ``B / D``
      rows of every minibatch, so D must divide B (and N).
    axis: the mesh axis, for messages.

  Raises:
    TypeError: a size that is not an int (bools included), ``shuffle`` not
      a bool, a ``key`` that is not a PRNG key.
    ValueError: a size that is not positive, ``N >= 2**31``, ``B > N``, B
      not dividing N with ``remainder="error"`` (naming the nearest valid
      sizes and the other modes), an unknown remainder, D not dividing B,
      no key when shuffling, or an array of several keys.
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
  batch_size = _checks.positive_int(fn, arg, batch_size)
  if num_shards is not None:
    if num_rows % num_shards:
      raise ValueError(
          f"{fn}: the number of rows {what} = {num_rows} is not divisible by "
          f"the size D = {num_shards} of mesh axis {axis!r}: every device "
          "must hold the same number of rows")
    if batch_size % num_shards:
      raise ValueError(
          f"{fn}: `{arg}` B = {batch_size} (the global minibatch size) is "
          f"not divisible by the size D = {num_shards} of mesh axis {axis!r};"
          f" each device takes B/D rows of every minibatch, so use B = "
          f"{multiples(batch_size, num_shards)}")
  if batch_size > num_rows:
    raise ValueError(
        f"{fn}: `{arg}` {batch_size} is larger than the number of rows "
        f"{what} = {num_rows}; use a batch size of at most {num_rows}")
  if remainder == "error" and num_rows % batch_size:
    below, above = _divisors_near(num_rows, batch_size)
    near = " or ".join(str(d) for d in (below, above) if d is not None)
    raise ValueError(
        f"{fn}: `{arg}` {batch_size} does not divide the number of rows "
        f"{what} = {num_rows} ({num_rows} % {batch_size} = "
        f"{num_rows % batch_size}); the nearest valid batch sizes are {near};"
        f" or pass remainder='drop' (leave the last {num_rows % batch_size} "
        "rows of each epoch's order out) or remainder='wrap' (complete the "
        "last minibatch with the first rows of the order)")
  if shuffle and key is None:
    raise ValueError(f"{fn}: `key` is None but shuffle=True; pass a PRNG key "
                     "(jax.random.key(seed)) or shuffle=False")
  num_epochs = _checks.positive_int(fn, "num_epochs", num_epochs)
  return Plan(num_rows, batch_size, shuffle, num_epochs, remainder)
