"""Running statistics (``RunningStats``): count, mean and ``M2`` per element
of one sample's shape, or of each leaf of a pytree sample, merged with Chan,
Golub and LeVeque's parallel update and exact across devices with
``axis_name``; the count is two uint32 words, the mean and ``M2``
compensated ``(hi, lo)`` pairs, and samples the statistics cannot hold are
counted in ``nonfinite`` (docs/guides/running-stats.md, "Numerics")."""

from __future__ import annotations

import functools
import operator
from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._checks import shape_of
from jrollout._types import Array
from jrollout._types import ArrayLike
from jrollout._types import AxisName

_TWO_32 = 4294967296.0
_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


class RunningStats(struct.PyTreeNode):
  """Count, mean and variance of a stream of samples of one shape, or of one
  pytree of shapes (observation groups: ``{"policy": [48], "critic": [60]}``).

  A frozen pytree (``jit`` argument, ``scan`` carry, ``vmap`` operand for a
  stack of statistics, ``flax.serialization``). Made by
  ``jr.init_running_stats``, read with ``mean``, ``variance``, ``std`` and
  ``count``. For a pytree sample each ``mean_*`` / ``m2_*`` field is a pytree
  of the sample's structure.

  Attributes:
    count_hi: ``[]`` uint32, the high word of the sample count.
    count_lo: ``[]`` uint32, the low word (``count = hi * 2**32 + lo``).
    mean_hi: ``[*shape]`` the mean rounded to the dtype.
    mean_lo: ``[*shape]`` the rest: ``mean = mean_hi + mean_lo``.
    m2_hi: ``[*shape]`` the sum of squared deviations, rounded.
    m2_lo: ``[*shape]`` the rest: ``M2 = m2_hi + m2_lo``.
    nonfinite: ``[]`` uint32, samples left out (a NaN or inf element, or
      too far from the mean to hold); saturates at ``2**32 - 1``.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats((2,)),
    ...                                 jnp.array([[1., 10.], [3., 30.]]))
    >>> stats.shape, stats.dtype, float(stats.count), int(stats.nonfinite)
    ((2,), dtype('float32'), 2.0, 0)
    >>> stats.mean.tolist(), stats.variance.tolist(), stats.std.tolist()
    ([2.0, 20.0], [1.0, 100.0], [1.0, 10.0])
  """
  count_hi: Array
  count_lo: Array
  mean_hi: Any
  mean_lo: Any
  m2_hi: Any
  m2_lo: Any
  nonfinite: Array

  @property
  def shape(self) -> Any:
    """One sample's shape (a stack's axes excluded), or a pytree of them."""
    lead = jnp.ndim(self.count_hi)
    return jax.tree.map(lambda m: tuple(m.shape[lead:]), self.mean_hi)

  @property
  def dtype(self) -> np.dtype:
    """The floating dtype of the mean and variance."""
    return np.dtype(jax.tree.leaves(self.mean_hi)[0].dtype)

  @property
  def count(self) -> Array:
    """``[]`` the count as a float of ``dtype`` (``exact_count()`` is exact)."""
    return _count_float(self.count_hi, self.count_lo, self.dtype)

  @property
  def mean(self) -> Any:
    """``[*shape]`` the mean of all samples, 0 before the first."""
    return jax.tree.map(jnp.add, self.mean_hi, self.mean_lo)

  @property
  def variance(self) -> Any:
    """``[*shape]`` the population variance ``M2 / count`` (``ddof=0``),
    never negative; 1 before the first sample."""
    count = self.count

    def leaf(m2_hi: Array, m2_lo: Array) -> Array:
      n = jnp.broadcast_to(
          jnp.reshape(count, count.shape + (1,) * (m2_hi.ndim - count.ndim)),
          m2_hi.shape)
      m2 = jnp.maximum(m2_hi + m2_lo, 0)
      return jnp.where(n > 0, m2 / jnp.maximum(n, 1),
                       jnp.ones((), self.dtype))

    return jax.tree.map(leaf, self.m2_hi, self.m2_lo)

  @property
  def std(self) -> Any:
    """``[*shape]`` ``sqrt(variance)``."""
    return jax.tree.map(jnp.sqrt, self.variance)

  def exact_count(self) -> Any:
    """The exact count on the host: an ``int`` (a uint64 array for a stack).
    Not traceable.

    Example:
      >>> import jax.numpy as jnp, jrollout as jr
      >>> jr.update_running_stats(jr.init_running_stats(),
      ...                         jnp.ones(5)).exact_count()
      5
    """
    hi = np.asarray(self.count_hi).astype(np.uint64)
    lo = np.asarray(self.count_lo).astype(np.uint64)
    count = (hi << np.uint64(32)) | lo
    return int(count) if count.ndim == 0 else count


