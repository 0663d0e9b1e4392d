"""Type aliases and the dimension legend used in every docstring.

Dimension letters:
  T: ``num_steps``, the length of a rollout.
  E: ``num_envs``, the number of parallel environments.
  N: rows of a flat batch (``N = E * T`` for a rollout batch).
  B: rows of one minibatch.
  M: number of minibatches in one epoch (``M = N // B``).
"""

from __future__ import annotations

from typing import Any, Literal

import jax

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
PyTree = Any
PRNGKey = jax.Array
# A mapped or mesh axis name (``axis_name`` everywhere), or a tuple of them.
AxisName = str | tuple[str, ...]

# The mode strings, one Literal each (the values are checked at call time).
Remainder = Literal["error", "drop", "wrap"]     # B not dividing N
ShardMode = Literal["local", "global"]           # minibatches over a mesh
Check = Literal["error", "callback", "off"]      # the write check
AutoresetMode = Literal["next_step", "same_step"]
