"""Running statistics of a stream of (pytree) samples, merged with Chan et
al.'s parallel update: a two-word uint32 count, compensated ``(hi, lo)`` mean
and ``M2``; docs/guides/running-stats.md, "Numerics"."""

from __future__ import annotations

from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._types import Array
from jrollout._types import ArrayLike
from jrollout._types import AxisName


class RunningStats(struct.PyTreeNode):
  """Count, mean and variance of a stream of samples (or pytree samples).

  Attributes:
    count_hi, count_lo: ``[]`` uint32, the count ``hi * 2**32 + lo``.
    mean_hi, mean_lo: ``[*shape]`` (or pytrees), the mean ``hi + lo``.
    m2_hi, m2_lo: ``[*shape]`` (or pytrees), the sum of squared deviations.
    nonfinite: ``[]`` uint32 (saturating), the samples left out: NaN, inf,
      or too far from the mean to hold.
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
      n = jnp.broadcast_to(jnp.reshape(
          count, count.shape + (1,) * (m2_hi.ndim - count.ndim)), m2_hi.shape)
      m2 = jnp.maximum(m2_hi + m2_lo, 0)
      return jnp.where(n > 0, m2 / jnp.maximum(n, 1), jnp.ones((), m2.dtype))

    return jax.tree.map(leaf, self.m2_hi, self.m2_lo)

  @property
  def std(self) -> Any:
    """``[*shape]`` ``sqrt(variance)``."""
    return jax.tree.map(jnp.sqrt, self.variance)

  def exact_count(self) -> Any:
    """The exact count on the host (not traceable): an ``int``, or uint64."""
    hi = np.asarray(self.count_hi).astype(np.uint64)
    count = (hi << np.uint64(32)) | np.asarray(self.count_lo).astype(np.uint64)
    return int(count) if count.ndim == 0 else count


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
  return hi.astype(dtype) * jnp.asarray(2.0**32, dtype) + lo.astype(dtype)


def _unzip(like: Any, parts: Any) -> Any:
  """A tree of tuples, ``like``'s structure above them, as a tuple of trees."""
  return jax.tree.transpose(jax.tree.structure(like), None, parts)


def _merge(a: RunningStats, b: RunningStats) -> RunningStats:
  """Chan et al.'s merge; a ``b`` empty or not held only adds ``nonfinite``."""
  n_a, n_b = a.count, b.count
  count_lo = a.count_lo + b.count_lo
  count_hi = (a.count_hi + b.count_hi
              + (count_lo < a.count_lo).astype(jnp.uint32))   # the carry
  n = jnp.maximum(_count_float(count_hi, count_lo, a.dtype), 1)
  w_a, w_b = n_a / n, n_b / n
  use_b = n_b >= n_a   # the mean from the side with more samples
  weight = n_a * w_b

  def leaf(a_hi: Array, a_lo: Array, a_m2_hi: Array, a_m2_lo: Array,
           b_hi: Array, b_lo: Array, b_m2_hi: Array,
           b_m2_lo: Array) -> tuple[Array, ...]:
    # delta = mean_b - mean_a (its leading difference exact); M2 gains
    # delta**2 * n_a * n_b / n, as delta * (delta * weight) if delta**2 is inf.
    d_hi, d_err = _two_sum(b_hi, -a_hi)
    delta = d_hi + (d_err + (b_lo - a_lo))
    from_a = _add_compensated(a_hi, a_lo, delta * w_b)
    from_b = _add_compensated(b_hi, b_lo, -(delta * w_a))
    cross = delta * delta * weight
    cross = jnp.where(jnp.isfinite(cross), cross, delta * (delta * weight))
    return (jnp.where(use_b, from_b[0], from_a[0]),
            jnp.where(use_b, from_b[1], from_a[1]),
            *_add_compensated(a_m2_hi, a_m2_lo, b_m2_hi + b_m2_lo + cross))

  new: tuple[Any, Any, Any, Any] = _unzip(a.mean_hi, jax.tree.map(
      leaf, a.mean_hi, a.mean_lo, a.m2_hi, a.m2_lo, b.mean_hi, b.mean_lo,
      b.m2_hi, b.m2_lo))
  held = jnp.all(jnp.array([jnp.all(jnp.isfinite(v))
                            for v in jax.tree.leaves(new)]))
  empty = (b.count_hi == 0) & (b.count_lo == 0)
  merged = jax.tree.map(lambda old, new: jnp.where(empty | ~held, old, new),
                        a, RunningStats(count_hi, count_lo, *new,
                                        a.nonfinite))
  refused = jnp.where(empty | held, jnp.uint32(0),
                      jnp.where(b.count_hi > 0, jnp.uint32(0xFFFFFFFF),
                                b.count_lo))
  return merged.replace(nonfinite=_add_saturating(
      _add_saturating(a.nonfinite, b.nonfinite), refused))


