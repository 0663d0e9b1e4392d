"""Pieces shared by the suites: the epoch body and the implementations' runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jrollout as jr
from benchmarks.baselines import jax_idiom


def sum_fn(carry, mb):
  """The epoch body: add every key's minibatch, summed over rows, to carry.

  Every element of every minibatch is read, and with integer-valued float32
  data the sums are exact, so all implementations must agree bit for bit.
  """
  return {k: carry[k] + jnp.sum(mb[k], axis=0) for k in carry}, None


def zero_sums(shapes: dict[str, tuple[int, ...]]) -> dict[str, jax.Array]:
  return {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}


def shapes_of(batch) -> dict[str, tuple[int, ...]]:
  if isinstance(batch, jr.RolloutState):
    return {k: tuple(v.shape[2:]) for k, v in batch.data.items()}
  return {k: tuple(v.shape[1:]) for k, v in batch.items()}


def make_jr_epoch(batch_size: int):
  """Jitted ``(carry, key, batch) -> carry`` over ``jr.scan_minibatches``."""
  @jax.jit
  def epoch(carry, key, batch):
    carry, _ = jr.scan_minibatches(sum_fn, carry, key, batch, batch_size)
    return carry
  return epoch


def jr_epoch_impl(batch, batch_size: int, key):
  """Setup of the jrollout epoch on ``batch`` (a dict or a RolloutState)."""
  def setup():
    epoch = make_jr_epoch(batch_size)
    carry = zero_sums(shapes_of(batch))

    def run():
      return jax.block_until_ready(epoch(carry, key, batch))
    return run
  return setup


def idiom_epoch_impl(batch, batch_size: int, key):
  def setup():
    epoch = jax_idiom.make_epoch(sum_fn, batch_size)
    carry = zero_sums(shapes_of(batch))

    def run():
      return jax.block_until_ready(epoch(carry, key, batch)[0])
    return run
  return setup


def numpy_take_impl(nbatch: dict[str, np.ndarray], seed: int = 0):
  """The numpy bound: one ``np.take(mode="clip")`` of every key, then sums.

  The permutation (and its ``% L`` for shorter keys) is drawn in setup: the
  bound is the gather and the reduction only.
  """
  def setup():
    n = max(len(v) for v in nbatch.values())
    perm = np.random.default_rng(seed).permutation(n)
    rows = {k: perm if len(v) == n else perm % len(v)
            for k, v in nbatch.items()}

    def run():
      return {k: np.take(v, rows[k], axis=0, mode="clip").sum(axis=0)
              for k, v in nbatch.items()}
    return run
  return setup


def torch_sync(device: str):
  """What a torch ``run()`` calls last: wait for the device's queue."""
  if device.startswith("cuda"):
    return torch.cuda.synchronize
  return lambda: None


def same(x):
  """``Impl.check`` that compares the output as it is."""
  return x
