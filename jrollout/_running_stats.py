"""Running statistics of a stream of samples: ``RunningStats``, its update,
merge and normalization.

Count, mean and sum of squared deviations per element of one sample's shape
(or of every leaf of a pytree sample, such as observation groups), merged
with Chan, Golub and LeVeque's parallel update, and exact across devices with
``axis_name``. Without ``jax_enable_x64`` the count is two
uint32 words and the mean and ``M2`` each a compensated ``(hi, lo)`` pair;
samples the statistics cannot hold are left out and counted in
``nonfinite``. The numerics and how they are tested:
docs/guides/running-stats.md, "Numerics". Reward scaling, built on these
statistics: ``jrollout._reward_scaling``.

Dimension letters: E = num_envs, T = num_steps (see ``jrollout._types``).
"""

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
_SAMPLE_SHAPE = "the statistics' sample shape"


class RunningStats(struct.PyTreeNode):
  """Count, mean and variance of a stream of samples of one shape, or of
  one pytree of shapes (observation groups: ``{"policy": [48], "critic":
  [60]}``).

  A frozen pytree: a valid ``jit`` argument, ``scan`` carry and ``vmap``
  operand (a stack of independent statistics), and it round-trips through
  ``flax.serialization``. Create it with ``jr.init_running_stats(shape)`` and
  update it with ``jr.update_running_stats``; read it with the ``mean``,
  ``variance``, ``std`` and ``count`` properties.

  Attributes:
    count_hi: ``[]`` uint32, the high word of the sample count.
    count_lo: ``[]`` uint32, the low word: ``count = count_hi * 2**32 +
      count_lo``, exact to ``2**64 - 1``.
    mean_hi: ``[*shape]`` float, the mean rounded to the dtype (for a
      pytree sample, a pytree of the sample's structure, one such array per
      leaf; the same for the three below).
    mean_lo: ``[*shape]`` float, the rest: ``mean = mean_hi + mean_lo``.
    m2_hi: ``[*shape]`` float, the sum of squared deviations from the mean
      (``M2 = count * variance``), rounded.
    m2_lo: ``[*shape]`` float, the rest: ``M2 = m2_hi + m2_lo``.
    nonfinite: ``[]`` uint32, how many samples were left out because an
      element was NaN or +-inf, or because the statistics could not hold
      them (their squared deviations overflow the dtype; see
      ``update_running_stats``); saturates at ``2**32 - 1``. Such a
      sample would make the mean and variance NaN for the rest of the run;
      it is skipped instead, and counted here so that it is seen: test
      ``stats.nonfinite`` (e.g. return it with the metrics).

  Example:
    >>> import jax, jax.numpy as jnp, jrollout as jr
    >>> stats = jr.init_running_stats((2,))                  # one sample: [2]
    >>> stats = jr.update_running_stats(stats, jnp.array([[1., 10.],
    ...                                                   [3., 30.]]))
    >>> stats.shape, stats.dtype, int(stats.count), int(stats.nonfinite)
    ((2,), dtype('float32'), 2, 0)
    >>> stats.mean.tolist(), stats.variance.tolist(), stats.std.tolist()
    ([2.0, 20.0], [1.0, 100.0], [1.0, 10.0])

    A pytree sample: one count, a mean and variance per leaf.

    >>> groups = jr.init_running_stats({"policy": (2,), "critic": ()})
    >>> groups = jr.update_running_stats(groups, {
    ...     "policy": jnp.array([[1., 10.], [3., 30.]]),
    ...     "critic": jnp.array([4., 8.])})
    >>> groups.shape, int(groups.count)
    ({'critic': (), 'policy': (2,)}, 2)
    >>> jax.tree.map(lambda v: v.tolist(), groups.variance)
    {'critic': 4.0, 'policy': [1.0, 100.0]}
  """
  count_hi: Array
  count_lo: Array
  mean_hi: Array
  mean_lo: Array
  m2_hi: Array
  m2_lo: Array
  nonfinite: Array

  @property
  def shape(self) -> Any:
    """One sample's shape (read off the arrays; a stack's axes excluded):
    a tuple, or a pytree of tuples in the sample's structure."""
    lead = jnp.ndim(self.count_hi)
    return jax.tree.map(lambda m: tuple(m.shape[lead:]), self.mean_hi)

  @property
  def dtype(self) -> np.dtype:
    """The floating dtype of the mean and variance (every leaf's)."""
    return np.dtype(jax.tree.leaves(self.mean_hi)[0].dtype)

  @property
  def count(self) -> Array:
    """``[]`` the sample count as a float of ``dtype`` (rounded above 2**24
    in float32; ``exact_count()`` gives the exact integer on the host)."""
    return _count_float(self.count_hi, self.count_lo, self.dtype)

  @property
  def mean(self) -> Any:
    """``[*shape]`` the mean of all samples (0 before the first); a pytree
    of them for a pytree sample."""
    return jax.tree.map(jnp.add, self.mean_hi, self.mean_lo)

  @property
  def variance(self) -> Any:
    """``[*shape]`` the population variance ``M2 / count`` (``ddof=0``),
    never negative; 1 before the first sample, so that ``normalize`` starts
    as the identity. A pytree of them for a pytree sample."""
    count = self.count
    lead = count.ndim

    def leaf(m2_hi: Array, m2_lo: Array) -> Array:
      n = jnp.broadcast_to(
          jnp.reshape(count, count.shape + (1,) * (m2_hi.ndim - lead)),
          m2_hi.shape)
      m2 = jnp.maximum(m2_hi + m2_lo, 0)
      return jnp.where(n > 0, m2 / jnp.maximum(n, 1),
                       jnp.ones((), self.dtype))

    return jax.tree.map(leaf, self.m2_hi, self.m2_lo)

  @property
  def std(self) -> Any:
    """``[*shape]`` ``sqrt(variance)`` (a pytree for a pytree sample)."""
    return jax.tree.map(jnp.sqrt, self.variance)

  def exact_count(self) -> Any:
    """The exact sample count, on the host: an ``int`` (a ``uint64`` numpy
    array for a stack of statistics). Not traceable.

    Example:
      >>> import jax.numpy as jnp, jrollout as jr
      >>> stats = jr.update_running_stats(jr.init_running_stats(), jnp.ones(5))
      >>> stats.exact_count()
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
  """``(hi, lo) + x`` as a renormalised pair (``|lo| <= ulp(hi) / 2``)."""
  s, err = _two_sum(hi, x)
  return _two_sum(s, lo + err)


def _count_float(hi: Array, lo: Array, dtype: Any) -> Array:
  return (hi.astype(dtype) * jnp.asarray(_TWO_32, dtype)
          + lo.astype(dtype))


def _add_count(hi: Array, lo: Array, n_hi: Array,
               n_lo: Array) -> tuple[Array, Array]:
  """Adds two 64-bit counts held as uint32 word pairs (carry included)."""
  new_lo = lo + n_lo   # uint32: wraps modulo 2**32
  carry = (new_lo < lo).astype(jnp.uint32)
  return hi + n_hi + carry, new_lo


def _merge(stats: RunningStats, n_hi: Array, n_lo: Array, mean_hi: Any,
           mean_lo: Any, m2: Any, nonfinite: Array) -> RunningStats:
  """Chan et al.'s merge of ``stats`` with a batch ``(n, mean, M2)``.

  The new mean is formed from the side with more samples,
  ``mean_a + delta * n_b / n`` or ``mean_b - delta * n_a / n``, so the
  rounding of the product is at most an ulp of ``delta * min(n_a, n_b) /
  n``: small against the spread of the merged samples, even when one side
  is a first batch far from zero (``mean_b`` is then taken whole).

  Args:
    stats: the running statistics ``a``.
    n_hi: ``[]`` uint32, the batch count's high word.
    n_lo: ``[]`` uint32, its low word.
    mean_hi: ``[*shape]`` the batch mean, rounded (for a pytree sample, a
      pytree of the structure of ``stats.mean_hi``; the same below).
    mean_lo: ``[*shape]`` the rest of the batch mean.
    m2: ``[*shape]`` the batch's sum of squared deviations from its mean.
    nonfinite: ``[]`` uint32, the batch's samples left out (NaN or inf).

  Returns:
    The statistics of both; ``stats`` itself, bit for bit, if the batch is
    empty or if the merged mean or ``M2`` of any leaf would not be finite
    (but for ``nonfinite``, which always adds: the batch's left-out
    samples, and in the second case the batch's count too, held at
    ``2**32 - 1``).
  """
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
    # M2 = M2_a + M2_b + delta**2 * n_a * n_b / n. delta**2 may overflow
    # where the product does not (n_a * n_b / n < 1, or n_a = 0): then
    # delta * (delta * n_a * n_b / n), which overflows only if the product
    # does.
    cross = delta * delta * weight
    cross = jnp.where(jnp.isfinite(cross), cross, delta * (delta * weight))
    m2_hi, m2_lo = _add_compensated(a_m2_hi, a_m2_lo, b_m2 + cross)
    return new_hi, new_lo, m2_hi, m2_lo

  treedef = _structure(stats.mean_hi)
  parts = [treedef.flatten_up_to(t) for t in (
      stats.mean_hi, stats.mean_lo, stats.m2_hi, stats.m2_lo, mean_hi,
      mean_lo, m2)]
  leaves = [leaf(*args) for args in zip(*parts, strict=True)]
  new_hi, new_lo, m2_hi, m2_lo = (
      treedef.unflatten([out[i] for out in leaves]) for i in range(4))
  merged = RunningStats(count_hi=count_hi, count_lo=count_lo,
                        mean_hi=new_hi, mean_lo=new_lo, m2_hi=m2_hi,
                        m2_lo=m2_lo, nonfinite=stats.nonfinite)
  # An empty batch leaves every bit as it was (signs of zeros included);
  # so does one whose statistics the dtype cannot hold in any leaf
  # (counted).
  empty = (n_hi == 0) & (n_lo == 0)
  held = functools.reduce(operator.and_, [
      jnp.all(jnp.isfinite(hi) & jnp.isfinite(lo) & jnp.isfinite(m2h)
              & jnp.isfinite(m2l)) for hi, lo, m2h, m2l in leaves])
  merged = jax.tree_util.tree_map(
      lambda old, new: jnp.where(empty | ~held, old, new), stats, merged)
  refused = jnp.where(empty | held, jnp.uint32(0),
                      jnp.where(n_hi > 0, jnp.uint32(0xFFFFFFFF), n_lo))
  return merged.replace(nonfinite=_add_saturating(
      _add_saturating(stats.nonfinite, nonfinite), refused))


def _check_stats(fn: str, name: str, stats: Any) -> RunningStats:
  """One ``RunningStats`` (not a stack made with ``jax.vmap``)."""
  _checks.check_instance(fn, name, stats, RunningStats, "init_running_stats")
  _checks.check_unstacked(fn, name, stats.count_hi, "statistics")
  return stats


def _structure(tree: Any) -> Any:
  """``tree``'s treedef (typed ``Any``: jaxlib's ``PyTreeDef`` has no
  stubs for ``flatten_up_to`` / ``unflatten``)."""
  return jax.tree.structure(tree)


def _is_shape(value: Any) -> bool:
  """A leaf of a tree of sample shapes: a tuple or list of no containers
  (``(48,)``, ``()``; ``(2.0,)`` too, refused later by name). A NamedTuple
  is a container, never a shape."""
  return (isinstance(value, (tuple, list)) and not hasattr(value, "_fields")
          and not any(isinstance(d, (tuple, list, dict)) for d in value))


def _where(name: str, path: Any) -> str:
  """``x['policy']``: an argument's leaf, named as the messages name it."""
  return f"{name}{jax.tree_util.keystr(path)}"


