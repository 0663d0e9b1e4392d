"""A keyed bijection on ``[0, N)``: the shuffle order of the minibatch iterator.

``jax.random.permutation`` sorts (twice, on XLA's CPU), which costs more
than a whole epoch of gathers at N = 131072. Instead the order is a keyed
pseudo-random permutation: an unbalanced Feistel network on the smallest
power of two ``2**k >= N`` (so fewer than 2 candidates per index), restricted
to ``[0, N)`` by cycle-walking (apply the network again while the result is
``>= N``). Cycle-walking a bijection of ``[0, 2**k)`` gives a bijection of
``[0, N)``, so the result is a true permutation, reproducible from the key
and computable for any subset of positions (one minibatch) on its own.

It is not a uniformly random permutation (no cheap method is), but each
round mixes with a 32-bit finaliser, which is ample for minibatch order.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from jrollout._types import Array, PRNGKey

_ROUNDS = 6


def _fmix32(h: Array) -> Array:
  """MurmurHash3's 32-bit finaliser (a bijection on uint32)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def round_keys(key: PRNGKey, epoch: Array | int = 0) -> Array:
  """``[_ROUNDS] uint32`` round keys for ``key`` and ``epoch``.

  Each epoch draws its own keys from ``fold_in(key, epoch)``, so inside an
  epoch loop they are computed in the loop body, not hoisted out of it
  (``jrollout._minibatch.scan`` relies on that; see its docstring).
  """
  return jax.random.bits(jax.random.fold_in(key, epoch), (_ROUNDS,),
                         jnp.uint32)


def _network(x: Array, keys: Array, bits: int) -> Array:
  """One pass of the Feistel network: a bijection of ``[0, 2**bits)``."""
  right_bits = bits // 2
  left_bits = bits - right_bits
  right_mask = jnp.uint32((1 << right_bits) - 1)
  left_mask = jnp.uint32((1 << left_bits) - 1)
  left = x >> right_bits
  right = x & right_mask
  for r in range(_ROUNDS):
    if r % 2 == 0:
      right = right ^ (_fmix32(left ^ keys[r]) & right_mask)
    else:
      left = left ^ (_fmix32(right ^ keys[r]) & left_mask)
  return (left << right_bits) | right


def permute(keys: Array, positions: Array, n: int) -> Array:
  """The permutation ``p`` of ``[0, n)`` at ``positions``: ``p[positions]``.

  Args:
    keys: round keys from ``round_keys``.
    positions: integer array of any shape, values in ``[0, n)``.
    n: N, a static positive int (< 2**31).

  Returns:
    int32 array of the shape of ``positions``.
  """
  bits = max(1, (n - 1).bit_length())
  x = _network(positions.astype(jnp.uint32), keys, bits)
  if (1 << bits) != n:
    limit = jnp.uint32(n)
    x = lax.while_loop(
        lambda x: jnp.any(x >= limit),
        lambda x: jnp.where(x >= limit, _network(x, keys, bits), x), x)
  return x.astype(jnp.int32)
