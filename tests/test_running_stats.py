"""Tests of jrollout._running_stats and jrollout._reward_scaling: running
statistics (of one array and of a pytree sample) and reward scaling.

Every result is compared with a float64 numpy computation on the same
float32 samples (``ref_stats``, ``ref_scale_rewards`` below); the leaves of
pytree statistics are also compared bit for bit with the statistics of one
array fed the same samples.
"""

import math
from typing import NamedTuple

import chex
import flax.serialization
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from tests.conftest import TRANSFORMS

D = 8
needs_8 = pytest.mark.skipif(
    jax.device_count() < D, reason=f"needs {D} devices (conftest fakes 8 CPUs)")


# --- float64 references. ---


def ref_stats(x, mask=None, sample_ndim=0):
  """(count, mean, population variance) of the unmasked samples, float64."""
  x = np.asarray(x, np.float64)
  lead = x.shape[:x.ndim - sample_ndim]
  flat = x.reshape((-1,) + x.shape[len(lead):])
  if mask is not None:
    flat = flat[np.asarray(mask).reshape(-1)]
  if flat.shape[0] == 0:
    shape = x.shape[len(lead):]
    return 0, np.zeros(shape), np.ones(shape)
  return flat.shape[0], flat.mean(0), flat.var(0)


def ref_scale_rewards(rewards, dones, gamma, eps=1e-8, clip=None):
  """gymnasium's NormalizeReward formula, exact statistics, float64.

  ``rewards``/``dones`` are ``[T, E]``; returns (scaled [T, E], G [E],
  all G samples).
  """
  rewards = np.asarray(rewards, np.float64)
  g = np.zeros(rewards.shape[1:])
  samples, out = [], []
  for r, d in zip(rewards, np.asarray(dones), strict=True):
    g = g * gamma * (1 - d) + r
    samples.extend(g.tolist())
    scaled = r / np.sqrt(np.var(samples) + eps)
    if clip is not None:
      scaled = np.clip(scaled, -clip, clip)
    out.append(scaled)
  return np.stack(out), g, samples


def assert_stats(stats, count, mean, var, rtol=1e-5, atol=1e-6):
  assert stats.exact_count() == count
  np.testing.assert_allclose(np.asarray(stats.mean, np.float64), mean,
                             rtol=rtol, atol=atol)
  np.testing.assert_allclose(np.asarray(stats.variance, np.float64), var,
                             rtol=rtol, atol=atol)


def host_mean(stats):
  """The (hi, lo) mean summed in float64 on the host."""
  return np.asarray(stats.mean_hi, np.float64) + np.asarray(stats.mean_lo)


def host_var(stats):
  m2 = np.asarray(stats.m2_hi, np.float64) + np.asarray(stats.m2_lo)
  return m2 / stats.exact_count()


def bits(tree):
  """Each leaf's bytes as unsigned ints: equal bits, signs of zeros and NaN
  payloads included."""
  return jax.tree.map(
      lambda v: np.asarray(v).view(f"u{np.asarray(v).dtype.itemsize}"), tree)


def assert_same_bits(a, b):
  chex.assert_trees_all_equal(bits(a), bits(b), strict=True)


# --- Creation and basic updates. ---


