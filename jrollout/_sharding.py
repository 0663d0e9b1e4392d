"""Data parallelism on a ``jax.sharding.Mesh`` of one host or many: ``shard``
splits the env axis E of every storage array ``[T, E, ...]`` over the mesh
axis ``axis_name`` (device ``d`` of D holds envs ``[d*E/D, (d+1)*E/D)``, the
ledger replicated), ``shard_rows`` lays out values and flat batches the same
way, and the writes keep that layout with no collective.
``scan_minibatches(..., mesh=)`` runs here under ``jax.shard_map``: each
device on ``B / D`` rows of every minibatch, in ``"local"`` mode its own rows
with the key ``fold_in(key, d)``, in ``"global"`` mode the single-device
order after an all-gather (docs/guides/sharding.md gives the exact rows, and
Explicit against Auto mesh axes).
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax import lax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jrollout import _checks
from jrollout import _plan
from jrollout import _state
from jrollout._types import AxisName, PRNGKey, PyTree


def axis(fn: str, mesh: Any, axis_name: Any) -> tuple[AxisName, int]:
  """Validates ``mesh`` / ``axis_name``; returns the axis (or tuple) and D."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"{fn}: `mesh` must be a jax.sharding.Mesh (e.g. "
                    f"jax.make_mesh((8,), ('envs',))), got "
                    f"{type(mesh).__name__}")
  names = tuple(mesh.axis_names)
  if axis_name is None:
    if len(names) != 1:
      raise ValueError(f"{fn}: the mesh has axes {names}; pass `axis_name=` "
                       "to say which one the envs are sharded over")
    axis_name = names[0]
  parts = _parts(axis_name)
  for part in parts:
    if part not in names:
      raise ValueError(f"{fn}: `axis_name` {part!r} is not an axis of the mesh "
                       f"(axes: {names})")
  if len(set(parts)) != len(parts):
    raise ValueError(f"{fn}: `axis_name` {axis_name!r} repeats a mesh axis")
  return axis_name, math.prod(mesh.shape[part] for part in parts)


def _parts(axis_name: AxisName) -> tuple[Any, ...]:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_mode(fn: str, mode: Any) -> None:
  """Refuses a sharded-minibatch mode other than ``"local"``/``"global"``."""
  if not isinstance(mode, str) or mode not in ("local", "global"):
    raise ValueError(f"{fn}: `mode` must be 'local' or 'global', got "
                     f"{mode!r}")


def _place(tree: PyTree, mesh: Mesh, axis_name: AxisName, spec: P, *,
           lazy: bool = False) -> PyTree:
  """Every leaf of ``tree`` laid out as ``NamedSharding(mesh, spec)``.

  Eagerly a ``jax.device_put``; a traced leaf gets a sharding constraint,
  or a reshard where an axis of ``axis_name`` is Explicit. ``lazy`` (the
  sharded scan's inputs) keeps a concrete array already laid out so, not
  ``device_put`` again on every call, and leaves a traced one on Auto axes
  to ``shard_map``'s input spec.
  """
  sharding = NamedSharding(mesh, spec)
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  explicit = any(types[part] == jax.sharding.AxisType.Explicit
                 for part in _parts(axis_name))

  def place(x: Any) -> Any:
    traced = isinstance(x, jax.core.Tracer)
    if traced and not explicit:
      return x if lazy else lax.with_sharding_constraint(x, sharding)
    if (lazy and not traced and isinstance(x, jax.Array)
        and x.sharding.is_equivalent_to(sharding, x.ndim)):
      return x
    return jax.device_put(x, sharding)   # under jit on Explicit axes: reshard

  return jax.tree_util.tree_map(place, tree)


def shard(state: _state.RolloutState, mesh: Mesh,
          axis_name: AxisName | None = None) -> _state.RolloutState:
  """Splits the env axis of a rollout over ``axis_name``: each device, its envs.

  Every storage array ``[T, E, *shape]`` is placed on ``NamedSharding(mesh,
  P(None, axis_name))``, the write counts replicated; the values are
  unchanged. Eagerly a ``jax.device_put`` (on several hosts each process
  passes the same values, e.g. a fresh ``jr.init``); under ``jit`` a
  sharding constraint, or a reshard on Explicit mesh axes. The writes and
  ``make_batch`` keep this layout without a collective when their values
  are laid out alike (``shard_rows``).

  Args:
    state: the rollout state (with its fields registered).
    mesh: a ``jax.sharding.Mesh``, on one host or several.
    axis_name: the mesh axis (or axes) to split the envs over; None for the
      only axis of a 1-D mesh.

  Returns:
    The same state, placed.

  Raises:
    TypeError: ``state`` is not a RolloutState, ``mesh`` not a Mesh.
    ValueError: E not divisible by the size of ``axis_name``, or
      ``axis_name`` not an axis of ``mesh``.

  Example:
    >>> import jax, jrollout as jr
    >>> mesh = jax.make_mesh((jax.device_count(),), ("envs",))
    >>> state = jr.register(jr.init(num_envs=8 * jax.device_count(),
    ...                             num_steps=4), "obs", (3,))
    >>> jr.shard(state, mesh, "envs").data["obs"].sharding.spec
    P(None, 'envs')
  """
  _state.check_state("shard", state)
  axis_name, size = axis("shard", mesh, axis_name)
  if state.num_envs % size:
    raise ValueError(
        f"shard: num_envs E = {state.num_envs} is not divisible by the size "
        f"{size} of mesh axis {axis_name!r}; every device must hold the same "
        f"number of envs (use E = {_plan.multiples(state.num_envs, size)})")
  counts, out_of_range = _place((state.counts, state.out_of_range), mesh,
                                axis_name, P())
  return state.replace(
      data=_place(state.data, mesh, axis_name, P(None, axis_name)),
      counts=counts, out_of_range=out_of_range)


