"""The rollout state: an immutable pytree of storage arrays and write counts."""

from __future__ import annotations

from typing import Any

from flax import struct
import jax
import numpy as np

from jrollout._types import Array


def is_array(x: Any) -> bool:
  """Whether a field's storage (or value) is one array, not a pytree."""
  return hasattr(x, "shape") and hasattr(x, "dtype")


class RolloutState(struct.PyTreeNode):
  """Storage for one rollout of E = ``num_envs`` envs over T = ``num_steps``.

  A frozen pytree: the arrays are leaves, the sizes are static (part of the
  treedef). It can be a ``jax.jit`` argument, a ``lax.scan`` carry, a
  ``jax.vmap``-ed stack of independent buffers, and it round-trips through
  ``flax.serialization.to_bytes`` / ``from_bytes``. Never mutate it: every
  function of jrollout returns a new state.

  Each field's shape and dtype are read off its storage array, so the set of
  names and their shapes and dtypes are static too (changing them retraces).

  Attributes:
    data: ``{name: [T, E, *shape]}`` storage, zero-initialised; a field
      registered with ``like=`` a pytree holds that pytree of ``[T, E, ...]``
      leaves.
    counts: ``[K, T] int32``: row ``i`` counts how many times each step of
      field ``names[i]`` (the names in sorted order) was written since the
      last ``make_batch``. One array for all fields keeps a write to few XLA
      ops; read it per field with ``jr.write_counts``.
    out_of_range: ``[K] int32``: how many writes to each field were aimed at a
      step outside ``[0, T)`` since the last ``make_batch``. Such writes are
      dropped, never clamped onto another step.
    num_envs: E, static.
    num_steps: T, static.
    container: static: the ``Container`` (``jrollout._containers``) of
      ``init(like=transition)`` for a NamedTuple or dataclass transition, in
      which ``make_batch`` returns the batch; None otherwise.

  Example:
    >>> import jax, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "obs", (4,))
    >>> state = jr.register(state, "r")
    >>> state.num_steps, state.num_envs, state.obs.shape   # [T, E, 4]
    (3, 2, (3, 2, 4))
    >>> [x.shape for x in jax.tree.leaves(state)]   # data, counts, out_of_range
    [(3, 2, 4), (3, 2), (2, 3), (2,)]
  """

  data: dict[str, Any]
  counts: Array
  out_of_range: Array
  num_envs: int = struct.field(pytree_node=False)
  num_steps: int = struct.field(pytree_node=False)
  container: Any = struct.field(pytree_node=False, default=None)

  @property
  def names(self) -> tuple[str, ...]:
    """The registered fields' names, sorted (the order of the pytree).

    Example:
      >>> import jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "obs", (4,))
      >>> jr.register(state, "action").names
      ('action', 'obs')
    """
    return tuple(sorted(self.data))

  def row(self, name: str) -> int:
    """The row of field ``name`` in ``counts`` and ``out_of_range``.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "obs", (4,))
      >>> state = jr.register(state, "action")
      >>> state = jr.update_at(state, 2, {"obs": np.zeros((2, 4))})
      >>> state.row("obs"), state.counts[state.row("obs")].tolist()
      (1, [0, 0, 1])
    """
    return self.names.index(name)

  def spec(self, name: str) -> Any:
    """``(shape, dtype)`` of one step of field ``name`` for one env (no T, E).

    For a pytree field (``register(like=)``): the pytree of
    ``jax.ShapeDtypeStruct`` of one step for one env.

    Example:
      >>> import jax.numpy as jnp, jrollout as jr
      >>> state = jr.init(num_envs=2, num_steps=3)
      >>> state = jr.register(state, "image", (8, 8), jnp.uint8)
      >>> state.spec("image")
      ((8, 8), dtype('uint8'))
    """
    arr = self.data[name]
    if not is_array(arr):
      return jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(tuple(x.shape[2:]), x.dtype), arr)
    return tuple(arr.shape[2:]), np.dtype(arr.dtype)

  def __getattr__(self, name: str) -> Array:
    # Attribute access to a field's storage (``state.obs``), as the original
    # ExperienceBuffer offered. Only called when normal lookup fails.
    data = self.__dict__.get("data")
    if data is not None and name in data:
      return data[name]
    raise AttributeError(
        f"RolloutState has no attribute or registered field {name!r}")