def _samples(fn: str, name: str, stats: RunningStats,
             value: Any) -> list[tuple[str, Any, tuple[int, ...]]]:
  """``value``'s leaves, checked against the statistics' sample structure:
  ``[(name of the leaf, leaf, its sample shape)]`` in the order of
  ``stats.mean_hi``'s leaves.

  Raises:
    TypeError: ``value`` has another structure (a dict for an array, a
      tuple for a NamedTuple) or a leaf that is not floating.
    ValueError: a leaf is missing or extra, or one is not ``[...,
      *shape]`` for its leaf's shape.
  """
  treedef = _structure(stats.mean_hi)
  shapes = treedef.flatten_up_to(stats.shape)
  got, got_def = jax.tree_util.tree_flatten_with_path(value)
  if got_def != treedef:
    want = [jax.tree_util.keystr(p) for p, _ in
            jax.tree_util.tree_flatten_with_path(stats.mean_hi)[0]]
    have = [jax.tree_util.keystr(p) for p, _ in got]
    missing = [w for w in want if w not in have]
    extra = [h for h in have if h not in want]
    if treedef.num_leaves == 1 and want == [""]:
      raise TypeError(
          f"{fn}: `{name}` is a {type(value).__name__} with leaves {have}, "
          f"expected one array [..., *{shapes[0]}]: the statistics were made "
          f"for samples of one shape")
    if have == [""]:
      raise TypeError(
          f"{fn}: `{name}` is one {type(value).__name__}, expected a pytree "
          f"with leaves {want}, the statistics' sample structure")
    if (missing or extra) and type(value) is type(stats.shape):
      raise ValueError(
          f"{fn}: `{name}` does not have the statistics' sample structure: "
          f"missing leaves {missing}, unexpected leaves {extra} (expected "
          f"{treedef})")
    raise TypeError(f"{fn}: `{name}` has structure {got_def}, expected "
                    f"{treedef}, the statistics' sample structure")
  return [(_where(name, path), leaf, shape)
          for (path, leaf), shape in zip(got, shapes, strict=True)]


