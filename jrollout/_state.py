"""The rollout state (a frozen pytree of zero-initialised ``[T, E, ...]``
storage and ``[K, T]`` write counts): ``init``, ``register``, containers of
fields (a NamedTuple or dataclass transition) and the live-state check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._types import Array


class RolloutState(struct.PyTreeNode):
  """Storage for one rollout of E = ``num_envs`` envs over T = ``num_steps``.

  A frozen pytree: the arrays are leaves, the sizes static (part of the
  treedef), so it can be a ``jax.jit`` argument, a ``lax.scan`` carry or a
  ``jax.vmap``-ed stack. Every function returns a new state.

  Attributes:
    data: ``{name: [T, E, *shape]}`` storage (a field registered with
      ``like=`` holds that pytree of ``[T, E, ...]`` leaves).
    counts: ``[K, T] int32``: row ``i`` counts the writes of each step of
      field ``names[i]`` since the last ``make_batch``.
    out_of_range: ``[K] int32``: writes aimed outside ``[0, T)`` (dropped).
    num_envs: E, static.
    num_steps: T, static.
    container: static: the ``Container`` of ``init(like=)`` for a
      NamedTuple or dataclass, in which ``make_batch`` returns the batch.

  Example:
    >>> import jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "obs", (4,))
    >>> state.num_steps, state.num_envs, state.obs.shape   # [T, E, 4]
    (3, 2, (3, 2, 4))
  """

  data: dict[str, Any]
  counts: Array
  out_of_range: Array
  num_envs: int = struct.field(pytree_node=False)
  num_steps: int = struct.field(pytree_node=False)
  container: Any = struct.field(pytree_node=False, default=None)

  @property
  def names(self) -> tuple[str, ...]:
    """The fields' names, sorted (the order of ``counts``' rows).

    Example:
      >>> import jrollout as jr
      >>> jr.register(jr.register(jr.init(2, 3), "obs"), "act").names
      ('act', 'obs')
    """
    return tuple(sorted(self.data))

  def row(self, name: str) -> int:
    """The row of field ``name`` in ``counts`` and ``out_of_range``.

    Example:
      >>> import jrollout as jr
      >>> jr.register(jr.register(jr.init(2, 3), "obs"), "act").row("obs")
      1
    """
    return self.names.index(name)

  def spec(self, name: str) -> Any:
    """``(shape, dtype)`` of one step of field ``name`` for one env; for a
    pytree field, its pytree of ``jax.ShapeDtypeStruct``.

    Example:
      >>> import jax.numpy as jnp, jrollout as jr
      >>> state = jr.init(num_envs=2, num_steps=3)
      >>> jr.register(state, "image", (8, 8), jnp.uint8).spec("image")
      ((8, 8), dtype('uint8'))
    """
    storage = self.data[name]
    if is_array(storage):
      return tuple(storage.shape[2:]), np.dtype(storage.dtype)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape[2:]), x.dtype), storage)

  def __getattr__(self, name: str) -> Array:
    # ``state.obs``: a field's storage, as the original ExperienceBuffer.
    data = self.__dict__.get("data")
    if data is not None and name in data:
      return data[name]
    raise AttributeError(
        f"RolloutState has no attribute or registered field {name!r}")


def is_array(x: Any) -> bool:
  """Whether a field's storage (or value) is one array, not a pytree."""
  return hasattr(x, "shape") and hasattr(x, "dtype")


class Container(NamedTuple):
  """A NamedTuple or dataclass type of fields, without its values.

  Attributes:
    treedef: the container's treedef with one leaf per field.
    names: the fields' names in the treedef's order.
    type_name: the class name, for messages.
  """
  treedef: Any
  names: tuple[str, ...]
  type_name: str

  def rebuild(self, fields: Mapping[str, Any]) -> Any:
    """The container holding ``fields[name]`` for each of its fields."""
    return self.treedef.unflatten([fields[name] for name in self.names])


def named_fields(value: Any) -> tuple[dict[str, Any], Container] | None:
  """``({name: field value}, Container)`` of a NamedTuple or a registered
  dataclass with named children; None for anything else."""
  if type(value) is dict:
    return None
  try:
    children, treedef = jax.tree_util.tree_flatten_with_path(
        value, is_leaf=lambda y: y is not value)
  except Exception:   # noqa: BLE001  (not a pytree jax can flatten)
    return None
  if not children or children[0][1] is value:
    return None   # a leaf: an array-like or an unregistered object
  names: list[str] = []
  for path, _ in children:
    name = getattr(path[0], "name", getattr(path[0], "key", None))
    if not isinstance(name, str) or name in names:
      return None
    names.append(name)
  fields = {name: child for name, (_, child) in zip(names, children)}
  return fields, Container(treedef, tuple(names), type(value).__name__)