# --- Compensated arithmetic (error-free transformations). ---


def _add_saturating(count: Array, n: Array) -> Array:
  """``count + n`` in uint32, held at ``2**32 - 1`` instead of wrapping."""
  total = count + n
  return jnp.where(total < count, jnp.uint32(0xFFFFFFFF), total)


def _two_sum(a: Array, b: Array) -> tuple[Array, Array]:
  """Knuth's TwoSum: ``s + err == a + b`` exactly, ``s = fl(a + b)``."""
  s = a + b
  bb = s - a
  err = (a - (s - bb)) + (b - bb)
  return s, err


def _add_compensated(hi: Array, lo: Array, x: Array) -> tuple[Array, Array]:
  """``(hi, lo) + x`` as a renormalised pair."""
  s, err = _two_sum(hi, x)
  return _two_sum(s, lo + err)


def _count_float(hi: Array, lo: Array, dtype: Any) -> Array:
  return hi.astype(dtype) * jnp.asarray(_TWO_32, dtype) + lo.astype(dtype)


def _add_count(hi: Array, lo: Array, n_hi: Array,
               n_lo: Array) -> tuple[Array, Array]:
  """Adds two 64-bit counts held as uint32 word pairs, with the carry."""
  new_lo = lo + n_lo
  carry = (new_lo < lo).astype(jnp.uint32)
  return hi + n_hi + carry, new_lo


def _pow2(k: Array, dtype: Any) -> Array:
  """``2.0**k`` exactly, built from its bits (``k`` a normal exponent)."""
  info = jnp.finfo(dtype)
  bits = (k + (int(info.maxexp) - 1)).astype(_UINT[np.dtype(dtype).itemsize])
  return jax.lax.bitcast_convert_type(bits << int(info.nmant), dtype)


def _merge(stats: RunningStats, n_hi: Array, n_lo: Array, mean_hi: list,
           mean_lo: list, m2: list, nonfinite: Array) -> RunningStats:
  """Chan et al.'s merge of ``stats`` with a batch ``(n, mean, M2)`` of leaf
  lists, the mean formed from the side with more samples. An empty batch, or
  one the dtype cannot hold in some leaf, leaves ``stats`` bit for bit but
  ``nonfinite`` (+ the batch's left-out samples, or its whole count)."""
  dtype = stats.dtype
  n_a = _count_float(stats.count_hi, stats.count_lo, dtype)
  n_b = _count_float(n_hi, n_lo, dtype)
  count_hi, count_lo = _add_count(stats.count_hi, stats.count_lo, n_hi, n_lo)
  n = jnp.maximum(_count_float(count_hi, count_lo, dtype), 1)
  w_a, w_b = n_a / n, n_b / n
  use_b = n_b >= n_a
  weight = n_a * w_b

  def leaf(a_hi: Array, a_lo: Array, a_m2_hi: Array, a_m2_lo: Array,
           b_hi: Array, b_lo: Array, b_m2: Array) -> tuple[Array, ...]:
    # delta = mean_b - mean_a, its leading difference taken exactly.
    d_hi, d_err = _two_sum(b_hi, -a_hi)
    delta = d_hi + (d_err + (b_lo - a_lo))
    from_a = _add_compensated(a_hi, a_lo, delta * w_b)
    from_b = _add_compensated(b_hi, b_lo, -(delta * w_a))
    new_hi = jnp.where(use_b, from_b[0], from_a[0])
    new_lo = jnp.where(use_b, from_b[1], from_a[1])
    # M2 += delta**2 * n_a * n_b / n; delta**2 may overflow where the
    # product does not, then delta * (delta * weight).
    cross = delta * delta * weight
    cross = jnp.where(jnp.isfinite(cross), cross, delta * (delta * weight))
    m2_hi, m2_lo = _add_compensated(a_m2_hi, a_m2_lo, b_m2 + cross)
    return new_hi, new_lo, m2_hi, m2_lo

  treedef = jax.tree.structure(stats.mean_hi)
  mine = [jax.tree.leaves(t) for t in (stats.mean_hi, stats.mean_lo,
                                       stats.m2_hi, stats.m2_lo)]
  leaves = [leaf(*args) for args in zip(*mine, mean_hi, mean_lo, m2,
                                        strict=True)]
  new = [jax.tree_util.tree_unflatten(treedef, part)
         for part in zip(*leaves, strict=True)]
  merged = RunningStats(count_hi=count_hi, count_lo=count_lo,
                        mean_hi=new[0], mean_lo=new[1], m2_hi=new[2],
                        m2_lo=new[3], nonfinite=stats.nonfinite)
  empty = (n_hi == 0) & (n_lo == 0)
  held = functools.reduce(operator.and_, [
      jnp.all(jnp.isfinite(hi) & jnp.isfinite(lo) & jnp.isfinite(m2h)
              & jnp.isfinite(m2l)) for hi, lo, m2h, m2l in leaves])
  merged = jax.tree.map(lambda old, new: jnp.where(empty | ~held, old, new),
                        stats, merged)
  refused = jnp.where(empty | held, jnp.uint32(0),
                      jnp.where(n_hi > 0, jnp.uint32(0xFFFFFFFF), n_lo))
  return merged.replace(nonfinite=_add_saturating(
      _add_saturating(stats.nonfinite, nonfinite), refused))