def _leading(fn: str, samples: list[tuple[str, Any, tuple[int, ...]]]
             ) -> tuple[int, ...]:
  """The leading axes every leaf shares (checked floating and
  ``[..., *shape]``)."""
  leading = None
  first = ""
  for where, leaf, shape in samples:
    _checks.check_floating(fn, where, leaf)
    lead = _checks.check_trailing(fn, where, leaf, shape, _SAMPLE_SHAPE)
    if leading is None:
      leading, first = lead, where
    elif lead != leading:
      raise ValueError(
          f"{fn}: `{where}` has leading axes {lead}, expected {leading} like "
          f"`{first}`: every leaf holds the same samples")
  assert leading is not None
  return leading


# --- Public API. ---


def init_running_stats(shape: Any = (), dtype: Any = jnp.float32
                       ) -> RunningStats:
  """Empty running statistics of samples of one shape, or of one pytree of
  shapes.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.init_running_stats((2,))
    >>> x = jnp.array([[1., 10.], [3., 30.]])            # 2 samples [2]
    >>> stats = jr.update_running_stats(stats, x)
    >>> stats.mean.tolist(), stats.variance.tolist(), stats.exact_count()
    ([2.0, 20.0], [1.0, 100.0], 2)
    >>> groups = jr.init_running_stats({"policy": (48,), "critic": (60,)})
    >>> groups.shape
    {'critic': (60,), 'policy': (48,)}

  Args:
    shape: one sample's shape, e.g. ``obs_shape`` (``()`` for scalars); or
      a pytree whose leaves are shapes (dicts, NamedTuples, tuples of
      tuples), such as observation groups ``{"policy": (48,), "critic":
      (60,)}``: one sample is then one value of that structure, and every
      function takes and returns that structure. From one step's
      observation ``obs`` (leaves ``[E, ...]``): ``jax.tree.map(lambda a:
      a.shape[1:], obs)``.
    dtype: the floating dtype of the mean and variance (every leaf's).

  Returns:
    A ``RunningStats`` with count 0, mean 0 and variance 1.

  Raises:
    TypeError: ``shape`` (or a leaf of it) is not a tuple of ints, or
      ``dtype`` is not a floating dtype available without x64.
    ValueError: a dimension is negative, or a tree of shapes has no leaf.
  """
  fn = "init_running_stats"
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      shape, is_leaf=_is_shape)
  if not leaves:
    raise ValueError(f"{fn}: `shape` {shape!r} holds no shape (an empty "
                     f"tree); give a tuple of ints or a pytree of them")
  dtype = _checks.check_float_dtype(fn, "dtype", dtype)
  shapes = [_checks.check_shape(fn, leaf, arg=_where("shape", path))
            for path, leaf in leaves]
  for one in shapes:
    _checks.check_size(fn, one, dtype)
  zero_count = jnp.zeros((), jnp.uint32)
  zeros = jax.tree_util.tree_unflatten(
      treedef, [_checks.zeros(fn, one, dtype) for one in shapes])
  return RunningStats(count_hi=zero_count, count_lo=zero_count,
                      mean_hi=zeros, mean_lo=zeros, m2_hi=zeros, m2_lo=zeros,
                      nonfinite=zero_count)


