"""Sequence minibatches for recurrent policies: split along envs, keep time.

A recurrent policy must see each env's steps in time order, with its hidden
state carried through them. So instead of shuffling rows, these functions
shuffle and split the env axis: minibatch ``j`` holds every step of the envs
``env_idx = p[j*Eb:(j+1)*Eb]`` (``p`` a keyed permutation of ``range(E)``,
the same one ``minibatch_indices(key, E, Eb)`` gives), as time-major
``[T, Eb, ...]`` arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _minibatch
from jrollout._state import RolloutState
from jrollout._types import Array, PRNGKey, PyTree


def _time_env_shape(fn: str, data: Any) -> tuple[int, int]:
  """``(T, E)`` shared by every leaf of ``data``; raises if they disagree."""
  if isinstance(data, RolloutState):
    if not data.data:
      raise ValueError(f"{fn}: the RolloutState has no registered keys")
    return data.num_steps, data.num_envs
  if not isinstance(data, Mapping):
    raise TypeError(f"{fn}: `data` must be a dict of time-major [T, E, ...] "
                    f"arrays or a RolloutState, got {type(data).__name__}")
  if not data:
    raise ValueError(f"{fn}: `data` is empty (no keys)")
  expected = None
  for path, leaf in jax.tree_util.tree_leaves_with_path(data):
    shape = tuple(np.shape(leaf)[:2])
    if len(shape) < 2:
      raise ValueError(f"{fn}: leaf {jax.tree_util.keystr(path)} has shape "
                       f"{np.shape(leaf)}, expected time-major [T, E, ...]")
    if expected is None:
      expected, first = shape, jax.tree_util.keystr(path)
    elif shape != expected:
      raise ValueError(
          f"{fn}: leaf {jax.tree_util.keystr(path)} has leading shape "
          f"{shape} but {first} has {expected}; every leaf must share "
          "[T, E]")
  if 0 in expected:
    raise ValueError(f"{fn}: [T, E] = {expected} has a zero-length axis")
  return expected


def _take_envs(data: Any, env_idx: Array) -> dict[str, PyTree]:
  source = data.data if isinstance(data, RolloutState) else data
  return jax.tree_util.tree_map(
      lambda x: jnp.asarray(x).at[:, env_idx].get(mode="promise_in_bounds"),
      dict(source))


def take_sequences(data: Any, env_idx: Array) -> dict[str, PyTree]:
  """The sequences of some envs: ``{k: data[k][:, env_idx]}``.

  Args:
    data: ``{key: pytree of [T, E, ...]}`` or a RolloutState.
    env_idx: ``[Eb]`` env indices in ``[0, E)``, e.g. one row of
      ``minibatch_indices(key, E, Eb)``.

  Returns:
    ``{key: pytree of [T, Eb, ...]}``.
  """
  _time_env_shape("take_sequences", data)   # validates; raises if bad
  return _take_envs(data, jnp.asarray(env_idx, jnp.int32))


def sequence_minibatches(key: PRNGKey | None, data: Any, envs_per_batch: int,
                         *, shuffle: bool = True,
                         num_epochs: int = 1) -> Iterator[dict[str, PyTree]]:
  """Iterates over env-split sequence minibatches, time order kept.

  Minibatch ``j`` of epoch ``e`` is ``take_sequences(data, env_idx)`` with
  ``env_idx = minibatch_indices(key, E, Eb, shuffle=shuffle, epoch=e)[j]``.
  Each is gathered by one jit-compiled call, compiled once per shape.

  Args:
    key: a PRNG key; may be None when ``shuffle=False``.
    data: ``{key: pytree of [T, E, ...]}`` (time-major) or a RolloutState.
    envs_per_batch: Eb, which must divide E.
    shuffle: shuffle the envs.
    num_epochs: number of epochs, each with its own order.

  Yields:
    ``{key: pytree of [T, Eb, ...]}``.
  """
  _, num_envs = _time_env_shape("sequence_minibatches", data)
  envs_per_batch = _minibatch.check_batch_size(
      "sequence_minibatches", num_envs, envs_per_batch, what="E",
      arg="envs_per_batch")
  _minibatch.check_key("sequence_minibatches", key, shuffle)
  num_epochs = _minibatch.check_num_epochs("sequence_minibatches", num_epochs)
  return _minibatch.iterate(_take_envs, key, data, num_envs, envs_per_batch,
                            shuffle, num_epochs)


def scan_sequence_minibatches(
    fn: Callable[[Any, dict[str, PyTree]], tuple[Any, Any]], carry: Any,
    key: PRNGKey | None, data: Any, envs_per_batch: int, *,
    num_epochs: int = 1, shuffle: bool = True) -> tuple[Any, Any]:
  """``scan_minibatches`` for sequence minibatches ``[T, Eb, ...]``.

  Runs ``fn(carry, minibatch) -> (carry, out)`` over every sequence
  minibatch of ``num_epochs`` epochs in one ``lax.scan``, in the order of
  ``sequence_minibatches``.

  Returns:
    ``(carry, outs)`` with ``outs`` leaves stacked ``[num_epochs, M, ...]``,
    ``M = E // Eb``.
  """
  _, num_envs = _time_env_shape("scan_sequence_minibatches", data)
  envs_per_batch = _minibatch.check_batch_size(
      "scan_sequence_minibatches", num_envs, envs_per_batch, what="E",
      arg="envs_per_batch")
  _minibatch.check_key("scan_sequence_minibatches", key, shuffle)
  num_epochs = _minibatch.check_num_epochs("scan_sequence_minibatches",
                                           num_epochs)
  return _minibatch.scan(_take_envs, fn, carry, key, data, num_envs,
                         envs_per_batch, shuffle, num_epochs)