# --- Checks. ---


def _check_stats(fn: str, name: str, stats: Any) -> None:
  """One ``RunningStats`` (not a stack made with ``jax.vmap``)."""
  _checks.check_instance(fn, name, stats, RunningStats, "init_running_stats")
  _checks.check_unstacked(fn, name, stats.count_hi, "statistics")


def _paths(tree: Any) -> list[str]:
  return [jax.tree_util.keystr(p)
          for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _samples(fn: str, name: str, stats: RunningStats,
             x: Any) -> list[tuple[str, Any, tuple[int, ...]]]:
  """``[(name, leaf, leading axes)]`` of ``x``, checked against the sample
  structure: a TypeError for another structure or a leaf not floating, a
  ValueError for a leaf missing or extra, or not ``[..., *shape]``."""
  treedef: Any = jax.tree.structure(stats.mean_hi)
  got, got_def = jax.tree_util.tree_flatten_with_path(x)
  if got_def != treedef:
    want, have = _paths(stats.mean_hi), _paths(x)
    missing = [w for w in want if w not in have]
    extra = [h for h in have if h not in want]
    same_kind = type(x) is type(stats.mean_hi) and bool(missing or extra)
    raise (ValueError if same_kind else TypeError)(
        f"{fn}: `{name}` has structure {got_def}, expected {treedef}, the "
        "statistics' sample structure" + (
            f": missing leaves {missing}, unexpected leaves {extra}"
            if same_kind else ""))
  lead = jnp.ndim(stats.count_hi)
  out = []
  for (path, leaf), mean in zip(got, jax.tree.leaves(stats.mean_hi),
                                strict=True):
    where = name + jax.tree_util.keystr(path)
    _checks.check_floating(fn, where, leaf)
    out.append((where, leaf, _checks.check_trailing(
        fn, where, leaf, tuple(mean.shape[lead:]),
        "the statistics' sample shape")))
  return out


def check_axis_name(fn: str, axis_name: Any) -> None:
  """A ValueError unless ``axis_name`` is None or bound by a map here."""
  if axis_name is None:
    return
  try:
    jax.lax.psum(1, axis_name)   # the axis size: static, no collective
  except NameError as err:
    raise ValueError(
        f"{fn}: `axis_name` {axis_name!r} is not bound here ({err}); call "
        f"{fn} inside jax.shard_map, jax.pmap or jax.vmap over that axis, "
        "or pass axis_name=None for the local batch alone") from None


def _is_shape(value: Any) -> bool:
  """A leaf of a tree of shapes: a tuple or list of no containers. A
  NamedTuple is a container."""
  return (isinstance(value, (tuple, list)) and not hasattr(value, "_fields")
          and not any(isinstance(d, (tuple, list, dict)) for d in value))


# --- Public API. ---


def init_running_stats(shape: Any = (), dtype: Any = jnp.float32
                       ) -> RunningStats:
  """Empty running statistics: count 0, mean 0, variance 1.

  Args:
    shape: one sample's shape (``()`` for scalars), or a pytree of shapes
      (dicts, NamedTuples, tuples of tuples) such as observation groups
      ``{"policy": (48,), "critic": (60,)}``: a sample is then one value of
      that structure, and every function takes and returns it.
    dtype: the floating dtype of the mean and variance.

  Returns:
    A ``RunningStats``.

  Raises:
    TypeError: a shape is not a tuple of ints, or ``dtype`` is not a
      floating dtype available without x64.
    ValueError: a negative dimension, a tree with no shape, or too large.

  Example:
    >>> import jrollout as jr
    >>> jr.init_running_stats({"policy": (48,), "critic": (60,)}).shape
    {'critic': (60,), 'policy': (48,)}
  """
  fn = "init_running_stats"
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      shape, is_leaf=_is_shape)
  if not leaves:
    raise ValueError(f"{fn}: `shape` {shape!r} holds no shape (an empty "
                     f"tree); give a tuple of ints or a pytree of them")
  dtype = _checks.check_float_dtype(fn, "dtype", dtype)
  shapes = [_checks.check_shape(
      fn, leaf, arg="shape" + jax.tree_util.keystr(path))
      for path, leaf in leaves]
  for one in shapes:
    _checks.check_size(fn, one, dtype)
  zero = jnp.zeros((), jnp.uint32)
  zeros = jax.tree_util.tree_unflatten(
      treedef, [_checks.zeros(fn, one, dtype) for one in shapes])
  return RunningStats(count_hi=zero, count_lo=zero, mean_hi=zeros,
                      mean_lo=zeros, m2_hi=zeros, m2_lo=zeros, nonfinite=zero)