def update_running_stats(stats: RunningStats, x: Any, *,
                         valid: ArrayLike | None = None,
                         axis_name: AxisName | None = None) -> RunningStats:
  """Folds a batch of samples into running statistics.

  ``x`` is ``[..., *stats.shape]``: every index of the leading axes is one
  sample (``[E, *obs_shape]`` for one step of E envs, ``[T, E, *obs_shape]``
  for a rollout). For statistics of a pytree sample, ``x`` is a pytree of
  that structure whose leaves share their leading axes, and a sample is one
  index of them across every leaf. Updating with ``x1`` then ``x2`` equals
  updating once with their concatenation (up to rounding). With
  ``axis_name`` (inside ``jax.shard_map``, ``jax.vmap`` or ``jax.pmap``) the
  batch statistics are summed over that mapped axis (``jax.lax.psum``), so
  every device ends with the statistics of all devices' samples; ``stats``
  must be the same on every device (it stays so).

  Samples the statistics cannot hold are left out, eagerly and under ``jit``
  alike, and counted in ``stats.nonfinite`` (test it to notice them): a
  sample with a NaN or +-inf element (in any leaf); a finite one farther
  than ``sqrt((F - M2) * (n + 1) / n)`` from the mean of the ``n`` samples
  so far (``F`` the dtype's largest value: ~1.8e19 in float32); and every
  sample of a batch whose merged mean or ``M2`` would still not be finite
  (0 and 1e30 in a first batch), which then changes nothing. Samples with
  ``valid`` False are not counted. Why, and the numerics:
  docs/guides/errors.md ("NaN, inf and overflow in running statistics").

  Example:
    >>> import jax, jax.numpy as jnp, jrollout as jr
    >>> stats = jr.init_running_stats()
    >>> x = jnp.arange(8.).reshape(4, 2)       # 4 devices, 2 samples each
    >>> f = lambda x: jr.update_running_stats(stats, x, axis_name="d")
    >>> out = jax.vmap(f, axis_name="d")(x)
    >>> out.mean.tolist(), out.variance.tolist()   # each device: all 8
    ([3.5, 3.5, 3.5, 3.5], [5.25, 5.25, 5.25, 5.25])

  Args:
    stats: the running statistics (one, not a stack: vmap over a stack).
    x: ``[..., *shape]`` floating samples (a pytree of them for a pytree
      sample); cast to ``stats.dtype``. At most ``2**31 - 1`` samples per
      call (over all devices).
    valid: optional ``[...]`` bool, the leading shape of ``x``; False
      excludes a sample. An all-False batch changes nothing.
    axis_name: a mapped axis name (or tuple of names) to combine the batch
      over; ``None`` for the local batch alone.

  Returns:
    The updated ``RunningStats``.

  Raises:
    TypeError: ``stats`` is not a ``RunningStats``, ``x`` (or a leaf) is not
      floating, ``x`` has another structure than the statistics' samples,
      or ``valid`` is not bool.
    ValueError: ``x`` (or a leaf, named by its path) is not ``[...,
      *shape]``, a leaf is missing or extra, the leaves' leading axes
      differ, ``valid`` does not have ``x``'s leading shape, or ``stats``
      is a stack.
  """
  fn = "update_running_stats"
  _check_stats(fn, "stats", stats)
  samples = _samples(fn, "x", stats, x)
  leading = _leading(fn, samples)
  if valid is not None:
    _checks.check_bool_array(fn, "valid", valid)
    if shape_of(valid) != leading:
      raise ValueError(
          f"{fn}: `valid` has shape {shape_of(valid)}, expected {leading}, the "
          f"leading axes of `x` (x has shape {_shapes(samples)}, samples "
          f"{stats.shape})")

  dtype = stats.dtype
  treedef = _structure(stats.mean_hi)
  xs = [jnp.asarray(leaf).astype(dtype) for _, leaf, _ in samples]
  mean_his = treedef.flatten_up_to(stats.mean_hi)
  m2_his = treedef.flatten_up_to(stats.m2_hi)
  axes = tuple(range(len(leading)))

  def per_sample(v: Array, full: tuple[int, ...]) -> Array:
    # [*leading] -> a leaf's shape
    return jnp.broadcast_to(
        jnp.reshape(v, leading + (1,) * (len(full) - len(leading))), full)

  def psum(tree: Any) -> Any:
    return tree if axis_name is None else jax.lax.psum(tree, axis_name)

  means = [jnp.broadcast_to(m, v.shape) for m, v in zip(mean_his, xs,
                                                        strict=True)]
  use, nonfinite = _kept(stats, xs, means, m2_his, valid, len(leading))
  keeps = [per_sample(use, v.shape) for v in xs]
  # Everything below runs on x / c, c = 2**k per element from the samples
  # kept: 1 (the unscaled arithmetic, bit for bit) unless a magnitude is
  # too large to square.
  scales, ds = [], []
  for v, m, m_hi, keep in zip(xs, means, mean_his, keeps, strict=True):
    scale, inv = _scales(jnp.where(keep, jnp.abs(v), jnp.zeros((), dtype)),
                         m_hi, axes, axis_name)
    inv = jnp.broadcast_to(inv, v.shape)
    scales.append(scale)
    ds.append(v * inv - m * inv)   # the deviations from the running mean
  n_local = jnp.sum(use, dtype=jnp.int32)

  def reduce(v: Array, keep: Array) -> Array:
    # over the samples, left-out ones as 0
    return jnp.sum(jnp.where(keep, v, jnp.zeros((), dtype)), axis=axes)

  # Pass 1: count and the sum of deviations from the running mean.
  n, skipped, s1 = psum((n_local, nonfinite,
                         [reduce(d, k) for d, k in zip(ds, keeps,
                                                       strict=True)]))
  n_f = jnp.maximum(n, 1).astype(dtype)
  # Pass 2: deviations from the batch mean; the corrected two-pass formula.
  ms = [t / n_f for t in s1]   # the batch mean minus mean_hi, to 1st order
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
                treedef.unflatten(b_his), treedef.unflatten(b_los),
                treedef.unflatten(m2s), skipped.astype(jnp.uint32))


