"""Data parallelism: a rollout sharded over a mesh axis, sharded minibatching.

Built on JAX's own engine (a ``jax.sharding.Mesh`` of one host or many,
``NamedSharding`` placements, ``jax.shard_map``). ``shard`` splits the env
axis E of every storage array ``[T, E, ...]`` over the mesh axis ``axis_name``
(device ``d`` of D holds envs ``[d*E/D, (d+1)*E/D)``; the ledger is
replicated), and ``jrollout._buffer``'s functions keep that layout with no
collective; ``shard_rows`` lays out values and flat batches the same way.
``scan_minibatches_sharded`` runs ``scan_minibatches`` data-parallel, each
device on ``B / D`` rows of each minibatch: in ``"local"`` mode on its own
rows with the key ``fold_in(key, d)``, in ``"global"`` mode in the
single-device order after an all-gather. The exact rows of each mode, and
Explicit against Auto mesh axes: docs/guides/sharding.md.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jrollout import _checks
from jrollout import _minibatch
from jrollout import _plan
from jrollout import _rows
from jrollout._state import RolloutState
from jrollout._types import Array, AxisName, PRNGKey, PyTree, Remainder
from jrollout._types import ShardMode

MODES = ("local", "global")


def _axis(fn: str, mesh: Any, axis_name: Any) -> tuple[AxisName, int]:
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
  parts = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  for part in parts:
    if part not in names:
      raise ValueError(f"{fn}: `axis_name` {part!r} is not an axis of the mesh "
                       f"(axes: {names})")
  if len(set(parts)) != len(parts):
    raise ValueError(f"{fn}: `axis_name` {axis_name!r} repeats a mesh axis")
  size = math.prod(mesh.shape[part] for part in parts)
  return (axis_name if isinstance(axis_name, tuple) else parts[0]), size


def _is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _explicit(mesh: Mesh, axis_name: AxisName) -> bool:
  parts = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  return any(types[p] == jax.sharding.AxisType.Explicit for p in parts)


def _place(x: Any, sharding: NamedSharding, explicit: bool) -> Array:
  """``x`` laid out as ``sharding``: eagerly, or as a constraint under jit."""
  if _is_traced(x) and not explicit:
    return lax.with_sharding_constraint(x, sharding)
  return jax.device_put(x, sharding)   # under jit on Explicit axes: reshard


def shard(state: RolloutState, mesh: Mesh,
          axis_name: AxisName | None = None) -> RolloutState:
  """Splits the env axis of a rollout over ``axis_name``: each device, its envs.

  Every storage array ``[T, E, *shape]`` is placed on
  ``NamedSharding(mesh, P(None, axis_name))`` (device ``d`` of the D along
  ``axis_name`` holds envs ``[d*E/D, (d+1)*E/D)``); the counts ``[K, T]`` and
  out-of-range counters ``[K]`` are replicated (``P()``). The values are
  unchanged. Works eagerly (a ``jax.device_put``; on several hosts each
  process must pass the same values, e.g. a fresh ``jr.init``) and under
  ``jit`` (a sharding constraint, or a reshard on Explicit mesh axes).

  ``update_at``, ``update_all``, ``make_batch`` and ``finish_rollout`` keep
  this layout without gathering anything, provided the values written are
  laid out alike: ``[E, ...]`` values as ``P(axis_name)`` and ``[T, E, ...]``
  values as ``P(None, axis_name)`` (``shard_rows(values, mesh, axis_name)`` and
  ``shard_rows(values, mesh, axis_name, dim=1)``).

  Args:
    state: the rollout state (with its keys registered).
    mesh: a ``jax.sharding.Mesh``, on one host or several.
    axis_name: the mesh axis (or tuple of axes) to split the envs over; ``None``
      for the only axis of a 1-D mesh.

  Returns:
    The same state, placed.

  Raises:
    ValueError: E is not divisible by the size of ``axis_name``, or
      ``axis_name`` is not an axis of ``mesh``.

  Example:
    >>> import jax, jrollout as jr
    >>> mesh = jax.make_mesh((jax.device_count(),), ("envs",))
    >>> state = jr.register(jr.init(num_envs=8 * jax.device_count(),
    ...                             num_steps=4), "obs", (3,))
    >>> state = jr.shard(state, mesh, "envs")
    >>> state.data["obs"].sharding.spec
    P(None, 'envs')
  """
  if not isinstance(state, RolloutState):
    raise TypeError(f"shard: `state` must be a RolloutState, got "
                    f"{type(state).__name__}; use jr.shard_rows for a dict")
  _checks.check_state("shard", state)
  axis_name, size = _axis("shard", mesh, axis_name)
  if state.num_envs % size:
    raise ValueError(
        f"shard: num_envs E = {state.num_envs} is not divisible by the size "
        f"{size} of mesh axis {axis_name!r}; every device must hold the same "
        f"number of envs (use E = {_plan.multiples(state.num_envs, size)})")
  explicit = _explicit(mesh, axis_name)
  envs = NamedSharding(mesh, P(None, axis_name))
  rep = NamedSharding(mesh, P())
  return state.replace(
      data=jax.tree_util.tree_map(lambda v: _place(v, envs, explicit),
                                  state.data),
      counts=_place(state.counts, rep, explicit),
      out_of_range=_place(state.out_of_range, rep, explicit))


def shard_rows(tree: PyTree, mesh: Mesh, axis_name: AxisName | None = None, *,
               dim: int = 0) -> PyTree:
  """Splits axis ``dim`` of every leaf over the mesh axis ``axis_name``.

  ``dim=0`` places ``update_at`` data ``[E, ...]``, a batch dict
  ``{name: [L_k, ...]}`` or a ``make_batch`` output ``[E*T, ...]`` like a
  ``shard``-ed rollout; ``dim=1`` places ``update_all`` data
  ``[T, E, ...]``. Other axes are replicated. Eager or under ``jit``.

  Args:
    tree: a pytree of arrays, each with at least ``dim + 1`` axes.
    mesh: the mesh.
    axis_name: the mesh axis (or tuple of axes); ``None`` for a 1-D mesh's axis.
    dim: which array axis to split (0 or 1, usually): a non-negative int
      (a negative axis is refused, as its meaning would differ between
      leaves of different ranks).

  Returns:
    The same pytree, placed on
    ``NamedSharding(mesh, P(*[None]*dim, axis_name))``.

  Raises:
    TypeError: ``dim`` is not an int.
    ValueError: ``dim`` is negative, or a leaf's axis ``dim`` is missing or
      not divisible by the size of ``axis_name`` (the message names the leaf).

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> mesh = jax.make_mesh((jax.device_count(),), ("envs",))
    >>> E = 2 * jax.device_count()
    >>> obs = jr.shard_rows(np.zeros((E, 3), np.float32), mesh)   # [E, 3]
    >>> obs.sharding.spec, obs.addressable_shards[0].data.shape
    (P('envs',), (2, 3))
    >>> jr.shard_rows(np.zeros((5, E)), mesh, dim=1).sharding.spec  # [T, E]
    P(None, 'envs')
  """
  axis_name, size = _axis("shard_rows", mesh, axis_name)
  dim = _checks.check_int("shard_rows", "dim", dim, minimum=0)
  _checks.check_arrays("shard_rows", "tree", tree)
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if len(shape) <= dim:
      raise ValueError(f"shard_rows: leaf {jax.tree_util.keystr(path)!r} has "
                       f"shape {shape}, with no axis {dim} to shard")
    if shape[dim] % size:
      raise ValueError(
          f"shard_rows: leaf {jax.tree_util.keystr(path)!r} has {shape[dim]} "
          f"rows along axis {dim}, not divisible by the size {size} of mesh "
          f"axis_name {axis_name!r}")
  sharding = NamedSharding(mesh, P(*([None] * dim), axis_name))
  explicit = _explicit(mesh, axis_name)
  return jax.tree_util.tree_map(lambda x: _place(x, sharding, explicit), tree)


def minibatch_indices_sharded(key: PRNGKey | None, num_rows: int,
                            batch_size: int, *, num_shards: int,
                            mode: ShardMode = "local", shuffle: bool = True,
                            epoch: Array | int = 0,
                            remainder: Remainder = "error") -> Array:
  """The global rows each device takes, per minibatch, in one epoch.

  The reference for ``scan_minibatches_sharded``: device ``d``'s minibatch
  ``j`` is ``take(batch, idx[d, j])`` for a batch whose keys all have
  ``N`` rows (for shorter keys, see the wrap rules in the module doc).

  Args:
    key: a PRNG key; may be None when ``shuffle=False``.
    num_rows: N, the global number of rows.
    batch_size: B, the global minibatch size.
    num_shards: D, the number of devices along the sharded axis.
    mode: ``"local"`` or ``"global"``.
    shuffle: shuffle (else each order is the identity).
    epoch: which epoch.
    remainder: ``"error"``, ``"drop"`` or ``"wrap"`` (``minibatch_indices``);
      in local mode it applies to each device's ``N/D`` rows.

  Returns:
    ``[D, M, B/D] int32`` global row indices (M as ``minibatch_indices``
    gives it). In local mode ``idx[d] = d*N/D + minibatch_indices(
    fold_in(key, d), N/D, B/D)``; in global mode ``idx[:, j]`` is
    ``minibatch_indices(key, N, B)[j]`` split into D consecutive parts.

  Example:
    >>> import jrollout as jr
    >>> idx = jr.minibatch_indices_sharded(None, 8, 4, num_shards=2,
    ...                                  shuffle=False)   # N=8, B=4, D=2
    >>> idx.tolist()              # [D, M, B/D]: each device, its own rows
    [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    >>> jr.minibatch_indices_sharded(None, 8, 4, num_shards=2, mode="global",
    ...                            shuffle=False).tolist()
    [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
  """
  fn = "minibatch_indices_sharded"
  num_shards = _checks.positive_int(fn, "num_shards", num_shards)
  _check_mode(fn, mode)
  plan = _plan.plan(fn, num_rows, batch_size, key=key, shuffle=shuffle,
                    remainder=remainder, num_shards=num_shards,
                    axis="(num_shards)")
  epoch = _checks.check_epoch(fn, epoch)
  if mode == "global":
    idx = _plan.epoch_indices(plan, key, epoch)
    return jnp.swapaxes(idx.reshape(plan.num_batches, num_shards, -1), 0, 1)
  local = plan.split(num_shards)
  return jnp.stack([
      d * local.num_rows + _plan.epoch_indices(
          local, jax.random.fold_in(key, d)
          if key is not None and plan.shuffle else None, epoch)
      for d in range(num_shards)]).astype(jnp.int32)


def _check_mode(fn: str, mode: Any) -> None:
  if not isinstance(mode, str) or mode not in MODES:
    raise ValueError(f"{fn}: `mode` must be 'local' or 'global', got "
                     f"{mode!r}")


@dataclasses.dataclass(frozen=True)
class _GlobalTake:
  """Gather of global mode: this device's B/D slice of the global rows.

  A hashable value (not a closure) so that ``_minibatch.scan``, which takes
  the gather as a static argument, reuses its compilation.
  """
  axis_name: AxisName
  local_batch: int
  gather: Callable[[dict[str, PyTree], Array], dict[str, PyTree]]

  def __call__(self, data: dict[str, PyTree], rows: Array
               ) -> dict[str, PyTree]:
    start = lax.axis_index(self.axis_name) * self.local_batch
    return self.gather(data, lax.dynamic_slice_in_dim(rows, start,
                                                      self.local_batch))


# How JAX words a scan carry whose varying manual axes change: jax 0.10
# says "manual axis types do not match", jax 0.9 "varying manual axes do
# not match".
_VMA_HINTS = ("manual axis types do not match",
              "varying manual axes do not match")


def _epochs(fn, carry, key, data, *, layout, plan, mesh, axis_name, num_shards,
            mode, check_vma):
  """The shard_map-ed epochs (traced inside ``_run``'s jit)."""
  dim = layout.sharded_dim

  def per_device(carry, key, data):
    if mode == "global":
      data = jax.tree_util.tree_map(
          lambda v: lax.all_gather(v, axis_name, axis=dim, tiled=True), data)
      gather = _GlobalTake(axis_name, plan.batch_size // num_shards, layout)
      carry, outs = _minibatch.scan(gather, fn, plan, carry, key, data)
    else:
      device_key = (jax.random.fold_in(key, lax.axis_index(axis_name))
                    if plan.shuffle else None)
      carry, outs = _minibatch.scan(layout.shard(num_shards), fn,
                                    plan.split(num_shards), carry,
                                    device_key, data)
    return carry, jax.tree_util.tree_map(lambda o: o[None], outs)

  spec = P(*([None] * dim), axis_name)
  mapped = jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(P(), P(), jax.tree_util.tree_map(lambda _: spec, data)),
      out_specs=(P(), P(axis_name)), check_vma=check_vma)
  return mapped(carry, key, data)


_run = jax.jit(_epochs, static_argnums=(0,), static_argnames=(
    "layout", "plan", "mesh", "axis_name", "num_shards", "mode", "check_vma"))


def scan_minibatches_sharded(
    fn: Callable[[Any, dict[str, PyTree]], tuple[Any, Any]], carry: Any,
    key: PRNGKey | None, batch: Any, batch_size: int, *, mesh: Mesh,
    axis_name: AxisName | None = None, mode: ShardMode = "local",
    num_epochs: int = 1, shuffle: bool = True,
    remainder: Remainder = "error",
    check_vma: bool = True) -> tuple[Any, Any]:
  """``scan_minibatches`` data-parallel over a mesh axis, one ``shard_map``.

  ``fn(carry, minibatch) -> (carry, out)`` runs on every device along
  ``axis_name``, inside ``jax.shard_map``, on that device's ``b = B/D`` rows of
  each minibatch, so it may use collectives over ``axis_name``
  (``jax.lax.pmean``, ``psum``). ``carry`` is replicated: every device must
  end each step with the same carry, which is what makes data-parallel SGD
  correct. With ``check_vma=True`` (JAX's default) JAX checks that and
  ``jax.grad`` of replicated parameters already sums the per-device
  gradients over ``axis_name``; average them by differentiating
  ``jax.lax.pmean(loss, axis_name)`` (``pmean`` of the gradients would be a
  no-op on the sum). With ``check_vma=False`` the gradients are per-device,
  as under ``pmap``: ``pmean`` them yourself (nothing checks that you did).

  Modes (B is the global minibatch size in both, M as for
  ``scan_minibatches``; docs/guides/sharding.md gives the exact rows):

  - ``"local"`` (default): each device shuffles and minibatches only its own
    rows, with the key ``fold_in(key, d)``; an epoch moves no data between
    devices (only ``fn``'s own collectives). Device ``d`` computes exactly
    ``scan_minibatches(fn, carry, fold_in(key, d), shard_d, B // D)`` where
    ``shard_d`` is its shard of ``batch``.
  - ``"global"``: the single-device order (``minibatch_indices(key, N, B)``),
    so the union of the devices' minibatch ``j`` is ``scan_minibatches``'
    minibatch ``j``, row for row; it first all-gathers the batch onto every
    device (``(D-1)/D`` of the batch's bytes received per device, once per
    call) and needs the memory for the whole batch on each.

  Inputs should be laid out as ``shard`` / ``shard_rows`` put them (storage
  ``P(None, axis_name)``, a dict's leaves ``P(axis_name)``); inputs laid out
  otherwise are resharded first, and that moves data.
  Works eagerly (compiled once per shapes and ``fn``) and inside the
  caller's ``jit``.

  Args:
    fn: the update, ``(carry, {name: [B/D, ...]}) -> (carry, out)``.
    carry: the initial carry, replicated (e.g. the train state).
    key: a PRNG key, the same on every device and host; may be None when
      ``shuffle=False``.
    batch: a sharded RolloutState or ``{name: pytree of [L_k, ...]}``.
    batch_size: B, the global minibatch size; D must divide it, it must
      divide N unless ``remainder`` says otherwise.
    mesh: the ``jax.sharding.Mesh``.
    axis_name: the mesh axis (or tuple of axes) the envs / rows are split over;
      ``None`` for a 1-D mesh's axis.
    mode: ``"local"`` or ``"global"``.
    num_epochs: the number of epochs, each with a fresh order.
    shuffle: shuffle the rows.
    check_vma: passed to ``jax.shard_map`` (see above).
    remainder: ``"error"``, ``"drop"`` or ``"wrap"`` (``minibatch_indices``);
      global mode equals ``scan_minibatches`` with the same remainder, local
      mode applies it to each device's own rows.

  Returns:
    ``(carry, outs)``: the final carry (replicated) and ``outs`` with every
    leaf ``[D, num_epochs, M, ...]`` sharded ``P(axis_name)``: device ``d``'s
    own outputs (all equal if ``fn`` reduced them over ``axis_name``).

  Raises:
    ValueError: a length, E or B not divisible by D, B not dividing N, an
      unknown mode or axis_name (trace time, before anything runs); or ``fn``
      returned a carry that differs between devices (``check_vma=True``).

  Example:
    >>> import jax, jax.numpy as jnp, jrollout as jr
    >>> mesh = jax.make_mesh((jax.device_count(),), ("d",))
    >>> batch = jr.shard_rows({"x": jnp.arange(32.0)}, mesh)     # N = 32
    >>> def fn(total, mb):           # mb["x"]: this device's B/D rows
    ...   return total + jax.lax.psum(jnp.sum(mb["x"]), "d"), None
    >>> total, _ = jr.scan_minibatches_sharded(
    ...     fn, jnp.float32(0), jax.random.key(0), batch, 16, mesh=mesh,
    ...     num_epochs=2)
    >>> total.item()                 # every row once per epoch: 2 * 496
    992.0
  """
  name = "scan_minibatches_sharded"
  _checks.check_callable(name, "fn", fn)
  _checks.check_arrays(name, "carry", carry)
  axis_name, size = _axis(name, mesh, axis_name)
  _check_mode(name, mode)
  check_vma = _checks.check_bool(name, "check_vma", check_vma)
  layout, data, lengths = _rows.rows(name, batch)
  layout.check_shardable(name, lengths, size, axis_name)
  plan = _plan.plan(name, max(lengths.values()), batch_size, key=key,
                    shuffle=shuffle, num_epochs=num_epochs,
                    remainder=remainder, num_shards=size, axis=axis_name)
  explicit = _explicit(mesh, axis_name)
  spec = NamedSharding(mesh, P(*([None] * layout.sharded_dim), axis_name))
  data = jax.tree_util.tree_map(
      lambda v: _place_if_needed(v, spec, explicit), data)
  try:
    return _run(fn, carry, key, data, layout=layout, plan=plan, mesh=mesh,
                axis_name=axis_name, num_shards=size, mode=mode,
                check_vma=check_vma)
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


def _place_if_needed(x: Any, sharding: NamedSharding, explicit: bool) -> Any:
  """Reshards a concrete array only if it is not laid out as ``sharding``."""
  if _is_traced(x):
    return _place(x, sharding, explicit) if explicit else x
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding,
                                                              x.ndim):
    return x
  return jax.device_put(x, sharding)