def as_values(values: Any) -> Any:
  """A write's ``data`` as ``{name: value}`` (a container of fields as the
  dict of its fields); anything else as it is, for the check to refuse."""
  if isinstance(values, Mapping):   # a chex dataclass is a Mapping too
    return values if type(values) is dict else dict(values.items())
  found = named_fields(values)
  return values if found is None else found[0]


def batch_fields(batch: Any) -> tuple[Any, Container | None]:
  """``(dict of fields, Container)`` of a container batch; ``(batch,
  None)`` for anything else."""
  if type(batch) is dict or isinstance(batch, RolloutState):
    return batch, None
  found = named_fields(batch)
  return (batch, None) if found is None else found


def init(num_envs: int, num_steps: int, *, like: Any = None) -> RolloutState:
  """An empty rollout state for E = ``num_envs`` envs over T = ``num_steps``.

  Args:
    num_envs: E, a positive int.
    num_steps: T, a positive int.
    like: optional, one step of a transition: a dict, NamedTuple or
      registered dataclass of ``[E, ...]`` values; each field is registered
      as by ``register(state, name, like=value)``, and ``make_batch``
      returns the batch in the NamedTuple or dataclass type.

  Returns:
    A RolloutState with no fields (or those of ``like``).

  Raises:
    TypeError: ``like`` is not a dict or a container of named fields.
    ValueError: a field of ``like`` is None; and as for ``register``.

  Example:
    >>> import jrollout as jr
    >>> state = jr.register(jr.init(num_envs=4, num_steps=8), "obs", (3,))
    >>> state.data["obs"].shape
    (8, 4, 3)
  """
  num_envs = _checks.positive_int("init", "num_envs", num_envs)
  num_steps = _checks.positive_int("init", "num_steps", num_steps)
  state = RolloutState(data={}, counts=jnp.zeros((0, num_steps), jnp.int32),
                       out_of_range=jnp.zeros((0,), jnp.int32),
                       num_envs=num_envs, num_steps=num_steps)
  if like is None:
    return state
  found = (like, None) if type(like) is dict else named_fields(like)
  if found is None:
    raise TypeError(
        "init: `like` must be one step of a transition: a dict, a "
        "NamedTuple or a registered dataclass of named fields, got "
        f"{type(like).__name__}")
  fields, container = found
  for name, value in fields.items():
    if value is None:
      raise ValueError(f"init: field {name!r} of `like` is None; give one "
                       "step's value of every field")
    state = _register("init", state, name, like=value)
  return state.replace(container=container)


def register(state: RolloutState, name: str, shape: tuple[int, ...] = (),
             dtype: Any = jnp.float32, *, like: Any = None) -> RolloutState:
  """Adds a field ``name`` with zero-initialised storage ``[T, E, *shape]``.

  With ``like``, one step's value of the field (a pytree of ``[E, ...]``
  arrays), the storage is that pytree of ``[T, E, ...]`` leaves and writes
  give every leaf; ``shape`` and ``dtype`` are then left out.

  Args:
    state: the rollout state.
    name: the new field's name, a str not registered yet.
    shape: the per-env, per-step shape, ``()`` for a scalar.
    dtype: a numeric or bool storage dtype (64-bit ones need x64).
    like: optional, the field's value for one step.

  Returns:
    A new state with the field added.

  Raises:
    TypeError: not a RolloutState, a name that is not a str, a bad shape or
      dtype, or both ``like`` and ``shape``/``dtype``.
    ValueError: the name is registered, or the storage would not fit in
      memory addresses; for a container state (``init(like=)``), any name.
    MemoryError: eagerly, the device has no memory for the storage.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=4, num_steps=8), "obs", (3,))
    >>> state = jr.register(state, "done", dtype=jnp.bool_)
    >>> state.names, state.counts.shape     # write counts [K, T]
    (('done', 'obs'), (2, 8))
  """
  if like is not None and (shape != () or dtype is not jnp.float32):
    raise TypeError("register: give either `like` or `shape`/`dtype`, not "
                    "both")
  if isinstance(state, RolloutState) and state.container is not None:
    raise ValueError(
        f"register: this state holds the fields of a "
        f"{state.container.type_name} (init(like=...)), in which make_batch "
        f"returns the batch; field {name!r} would not be in it. Add it to "
        "the container type, or compute it after the rollout and align it "
        "with jr.batch_rows")
  return _register("register", state, name, shape, dtype, like=like)