def shard_rows(tree: PyTree, mesh: Mesh, axis_name: AxisName | None = None, *,
               dim: int = 0) -> PyTree:
  """Splits axis ``dim`` of every leaf over the mesh axis ``axis_name``.

  ``dim=0`` places ``update_at`` data ``[E, ...]`` or a batch ``{name:
  [L_k, ...]}`` like a ``shard``-ed rollout, ``dim=1`` ``update_all`` data
  ``[T, E, ...]``; other axes are replicated. Eager or under ``jit``.

  Args:
    tree: a pytree of arrays, each with at least ``dim + 1`` axes.
    mesh: the mesh.
    axis_name: the mesh axis (or axes); None for a 1-D mesh's axis.
    dim: the array axis to split, a non-negative int (a negative one would
      mean different axes in leaves of different ranks).

  Returns:
    The same pytree on ``NamedSharding(mesh, P(*[None]*dim, axis_name))``.

  Raises:
    TypeError: ``dim`` is not an int.
    ValueError: ``dim`` negative, a leaf's axis ``dim`` missing or not
      divisible by the size of ``axis_name`` (naming the leaf).

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> mesh = jax.make_mesh((jax.device_count(),), ("envs",))
    >>> E = 2 * jax.device_count()
    >>> obs = jr.shard_rows(np.zeros((E, 3), np.float32), mesh)   # [E, 3]
    >>> obs.sharding.spec, obs.addressable_shards[0].data.shape
    (P('envs',), (2, 3))
  """
  axis_name, size = axis("shard_rows", mesh, axis_name)
  dim = _checks.check_int("shard_rows", "dim", dim, minimum=0)
  _checks.check_arrays("shard_rows", "tree", tree)
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shape = np.shape(leaf)
    if len(shape) <= dim:
      raise ValueError(f"shard_rows: leaf {jax.tree_util.keystr(path)!r} has "
                       f"shape {shape}, with no axis {dim} to shard")
    if shape[dim] % size:
      raise ValueError(
          f"shard_rows: leaf {jax.tree_util.keystr(path)!r} has {shape[dim]} "
          f"rows along axis {dim}, not divisible by the size {size} of mesh "
          f"axis_name {axis_name!r}")
  return _place(tree, mesh, axis_name, P(*([None] * dim), axis_name))


# How JAX words a scan carry whose varying manual axes change: jax 0.10
# says "manual axis types do not match", jax 0.9 "varying manual axes do
# not match".
_VMA_HINTS = ("manual axis types do not match",
              "varying manual axes do not match")


def _epochs(name, fn, carry, key, data, *, layout, plan, mesh, axis_name,
            num_shards, mode, check_vma):
  """The shard_map-ed epochs (traced inside ``_run``'s jit)."""
  dim = layout.sharded_dim

  def per_device(carry, key, data):
    if mode == "global":   # the global rows, of which this device's B / D
      data = lax.all_gather(data, axis_name, axis=dim, tiled=True)
      size = plan.batch_size // num_shards

      def rows_of(data, rows):
        start = lax.axis_index(axis_name) * size
        return layout(data, lax.dynamic_slice_in_dim(rows, start, size))
      device_plan = plan
    else:   # this device's own rows, with the key fold_in(key, d)
      rows_of, device_plan = layout.shard(num_shards), plan.split(num_shards)
      key = (jax.random.fold_in(key, lax.axis_index(axis_name))
             if plan.shuffle else None)
    carry, outs = _plan.scan(rows_of, fn, device_plan, carry, key, data,
                             name=name)
    return carry, jax.tree_util.tree_map(lambda o: o[None], outs)

  mapped = jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(P(), P(), P(*([None] * dim), axis_name)),
      out_specs=(P(), P(axis_name)), check_vma=check_vma)
  return mapped(carry, key, data)


_run = jax.jit(_epochs, static_argnums=(0, 1), static_argnames=(
    "layout", "plan", "mesh", "axis_name", "num_shards", "mode", "check_vma"))


def scan(name: str, fn: Any, carry: Any, key: PRNGKey | None,
         data: dict[str, PyTree], *, layout: Any, plan: _plan.Plan,
         mesh: Mesh, axis_name: AxisName, num_shards: int, mode: str,
         check_vma: bool) -> tuple[Any, Any]:
  """``scan_minibatches`` with ``mesh=``, its arguments validated: ``data``
  placed as ``layout`` is sharded, then ``fn`` over every device's share.

  Raises:
    ValueError: ``fn`` returned a carry that differs between devices
      (``check_vma=True``).
  """
  data = _place(data, mesh, axis_name,
                P(*([None] * layout.sharded_dim), axis_name), lazy=True)
  try:
    return _run(name, fn, carry, key, data, layout=layout, plan=plan,
                mesh=mesh, axis_name=axis_name, num_shards=num_shards,
                mode=mode, check_vma=check_vma)
  except TypeError as e:
    if not any(hint in str(e) for hint in _VMA_HINTS):
      raise
    raise ValueError(
        f"{name}: `fn` returned a carry that varies across the devices of "
        f"mesh axis {axis_name!r} (it depends on the device's own minibatch "
        "rows without a reduction). Every device must end each step with the "
        "same carry: reduce over the axis, e.g. differentiate "
        f"jax.lax.pmean(loss, {axis_name!r}) or pmean the values you keep. "
        f"JAX's message:\n{e}") from None