def test_running_stats_starts_empty():
  stats = jr.init_running_stats((3, 2))
  assert stats.shape == (3, 2)
  assert stats.dtype == np.float32
  assert stats.exact_count() == 0
  assert stats.count_hi.dtype == stats.count_lo.dtype == jnp.uint32
  np.testing.assert_array_equal(stats.mean, np.zeros((3, 2)))
  np.testing.assert_array_equal(stats.variance, np.ones((3, 2)))
  assert float(stats.count) == 0.0
  assert jr.init_running_stats(4).shape == (4,)
  assert jr.init_running_stats(dtype=jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_update_matches_numpy(transform):
  rng = np.random.default_rng(0)
  x = rng.normal(5.0, 2.0, (7, 6, 3)).astype(np.float32)   # [T, E, 3]
  mask = rng.random((7, 6)) < 0.7
  update = transform(jr.update_running_stats)
  stats = update(jr.init_running_stats((3,)), x)
  assert_stats(stats, *ref_stats(x, sample_ndim=1))
  stats = transform(lambda s, x, m: jr.update_running_stats(s, x, valid=m))(
      jr.init_running_stats((3,)), x, mask)
  assert_stats(stats, *ref_stats(x, mask, sample_ndim=1))


def test_update_does_not_recompile(count_compiles):
  update = jax.jit(jr.update_running_stats)
  stats = update(jr.init_running_stats((2,)), jnp.ones((4, 2)))
  zeros, threes = jnp.zeros((4, 2)), jnp.full((4, 2), 3.0, jnp.float32)
  huge = jnp.full((4, 2), 1e30, jnp.float32)   # left out: no other program
  with count_compiles() as c:
    stats = update(stats, zeros)
    stats = update(stats, threes)
    stats = update(stats, huge)
  assert c.count == 0
  assert (stats.exact_count(), int(stats.nonfinite)) == (12, 4)


def test_all_masked_batch_changes_nothing():
  rng = np.random.default_rng(1)
  stats = jr.update_running_stats(
      jr.init_running_stats((2,)), rng.normal(size=(5, 2)).astype(np.float32))
  x = np.full((4, 2), np.nan, np.float32)   # masked NaNs do not leak
  for s in (stats, jr.init_running_stats((2,))):
    out = jax.jit(jr.update_running_stats)(s, x, valid=np.zeros(4, bool))
    assert_same_bits(out, s)


def test_masked_samples_may_hold_nan():
  x = np.array([1.0, np.nan, 3.0], np.float32)
  stats = jr.update_running_stats(jr.init_running_stats(), x,
                                  valid=np.array([True, False, True]))
  assert_stats(stats, 2, 2.0, 1.0)


def test_constant_samples_have_zero_variance_never_negative():
  for value in (1e3, -7.1, 3.0e7, 1e-30):
    stats = jr.init_running_stats()
    for _ in range(5):
      stats = jr.update_running_stats(stats, jnp.full((33,), value,
                                                      jnp.float32))
    assert float(stats.variance) == 0.0, value
    assert float(stats.mean) == np.float32(value)


def test_bfloat16_samples_are_cast_to_the_stats_dtype():
  x = jnp.array([1.0, 2.0, 4.0], jnp.bfloat16)
  stats = jr.update_running_stats(jr.init_running_stats(), x)
  assert stats.dtype == np.float32
  assert_stats(stats, *ref_stats(np.array([1.0, 2.0, 4.0])))


# --- Hypothesis: sequential == concatenated, merge orders, masks. ---


@st.composite
def streams(draw):
  # Few distinct shapes, so that the jitted update compiles a few times only.
  sample_shape = draw(st.sampled_from([(), (2,), (2, 3)]))
  num = draw(st.integers(1, 5))
  batches = []
  for _ in range(num):
    lead = draw(st.sampled_from([(0,), (5,), (2, 3), (64,)]))
    batches.append((lead, draw(st.booleans())))
  loc = draw(st.sampled_from([0.0, 1e3, -5e4]))
  scale = draw(st.sampled_from([1e-1, 1.0, 30.0]))
  seed = draw(st.integers(0, 2**31 - 1))
  return sample_shape, batches, loc, scale, seed


def _make_batches(sample_shape, batches, loc, scale, seed):
  rng = np.random.default_rng(seed)
  out = []
  for lead, masked in batches:
    x = (loc + scale * rng.standard_normal(lead + sample_shape)).astype(
        np.float32)
    # An all-True mask, not None: the same compiled update serves both.
    mask = rng.random(lead) < 0.6 if masked else np.ones(lead, bool)
    out.append((x, mask))
  return out


_update = jax.jit(lambda s, x, m: jr.update_running_stats(s, x, valid=m))
_merge = jax.jit(jr.merge_running_stats)


def _flat(x, mask, sample_shape):
  flat = x.reshape((-1,) + sample_shape)
  return flat[mask.reshape(-1)]


@given(streams())
def test_sequential_updates_equal_numpy_on_the_concatenation(stream):
  sample_shape, batches, loc, scale, seed = stream
  data = _make_batches(sample_shape, batches, loc, scale, seed)
  stats = jr.init_running_stats(sample_shape)
  for x, mask in data:
    stats = _update(stats, x, mask)
  allx = np.concatenate([_flat(x, m, sample_shape) for x, m in data])
  count, mean, var = ref_stats(allx, sample_ndim=len(sample_shape))
  assert stats.exact_count() == count
  np.testing.assert_allclose(host_mean(stats), mean, rtol=0,
                             atol=1e-6 * scale)
  if count:
    np.testing.assert_allclose(host_var(stats), var, rtol=1e-5)
    assert (np.asarray(stats.variance) >= 0).all()
  # One update with the concatenation (masked samples dropped) agrees.
  # (padded to a fixed 320 rows and masked: one compile per sample shape)
  padded = np.zeros((320,) + sample_shape, np.float32)
  padded[:len(allx)] = allx
  once = _update(jr.init_running_stats(sample_shape), padded,
                 np.arange(320) < len(allx))
  np.testing.assert_allclose(host_mean(once), host_mean(stats), rtol=0,
                             atol=1e-6 * scale)
  np.testing.assert_allclose(np.asarray(once.variance),
                             np.asarray(stats.variance), rtol=1e-5)


@given(streams(), st.randoms(use_true_random=False))
def test_merge_order_does_not_matter(stream, random):
  sample_shape, batches, loc, scale, seed = stream
  data = _make_batches(sample_shape, batches, loc, scale, seed)
  parts = [_update(jr.init_running_stats(sample_shape), x, m) for x, m in data]
  order = list(range(len(parts)))
  random.shuffle(order)
  merge = _merge
  merged = jr.init_running_stats(sample_shape)
  for i in order:
    merged = merge(merged, parts[i])
  # A balanced tree of merges, too.
  tree = list(parts)
  while len(tree) > 1:
    tree = [merge(*tree[i:i + 2]) if i + 1 < len(tree) else tree[i]
            for i in range(0, len(tree), 2)]
  allx = np.concatenate([_flat(x, m, sample_shape) for x, m in data])
  count, mean, var = ref_stats(allx, sample_ndim=len(sample_shape))
  for stats in (merged, tree[0]):
    assert stats.exact_count() == count
    np.testing.assert_allclose(host_mean(stats), mean, rtol=0,
                               atol=1e-6 * scale)
    if count:
      np.testing.assert_allclose(host_var(stats), var, rtol=1e-5)


# --- Counts beyond float32 and int32. ---


def _synthetic(count, mean, var, shape=()):
  """Statistics of ``count`` samples with the given mean and variance."""
  stats = jr.init_running_stats(shape)
  return stats.replace(
      count_hi=jnp.uint32(count >> 32), count_lo=jnp.uint32(count & 0xFFFFFFFF),
      mean_hi=jnp.full(shape, mean, jnp.float32),
      m2_hi=jnp.full(shape, np.float32(var * count), jnp.float32))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_count_is_exact_beyond_2_to_the_40(transform):
  big = 2**40 + 12345
  a = _synthetic(big, 2.0, 0.25)
  x = np.arange(1000, dtype=np.float32) / 1000 + 2.0   # mean 2.4995
  update = transform(jr.update_running_stats)
  stats = update(a, x)
  assert stats.exact_count() == big + 1000
  stats = update(stats, x, valid=np.arange(1000) < 3)
  assert stats.exact_count() == big + 1003
  # The float64 merge formula (Chan et al.) for the first update.
  n_b, m_b, v_b = ref_stats(x)
  n = big + n_b
  delta = m_b - 2.0
  mean = 2.0 + delta * n_b / n
  var = (0.25 * big + v_b * n_b + delta**2 * big * n_b / n) / n
  one = update(a, x)
  np.testing.assert_allclose(host_mean(one), mean, rtol=1e-12)
  np.testing.assert_allclose(host_var(one), var, rtol=1e-6)
  # The batch moved the mean by 5e-10: far below one float32 ulp of 2.0
  # (2.4e-7), yet kept in mean_lo.
  assert float(one.mean_hi) == 2.0 and float(one.mean_lo) > 0


def test_count_carries_into_the_high_word():
  for big in (2**32 - 3, 2**33 - 1, 2**63 + 2**32 - 5):
    stats = jr.update_running_stats(_synthetic(big, 0.0, 1.0),
                                    jnp.zeros(10, jnp.float32))
    assert stats.exact_count() == big + 10, big
  a, b = _synthetic(2**40 - 1, 1.0, 1.0), _synthetic(2**41 + 1, 1.0, 1.0)
  assert jr.merge_running_stats(a, b).exact_count() == 3 * 2**40


def test_count_property_is_a_float_of_the_count():
  stats = _synthetic(2**40 + 7, 0.0, 1.0)
  assert float(stats.count) == float(2**40)   # rounded to float32
  assert stats.count.dtype == jnp.float32


@pytest.mark.slow
def test_long_stream_accuracy_1e8_samples():
  """1e8 float32 samples, mean 1e3, std 1e-1, batches of 1e4: mean and
  variance within 1e-4 relative of float64 numpy (reached: ~1e-10 for the
  (hi, lo) pair, ~3e-8 for the float32 ``variance``)."""
  batch, num, chunk = 10_000, 10_000, 100
  run = jax.jit(lambda s, xs: jax.lax.scan(
      lambda s, x: (jr.update_running_stats(s, x), None), s, xs)[0])
  rng = np.random.default_rng(0)
  stats = jr.init_running_stats()
  s1 = s2 = 0.0
  for _ in range(num // chunk):
    x = (1e3 + 1e-1 * rng.standard_normal((chunk, batch))).astype(np.float32)
    stats = run(stats, x)
    d = x.astype(np.float64) - 1e3
    s1 += d.sum()
    s2 += (d * d).sum()
  n = batch * num
  mean, var = 1e3 + s1 / n, s2 / n - (s1 / n)**2
  assert stats.exact_count() == n
  np.testing.assert_allclose(float(stats.mean), mean, rtol=1e-7)
  np.testing.assert_allclose(float(stats.variance), var, rtol=1e-6)
  np.testing.assert_allclose(host_var(stats), var, rtol=1e-8)


# --- Samples too large to square (issue 40): held, or refused and counted.


F32 = np.float32
# Finite float32 batches whose statistics float32 holds, though squaring
# the samples (or summing them) overflows: constant streams far from 0, a
# first batch far from 0 with a spread, many huge samples.
HELD = {
    "constant 1e30": [np.full((4,), 1e30, F32)] * 3,
    "1e35 x 10000": [np.full((10_000,), 1e35, F32)],
    "5e19 with spread": [F32(5e19) + np.array([-1e13, 0, 1e13], F32),
                         F32(5e19) + np.array([2e13, -3e13], F32)],
    "-3e38 and 1": [np.array([-3e38, -3e38], F32), np.array([-3e38], F32)],
    "per element": [np.array([[1e30, 1.0], [1e30, 3.0]], F32)],
}


@pytest.mark.parametrize("case", sorted(HELD))
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_samples_too_large_to_square_keep_the_statistics_finite(case,
                                                                 transform):
  batches = HELD[case]
  sample = batches[0].shape[1:]
  update = transform(jr.update_running_stats)
  stats = jr.init_running_stats(sample)
  for x in batches:
    stats = update(stats, x)
  count, mean, var = ref_stats(np.concatenate(batches), sample_ndim=len(sample))
  assert int(stats.nonfinite) == 0
  assert np.isfinite(np.asarray(host_mean(stats))).all()
  assert_stats(stats, count, mean, var, rtol=1e-6, atol=0)


def test_huge_samples_under_vmap_match_numpy():
  x = np.stack([np.full((6,), 1e30, F32),
                F32(5e19) + np.arange(-3, 3).astype(F32) * F32(1e13),
                np.linspace(-1, 1, 6).astype(F32)])   # 3 seeds
  stack = jax.vmap(lambda _: jr.init_running_stats())(jnp.arange(3))
  out = jax.jit(jax.vmap(jr.update_running_stats))(stack, x)
  np.testing.assert_array_equal(np.asarray(out.nonfinite), [0, 0, 0])
  for i in range(3):
    _, mean, var = ref_stats(x[i])
    np.testing.assert_allclose(np.asarray(out.mean[i], np.float64), mean,
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.variance[i], np.float64), var,
                               rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_sample_the_statistics_cannot_hold_is_left_out_and_counted(
    transform):
  """Alone, 1e30 would make M2 ~ 1e60 > float32's largest: that sample is
  left out and counted, the rest of its batch is kept (as for NaN)."""
  update = transform(lambda s, x, m: jr.update_running_stats(s, x, valid=m))
  first = np.array([1.0, 2.0, 3.0], F32)
  stats = update(jr.init_running_stats(), first, np.ones(3, bool))
  x = np.array([4.0, 1e30, 5.0, -1e30, 6.0], F32)
  mask = np.array([True, True, True, False, True])   # masked: not counted
  out = update(stats, x, mask)
  assert int(out.nonfinite) == 1
  assert_stats(out, *ref_stats(np.array([1, 2, 3, 4, 5, 6], F32)),
               rtol=1e-6)
  # A reach just inside sqrt((F - M2) * (n + 1) / n) is kept.
  n, m2 = 3, 2.0
  reach = np.sqrt((float(np.finfo(F32).max) - m2) * (n + 1) / n)
  inside = np.array([2.0 + reach * 0.999], F32)
  kept = update(stats, inside, np.ones(1, bool))
  assert (kept.exact_count(), int(kept.nonfinite)) == (4, 0)
  assert np.isfinite(np.asarray(kept.variance))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_batch_the_statistics_cannot_hold_changes_nothing_but_the_count(
    transform):
  """0 and 1e30 in a first batch (variance 2.5e59; with samples seen
  before, 1e30 would be left out alone), or four samples of +-1.5e19 (each
  fine alone, M2 = 9e38 together): the statistics stay as they were and
  every sample is counted; later batches are unaffected."""
  update = transform(jr.update_running_stats)
  rng = np.random.default_rng(7)
  normal = rng.normal(2.0, 3.0, (16, 2)).astype(F32)
  far = np.array([[0.0, 1.0], [1e30, 2.0]], F32)
  spread = np.array([[1.5e19, 0], [-1.5e19, 0]] * 2, F32)
  for stats, bads in ((jr.init_running_stats((2,)), (far, spread)),
                      (update(jr.init_running_stats((2,)), normal), (spread,))):
    for bad in bads:
      before = jax.tree_util.tree_map(np.array, stats)
      out = update(stats, bad)
      assert int(out.nonfinite) == int(stats.nonfinite) + len(bad)
      assert_same_bits(out.replace(nonfinite=stats.nonfinite), stats)
      assert_same_bits(stats, before)   # the input is unchanged
      after = update(out, normal)
      seen = normal if stats.exact_count() == 0 else np.concatenate(
          [normal, normal])
      assert_stats(after, *ref_stats(seen, sample_ndim=1), rtol=1e-5)
      assert np.isfinite(np.asarray(after.variance)).all()


def test_huge_samples_with_axis_name_equal_one_device():
  x = np.full((D * 2,), 1e30, F32)
  x[3] = 7.0   # 1e30 and 7 together: not holdable; each device agrees
  for data in (np.full((D * 2,), 1e30, F32), x):
    one = jr.update_running_stats(jr.init_running_stats(), data)
    out = jax.vmap(lambda v: jr.update_running_stats(
        jr.init_running_stats(), v, axis_name="d"), axis_name="d")(
            data.reshape(D, 2))
    for device in range(D):
      assert_same_bits(jax.tree.map(lambda v, d=device: v[d], out), one)


def test_merge_of_statistics_too_far_apart_keeps_a_and_counts_b():
  a = jr.update_running_stats(jr.init_running_stats(),
                              np.array([1., 2., 3.], F32))
  b = jr.update_running_stats(jr.init_running_stats(), np.full((5,), 1e30, F32))
  out = jax.jit(jr.merge_running_stats)(a, b)
  assert int(out.nonfinite) == 5
  assert_same_bits(out.replace(nonfinite=a.nonfinite), a)
  # An empty `a` takes b whole (its mean 1e30, variance 0).
  empty = jr.merge_running_stats(jr.init_running_stats(), b)
  assert_stats(empty, 5, 1e30, 0.0, rtol=1e-7, atol=0)
  assert int(empty.nonfinite) == 0


# --- vmap, axis_name, shard_map, shard_rows. ---


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_vmap_over_a_stack_of_statistics(transform):
  rng = np.random.default_rng(2)
  x = rng.normal(size=(3, 10, 2)).astype(np.float32)   # 3 seeds
  stack = jax.vmap(lambda _: jr.init_running_stats((2,)))(jnp.arange(3))
  assert stack.shape == (2,)
  out = transform(jax.vmap(jr.update_running_stats))(stack, x)
  np.testing.assert_array_equal(out.exact_count(), [10, 10, 10])
  for i in range(3):
    _, mean, var = ref_stats(x[i], sample_ndim=1)
    np.testing.assert_allclose(out.mean[i], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.variance[i], var, rtol=1e-5)


def _split_data(seed=3, n=8 * 6, loc=1e3):
  rng = np.random.default_rng(seed)
  x = (loc + rng.normal(size=(n, 3))).astype(np.float32)
  mask = rng.random(n) < 0.7
  prior = jr.update_running_stats(
      jr.init_running_stats((3,)), (loc + rng.normal(size=(5, 3))).astype(
          np.float32))
  return prior, x, mask


def _assert_close_stats(a, b):
  assert a.exact_count() == b.exact_count()
  np.testing.assert_allclose(host_mean(a), host_mean(b), rtol=1e-7)
  np.testing.assert_allclose(host_var(a), host_var(b), rtol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_axis_name_under_vmap_equals_one_device(transform):
  prior, x, mask = _split_data()
  one = jr.update_running_stats(prior, x, valid=mask)

  def f(x, m):
    return jr.update_running_stats(prior, x, valid=m, axis_name="d")

  out = transform(jax.vmap(f, axis_name="d"))(x.reshape(D, -1, 3),
                                               mask.reshape(D, -1))
  for leaf in jax.tree_util.tree_leaves(out):   # every device, bit-equal
    assert (np.asarray(leaf) == np.asarray(leaf)[:1]).all()
  _assert_close_stats(jax.tree_util.tree_map(lambda v: v[0], out), one)


@needs_8
def test_axis_name_under_shard_map_equals_one_device():
  prior, x, mask = _split_data()
  one = jr.update_running_stats(prior, x, valid=mask)
  mesh = jax.make_mesh((D,), ("envs",))
  f = jax.jit(jax.shard_map(
      lambda s, x, m: jr.update_running_stats(s, x, valid=m, axis_name="envs"),
      mesh=mesh, in_specs=(P(), P("envs"), P("envs")), out_specs=P()))
  out = f(prior, *jr.shard_rows((x, mask), mesh))
  _assert_close_stats(out, one)
  # Every device holds the same statistics.
  for leaf in jax.tree_util.tree_leaves(out):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == D
    assert all((s == shards[0]).all() for s in shards)


@needs_8
def test_axis_name_on_a_2d_mesh_combines_both_axes():
  prior, x, mask = _split_data(n=8 * 4)
  one = jr.update_running_stats(prior, x, valid=mask)
  mesh = jax.make_mesh((2, 4), ("hosts", "envs"))
  f = jax.jit(jax.shard_map(
      lambda s, x, m: jr.update_running_stats(
          s, x, valid=m, axis_name=("hosts", "envs")),
      mesh=mesh, in_specs=(P(), P(("hosts", "envs")), P(("hosts", "envs"))),
      out_specs=P()))
  _assert_close_stats(
      f(prior, *jr.shard_rows((x, mask), mesh, ("hosts", "envs"))), one)


@needs_8
def test_rows_sharded_with_shard_rows_equal_one_device():
  prior, x, mask = _split_data()
  one = jr.update_running_stats(prior, x, valid=mask)
  mesh = jax.make_mesh((D,), ("envs",))
  xs, ms = jr.shard_rows((x, mask), mesh)
  assert xs.sharding.spec == P("envs")
  out = jax.jit(jr.update_running_stats)(prior, xs, valid=ms)
  _assert_close_stats(out, one)
  stats = jax.device_put(prior, NamedSharding(mesh, P()))
  y = jax.jit(jr.normalize)(stats, xs)
  np.testing.assert_allclose(y, jr.normalize(prior, x), rtol=1e-6)


# --- normalize / denormalize. ---


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_normalize_matches_numpy(transform):
  rng = np.random.default_rng(4)
  data = rng.normal(3.0, 5.0, (50, 2)).astype(np.float32)
  stats = jr.update_running_stats(jr.init_running_stats((2,)), data)
  x = rng.normal(3.0, 20.0, (4, 6, 2)).astype(np.float32)
  _, mean, var = ref_stats(data, sample_ndim=1)
  want = (x - mean) / np.sqrt(var + 1e-8)
  got = transform(jr.normalize)(stats, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  got = transform(lambda s, x: jr.normalize(s, x, clip=1.5, eps=0.1))(
      stats, x)
  np.testing.assert_allclose(
      got, np.clip((x - mean) / np.sqrt(var + 0.1), -1.5, 1.5), rtol=1e-5,
      atol=1e-6)
  assert got.dtype == jnp.float32 and got.shape == x.shape
  back = transform(jr.denormalize)(stats, transform(jr.normalize)(stats, x))
  np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(
      transform(jr.denormalize)(stats, x), x * np.sqrt(var + 1e-8) + mean,
      rtol=1e-5, atol=1e-5)


def test_normalize_keeps_the_input_dtype_and_vmaps():
  stats = jr.update_running_stats(jr.init_running_stats(), jnp.array([1., 3.]))
  y = jr.normalize(stats, jnp.array([2., 4.], jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), [0., 2.], atol=1e-2)
  np.testing.assert_array_equal(jr.normalize(jr.init_running_stats(),
                                             jnp.array([2.])), [2.])
  stack = jax.vmap(
      lambda x: jr.update_running_stats(jr.init_running_stats(), x))(
      jnp.array([[0., 2.], [10., 30.]]))
  y = jax.vmap(jr.normalize)(stack, jnp.array([[2.], [40.]]))
  np.testing.assert_allclose(y, [[1.], [2.]], rtol=1e-6)


# --- Serialisation. ---


def test_round_trips_through_flax_serialization():
  stats = _synthetic(2**40 + 3, 1e3, 0.5, (2,))
  stats = jr.update_running_stats(stats, jnp.ones((3, 2)))
  back = flax.serialization.from_bytes(jr.init_running_stats((2,)),
                                       flax.serialization.to_bytes(stats))
  assert back.exact_count() == 2**40 + 6
  assert_same_bits(back, stats)
  scaler = jr.init_reward_scaler(3)
  _, scaler = jr.scale_rewards(scaler, jnp.array([1., 2., 3.]),
                               jnp.zeros(3, bool), gamma=0.9)
  state = flax.serialization.to_state_dict(scaler)
  assert set(state) == {"returns", "stats"}
  back = flax.serialization.from_state_dict(jr.init_reward_scaler(3), state)
  np.testing.assert_array_equal(back.returns, scaler.returns)
  assert back.stats.exact_count() == 3


def test_round_trips_through_the_rollout_checkpoint(tmp_path):
  """jr.save_rollout / jr.restore_rollout (the exact-resume checkpoint):
  statistics and a scaler saved mid-stream resume bit for bit."""
  pytest.importorskip("orbax.checkpoint")
  stats = jr.update_running_stats(_synthetic(2**40 + 5, 1e3, 0.5, (3,)),
                                  jnp.full((4, 3), 1e3 + 0.25, jnp.float32))
  rewards, dones = _reward_stream(9, 6, 4)
  _, scaler = jr.scale_rollout_rewards(jr.init_reward_scaler(4), rewards, dones,
                                       gamma=0.9)
  item = {"obs_stats": stats, "scaler": scaler}
  jr.save_rollout(tmp_path / "ckpt", item)
  target = {"obs_stats": jr.init_running_stats((3,)),
            "scaler": jr.init_reward_scaler(4)}
  back = jr.restore_rollout(tmp_path / "ckpt", target)
  assert back["obs_stats"].exact_count() == 2**40 + 9
  assert_same_bits(back, item)
  # Resuming gives what the uninterrupted run gives.
  more = rewards[::-1]
  want = jr.scale_rollout_rewards(scaler, more, dones, gamma=0.9)[0]
  got = jr.scale_rollout_rewards(back["scaler"], more, dones, gamma=0.9)[0]
  np.testing.assert_array_equal(got, want)


# --- Reward scaling. ---


def _reward_stream(seed, t, e):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(-2.0, 3.0, (t, e)).astype(np.float32)
  dones = rng.random((t, e)) < 0.15
  return rewards, dones


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_scale_rewards_matches_the_reference(transform):
  rewards, dones = _reward_stream(5, 40, 6)
  want, g, _ = ref_scale_rewards(rewards, dones, 0.9, clip=4.0)
  step = transform(lambda s, r, d: jr.scale_rewards(s, r, d, gamma=0.9,
                                                    clip=4.0))
  scaler, got = jr.init_reward_scaler(6), []
  for r, d in zip(rewards, dones, strict=True):
    scaled, scaler = step(scaler, r, d)
    got.append(scaled)
  np.testing.assert_allclose(np.stack(got), want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(scaler.returns, g, rtol=1e-5, atol=1e-6)
  assert scaler.stats.exact_count() == 40 * 6
  # The rollout form equals T one-step calls.
  scaled, state = transform(
      lambda s, r, d: jr.scale_rollout_rewards(s, r, d, gamma=0.9, clip=4.0))(
          jr.init_reward_scaler(6), rewards, dones)
  np.testing.assert_allclose(scaled, np.stack(got), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(state.returns, scaler.returns, rtol=1e-6)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_scale_rewards_resets_at_terminations_and_truncations(transform):
  # The episode ends where either flag is set: the reference takes their or.
  rewards, term = _reward_stream(11, 30, 5)
  trunc = np.random.default_rng(12).random(term.shape) < 0.1
  want, g, _ = ref_scale_rewards(rewards, term | trunc, 0.9)
  step = transform(lambda s, r, d, c: jr.scale_rewards(
      s, r, d, truncations=c, gamma=0.9))
  scaler, got = jr.init_reward_scaler(5), []
  for r, d, c in zip(rewards, term, trunc, strict=True):
    scaled, scaler = step(scaler, r, d, c)
    got.append(scaled)
  np.testing.assert_allclose(np.stack(got), want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(scaler.returns, g, rtol=1e-5, atol=1e-6)
  scaled, rolled = transform(lambda s, r, d, c: jr.scale_rollout_rewards(
      s, r, d, truncations=c, gamma=0.9))(
          jr.init_reward_scaler(5), rewards, term, trunc)
  np.testing.assert_allclose(scaled, np.stack(got), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(rolled.returns, scaler.returns, rtol=1e-6)
  # Without truncations, a truncated episode's return runs on.
  alone, _ = jr.scale_rollout_rewards(jr.init_reward_scaler(5), rewards,
                                      term, gamma=0.9)
  np.testing.assert_allclose(alone, ref_scale_rewards(rewards, term, 0.9)[0],
                             rtol=2e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"scale_rollout_rewards: `truncations` "
                     r"has shape \(30,\), expected \(T, 5\)"):
    jr.scale_rollout_rewards(jr.init_reward_scaler(5), rewards, term,
                             truncations=trunc[:, 0])
  with pytest.raises(TypeError, match=r"scale_rewards: `truncations`"):
    jr.scale_rewards(jr.init_reward_scaler(5), rewards[0], term[0],
                     truncations=np.ones(5, np.float32))


def test_scale_rewards_resets_at_the_current_steps_done():
  # gamma = 0.5; env 0 ends its episode at step 1.
  rewards = np.array([[1.], [2.], [4.]], np.float32)
  dones = np.array([[False], [True], [False]])
  _, scaler = jr.scale_rollout_rewards(jr.init_reward_scaler(1), rewards, dones,
                                       gamma=0.5)
  # G: 1, then 2 (reset by the done of step 1), then 0.5 * 2 + 4 = 5.
  assert float(scaler.returns[0]) == 5.0
  np.testing.assert_allclose(float(scaler.stats.mean), 8 / 3, rtol=1e-6)


def test_scale_rewards_matches_gymnasiums_wrapper():
  """gymnasium's own NormalizeReward (single env, resets on `terminated`),
  its pseudo-count prior made negligible so both statistics are exact."""
  gym = pytest.importorskip("gymnasium")   # installed with gymnax
  NormalizeReward = pytest.importorskip("gymnasium.wrappers").NormalizeReward
  RunningMeanStd = pytest.importorskip(
      "gymnasium.wrappers.utils").RunningMeanStd
  rewards, dones = _reward_stream(6, 60, 1)

  class Scripted(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, ())
    action_space = gym.spaces.Discrete(1)

    def __init__(self):
      self.t = 0

    def reset(self, *, seed=None, options=None):
      return np.float32(0), {}

    def step(self, action):
      r, d = float(rewards[self.t, 0]), bool(dones[self.t, 0])
      self.t += 1
      return np.float32(0), r, d, False, {}

  env = NormalizeReward(Scripted(), gamma=0.95)
  env.return_rms = RunningMeanStd(epsilon=1e-300, shape=())
  env.reset()
  want = [env.step(0)[1] for _ in range(len(rewards))]
  got, _ = jr.scale_rollout_rewards(jr.init_reward_scaler(1), rewards, dones,
                                    gamma=0.95)
  np.testing.assert_allclose(got[:, 0], np.ravel(want), rtol=2e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_scale_rewards_vmaps_over_seeds_and_gammas(transform):
  rewards, dones = _reward_stream(7, 20, 4)
  gammas = jnp.array([0.0, 0.5, 0.99])
  scalers = jax.vmap(lambda _: jr.init_reward_scaler(4))(gammas)

  def f(s, g):
    return jr.scale_rollout_rewards(s, rewards, dones, gamma=g)

  scaled, _ = transform(jax.vmap(f))(scalers, gammas)
  for i, g in enumerate([0.0, 0.5, 0.99]):
    want, _, _ = ref_scale_rewards(rewards, dones, g)
    np.testing.assert_allclose(scaled[i], want, rtol=2e-5, atol=1e-6)


def test_scale_rewards_with_axis_name_equals_one_device():
  rewards, dones = _reward_stream(8, 10, 16)
  one, one_state = jr.scale_rollout_rewards(jr.init_reward_scaler(16), rewards,
                                            dones, gamma=0.9)
  per = jr.init_reward_scaler(2)

  def f(r, d):
    return jr.scale_rollout_rewards(per, r, d, gamma=0.9, axis_name="d")

  def split(a):   # [T, E] -> [D, T, E / D]
    return a.reshape(10, D, 2).transpose(1, 0, 2)

  scaled, state = jax.vmap(f, axis_name="d")(split(rewards), split(dones))
  np.testing.assert_allclose(scaled.transpose(1, 0, 2).reshape(10, 16), one,
                             rtol=1e-5)
  assert int(state.stats.exact_count()[3]) == one_state.stats.exact_count()


# --- Pytree samples (observation groups, NamedTuples). ---


class Obs(NamedTuple):
  pixels: object
  vec: object


def _groups():
  return {"policy": (3,), "critic": (2, 2), "scalar": ()}


def _batch(shapes, leading, rng, loc=5.0):
  return jax.tree.map(
      lambda s: rng.normal(loc, 2.0, leading + s).astype(np.float32), shapes,
      is_leaf=lambda s: isinstance(s, tuple) and not hasattr(s, "_fields")
      and all(isinstance(d, int) for d in s))


def _one_leaf(stats, i):
  """Leaf ``i`` of pytree statistics as the statistics of one array."""
  pick = lambda t: jax.tree.leaves(t)[i]   # noqa: E731
  return jr.RunningStats(count_hi=stats.count_hi, count_lo=stats.count_lo,
                         mean_hi=pick(stats.mean_hi),
                         mean_lo=pick(stats.mean_lo),
                         m2_hi=pick(stats.m2_hi), m2_lo=pick(stats.m2_lo),
                         nonfinite=stats.nonfinite)


# --- Creation. ---


def test_a_tree_of_shapes_makes_statistics_of_that_structure():
  stats = jr.init_running_stats(_groups())
  assert stats.shape == _groups()
  assert stats.dtype == np.float32
  assert stats.exact_count() == 0
  assert jax.tree.map(np.shape, stats.mean) == _groups()
  for v in jax.tree.leaves(stats.variance):
    np.testing.assert_array_equal(v, np.ones(v.shape))
  nt = jr.init_running_stats(Obs(pixels=(2, 2), vec=(3,)), jnp.bfloat16)
  assert isinstance(nt.mean, Obs) and isinstance(nt.std, Obs)
  assert nt.shape == Obs((2, 2), (3,)) and nt.dtype == jnp.bfloat16
  tup = jr.init_running_stats(((2,), (), [4]))
  assert tup.shape == ((2,), (), (4,))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       kind=st.sampled_from(["dict", "namedtuple", "tuple", "nested"]),
       leading=st.sampled_from([(5,), (3, 4), (1,)]),
       masked=st.booleans(), jit=st.booleans())
def test_each_leaf_equals_numpy_and_one_array_fed_the_same_samples(
    seed, kind, leading, masked, jit):
  rng = np.random.default_rng(seed)
  dims = [tuple(rng.integers(1, 4, rng.integers(0, 3))) for _ in range(3)]
  dims = [tuple(int(d) for d in s) for s in dims]
  shapes = {"dict": {"a": dims[0], "b": dims[1]},
            "namedtuple": Obs(pixels=dims[0], vec=dims[1]),
            "tuple": (dims[0], dims[1], dims[2]),
            "nested": {"obs": Obs(pixels=dims[0], vec=dims[1]),
                       "extra": (dims[2],)}}[kind]
  batches = [_batch(shapes, leading, rng, loc) for loc in (3.0, -1e3)]
  masks = [rng.random(leading) < 0.7 for _ in batches] if masked else \
      [None, None]
  update = jr.update_running_stats
  if jit:
    update = jax.jit(update)
  stats = jr.init_running_stats(shapes)
  for x, m in zip(batches, masks, strict=True):
    stats = update(stats, x, valid=m)
  assert stats.shape == jax.tree.map(lambda s: s, shapes,
                                     is_leaf=lambda s: isinstance(s, tuple)
                                     and not hasattr(s, "_fields"))
  assert type(stats.mean) is type(shapes)
  for i, leaf_shape in enumerate(jax.tree.structure(stats.mean_hi)
                                 .flatten_up_to(stats.shape)):
    xs = [jax.tree.leaves(x)[i] for x in batches]
    whole = np.concatenate([x.reshape((-1,) + leaf_shape) for x in xs])
    keep = (np.concatenate([m.reshape(-1) for m in masks]) if masked
            else None)
    count, mean, var = ref_stats(whole, keep, sample_ndim=len(leaf_shape))
    got = _one_leaf(stats, i)
    assert got.exact_count() == count
    np.testing.assert_allclose(np.asarray(got.mean, np.float64), mean,
                               rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(got.variance, np.float64), var,
                               rtol=1e-4, atol=1e-4)
    # Bit for bit what the statistics of that one array give.
    alone = jr.init_running_stats(leaf_shape)
    for x, m in zip(xs, masks, strict=True):
      alone = update(alone, x, valid=m)
    assert_same_bits(got, alone)


def test_a_nan_in_one_leaf_leaves_the_whole_sample_out():
  rng = np.random.default_rng(0)
  x = _batch(_groups(), (6,), rng)
  x["critic"][2, 1, 0] = np.nan
  x["scalar"][4] = np.inf
  stats = jr.update_running_stats(jr.init_running_stats(_groups()), x)
  assert stats.exact_count() == 4 and int(stats.nonfinite) == 2
  keep = np.array([True, True, False, True, False, True])
  for name, shape in _groups().items():
    count, mean, var = ref_stats(x[name][keep], sample_ndim=len(shape))
    np.testing.assert_allclose(stats.mean[name], mean, rtol=1e-5)
    np.testing.assert_allclose(stats.variance[name], var, rtol=1e-4)


def test_a_sample_too_far_in_one_leaf_leaves_the_whole_sample_out():
  rng = np.random.default_rng(1)
  stats = jr.update_running_stats(jr.init_running_stats(_groups()),
                                  _batch(_groups(), (8,), rng))
  x = _batch(_groups(), (3,), rng)
  x["policy"][1, 0] = 3e38   # beyond the reach of M2 in float32
  after = jr.update_running_stats(stats, x)
  assert after.exact_count() == 10 and int(after.nonfinite) == 1
  for v in jax.tree.leaves(after.m2_hi):
    assert np.isfinite(np.asarray(v)).all()


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_normalize_and_denormalize_each_leaf(transform):
  rng = np.random.default_rng(2)
  shapes = Obs(pixels=(2, 2), vec=(3,))
  data = _batch(shapes, (4, 5), rng)
  stats = jr.update_running_stats(jr.init_running_stats(shapes), data)
  y = transform(lambda s, x: jr.normalize(s, x, clip=1.5))(stats, data)
  assert isinstance(y, Obs)
  for leaf, got, shape in zip(data, y, shapes, strict=True):
    flat = leaf.reshape((-1,) + shape).astype(np.float64)
    want = np.clip((leaf - flat.mean(0)) / np.sqrt(flat.var(0) + 1e-8),
                   -1.5, 1.5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # Each leaf's leading axes may differ when normalising.
  one = Obs(pixels=data.pixels[0, 0], vec=data.vec[:2, :1])
  y = transform(jr.normalize)(stats, one)
  back = transform(jr.denormalize)(stats, y)
  for a, b in zip(back, one, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert back.pixels.shape == (2, 2) and back.vec.shape == (2, 1, 3)


def test_vmap_over_devices_with_axis_name_equals_one_device():
  rng = np.random.default_rng(3)
  shapes = {"policy": (3,), "critic": ()}
  prior = jr.update_running_stats(jr.init_running_stats(shapes),
                                  _batch(shapes, (5,), rng))
  x = _batch(shapes, (4, 6), rng, loc=1e3)
  mask = rng.random((4, 6)) < 0.8
  one = jr.update_running_stats(prior, jax.tree.map(
      lambda v: v.reshape((-1,) + v.shape[2:]), x), valid=mask.reshape(-1))
  out = jax.vmap(lambda x, m: jr.update_running_stats(
      prior, x, valid=m, axis_name="d"), axis_name="d")(x, mask)
  first = jax.tree.map(lambda v: v[0], out)
  for leaf in jax.tree.leaves(out):
    assert (np.asarray(leaf) == np.asarray(leaf)[:1]).all()
  assert first.exact_count() == one.exact_count()
  chex.assert_trees_all_close(first.mean, one.mean, rtol=1e-6)
  chex.assert_trees_all_close(first.variance, one.variance, rtol=1e-5)


def test_a_stack_of_pytree_statistics_vmaps():
  rng = np.random.default_rng(4)
  shapes = {"policy": (3,), "critic": ()}
  xs = [_batch(shapes, (6,), rng, loc) for loc in (1.0, 9.0)]
  stack = jax.vmap(lambda _: jr.init_running_stats(shapes))(jnp.arange(2))
  assert stack.shape == shapes
  out = jax.vmap(jr.update_running_stats)(
      stack, jax.tree.map(lambda *v: np.stack(v), *xs))
  for k, x in enumerate(xs):
    alone = jr.update_running_stats(jr.init_running_stats(shapes), x)
    assert_same_bits(jax.tree.map(lambda v, k=k: v[k], out), alone)


def test_merge_equals_one_update_on_both():
  rng = np.random.default_rng(5)
  shapes = Obs(pixels=(2,), vec=())
  a_x, b_x = _batch(shapes, (7,), rng, 2.0), _batch(shapes, (3,), rng, -4.0)
  empty = jr.init_running_stats(shapes)
  merged = jr.merge_running_stats(jr.update_running_stats(empty, a_x),
                                  jr.update_running_stats(empty, b_x))
  both = jr.update_running_stats(empty, jax.tree.map(
      lambda a, b: np.concatenate([a, b]), a_x, b_x))
  assert isinstance(merged.mean, Obs)
  assert merged.exact_count() == both.exact_count() == 10
  chex.assert_trees_all_close(merged.mean, both.mean, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(merged.variance, both.variance, rtol=1e-5)


def test_pytree_update_does_not_recompile(count_compiles):
  shapes = _groups()
  update = jax.jit(jr.update_running_stats)
  rng = np.random.default_rng(6)
  stats = update(jr.init_running_stats(shapes), _batch(shapes, (4,), rng))
  batches = [_batch(shapes, (4,), rng) for _ in range(2)]
  with count_compiles() as c:
    for x in batches:
      stats = update(stats, x)
  assert c.count == 0
  assert stats.exact_count() == 12


def test_round_trips_through_serialization_and_the_checkpoint(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  rng = np.random.default_rng(7)
  shapes = {"policy": (3,), "critic": (2,)}
  stats = jr.update_running_stats(jr.init_running_stats(shapes),
                                  _batch(shapes, (9,), rng))
  back = flax.serialization.from_bytes(jr.init_running_stats(shapes),
                                       flax.serialization.to_bytes(stats))
  assert_same_bits(back, stats)
  jr.save_rollout(tmp_path / "ckpt", {"obs_stats": stats})
  restored = jr.restore_rollout(tmp_path / "ckpt",
                                {"obs_stats": jr.init_running_stats(shapes)})
  assert_same_bits(restored["obs_stats"], stats)
  x = _batch(shapes, (4,), rng)
  assert_same_bits(jr.update_running_stats(restored["obs_stats"], x),
             jr.update_running_stats(stats, x))


# --- Misuse: errors raised at trace time, naming the function, the argument
# (and the leaf), what was expected and what was given. ---


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_update_errors(transform):
  stats = jr.init_running_stats((3,))
  update = transform(jr.update_running_stats)
  with pytest.raises(ValueError, match=r"update_running_stats: `x` has shape "
                     r"\(4, 2\), expected \[\.\.\., \*\(3,\)\]"):
    update(stats, jnp.zeros((4, 2)))
  with pytest.raises(TypeError, match=r"update_running_stats: `x` has dtype "
                     r"int32, expected a floating dtype"):
    update(stats, jnp.zeros((4, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"update_running_stats: `valid` has "
                     r"shape \(5,\), expected \(4,\) = the leading axes "
                     r"of `x`"):
    transform(lambda s, x, m: jr.update_running_stats(s, x, valid=m))(
        stats, jnp.zeros((4, 3)), jnp.ones(5, bool))
  with pytest.raises(TypeError, match=r"update_running_stats: `valid` has "
                     r"dtype float32, expected bool"):
    transform(lambda s, x, m: jr.update_running_stats(s, x, valid=m))(
        stats, jnp.zeros((4, 3)), jnp.ones(4))
  with pytest.raises(TypeError, match=r"update_running_stats: `stats` must be "
                     r"a RunningStats .*got dict"):
    jr.update_running_stats({"mean": 0}, jnp.zeros((4, 3)))
  stack = jax.vmap(lambda _: stats)(jnp.arange(2))
  with pytest.raises(ValueError, match=r"update_running_stats: `stats` is a "
                     r"stack .*jax.vmap"):
    jr.update_running_stats(stack, jnp.zeros((2, 3)))


def test_normalize_errors():
  stats = jr.init_running_stats((3,))
  with pytest.raises(ValueError, match=r"normalize: `x` has shape \(2,\), "
                     r"expected \[\.\.\., \*\(3,\)\]"):
    jr.normalize(stats, jnp.zeros(2))
  with pytest.raises(TypeError, match=r"normalize: `x` has dtype int32"):
    jax.jit(jr.normalize)(stats, jnp.zeros(3, jnp.int32))
  for clip in (0, -1.0):
    with pytest.raises(ValueError, match=rf"normalize: `clip` must be > 0, "
                       rf"got {clip}"):
      jr.normalize(stats, jnp.zeros(3), clip=clip)
  with pytest.raises(ValueError, match=r"normalize: `eps` has shape \(3,\), "
                     r"expected a scalar"):
    jr.normalize(stats, jnp.zeros(3), eps=jnp.ones(3))
  with pytest.raises(TypeError, match=r"normalize: `clip` must be a real "
                     r"number.*got bool True"):
    jr.normalize(stats, jnp.zeros(3), clip=True)
  with pytest.raises(ValueError, match=r"normalize: `eps` must be >= 0, got "
                     r"-1.0"):
    jr.normalize(stats, jnp.zeros(3), eps=-1.0)
  with pytest.raises(ValueError, match=r"denormalize: `y` has shape \(3, 1\)"):
    jr.denormalize(stats, jnp.zeros((3, 1)))
  with pytest.raises(TypeError, match=r"denormalize: `y` has dtype bool"):
    jr.denormalize(stats, jnp.zeros(3, bool))


def test_constructor_errors():
  with pytest.raises(TypeError, match=r"running_stats: `dtype` must be a "
                     r"floating dtype, got int32"):
    jr.init_running_stats((2,), jnp.int32)
  with pytest.raises(TypeError, match=r"running_stats: `dtype` float64 is not "
                     r"available with jax_enable_x64 disabled"):
    jr.init_running_stats((2,), np.float64)
  with pytest.raises(TypeError, match=r"running_stats: `shape` must be a "
                     r"tuple of ints, got \(2.0,\)"):
    jr.init_running_stats((2.0,))
  # A bool is never a dimension ((True,) is not (1,)).
  for fn, call in (
      ("init_running_stats", lambda: jr.init_running_stats(True)),
      ("init_running_stats", lambda: jr.init_running_stats((True,))),
      ("init_running_stats", lambda: jr.init_running_stats(
          (2, np.bool_(True)))),
      ("init_reward_scaler", lambda: jr.init_reward_scaler((2, True)))):
    with pytest.raises(TypeError, match=rf"^{fn}: .*bool"):
      call()
  with pytest.raises(ValueError, match=r"running_stats: `shape` must be "
                     r"non-negative, got \(-1,\)"):
    jr.init_running_stats((-1,))
  for bad, kind in ((True, "bool True"), (2.0, "float 2.0"), ("4", "str '4'")):
    with pytest.raises(TypeError, match=r"reward_scaler: `num_envs` must be "
                       rf"an int, got {kind}"):
      jr.init_reward_scaler(bad)
  with pytest.raises(ValueError, match=r"reward_scaler: `num_envs` must be "
                     r"positive, got 0"):
    jr.init_reward_scaler(0)
  with pytest.raises(ValueError, match=r"merge_running_stats: `b` holds "
                     r"samples of shape \(2,\), expected \(\) like `a`"):
    jr.merge_running_stats(jr.init_running_stats(), jr.init_running_stats(2))
  with pytest.raises(TypeError, match=r"merge_running_stats: `b` has dtype "
                     r"bfloat16, expected float32 like `a`"):
    jr.merge_running_stats(jr.init_running_stats(),
                           jr.init_running_stats(dtype=jnp.bfloat16))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_reward_scaler_errors(transform):
  scaler = jr.init_reward_scaler(4)
  r, d = jnp.zeros(4), jnp.zeros(4, bool)
  scale = transform(lambda s, r, d: jr.scale_rewards(s, r, d, gamma=0.99))
  with pytest.raises(ValueError, match=r"scale_rewards: `rewards` has shape "
                     r"\(3,\), expected \(4,\) = \[E\]"):
    scale(scaler, jnp.zeros(3), d)
  with pytest.raises(ValueError, match=r"scale_rewards: `terminations` has "
                     r"shape "
                     r"\(2, 4\), expected \(4,\) = \[E\]"):
    scale(scaler, r, jnp.zeros((2, 4), bool))
  with pytest.raises(TypeError, match=r"scale_rewards: `terminations` has "
                     r"dtype "
                     r"float32, expected bool"):
    scale(scaler, r, jnp.zeros(4))
  with pytest.raises(TypeError, match=r"scale_rewards: `rewards` has dtype "
                     r"int32, expected a floating dtype"):
    scale(scaler, jnp.zeros(4, jnp.int32), d)
  with pytest.raises(ValueError, match=r"scale_rewards: `gamma` must be in "
                     r"\[0, 1\], got 1.5"):
    jr.scale_rewards(scaler, r, d, gamma=1.5)
  with pytest.raises(TypeError, match=r"scale_rewards: `scaler` must be a "
                     r"RewardScaler"):
    jr.scale_rewards(jr.init_running_stats(), r, d, gamma=0.9)
  with pytest.raises(ValueError, match=r"scale_rollout_rewards: `rewards` has "
                     r"shape \(4,\), expected \(T, 4\) = \[T, E\]"):
    jr.scale_rollout_rewards(scaler, r, d, gamma=0.9)


def test_merge_errors_name_the_argument():
  stats = jr.init_running_stats()
  stack = jax.vmap(lambda _: stats)(jnp.arange(2))
  for name, a, b in (("a", 1.0, stats), ("b", stats, None)):
    with pytest.raises(TypeError, match=rf"^merge_running_stats: `{name}` must "
                       r"be a RunningStats \(from jr\.init_running_stats\), "
                       r"got "):
      jr.merge_running_stats(a, b)
  for name, a, b in (("a", stack, stats), ("b", stats, stack)):
    with pytest.raises(ValueError, match=rf"^merge_running_stats: `{name}` is "
                       r"a stack of statistics \(count of shape \(2,\)\); map "
                       r"over the stack with jax\.vmap$"):
      jr.merge_running_stats(a, b)


def test_errors_name_the_leaf():
  stats = jr.init_running_stats({"policy": (3,), "critic": (2,)})
  good = {"policy": jnp.ones((4, 3)), "critic": jnp.ones((4, 2))}
  stats = jr.update_running_stats(stats, good)
  before = jax.tree.map(np.array, stats)
  fn = "update_running_stats"
  with pytest.raises(ValueError, match=rf"{fn}: `x` has structure "
                     r"PyTreeDef\(\{'policy': \*\}\), expected .*'critic'.*: "
                     r"missing leaves \[\"\['critic'\]\"\], unexpected "
                     r"leaves \[\]$"):
    jr.update_running_stats(stats, {"policy": good["policy"]})
  with pytest.raises(ValueError,
                     match=r"unexpected leaves \[\"\['extra'\]\"\]"):
    jr.update_running_stats(stats, {**good, "extra": jnp.ones((4,))})
  with pytest.raises(ValueError, match=rf"{fn}: `x\['critic'\]` has shape "
                     r"\(4, 3\), expected \[\.\.\., \*\(2,\)\]"):
    jr.update_running_stats(stats, {**good, "critic": jnp.ones((4, 3))})
  with pytest.raises(TypeError, match=rf"{fn}: `x\['policy'\]` has dtype "
                     r"int32, expected a floating dtype"):
    jr.update_running_stats(stats, {**good, "policy": jnp.ones((4, 3), int)})
  with pytest.raises(ValueError, match=rf"{fn}: `x\['policy'\]` has leading "
                     r"axes \(5,\), expected \(4,\) like `x\['critic'\]`"):
    jr.update_running_stats(stats, {**good, "policy": jnp.ones((5, 3))})
  with pytest.raises(ValueError, match=rf"{fn}: `valid` has shape \(3,\), "
                     r"expected \(4,\)"):
    jr.update_running_stats(stats, good, valid=jnp.ones(3, bool))
  with pytest.raises(TypeError, match=rf"{fn}: `x` has structure "
                     r"PyTreeDef\(\*\), expected PyTreeDef\(\{'critic': \*, "
                     r"'policy': \*\}\), the statistics' sample structure$"):
    jr.update_running_stats(stats, jnp.ones((4, 3)))
  flat = jr.init_running_stats((3,))
  with pytest.raises(TypeError, match=rf"{fn}: `x` has structure "
                     r"PyTreeDef\(\{'policy': \*\}\), expected "
                     r"PyTreeDef\(\*\)"):
    jr.update_running_stats(flat, {"policy": jnp.ones((4, 3))})
  nt = jr.init_running_stats(Obs(pixels=(2,), vec=(3,)))
  with pytest.raises(TypeError, match=rf"{fn}: `x` has structure "
                     r"PyTreeDef\(\(\*, \*\)\), expected .*Obs"):
    jr.update_running_stats(nt, (jnp.ones((4, 2)), jnp.ones((4, 3))))
  with pytest.raises(ValueError, match=r"normalize: `x\['critic'\]` has "
                     r"shape"):
    jr.normalize(stats, {**good, "critic": jnp.ones((4, 3))})
  with pytest.raises(ValueError, match=r"denormalize: `y` has structure .*"
                     r"missing leaves"):
    jr.denormalize(stats, {"policy": good["policy"]})
  with pytest.raises(ValueError, match=r"merge_running_stats: `b` holds "
                     r"samples of structure"):
    jr.merge_running_stats(stats, flat)
  with pytest.raises(TypeError, match=r"init_running_stats: `shape\['critic'\]"
                     r"` must be a tuple of ints, got 'abc'"):
    jr.init_running_stats({"policy": (3,), "critic": "abc"})
  with pytest.raises(ValueError, match=r"init_running_stats: `shape\[1\]` "
                     r"must be non-negative"):
    jr.init_running_stats(((3,), (-1,)))
  with pytest.raises(ValueError, match=r"init_running_stats: `shape` \{\} "
                     r"holds no shape"):
    jr.init_running_stats({})
  # The failed calls changed nothing: the statistics are values.
  assert_same_bits(stats, before)
  assert stats.exact_count() == 4


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_an_unbound_axis_name_names_the_function_and_the_remedy(transform):
  stats, x = jr.init_running_stats(), jnp.ones(4)
  update = transform(lambda s, v: jr.update_running_stats(s, v,
                                                          axis_name="d"))
  with pytest.raises(ValueError, match=r"^update_running_stats: `axis_name` "
                     r"'d' is not bound here .*; call update_running_stats "
                     r"inside jax\.shard_map, jax\.pmap or jax\.vmap over that "
                     r"axis, or pass axis_name=None"):
    update(stats, x)
  with pytest.raises(ValueError, match=r"^update_running_stats: `axis_name` "
                     r"\('envs', 'd'\) is not bound"):
    jax.vmap(lambda v: jr.update_running_stats(
        stats, v, axis_name=("envs", "d")), axis_name="envs")(x[:, None])
  scaler = jr.init_reward_scaler(4)
  for fn, call in (
      ("scale_rewards", lambda s, r, d: jr.scale_rewards(
          s, r, d, axis_name="d")),
      ("scale_rollout_rewards", lambda s, r, d: jr.scale_rollout_rewards(
          s, r[None], d[None], axis_name="d"))):
    with pytest.raises(ValueError, match=rf"^{fn}: `axis_name` 'd' is not "
                       rf"bound here .*; call {fn} inside"):
      transform(call)(scaler, x, jnp.zeros(4, bool))
  # Bound, the same call runs.
  out = transform(jax.vmap(lambda v: jr.update_running_stats(
      stats, v, axis_name="d"), axis_name="d"))(x[:, None])
  np.testing.assert_array_equal(out.exact_count(), [4] * 4)


@settings(max_examples=12)
@given(x=hnp.arrays(np.float32, (5, 2),
                    elements=st.sampled_from([0.5, -2.0, 3.0, 1e3, math.nan,
                                              math.inf, -math.inf])),
       use_mask=st.booleans(), transform=st.sampled_from(["eager", "jit"]))
def test_nonfinite_samples_are_skipped_and_counted(x, use_mask, transform):
  mask = (np.arange(x.shape[0]) % 3 != 1) if use_mask else None
  update = (jr.update_running_stats if transform == "eager"
            else jax.jit(jr.update_running_stats))
  stats = update(jr.init_running_stats((2,)), x, valid=mask)
  stats = update(stats, np.full((2, 2), 1.0, np.float32))
  chosen = np.ones(x.shape[0], bool) if mask is None else mask
  finite = np.isfinite(x).all(axis=1)
  samples = np.concatenate([x[chosen & finite], np.ones((2, 2))])
  assert stats.exact_count() == len(samples)
  assert int(stats.nonfinite) == int((chosen & ~finite).sum())
  np.testing.assert_allclose(stats.mean, samples.mean(0), rtol=1e-5)
  np.testing.assert_allclose(stats.variance, samples.var(0), rtol=1e-4,
                             atol=1e-5)
  merged = jr.merge_running_stats(stats, stats)
  assert int(merged.nonfinite) == 2 * int(stats.nonfinite)


def test_large_python_ints_as_hyperparameters_are_numbers():
  """``eps=2**40`` is a valid (if odd) float; it used to overflow int32."""
  got = jr.normalize(jr.init_running_stats(), np.ones(3, np.float32), eps=2**40)
  np.testing.assert_allclose(got, np.ones(3) / np.sqrt(1 + 2.0**40),
                             rtol=1e-6)
