"""The JAX idiom PPO code uses today (purejaxrl style), written from scratch.

Rollouts are stacked over time (``lax.scan`` outputs, or from Python a list
of per-step arrays then ``jnp.stack``); an epoch draws
``jax.random.permutation(key, N)``, gathers every key with it, reshapes to
``[M, B, ...]`` and ``lax.scan``s over the minibatches, all in one jit.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp


def stack_steps(steps: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
  """``[{key: [E, ...]}] * T -> {key: [T, E, ...]}``."""
  return {k: jnp.stack([s[k] for s in steps]) for k in steps[0]}


def flatten(data: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """``[T, E, *s] -> [E * T, *s]`` env-major, as make_batch orders rows."""
  return {k: jnp.swapaxes(v, 0, 1).reshape(-1, *v.shape[2:])
          for k, v in data.items()}


def epoch(fn: Callable[[Any, dict[str, jax.Array]], tuple[Any, Any]],
          carry: Any, key: jax.Array, batch: dict[str, jax.Array],
          batch_size: int) -> tuple[Any, Any]:
  """Permute, gather all keys (rows ``perm % L``), reshape, scan.

  Call under ``jax.jit`` (``make_epoch`` does).
  """
  n = max(v.shape[0] for v in batch.values())
  perm = jax.random.permutation(key, n)
  shuffled = {}
  for k, v in batch.items():
    rows = perm if v.shape[0] == n else perm % v.shape[0]
    shuffled[k] = jnp.take(v, rows, axis=0)
  mbs = {k: v.reshape(n // batch_size, batch_size, *v.shape[1:])
         for k, v in shuffled.items()}
  return lax.scan(fn, carry, mbs)


def make_epoch(fn, batch_size: int):
  """A jitted ``(carry, key, batch) -> (carry, outs)`` for one epoch."""
  return jax.jit(functools.partial(epoch, fn, batch_size=batch_size))


def make_flatten_epoch(fn, batch_size: int):
  """A jitted flatten of ``[T, E, ...]`` storage followed by ``epoch``."""
  def run(carry, key, data):
    return epoch(fn, carry, key, flatten(data), batch_size)
  return jax.jit(run)