def _kept(stats: RunningStats, xs: list[Array], means: list[Array],
          m2_his: list[Array], valid: ArrayLike | None,
          num_leading: int) -> tuple[Array, Array]:
  """``(use, left_out)``: which samples the statistics take (``[*leading]``
  bool) and how many valid ones they leave out (``[]`` int32).

  A sample with a NaN or inf element in any leaf is left out (and
  counted): one would make the mean and variance NaN for the rest of the
  run. So is one that alone would push a leaf's M2 past the dtype's largest
  value, whatever the rest of the batch holds (a deviation that overflows
  to inf is beyond any reach).
  """
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
      for v, m, m2 in zip(xs, means, m2_his, strict=True)])
  if valid is None:
    use = finite & near
    return use, jnp.sum(~use, dtype=jnp.int32)
  given = jnp.asarray(valid)
  use = given & finite & near
  return use, jnp.sum(given & ~use, dtype=jnp.int32)


def _shapes(samples: list[tuple[str, Any, tuple[int, ...]]]) -> Any:
  """The shape of a single array, or ``{leaf: shape}`` of a pytree."""
  shapes = {where: shape_of(leaf) for where, leaf, _ in samples}
  return shapes["x"] if list(shapes) == ["x"] else shapes


def _pow2(k: Array, dtype: Any) -> Array:
  """``2.0**k`` in the floating ``dtype``, exactly, built from its bits
  (``k`` within the normal exponents)."""
  info = jnp.finfo(dtype)
  bits = (k + (int(info.maxexp) - 1)).astype(_UINT[np.dtype(dtype).itemsize])
  return jax.lax.bitcast_convert_type(bits << int(info.nmant), dtype)