def update_running_stats(stats: RunningStats, x: Any, *,
                         valid: ArrayLike | None = None,
                         axis_name: AxisName | None = None) -> RunningStats:
  """Folds a batch of samples into running statistics.

  Every index of ``x``'s leading axes is one sample (``[E, *shape]`` for one
  step, ``[T, E, *shape]`` for a rollout; for a pytree sample, the same index
  across every leaf). Updating with ``x1`` then ``x2`` equals updating with
  their concatenation, up to rounding. With ``axis_name`` the batch is
  combined over that mapped axis (``psum``), so every device ends with the
  statistics of all devices' samples (``stats`` the same on every device).
  Left out and counted in ``nonfinite``: a sample with a NaN or inf element;
  one farther than ``sqrt((F - M2) * (n + 1) / n)`` from the mean of the
  ``n`` samples so far (``F`` the dtype's largest value); every sample of a
  batch whose merged mean or ``M2`` would not be finite (the statistics then
  stay as they were). Samples with ``valid`` False are not counted.

  Args:
    stats: the statistics (one; vmap over a stack).
    x: ``[..., *stats.shape]`` floating samples (a pytree of them), cast to
      ``stats.dtype``; at most ``2**31 - 1`` per call over all devices.
    valid: optional ``[...]`` bool, ``x``'s leading shape; False excludes.
    axis_name: a mapped axis name (or tuple) to combine over, or None.

  Returns:
    The updated ``RunningStats``.

  Raises:
    TypeError: ``stats`` not a ``RunningStats``, ``x`` of another structure
      or not floating, ``valid`` not bool.
    ValueError: a leaf (named by its path) not ``[..., *shape]``, missing or
      extra; leaves' leading axes that differ; ``valid`` not of the leading
      shape; ``stats`` a stack; ``axis_name`` not bound by an enclosing map.

  Example:
    >>> import jax, jax.numpy as jnp, jrollout as jr
    >>> f = lambda x: jr.update_running_stats(jr.init_running_stats(), x,
    ...                                       axis_name="d")
    >>> out = jax.vmap(f, axis_name="d")(jnp.arange(8.).reshape(4, 2))
    >>> out.mean.tolist(), out.variance.tolist()   # each device: all 8
    ([3.5, 3.5, 3.5, 3.5], [5.25, 5.25, 5.25, 5.25])
  """
  fn = "update_running_stats"
  _check_stats(fn, "stats", stats)
  samples = _samples(fn, "x", stats, x)
  first, _, leading = samples[0]
  for where, _, lead in samples:
    if lead != leading:
      raise ValueError(
          f"{fn}: `{where}` has leading axes {lead}, expected {leading} like "
          f"`{first}`: every leaf holds the same samples")
  if valid is not None:
    _checks.check_bool_array(fn, "valid", valid)
    if shape_of(valid) != leading:
      raise ValueError(
          f"{fn}: `valid` has shape {shape_of(valid)}, expected {leading}, "
          "the leading axes of `x`")
  check_axis_name(fn, axis_name)

  dtype = stats.dtype
  xs = [jnp.asarray(leaf).astype(dtype) for _, leaf, _ in samples]
  mean_his = jax.tree.leaves(stats.mean_hi)
  axes = tuple(range(len(leading)))
  zero = jnp.zeros((), dtype)

  def psum(tree: Any) -> Any:
    return tree if axis_name is None else jax.lax.psum(tree, axis_name)

  def reduce(v: Array, keep: Array) -> Array:
    # over the samples, left-out ones as 0
    return jnp.sum(jnp.where(keep, v, zero), axis=axes)

  means = [jnp.broadcast_to(m, v.shape) for m, v in zip(mean_his, xs,
                                                        strict=True)]
  use, nonfinite = _kept(stats, xs, means, valid, len(leading))
  keeps = [jnp.broadcast_to(
      jnp.reshape(use, leading + (1,) * (v.ndim - len(leading))), v.shape)
      for v in xs]
  # Everything below runs on x / c, c = 2**k per element (1 unless a
  # magnitude is too large to square).
  scales, ds = [], []
  for v, m, m_hi, keep in zip(xs, means, mean_his, keeps, strict=True):
    scale, inv = _scales(jnp.where(keep, jnp.abs(v), zero), m_hi, axes,
                         axis_name)
    inv = jnp.broadcast_to(inv, v.shape)
    scales.append(scale)
    ds.append(v * inv - m * inv)   # the deviations from the running mean
  n_local = jnp.sum(use, dtype=jnp.int32)
  # Pass 1: count and the sum of deviations from the running mean.
  n, skipped, s1 = psum((n_local, nonfinite,
                         [reduce(d, k) for d, k in zip(ds, keeps,
                                                       strict=True)]))
  n_f = jnp.maximum(n, 1).astype(dtype)
  # Pass 2: deviations from the batch mean; the corrected two-pass formula.
  ms = [t / n_f for t in s1]
  es = [d - jnp.broadcast_to(m, d.shape) for d, m in zip(ds, ms, strict=True)]
  s1e, s2 = psum(([reduce(e, k) for e, k in zip(es, keeps, strict=True)],
                  [reduce(e * e, k) for e, k in zip(es, keeps, strict=True)]))
  b_his, b_los, m2s = [], [], []
  for m_hi, m, a, b, scale in zip(mean_his, ms, s1e, s2, scales,
                                  strict=True):
    m2s.append(jnp.maximum(b - a * a / n_f, 0) * scale * scale)  # may be inf
    # The batch mean as an exact pair: mean_hi + m, then the correction.
    b_hi, b_err = _two_sum(m_hi, m * scale)
    b_his.append(b_hi)
    b_los.append(b_err + a / n_f * scale)
  return _merge(stats, jnp.zeros((), jnp.uint32), n.astype(jnp.uint32),
                b_his, b_los, m2s, skipped.astype(jnp.uint32))


