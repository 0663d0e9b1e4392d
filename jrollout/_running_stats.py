"""Running statistics of a stream of samples: ``RunningStats``, its update,
merge and normalization.

Count, mean and sum of squared deviations per element of one sample's shape,
merged with Chan, Golub and LeVeque's parallel update, and exact across
devices with ``axis_name``. Without ``jax_enable_x64`` the count is two
uint32 words and the mean and ``M2`` each a compensated ``(hi, lo)`` pair;
samples the statistics cannot hold are left out and counted in
``nonfinite``. The numerics and how they are tested:
docs/guides/running-stats.md, "Numerics". Reward scaling, built on these
statistics: ``jrollout._reward_scaling``.

Dimension letters: E = num_envs, T = num_steps (see ``jrollout._types``).
"""

from __future__ import annotations

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
  """Count, mean and variance of a stream of samples of one shape.

  A frozen pytree: a valid ``jit`` argument, ``scan`` carry and ``vmap``
  operand (a stack of independent statistics), and it round-trips through
  ``flax.serialization``. Create it with ``jr.init_running_stats(shape)`` and
  update it with ``jr.update_running_stats``; read it with the ``mean``,
  ``variance``, ``std`` and ``count`` properties.

  Attributes:
    count_hi: ``[]`` uint32, the high word of the sample count.
    count_lo: ``[]`` uint32, the low word: ``count = count_hi * 2**32 +
      count_lo``, exact to ``2**64 - 1``.
    mean_hi: ``[*shape]`` float, the mean rounded to the dtype.
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
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.init_running_stats((2,))                  # one sample: [2]
    >>> stats = jr.update_running_stats(stats, jnp.array([[1., 10.],
    ...                                                   [3., 30.]]))
    >>> stats.shape, stats.dtype, int(stats.count), int(stats.nonfinite)
    ((2,), dtype('float32'), 2, 0)
    >>> stats.mean.tolist(), stats.variance.tolist(), stats.std.tolist()
    ([2.0, 20.0], [1.0, 100.0], [1.0, 10.0])
  """
  count_hi: Array
  count_lo: Array
  mean_hi: Array
  mean_lo: Array
  m2_hi: Array
  m2_lo: Array
  nonfinite: Array

  @property
  def shape(self) -> tuple[int, ...]:
    """One sample's shape (read off the arrays; a stack's axes excluded)."""
    return tuple(self.mean_hi.shape[jnp.ndim(self.count_hi):])

  @property
  def dtype(self) -> np.dtype:
    """The floating dtype of the mean and variance."""
    return np.dtype(self.mean_hi.dtype)

  @property
  def count(self) -> Array:
    """``[]`` the sample count as a float of ``dtype`` (rounded above 2**24
    in float32; ``exact_count()`` gives the exact integer on the host)."""
    return _count_float(self.count_hi, self.count_lo, self.dtype)

  @property
  def mean(self) -> Array:
    """``[*shape]`` the mean of all samples (0 before the first)."""
    return self.mean_hi + self.mean_lo

  @property
  def variance(self) -> Array:
    """``[*shape]`` the population variance ``M2 / count`` (``ddof=0``),
    never negative; 1 before the first sample, so that ``normalize`` starts
    as the identity."""
    count = self.count
    count = jnp.broadcast_to(
        jnp.reshape(count, count.shape + (1,) * len(self.shape)),
        self.mean_hi.shape)
    m2 = jnp.maximum(self.m2_hi + self.m2_lo, 0)
    return jnp.where(count > 0, m2 / jnp.maximum(count, 1),
                     jnp.ones((), self.dtype))

  @property
  def std(self) -> Array:
    """``[*shape]`` ``sqrt(variance)``."""
    return jnp.sqrt(self.variance)

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


