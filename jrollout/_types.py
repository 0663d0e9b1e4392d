"""Type aliases and the dimension legend used in every docstring.

Dimension letters:
  T: ``num_steps``, the length of a rollout.
  E: ``num_envs``, the number of parallel environments.
  N: rows of a flat batch (``N = E * T`` for a rollout batch).
  B: rows of one minibatch.
  M: number of minibatches in one epoch (``M = N // B``).
"""

from __future__ import annotations

from typing import Any

import jax

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
PyTree = Any
PRNGKey = jax.Array