def _register(fn: str, state: RolloutState, name: str,
              shape: tuple[int, ...] = (), dtype: Any = jnp.float32, *,
              like: Any = None) -> RolloutState:
  check_state(fn, state)
  if not isinstance(name, str):
    raise TypeError(
        f"{fn}: `name` must be a str, got {type(name).__name__} {name!r}")
  if name in state.data:
    spec = state.spec(name)
    what = (f"shape {spec[0]}, dtype {spec[1].name}"
            if is_array(state.data[name]) else "a pytree")
    raise ValueError(f"{fn}: field {name!r} is already registered ({what}); "
                     "each name is registered once")
  if like is None:
    like = jax.ShapeDtypeStruct(
        (state.num_envs, *_checks.check_shape(fn, shape, name)),
        _checks.check_dtype(fn, name, dtype))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  if not leaves:
    raise ValueError(f"{fn}: field {name!r}: `like` holds no arrays")
  zeros = []
  for path, leaf in leaves:
    where = f"field {name!r}" + (
        f" leaf {jax.tree_util.keystr(path)}" if path else "")
    if not is_array(leaf):
      raise TypeError(f"{fn}: {where} of `like` is a {type(leaf).__name__}, "
                      "expected an array [E, ...] (its shape and dtype)")
    if tuple(leaf.shape[:1]) != (state.num_envs,):
      raise ValueError(
          f"{fn}: {where} of `like` has shape {tuple(leaf.shape)}, expected "
          f"[E, ...] with E = {state.num_envs} (one step of every env)")
    leaf_dtype = _checks.check_dtype(fn, name, leaf.dtype)
    zeros.append(_checks.zeros(fn, (state.num_steps, *leaf.shape),
                               leaf_dtype, name, " = [T, E] + shape"))
  row = sorted([*state.data, name]).index(name)

  def insert_zero_row(x: Array) -> Array:
    # A static slice-and-concatenate (jnp.insert adds an argsort when traced).
    zero = jnp.zeros((1, *x.shape[1:]), x.dtype)
    return jnp.concatenate([x[:row], zero, x[row:]], axis=0)

  return state.replace(
      data={**state.data, name: jax.tree_util.tree_unflatten(treedef, zeros)},
      counts=insert_zero_row(state.counts),
      out_of_range=insert_zero_row(state.out_of_range))


# --- The live check: one state, not a stack, not consumed. ---


def deleted(x: Any) -> bool:
  """Whether ``x`` is a concrete JAX array whose buffers were deleted."""
  return isinstance(x, jax.Array) and not isinstance(
      x, jax.core.Tracer) and x.is_deleted()


def consumed_keys(state: RolloutState) -> list[str]:
  """The parts of ``state`` whose buffers were deleted (donated)."""
  parts = {**state.data, "counts": state.counts,
           "out_of_range": state.out_of_range}
  return [name for name, value in parts.items()
          if any(deleted(x) for x in jax.tree_util.tree_leaves(value))]


def check_state(fn: str, state: Any, name: str = "state") -> RolloutState:
  """One live ``RolloutState``: a TypeError for another type, a ValueError
  for a stack of states (at trace time) or a consumed one (eagerly)."""
  if not isinstance(state, RolloutState):
    raise TypeError(
        f"{fn}: `{name}` must be a RolloutState, got "
        f"{type(state).__name__} (make one with jr.init and jr.register)")
  counts = state.counts
  if getattr(counts, "ndim", 2) != 2:
    how = "take one state out of the stack: jax.tree.map(lambda x: x[i], s)"
    if fn.isidentifier() and fn.islower():   # a function of jr, not a class
      how = (f"call {fn} under jax.vmap, which passes it one state at a "
             f"time (jax.vmap(jr.{fn})(states, ...)), or {how}")
    what = (f"its write counts have shape {tuple(counts.shape)}, one "
            f"state's are [K, T] = {tuple(counts.shape[-2:])}; leading axes "
            f"{tuple(counts.shape[:-2])}")
    raise ValueError(f"{fn}: `{name}` is a stack of states ({what}), e.g. "
                     f"made with jax.vmap; {how}")
  if not isinstance(counts, jax.core.Tracer):
    parts = consumed_keys(state)
    if parts:
      raise ValueError(
          f"{fn}: `{name}` was consumed: the buffers of {parts} were deleted "
          "when a call donated them (a jr.RolloutWriter or ExperienceBuffer "
          "consumes the state it is given, and a writer consumes each state "
          "read from it at its next flush). Use the state that call holds "
          "now (`writer.state`), not the one passed in or read before")
  return state