_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _scales(magnitude: Array, mean_hi: Array, axes: tuple[int, ...],
            axis_name: AxisName | None) -> tuple[Array, Array]:
  """``(c, 1 / c)`` per element, ``c = 2**k``: 1 while the batch's
  magnitudes (``[N, *shape]``, left-out samples as 0) and the running mean
  are below ``2**((maxexp - 36) // 2)`` (``2**46`` in float32), where the
  two-pass sums of up to ``2**31`` samples cannot overflow; else the power
  of two above them (at most ``2**(maxexp - 3)``, so that ``1 / c`` is a
  normal number), and ``x / c`` is below 8."""
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


def _reach(count: Array, m2_hi: Array, dtype: Any) -> Array:
  """``[*shape]``: how far from the running mean a sample may lie before,
  folded in alone, it pushes ``M2`` past the largest value ``F`` of the
  dtype: ``sqrt((F - M2) * (n + 1) / n)`` (adding ``x`` to ``n`` samples
  adds ``(x - mean)**2 * n / (n + 1)`` to ``M2``, and adding more samples
  never lowers it). Infinite before the first sample. ``count`` is ``n``
  as a float, ``m2_hi`` one leaf's rounded ``M2``."""
  n = count
  room = jnp.sqrt(jnp.asarray(jnp.finfo(dtype).max, dtype)
                  - jnp.maximum(m2_hi, 0))
  return jnp.where(n > 0, room * jnp.sqrt((n + 1) / jnp.maximum(n, 1)),
                   jnp.asarray(jnp.inf, dtype))


