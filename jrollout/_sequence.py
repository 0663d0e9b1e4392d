"""Sequence minibatches for recurrent policies: split along envs, keep time.

A recurrent policy must see each env's steps in time order, with its hidden
state carried through them. So instead of shuffling rows, these functions
shuffle and split the env axis: minibatch ``j`` holds every step of the envs
``env_idx = p[j*Eb:(j+1)*Eb]`` (``p`` a keyed permutation of ``range(E)``,
the same one ``minibatch_indices(key, E, Eb)`` gives), as time-major
``[T, Eb, ...]`` arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp

from jrollout import _minibatch
from jrollout import _plan
from jrollout import _rows
from jrollout._types import Array, PRNGKey, PyTree


def take_sequences(data: Any, env_idx: Array) -> dict[str, PyTree]:
  """The sequences of some envs: ``{k: data[k][:, env_idx]}``.

  Args:
    data: ``{key: pytree of [T, E, ...]}`` or a RolloutState.
    env_idx: ``[Eb]`` env indices in ``[0, E)``, e.g. one row of
      ``minibatch_indices(key, E, Eb)``.

  Returns:
    ``{key: pytree of [T, Eb, ...]}``.
  """
  layout, data, _ = _rows.env_rows("take_sequences", data)
  return layout(data, jnp.asarray(env_idx, jnp.int32))


def _request(fn: str, key: PRNGKey | None, data: Any, envs_per_batch: Any,
             shuffle: bool, num_epochs: Any, remainder: Any):
  """``(gather, plan, data)`` of a sequence minibatch call, validated."""
  layout, data, (_, num_envs) = _rows.env_rows(fn, data)
  plan = _plan.plan(fn, num_envs, envs_per_batch, key=key, shuffle=shuffle,
                    num_epochs=num_epochs, remainder=remainder, what="E",
                    arg="envs_per_batch")
  return layout, plan, data


def sequence_minibatches(key: PRNGKey | None, data: Any, envs_per_batch: int,
                         *, shuffle: bool = True, num_epochs: int = 1,
                         remainder: str = "error"
                         ) -> Iterator[dict[str, PyTree]]:
  """Iterates over env-split sequence minibatches, time order kept.

  Minibatch ``j`` of epoch ``e`` is ``take_sequences(data, env_idx)`` with
  ``env_idx = minibatch_indices(key, E, Eb, shuffle=shuffle, epoch=e,
  remainder=remainder)[j]``. Each is gathered by one jit-compiled call,
  compiled once per shape.

  Args:
    key: a PRNG key; may be None when ``shuffle=False``.
    data: ``{key: pytree of [T, E, ...]}`` (time-major) or a RolloutState.
    envs_per_batch: Eb; it must divide E unless ``remainder`` says otherwise.
    shuffle: shuffle the envs.
    num_epochs: number of epochs, each with its own order.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"``, applied to the env
      axis as ``minibatch_indices`` applies it to rows.

  Yields:
    ``{key: pytree of [T, Eb, ...]}``.
  """
  gather, plan, data = _request("sequence_minibatches", key, data,
                                envs_per_batch, shuffle, num_epochs,
                                remainder)
  return _minibatch.iterate(gather, plan, key, data)


def scan_sequence_minibatches(
    fn: Callable[[Any, dict[str, PyTree]], tuple[Any, Any]], carry: Any,
    key: PRNGKey | None, data: Any, envs_per_batch: int, *,
    num_epochs: int = 1, shuffle: bool = True,
    remainder: str = "error") -> tuple[Any, Any]:
  """``scan_minibatches`` for sequence minibatches ``[T, Eb, ...]``.

  Runs ``fn(carry, minibatch) -> (carry, out)`` over every sequence
  minibatch of ``num_epochs`` epochs in one ``lax.scan``, in the order of
  ``sequence_minibatches``.

  Returns:
    ``(carry, outs)`` with ``outs`` leaves stacked ``[num_epochs, M, ...]``,
    ``M = E // Eb`` (``ceil(E / Eb)`` with ``remainder="wrap"``).
  """
  gather, plan, data = _request("scan_sequence_minibatches", key, data,
                                envs_per_batch, shuffle, num_epochs,
                                remainder)
  return _minibatch.scan(gather, fn, plan, carry, key, data)