def _kept(stats: RunningStats, xs: list[Array], means: list[Array],
          valid: ArrayLike | None, num_leading: int) -> tuple[Array, Array]:
  """``(use, left_out)``: the samples taken (``[*leading]`` bool) and how
  many valid ones are left out: a NaN or inf in any leaf, or a deviation
  that alone would push a leaf's ``M2`` past the dtype's largest value."""
  def every(flags: list[Array]) -> Array:
    return functools.reduce(operator.and_, flags)

  def sample_axes(v: Array) -> tuple[int, ...]:
    return tuple(range(num_leading, v.ndim))

  count, dtype = stats.count, stats.dtype
  finite = every([jnp.all(jnp.isfinite(v), axis=sample_axes(v)) for v in xs])
  near = every([
      jnp.all(jnp.abs(v - m) <= jnp.broadcast_to(_reach(count, m2, dtype),
                                                 v.shape),
              axis=sample_axes(v))
      for v, m, m2 in zip(xs, means, jax.tree.leaves(stats.m2_hi),
                          strict=True)])
  if valid is None:
    use = finite & near
    return use, jnp.sum(~use, dtype=jnp.int32)
  given = jnp.asarray(valid)
  use = given & finite & near
  return use, jnp.sum(given & ~use, dtype=jnp.int32)