def merge_running_stats(a: RunningStats, b: RunningStats) -> RunningStats:
  """The statistics of two sample streams together (Chan et al.'s merge).

  For statistics gathered apart, e.g. by separate workers or runs:
  ``merge_running_stats(update_running_stats(s, x1), update_running_stats(s0,
  x2))`` with ``s0`` empty equals ``update_running_stats(s, concat(x1, x2))``
  up to rounding, in any order and grouping. Counts add exactly.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> empty = jr.init_running_stats()
    >>> a = jr.update_running_stats(empty, jnp.array([1., 3.]))
    >>> b = jr.update_running_stats(empty, jnp.array([5., 7.]))
    >>> ab = jr.merge_running_stats(a, b)
    >>> ab.mean.tolist(), ab.variance.tolist(), ab.exact_count()
    (4.0, 5.0, 4)

  Args:
    a: running statistics.
    b: running statistics of the same sample shape (or pytree of shapes)
      and dtype.

  Returns:
    The statistics of the samples of both; ``a`` itself if ``b`` is empty.

  Raises:
    TypeError: ``a`` or ``b`` is not a ``RunningStats``, or their dtypes
      differ.
    ValueError: their sample shapes (or structures) differ, or one is a
      stack.
  """
  fn = "merge_running_stats"
  _check_stats(fn, "a", a)
  _check_stats(fn, "b", b)
  a_def, b_def = (_structure(s.mean_hi) for s in (a, b))
  if b_def != a_def:
    raise ValueError(f"{fn}: `b` holds samples of structure {b_def}, "
                     f"expected {a_def} like `a`")
  if b.shape != a.shape:
    raise ValueError(f"{fn}: `b` holds samples of shape {b.shape}, expected "
                     f"{a.shape} like `a`")
  if b.dtype != a.dtype:
    raise TypeError(f"{fn}: `b` has dtype {b.dtype.name}, expected "
                    f"{a.dtype.name} like `a`")
  return _merge(a, b.count_hi, b.count_lo, b.mean_hi, b.mean_lo,
                jax.tree.map(jnp.add, b.m2_hi, b.m2_lo), b.nonfinite)