def _check_stats(fn: str, name: str, stats: Any) -> None:
  """One ``RunningStats`` (not a stack made with ``jax.vmap``)."""
  _checks.check_instance(fn, name, stats, RunningStats, "init_running_stats")
  _checks.check_unstacked(fn, name, stats.count_hi, "statistics")


def _samples(fn: str, name: str, stats: RunningStats,
             x: Any) -> list[tuple[str, tuple[int, ...]]]:
  """``[(name of the leaf, leading axes)]`` of ``x``, checked with ``stats``:
  its structure, leaves floating ``[..., *shape]``."""
  _check_stats(fn, "stats", stats)
  treedef: Any = jax.tree.structure(stats.mean_hi)
  got, got_def = jax.tree_util.tree_flatten_with_path(x)
  if got_def != treedef:
    want = [jax.tree_util.keystr(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(stats.mean_hi)[0]]
    have = [jax.tree_util.keystr(path) for path, _ in got]
    missing = [w for w in want if w not in have]
    extra = [h for h in have if h not in want]
    same_kind = type(x) is type(stats.mean_hi) and bool(missing or extra)
    raise (ValueError if same_kind else TypeError)(
        f"{fn}: `{name}` has structure {got_def}, expected {treedef}, the "
        "statistics' sample structure" + (
            f": missing leaves {missing}, unexpected leaves {extra}"
            if same_kind else ""))
  out = []
  for (path, leaf), mean in zip(got, jax.tree.leaves(stats.mean_hi)):
    where = name + jax.tree_util.keystr(path)
    _checks.check_floating(fn, where, leaf)
    out.append((where, _checks.check_trailing(
        fn, where, leaf, mean.shape, "the statistics' sample shape")))
  return out


def check_eps_clip(fn: str, eps: Any, clip: Any) -> None:
  """``eps`` a real number >= 0, ``clip`` None or a real number > 0."""
  _checks.check_scalar(fn, "eps", eps, low=0.0)
  if clip is not None:
    _checks.check_scalar(fn, "clip", clip, low=0.0, low_open=True)


def check_axis_name(fn: str, axis_name: Any) -> None:
  """A ValueError unless ``axis_name`` is None or bound by a map here."""
  try:
    if axis_name is not None:
      jax.lax.psum(1, axis_name)   # the axis size: static, no collective
  except NameError as err:
    raise ValueError(
        f"{fn}: `axis_name` {axis_name!r} is not bound here ({err}); call "
        f"{fn} inside jax.shard_map, jax.pmap or jax.vmap over that axis, "
        "or pass axis_name=None for the local batch alone") from None


def _is_shape(value: Any) -> bool:
  """A leaf of a tree of shapes: a tuple or list (no NamedTuple) of ints."""
  return (isinstance(value, (tuple, list)) and not hasattr(value, "_fields")
          and not any(isinstance(d, (tuple, list, dict)) for d in value))


def init_running_stats(shape: Any = (), dtype: Any = jnp.float32
                       ) -> RunningStats:
  """Empty running statistics: count 0, mean 0, variance 1, of samples of
  ``shape`` (a tuple of ints, or a pytree of them) in a floating ``dtype``.

  Raises:
    TypeError: a shape not a tuple of ints, ``dtype`` not floating.
    ValueError: a negative dimension, a tree with no shape, or too large.

  Example:
    >>> import jrollout as jr
    >>> jr.init_running_stats({"policy": (48,), "critic": (60,)}).shape
    {'critic': (60,), 'policy': (48,)}
  """
  fn = "init_running_stats"
  if not jax.tree.leaves(shape, is_leaf=_is_shape):
    raise ValueError(f"{fn}: `shape` {shape!r} holds no shape (an empty "
                     f"tree); give a tuple of ints or a pytree of them")
  dtype = _checks.check_dtype(fn, None, dtype, floating=True)

  def zeros_of(key: Any, leaf: Any) -> Array:
    one = _checks.check_shape(fn, leaf, arg=f"shape{jax.tree_util.keystr(key)}")
    return _checks.zeros(fn, one, dtype)

  zero = jnp.zeros((), jnp.uint32)
  zeros = jax.tree_util.tree_map_with_path(zeros_of, shape, is_leaf=_is_shape)
  return RunningStats(zero, zero, zeros, zeros, zeros, zeros, zero)


def update_running_stats(stats: RunningStats, x: Any, *,
                         valid: ArrayLike | None = None,
                         axis_name: AxisName | None = None) -> RunningStats:
  """Folds a batch of samples into running statistics.

  Args:
    stats: the statistics (one; vmap over a stack).
    x: ``[..., *stats.shape]`` floating samples (a pytree of them, every
      leaf with the same leading axes), at most ``2**31 - 1``; the ones
      ``stats`` cannot hold go to ``nonfinite``.
    valid: optional ``[...]`` bool of ``x``'s leading shape: False excludes.
    axis_name: a mapped axis (or tuple) to combine the batch over, or None.

  Raises:
    TypeError: ``stats``, ``x`` or ``valid`` of another type or structure.
    ValueError: a leaf missing, extra, or of another shape; ``stats`` a
      stack; an ``axis_name`` not bound by an enclosing map.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats((2,)),
    ...                                 jnp.array([[1., 10.], [3., 30.]]))
    >>> stats.mean.tolist(), stats.variance.tolist(), stats.exact_count()
    ([2.0, 20.0], [1.0, 100.0], 2)
    >>> isinstance(stats, jr.RunningStats), int(stats.count)
    (True, 2)
  """
  fn = "update_running_stats"
  samples = _samples(fn, "x", stats, x)
  first, leading = samples[0]
  for where, lead in samples:
    if lead != leading:
      raise ValueError(
          f"{fn}: `{where}` has leading axes {lead}, expected {leading} like "
          f"`{first}`: every leaf holds the same samples")
  if valid is not None:
    _checks.check_bool_array(fn, "valid", valid)
    _checks.check_shape_equal(fn, "valid", valid, leading,
                              "the leading axes of `x`")
  check_axis_name(fn, axis_name)

  dtype, count = stats.dtype, stats.count
  maxexp = int(jnp.finfo(dtype).maxexp)
  axes = tuple(range(len(leading)))
  one = jnp.ones((), dtype)
  xs = jax.tree.map(lambda v: jnp.asarray(v).astype(dtype), x)

  def held(v: Array, m_hi: Array, m2_hi: Array) -> Array:
    # [*leading]: no NaN or inf, and no deviation that alone would push M2
    # past the largest value F: sqrt((F - M2) * (n + 1) / n).
    room = jnp.sqrt(jnp.asarray(jnp.finfo(dtype).max, dtype)
                    - jnp.maximum(m2_hi, 0))
    reach = room * jnp.sqrt((count + 1) / jnp.maximum(count, 1))
    near = (count == 0) | (jnp.abs(v - jnp.broadcast_to(m_hi, v.shape))
                           <= jnp.broadcast_to(reach, v.shape))
    return jnp.all(jnp.isfinite(v) & near, axis=tuple(range(len(axes), v.ndim)))

  given = True if valid is None else jnp.asarray(valid)
  use = given & jnp.all(jnp.array(jax.tree.leaves(jax.tree.map(
      held, xs, stats.mean_hi, stats.m2_hi))), axis=0)

  def kept(v: Array) -> Array:   # the samples left out as 0
    return jnp.where(jnp.reshape(use, leading + (1,) * (v.ndim - len(axes))),
                     v, 0)

  def psum(tree: Any) -> Any:
    return tree if axis_name is None else jax.lax.psum(tree, axis_name)

  n, skipped = psum((jnp.sum(use, dtype=jnp.int32),
                     jnp.sum(given & ~use, dtype=jnp.int32)))
  n_f = jnp.maximum(n, 1).astype(dtype)

  def batch(v: Array, m_hi: Array) -> tuple[Array, Array, Array]:
    # The batch's (mean_hi, mean_lo, M2) from d = (v - mean_hi) / c, c = 2**k
    # per element: 1 where sums of 2**31 squares cannot overflow, else a
    # power of two above |v| and |mean|.
    top = jnp.maximum(jnp.max(kept(jnp.abs(v)), axis=axes, initial=0),
                      jnp.abs(m_hi))
    if axis_name is not None:
      top = jax.lax.pmax(top, axis_name)
    k = jnp.frexp(top)[1]   # top < 2**k
    k = jnp.where(k > (maxexp - 36) // 2, jnp.clip(k, 0, maxexp - 3), 0)
    scale = jnp.ldexp(one, k)
    inv = jnp.broadcast_to(jnp.ldexp(one, -k), v.shape)
    d = v * inv - jnp.broadcast_to(m_hi, v.shape) * inv
    # Pass 1: the mean deviation from the running mean; pass 2: the
    # deviations from the batch mean, in the corrected two-pass formula.
    m = psum(jnp.sum(kept(d), axis=axes)) / n_f
    e = d - jnp.broadcast_to(m, d.shape)
    s1, s2 = psum((jnp.sum(kept(e), axis=axes),
                   jnp.sum(kept(e * e), axis=axes)))
    mean_hi, mean_err = _two_sum(m_hi, m * scale)   # an exact pair
    m2 = jnp.maximum(s2 - s1 * s1 / n_f, 0) * scale * scale   # may be inf
    return mean_hi, mean_err + s1 / n_f * scale, m2

  mean_hi, mean_lo, m2 = _unzip(stats.mean_hi,
                                jax.tree.map(batch, xs, stats.mean_hi))
  return _merge(stats, RunningStats(
      jnp.uint32(0), n.astype(jnp.uint32), mean_hi, mean_lo, m2,
      jax.tree.map(jnp.zeros_like, m2), skipped.astype(jnp.uint32)))


def merge_running_stats(a: RunningStats, b: RunningStats) -> RunningStats:
  """The statistics of two sample streams together (Chan et al.'s merge),
  equal to one update with both streams' samples up to rounding.

  Raises:
    TypeError: ``a`` or ``b`` not ``RunningStats``; ``b`` of another dtype.
    ValueError: a stack, or ``b`` of another sample structure or shape.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> up = lambda x: jr.update_running_stats(jr.init_running_stats(), x)
    >>> jr.merge_running_stats(up(jnp.array([1., 3.])),
    ...                        up(jnp.array([5., 7.]))).variance.tolist()
    5.0
  """
  fn = "merge_running_stats"
  _check_stats(fn, "a", a)
  _check_stats(fn, "b", b)
  for what, got, want in (("structure", jax.tree.structure(b.mean_hi),
                           jax.tree.structure(a.mean_hi)),
                          ("shape", b.shape, a.shape)):
    if got != want:
      raise ValueError(f"{fn}: `b` holds samples of {what} {got}, expected "
                       f"{want} like `a`")
  if b.dtype != a.dtype:
    raise TypeError(f"{fn}: `b` has dtype {b.dtype.name}, expected "
                    f"{a.dtype.name} like `a`")
  return _merge(a, b)


def normalize(stats: RunningStats, x: Any, *, clip: Any = None,
              eps: float | ArrayLike = 1e-8) -> Any:
  """Standardises samples ``x``, ``[..., *stats.shape]`` floating (a pytree
  of them, each leaf with its own leading axes): ``(x - mean) /
  sqrt(variance + eps)``, clipped to ``[-clip, clip]``, in ``x``'s shapes
  and dtypes (gymnasium's NormalizeObservation).

  Raises:
    TypeError: ``x`` not floating or of another structure; ``clip`` or
      ``eps`` not a real number.
    ValueError: a leaf of another shape; ``clip`` <= 0 or ``eps`` < 0.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats(),
    ...                                 jnp.array([1., 3.]))
    >>> y = jr.normalize(stats, jnp.array([5., -1.]), clip=2.)
    >>> y.tolist(), jr.denormalize(stats, y).tolist()
    ([2.0, -2.0], [4.0, 0.0])
  """
  return _affine("normalize", "x", stats, x, eps,
                 lambda v, mean, scale: (v - mean) / scale, clip)


def denormalize(stats: RunningStats, y: Any, *,
                eps: float | ArrayLike = 1e-8) -> Any:
  """Undoes ``normalize`` (not its clip): ``y * sqrt(variance + eps) + mean``;
  ``y`` and the errors as ``normalize``'s ``x``."""
  return _affine("denormalize", "y", stats, y, eps,
                 lambda v, mean, scale: v * scale + mean)


def clip_symmetric(y: Array, clip: Any) -> Array:
  """``y`` clipped to ``[-clip, clip]`` (unchanged for ``clip=None``)."""
  if clip is None:
    return y
  clip = jnp.asarray(clip, y.dtype)
  return jnp.clip(y, -clip, clip)


def _affine(fn: str, name: str, stats: RunningStats, x: Any, eps: Any,
            f: Any, clip: Any = None) -> Any:
  """Checks; ``f(v, mean, sqrt(variance + eps))`` per leaf ``v``, clipped."""
  _samples(fn, name, stats, x)
  check_eps_clip(fn, eps, clip)
  eps = jnp.asarray(eps, stats.dtype)

  def leaf(v: Any, mean: Array, variance: Array) -> Array:
    v = jnp.asarray(v)
    scale = jnp.broadcast_to(jnp.sqrt(variance + eps), v.shape)
    y = f(v.astype(stats.dtype), jnp.broadcast_to(mean, v.shape), scale)
    return clip_symmetric(y, clip).astype(v.dtype)

  return jax.tree.map(leaf, x, stats.mean, stats.variance)