def _scales(magnitude: Array, mean_hi: Array, axes: tuple[int, ...],
            axis_name: AxisName | None) -> tuple[Array, Array]:
  """``(c, 1 / c)``, ``c = 2**k`` per element: 1 below ``2**((maxexp - 36)
  // 2)``, where sums of ``2**31`` squares cannot overflow; else the power
  of two above the batch's magnitudes and the mean (<= ``2**(maxexp-3)``)."""
  dtype = mean_hi.dtype
  info = jnp.finfo(dtype)
  top = jnp.maximum(jnp.max(magnitude, axis=axes, initial=0),
                    jnp.abs(mean_hi))
  if axis_name is not None:
    top = jax.lax.pmax(top, axis_name)
  k = jnp.frexp(top)[1]   # top < 2**k
  k = jnp.where(k > (int(info.maxexp) - 36) // 2,
                jnp.clip(k, 0, int(info.maxexp) - 3), 0)
  return _pow2(k, dtype), _pow2(-k, dtype)


def _reach(n: Array, m2_hi: Array, dtype: Any) -> Array:
  """``[*shape]`` how far from the mean of ``n`` samples one may lie before,
  alone, it pushes ``M2`` past the largest value ``F``: ``sqrt((F - M2) *
  (n + 1) / n)``; infinite before the first sample."""
  room = jnp.sqrt(jnp.asarray(jnp.finfo(dtype).max, dtype)
                  - jnp.maximum(m2_hi, 0))
  return jnp.where(n > 0, room * jnp.sqrt((n + 1) / jnp.maximum(n, 1)),
                   jnp.asarray(jnp.inf, dtype))


def merge_running_stats(a: RunningStats, b: RunningStats) -> RunningStats:
  """The statistics of two sample streams together (Chan et al.'s merge).

  ``merge(update(s, x1), update(empty, x2))`` equals ``update(s, concat(x1,
  x2))`` up to rounding, in any order and grouping; counts add exactly.

  Args:
    a: running statistics.
    b: running statistics of the same sample structure, shape and dtype.

  Returns:
    The statistics of both; ``a`` itself if ``b`` is empty.

  Raises:
    TypeError: ``a`` or ``b`` not a ``RunningStats``, or dtypes that differ.
    ValueError: sample structures or shapes that differ, or a stack.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> empty = jr.init_running_stats()
    >>> ab = jr.merge_running_stats(
    ...     jr.update_running_stats(empty, jnp.array([1., 3.])),
    ...     jr.update_running_stats(empty, jnp.array([5., 7.])))
    >>> ab.mean.tolist(), ab.variance.tolist(), ab.exact_count()
    (4.0, 5.0, 4)
  """
  fn = "merge_running_stats"
  _check_stats(fn, "a", a)
  _check_stats(fn, "b", b)
  a_def: Any = jax.tree.structure(a.mean_hi)
  b_def = jax.tree.structure(b.mean_hi)
  if b_def != a_def:
    raise ValueError(f"{fn}: `b` holds samples of structure {b_def}, "
                     f"expected {a_def} like `a`")
  if b.shape != a.shape:
    raise ValueError(f"{fn}: `b` holds samples of shape {b.shape}, expected "
                     f"{a.shape} like `a`")
  if b.dtype != a.dtype:
    raise TypeError(f"{fn}: `b` has dtype {b.dtype.name}, expected "
                    f"{a.dtype.name} like `a`")
  return _merge(a, b.count_hi, b.count_lo, jax.tree.leaves(b.mean_hi),
                jax.tree.leaves(b.mean_lo),
                jax.tree.leaves(jax.tree.map(jnp.add, b.m2_hi, b.m2_lo)),
                b.nonfinite)