def normalize(stats: RunningStats, x: Any, *, clip: Any = None,
              eps: float | ArrayLike = 1e-8) -> Any:
  """Standardises samples: ``(x - mean) / sqrt(variance + eps)``, clipped.

  As gymnasium's ``NormalizeObservation`` computes it, with the population
  variance (``ddof=0``) of all samples seen. Before any sample (variance 1,
  mean 0) it is ``x / sqrt(1 + eps)``. For statistics of a pytree sample,
  ``x`` is a pytree of that structure and each leaf is standardised by its
  own mean and variance.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats(),
    ...                                 jnp.array([1., 3.]))
    >>> jr.normalize(stats, jnp.array([5., -1.]), clip=2.).tolist()
    [2.0, -2.0]

  Args:
    stats: the running statistics.
    x: ``[..., *stats.shape]`` floating samples (a pytree of them for a
      pytree sample; the leaves' leading axes may differ here).
    clip: optional positive bound: the result is clipped to ``[-clip,
      clip]`` (e.g. 10, as Brax and Stable-Baselines3 do).
    eps: non-negative constant added to the variance.

  Returns:
    ``x``'s structure, each array of its own shape and dtype (computed in
    ``stats.dtype``).

  Raises:
    TypeError: ``x`` (or a leaf) is not floating, or has another structure
      than the statistics' samples; ``clip`` or ``eps`` is not a real
      number (None, a string, a bool, a complex number).
    ValueError: ``x`` (or a leaf) is not ``[..., *stats.shape]``, a leaf is
      missing or extra; a concrete ``clip`` (a number or a 0-d array;
      traced ones are not checked) is not positive or ``eps`` is negative.
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
  """Undoes ``normalize`` (without its clip): ``y * sqrt(variance + eps) +
  mean``.

  Args:
    stats: the running statistics.
    y: ``[..., *stats.shape]`` floating normalised values (a pytree of
      them for a pytree sample).
    eps: the ``eps`` given to ``normalize``.

  Returns:
    ``y``'s structure, each array of its own shape and dtype.

  Raises:
    TypeError: ``y`` (or a leaf) is not floating, or has another structure
      than the statistics' samples.
    ValueError: ``y`` (or a leaf) is not ``[..., *stats.shape]``, a leaf is
      missing or extra, or ``eps`` is negative.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats(),
    ...                                 jnp.array([1., 3.]))   # mean 2, std 1
    >>> y = jr.normalize(stats, jnp.array([3., 0.]))
    >>> y.tolist(), jr.denormalize(stats, y).tolist()
    ([1.0, -2.0], [3.0, 0.0])
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
  """Leaves in the order of ``stats.mean_hi``'s, in its structure."""
  return _structure(stats.mean_hi).unflatten(leaves)


def _affine(fn: str, name: str, stats: RunningStats, x: Any, eps: Any
            ) -> tuple[list[Array], list[Array], list[Array]]:
  """Checks; returns ``x``'s leaves and the mean and scale of each,
  broadcast to its shape."""
  _check_stats(fn, "stats", stats)
  samples = _samples(fn, name, stats, x)
  for where, leaf, shape in samples:
    _checks.check_floating(fn, where, leaf)
    _checks.check_trailing(fn, where, leaf, shape, _SAMPLE_SHAPE)
  _checks.check_scalar(fn, "eps", eps, low=0.0)
  leaves = [jnp.asarray(leaf) for _, leaf, _ in samples]
  eps = jnp.asarray(eps, stats.dtype)
  treedef = _structure(stats.mean_hi)
  means = treedef.flatten_up_to(stats.mean)
  variances = treedef.flatten_up_to(stats.variance)
  return (leaves,
          [jnp.broadcast_to(m, v.shape) for m, v in zip(means, leaves,
                                                        strict=True)],
          [jnp.broadcast_to(jnp.sqrt(var + eps), v.shape)
           for var, v in zip(variances, leaves, strict=True)])