def _merge(stats: RunningStats, n_hi: Array, n_lo: Array, mean_hi: Array,
           mean_lo: Array, m2: Array, nonfinite: Array) -> RunningStats:
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
    mean_hi: ``[*shape]`` the batch mean, rounded.
    mean_lo: ``[*shape]`` the rest of the batch mean.
    m2: ``[*shape]`` the batch's sum of squared deviations from its mean.
    nonfinite: ``[]`` uint32, the batch's samples left out (NaN or inf).

  Returns:
    The statistics of both; ``stats`` itself, bit for bit, if the batch is
    empty or if the merged mean or ``M2`` would not be finite (but for
    ``nonfinite``, which always adds: the batch's left-out samples, and in
    the second case the batch's count too, held at ``2**32 - 1``).
  """
  dtype = stats.dtype
  n_a = _count_float(stats.count_hi, stats.count_lo, dtype)
  n_b = _count_float(n_hi, n_lo, dtype)
  count_hi, count_lo = _add_count(stats.count_hi, stats.count_lo, n_hi, n_lo)
  n = jnp.maximum(_count_float(count_hi, count_lo, dtype), 1)
  w_a, w_b = n_a / n, n_b / n
  # delta = mean_b - mean_a, its leading difference taken exactly.
  d_hi, d_err = _two_sum(mean_hi, -stats.mean_hi)
  delta = d_hi + (d_err + (mean_lo - stats.mean_lo))
  from_a = _add_compensated(stats.mean_hi, stats.mean_lo, delta * w_b)
  from_b = _add_compensated(mean_hi, mean_lo, -(delta * w_a))
  use_b = n_b >= n_a
  new_hi = jnp.where(use_b, from_b[0], from_a[0])
  new_lo = jnp.where(use_b, from_b[1], from_a[1])
  # M2 = M2_a + M2_b + delta**2 * n_a * n_b / n. delta**2 may overflow
  # where the product does not (n_a * n_b / n < 1, or n_a = 0): then
  # delta * (delta * n_a * n_b / n), which overflows only if the product
  # does.
  weight = n_a * w_b
  cross = delta * delta * weight
  cross = jnp.where(jnp.isfinite(cross), cross, delta * (delta * weight))
  m2_hi, m2_lo = _add_compensated(stats.m2_hi, stats.m2_lo, m2 + cross)
  merged = RunningStats(count_hi=count_hi, count_lo=count_lo,
                        mean_hi=new_hi, mean_lo=new_lo, m2_hi=m2_hi,
                        m2_lo=m2_lo, nonfinite=stats.nonfinite)
  # An empty batch leaves every bit as it was (signs of zeros included);
  # so does one whose statistics the dtype cannot hold (counted).
  empty = (n_hi == 0) & (n_lo == 0)
  held = jnp.all(jnp.isfinite(new_hi) & jnp.isfinite(new_lo)
                 & jnp.isfinite(m2_hi) & jnp.isfinite(m2_lo))
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


# --- Public API. ---


def init_running_stats(shape: Any = (), dtype: Any = jnp.float32
                       ) -> RunningStats:
  """Empty running statistics of samples of one shape.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.init_running_stats((2,))
    >>> x = jnp.array([[1., 10.], [3., 30.]])            # 2 samples [2]
    >>> stats = jr.update_running_stats(stats, x)
    >>> stats.mean.tolist(), stats.variance.tolist(), stats.exact_count()
    ([2.0, 20.0], [1.0, 100.0], 2)

  Args:
    shape: one sample's shape, e.g. ``obs_shape`` (``()`` for scalars).
    dtype: the floating dtype of the mean and variance.

  Returns:
    A ``RunningStats`` with count 0, mean 0 and variance 1.

  Raises:
    TypeError: ``shape`` is not a tuple of ints or ``dtype`` is not a
      floating dtype available without x64.
    ValueError: a dimension of ``shape`` is negative.
  """
  fn = "init_running_stats"
  shape = _checks.check_shape(fn, shape)
  dtype = _checks.check_float_dtype(fn, "dtype", dtype)
  _checks.check_size(fn, shape, dtype)
  zero_count = jnp.zeros((), jnp.uint32)
  zeros = _checks.zeros(fn, shape, dtype)
  return RunningStats(count_hi=zero_count, count_lo=zero_count,
                      mean_hi=zeros, mean_lo=zeros, m2_hi=zeros, m2_lo=zeros,
                      nonfinite=zero_count)


def update_running_stats(stats: RunningStats, x: ArrayLike, *,
                         valid: ArrayLike | None = None,
                         axis_name: AxisName | None = None) -> RunningStats:
  """Folds a batch of samples into running statistics.

  ``x`` is ``[..., *stats.shape]``: every index of the leading axes is one
  sample (``[E, *obs_shape]`` for one step of E envs, ``[T, E, *obs_shape]``
  for a rollout). Updating with ``x1`` then ``x2`` equals updating once with
  their concatenation (up to rounding). With ``axis_name`` (inside
  ``jax.shard_map``, ``jax.vmap`` or ``jax.pmap``) the batch statistics are
  summed over that mapped axis (``jax.lax.psum``), so every device ends with
  the statistics of all devices' samples; ``stats`` must be the same on
  every device (it stays so).

  Samples the statistics cannot hold are left out, eagerly and under ``jit``
  alike, and counted in ``stats.nonfinite`` (test it to notice them): a
  sample with a NaN or +-inf element; a finite one farther than
  ``sqrt((F - M2) * (n + 1) / n)`` from the mean of the ``n`` samples so far
  (``F`` the dtype's largest value: ~1.8e19 in float32); and every sample of
  a batch whose merged mean or ``M2`` would still not be finite (0 and 1e30
  in a first batch), which then changes nothing. Samples with ``valid``
  False are not counted. Why, and the numerics: docs/guides/errors.md
  ("NaN, inf and overflow in running statistics").

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
    x: ``[..., *shape]`` floating samples; cast to ``stats.dtype``. At most
      ``2**31 - 1`` samples per call (over all devices).
    valid: optional ``[...]`` bool, the leading shape of ``x``; False
      excludes a sample. An all-False batch changes nothing.
    axis_name: a mapped axis name (or tuple of names) to combine the batch
      over; ``None`` for the local batch alone.

  Returns:
    The updated ``RunningStats``.

  Raises:
    TypeError: ``stats`` is not a ``RunningStats``, ``x`` is not floating,
      or ``valid`` is not bool.
    ValueError: ``x`` is not ``[..., *stats.shape]``, ``valid`` does not
      have ``x``'s leading shape, or ``stats`` is a stack.
  """
  fn = "update_running_stats"
  _check_stats(fn, "stats", stats)
  _checks.check_floating(fn, "x", x)
  shape = stats.shape
  leading = _checks.check_trailing(fn, "x", x, shape, _SAMPLE_SHAPE)
  if valid is not None:
    _checks.check_bool_array(fn, "valid", valid)
    if shape_of(valid) != leading:
      raise ValueError(
          f"{fn}: `valid` has shape {shape_of(valid)}, expected {leading}, the "
          f"leading axes of `x` (x has shape {shape_of(x)}, samples {shape})")

  dtype = stats.dtype
  x = jnp.asarray(x).astype(dtype)
  full = x.shape
  axes = tuple(range(len(leading)))
  sample_axes = tuple(range(len(leading), len(full)))

  def per_sample(v: Array) -> Array:   # [*leading] -> x's shape
    return jnp.broadcast_to(jnp.reshape(v, leading + (1,) * len(shape)), full)

  def psum(tree: Any) -> Any:
    return tree if axis_name is None else jax.lax.psum(tree, axis_name)

  # A sample with a NaN or inf element is left out (and counted): one would
  # make the mean and variance NaN for the rest of the run.
  given = None if valid is None else jnp.asarray(valid)
  finite = jnp.all(jnp.isfinite(x), axis=sample_axes)
  # A sample that alone would push M2 past the dtype's largest value is
  # left out (and counted) too, whatever the rest of the batch holds (a
  # deviation that overflows to inf is beyond any reach).
  reach = jnp.broadcast_to(_reach(stats), full)
  mean_hi = jnp.broadcast_to(stats.mean_hi, full)
  near = jnp.all(jnp.abs(x - mean_hi) <= reach, axis=sample_axes)
  use = finite & near if given is None else given & finite & near
  nonfinite = (jnp.sum(~use, dtype=jnp.int32) if given is None
               else jnp.sum(given & ~use, dtype=jnp.int32))
  keep = per_sample(use)
  # Everything below runs on x / c, c = 2**k per element from the samples
  # kept: 1 (the unscaled arithmetic, bit for bit) unless a magnitude is
  # too large to square.
  scale, inv = _scales(jnp.where(keep, jnp.abs(x), jnp.zeros((), dtype)),
                       stats.mean_hi, axes, axis_name)
  inv = jnp.broadcast_to(inv, full)
  d = x * inv - mean_hi * inv   # the deviations from the running mean
  n_local = jnp.sum(use, dtype=jnp.int32)

  def reduce(v: Array) -> Array:   # over the samples, left-out ones as 0
    return jnp.sum(jnp.where(keep, v, jnp.zeros((), dtype)), axis=axes)

  # Pass 1: count and the sum of deviations from the running mean.
  n, skipped, s1 = psum((n_local, nonfinite, reduce(d)))
  n_f = jnp.maximum(n, 1).astype(dtype)
  m = s1 / n_f   # the batch mean minus mean_hi, to first order
  # Pass 2: deviations from the batch mean; the corrected two-pass formula.
  e = d - jnp.broadcast_to(m, full)
  s1e, s2 = psum((reduce(e), reduce(e * e)))
  m2 = jnp.maximum(s2 - s1e * s1e / n_f, 0) * scale * scale   # may be inf
  # The batch mean as an exact pair: mean_hi + m, then the correction.
  b_hi, b_err = _two_sum(stats.mean_hi, m * scale)
  return _merge(stats, jnp.zeros((), jnp.uint32), n.astype(jnp.uint32),
                b_hi, b_err + s1e / n_f * scale, m2,
                skipped.astype(jnp.uint32))


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


def _reach(stats: RunningStats) -> Array:
  """``[*shape]``: how far from the running mean a sample may lie before,
  folded in alone, it pushes ``M2`` past the largest value ``F`` of the
  dtype: ``sqrt((F - M2) * (n + 1) / n)`` (adding ``x`` to ``n`` samples
  adds ``(x - mean)**2 * n / (n + 1)`` to ``M2``, and adding more samples
  never lowers it). Infinite before the first sample."""
  dtype = stats.dtype
  n = stats.count
  room = jnp.sqrt(jnp.asarray(jnp.finfo(dtype).max, dtype)
                  - jnp.maximum(stats.m2_hi, 0))
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
    b: running statistics of the same sample shape and dtype.

  Returns:
    The statistics of the samples of both; ``a`` itself if ``b`` is empty.

  Raises:
    TypeError: ``a`` or ``b`` is not a ``RunningStats``, or their dtypes
      differ.
    ValueError: their sample shapes differ, or one is a stack.
  """
  fn = "merge_running_stats"
  _check_stats(fn, "a", a)
  _check_stats(fn, "b", b)
  if b.shape != a.shape:
    raise ValueError(f"{fn}: `b` holds samples of shape {b.shape}, expected "
                     f"{a.shape} like `a`")
  if b.dtype != a.dtype:
    raise TypeError(f"{fn}: `b` has dtype {b.dtype.name}, expected "
                    f"{a.dtype.name} like `a`")
  return _merge(a, b.count_hi, b.count_lo, b.mean_hi, b.mean_lo,
                b.m2_hi + b.m2_lo, b.nonfinite)


def normalize(stats: RunningStats, x: ArrayLike, *, clip: Any = None,
              eps: float | ArrayLike = 1e-8) -> Array:
  """Standardises samples: ``(x - mean) / sqrt(variance + eps)``, clipped.

  As gymnasium's ``NormalizeObservation`` computes it, with the population
  variance (``ddof=0``) of all samples seen. Before any sample (variance 1,
  mean 0) it is ``x / sqrt(1 + eps)``.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats(),
    ...                                 jnp.array([1., 3.]))
    >>> jr.normalize(stats, jnp.array([5., -1.]), clip=2.).tolist()
    [2.0, -2.0]

  Args:
    stats: the running statistics.
    x: ``[..., *stats.shape]`` floating samples.
    clip: optional positive bound: the result is clipped to ``[-clip,
      clip]`` (e.g. 10, as Brax and Stable-Baselines3 do).
    eps: non-negative constant added to the variance.

  Returns:
    An array of ``x``'s shape and dtype (computed in ``stats.dtype``).

  Raises:
    TypeError: ``x`` is not floating; ``clip`` or ``eps`` is not a real
      number (None, a string, a bool, a complex number).
    ValueError: ``x`` is not ``[..., *stats.shape]``; a concrete ``clip``
      (a number or a 0-d array; traced ones are not checked) is not
      positive or ``eps`` is negative.
  """
  fn = "normalize"
  x, mean, scale = _affine(fn, stats, x, eps)
  if clip is not None:
    _checks.check_scalar(fn, "clip", clip, low=0.0, low_open=True)
  y = clip_symmetric((x.astype(stats.dtype) - mean) / scale, clip)
  return y.astype(x.dtype)


def denormalize(stats: RunningStats, y: ArrayLike, *,
                eps: float | ArrayLike = 1e-8) -> Array:
  """Undoes ``normalize`` (without its clip): ``y * sqrt(variance + eps) +
  mean``.

  Args:
    stats: the running statistics.
    y: ``[..., *stats.shape]`` floating normalised values.
    eps: the ``eps`` given to ``normalize``.

  Returns:
    An array of ``y``'s shape and dtype.

  Raises:
    TypeError: ``y`` is not floating.
    ValueError: ``y`` is not ``[..., *stats.shape]`` or ``eps`` is negative.

  Example:
    >>> import jax.numpy as jnp, jrollout as jr
    >>> stats = jr.update_running_stats(jr.init_running_stats(),
    ...                                 jnp.array([1., 3.]))   # mean 2, std 1
    >>> y = jr.normalize(stats, jnp.array([3., 0.]))
    >>> y.tolist(), jr.denormalize(stats, y).tolist()
    ([1.0, -2.0], [3.0, 0.0])
  """
  y, mean, scale = _affine("denormalize", stats, y, eps)
  return (y.astype(stats.dtype) * scale + mean).astype(y.dtype)


def clip_symmetric(y: Array, clip: Any) -> Array:
  """``y`` clipped to ``[-clip, clip]`` (unchanged for ``clip=None``)."""
  if clip is None:
    return y
  clip = jnp.asarray(clip, y.dtype)
  return jnp.clip(y, -clip, clip)


def _affine(fn: str, stats: RunningStats, x: ArrayLike,
            eps: Any) -> tuple[Array, Array, Array]:
  """Checks; returns ``x`` and the mean and scale broadcast to its shape."""
  _check_stats(fn, "stats", stats)
  name = "y" if fn == "denormalize" else "x"
  _checks.check_floating(fn, name, x)
  _checks.check_trailing(fn, name, x, stats.shape, _SAMPLE_SHAPE)
  _checks.check_scalar(fn, "eps", eps, low=0.0)
  x = jnp.asarray(x)
  eps = jnp.asarray(eps, stats.dtype)
  scale = jnp.sqrt(stats.variance + eps)
  mean = stats.mean
  return (x, jnp.broadcast_to(mean, x.shape),
          jnp.broadcast_to(scale, x.shape))