def normalize(stats: RunningStats, x: Any, *, clip: Any = None,
              eps: float | ArrayLike = 1e-8) -> Any:
  """Standardises samples: ``(x - mean) / sqrt(variance + eps)``, clipped.

  As gymnasium's ``NormalizeObservation``, with the population variance of
  every sample seen; ``x / sqrt(1 + eps)`` before the first. A pytree
  sample is standardised leaf by leaf (the leaves' leading axes may differ).

  Args:
    stats: the running statistics.
    x: ``[..., *stats.shape]`` floating samples (a pytree of them).
    clip: optional bound > 0: the result is clipped to ``[-clip, clip]``.
    eps: a number >= 0 added to the variance.

  Returns:
    ``x``'s structure, shapes and dtypes (computed in ``stats.dtype``).

  Raises:
    TypeError: ``x`` not floating or of another structure; ``clip`` or
      ``eps`` not a real number.
    ValueError: a leaf not ``[..., *shape]``, missing or extra; a concrete
      ``clip`` <= 0 or ``eps`` < 0.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats(),
    ...                                 jnp.array([1., 3.]))
    >>> jr.normalize(stats, jnp.array([5., -1.]), clip=2.).tolist()
    [2.0, -2.0]
  """
  fn = "normalize"
  leaves, mean, scale = _affine(fn, "x", stats, x, eps)
  if clip is not None:
    _checks.check_scalar(fn, "clip", clip, low=0.0, low_open=True)
  return _unflatten(stats, [
      clip_symmetric((v.astype(stats.dtype) - m) / c, clip).astype(v.dtype)
      for v, m, c in zip(leaves, mean, scale, strict=True)])


def denormalize(stats: RunningStats, y: Any, *,
                eps: float | ArrayLike = 1e-8) -> Any:
  """Undoes ``normalize`` (not its clip): ``y * sqrt(variance + eps) + mean``.

  Args:
    stats: the running statistics.
    y: ``[..., *stats.shape]`` floating normalised values (a pytree of them).
    eps: the ``eps`` given to ``normalize``.

  Returns:
    ``y``'s structure, shapes and dtypes.

  Raises:
    TypeError, ValueError: as ``normalize``.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats(),
    ...                                 jnp.array([1., 3.]))
    >>> jr.denormalize(stats, jnp.array([1., -2.])).tolist()
    [3.0, 0.0]
  """
  leaves, mean, scale = _affine("denormalize", "y", stats, y, eps)
  return _unflatten(stats, [
      (v.astype(stats.dtype) * c + m).astype(v.dtype)
      for v, m, c in zip(leaves, mean, scale, strict=True)])


def clip_symmetric(y: Array, clip: Any) -> Array:
  """``y`` clipped to ``[-clip, clip]`` (unchanged for ``clip=None``)."""
  if clip is None:
    return y
  clip = jnp.asarray(clip, y.dtype)
  return jnp.clip(y, -clip, clip)


def _unflatten(stats: RunningStats, leaves: list[Array]) -> Any:
  return jax.tree_util.tree_unflatten(jax.tree.structure(stats.mean_hi),
                                      leaves)


def _affine(fn: str, name: str, stats: RunningStats, x: Any, eps: Any
            ) -> tuple[list[Array], list[Array], list[Array]]:
  """Checks; ``x``'s leaves and each one's mean and scale, broadcast."""
  _check_stats(fn, "stats", stats)
  samples = _samples(fn, name, stats, x)
  _checks.check_scalar(fn, "eps", eps, low=0.0)
  leaves = [jnp.asarray(leaf) for _, leaf, _ in samples]
  eps = jnp.asarray(eps, stats.dtype)
  means = jax.tree.leaves(stats.mean)
  variances = jax.tree.leaves(stats.variance)
  return (leaves,
          [jnp.broadcast_to(m, v.shape) for m, v in zip(means, leaves,
                                                        strict=True)],
          [jnp.broadcast_to(jnp.sqrt(var + eps), v.shape)
           for var, v in zip(variances, leaves, strict=True)])
