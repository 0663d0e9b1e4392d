"""Tests of jrollout._running_stats and jrollout._reward_scaling: running
statistics (of one array and of a pytree sample) and reward scaling, each
compared with a float64 numpy computation on the same float32 samples."""

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
F32 = np.float32
needs_8 = pytest.mark.skipif(
    jax.device_count() < D, reason=f"needs {D} devices (conftest fakes 8 CPUs)")


# --- float64 references and helpers. ---


def ref_stats(x, mask=None, sample_ndim=0):
  """(count, mean, population variance) of the unmasked samples, float64."""
  x = np.asarray(x, np.float64)
  flat = x.reshape((-1,) + x.shape[x.ndim - sample_ndim:])
  if mask is not None:
    flat = flat[np.asarray(mask).reshape(-1)]
  if flat.shape[0] == 0:
    return 0, np.zeros(flat.shape[1:]), np.ones(flat.shape[1:])
  return flat.shape[0], flat.mean(0), flat.var(0)


def ref_scale_rewards(rewards, dones, gamma, eps=1e-8, clip=None):
  """gymnasium's NormalizeReward with exact statistics, float64: ``[T, E]``
  rewards and dones in; (scaled [T, E], G [E]) out."""
  rewards = np.asarray(rewards, np.float64)
  g = np.zeros(rewards.shape[1:])
  samples, out = [], []
  for r, d in zip(rewards, np.asarray(dones), strict=True):
    g = g * gamma * (1 - d) + r
    samples.extend(g.tolist())
    scaled = r / np.sqrt(np.var(samples) + eps)
    out.append(scaled if clip is None else np.clip(scaled, -clip, clip))
  return np.stack(out), g


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


def assert_same_bits(a, b):
  """Equal bits, signs of zeros and NaN payloads included."""
  bits = lambda t: jax.tree.map(   # noqa: E731
      lambda v: np.asarray(v).view(f"u{np.asarray(v).dtype.itemsize}"), t)
  chex.assert_trees_all_equal(bits(a), bits(b), strict=True)


def _synthetic(count, mean, var, shape=()):
  """Statistics of ``count`` samples with the given mean and variance."""
  return jr.init_running_stats(shape).replace(
      count_hi=jnp.uint32(count >> 32), count_lo=jnp.uint32(count & 0xFFFFFFFF),
      mean_hi=jnp.full(shape, mean, jnp.float32),
      m2_hi=jnp.full(shape, np.float32(var * count), jnp.float32))


class Obs(NamedTuple):
  pixels: object
  vec: object


GROUPS = {"policy": (3,), "critic": (2, 2), "scalar": ()}


def _is_shape(s):
  return isinstance(s, tuple) and not hasattr(s, "_fields") and all(
      isinstance(d, int) for d in s)


def _batch(shapes, leading, rng, loc=5.0):
  return jax.tree.map(
      lambda s: rng.normal(loc, 2.0, leading + s).astype(np.float32), shapes,
      is_leaf=_is_shape)


def _leaf(stats, i):
  """Leaf ``i`` of pytree statistics as the statistics of one array."""
  pick = lambda t: jax.tree.leaves(t)[i]   # noqa: E731
  return stats.replace(mean_hi=pick(stats.mean_hi),
                       mean_lo=pick(stats.mean_lo),
                       m2_hi=pick(stats.m2_hi), m2_lo=pick(stats.m2_lo))


_update = jax.jit(lambda s, x, m: jr.update_running_stats(s, x, valid=m))
_merge = jax.jit(jr.merge_running_stats)


# --- Creation and updates against numpy. ---


def test_init_makes_empty_statistics_of_a_shape_or_a_tree_of_shapes():
  stats = jr.init_running_stats((3, 2))
  assert (stats.shape, stats.dtype, stats.exact_count()) == (
      (3, 2), np.float32, 0)
  assert stats.count_hi.dtype == stats.count_lo.dtype == jnp.uint32
  np.testing.assert_array_equal(stats.mean, np.zeros((3, 2)))
  np.testing.assert_array_equal(stats.variance, np.ones((3, 2)))
  assert float(stats.count) == 0.0
  assert jr.init_running_stats(4).shape == (4,)
  assert jr.init_running_stats(dtype=jnp.bfloat16).dtype == jnp.bfloat16
  tree = jr.init_running_stats(GROUPS)
  assert tree.shape == GROUPS and tree.exact_count() == 0
  assert jax.tree.map(np.shape, tree.mean) == GROUPS
  chex.assert_trees_all_equal(tree.variance, jax.tree.map(
      np.ones, GROUPS, is_leaf=_is_shape))
  nt = jr.init_running_stats(Obs(pixels=(2, 2), vec=(3,)), jnp.bfloat16)
  assert isinstance(nt.mean, Obs) and isinstance(nt.std, Obs)
  assert nt.shape == Obs((2, 2), (3,)) and nt.dtype == jnp.bfloat16
  assert jr.init_running_stats(((2,), (), [4])).shape == ((2,), (), (4,))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_bfloat16_samples_are_cast_to_the_statistics_dtype(transform):
  half = transform(jr.update_running_stats)(
      jr.init_running_stats(), jnp.array([1.0, 2.0, 4.0], jnp.bfloat16))
  assert half.dtype == np.float32
  assert_stats(half, *ref_stats(np.array([1.0, 2.0, 4.0])))


def test_update_does_not_recompile(count_compiles):
  update = jax.jit(jr.update_running_stats)
  rng = np.random.default_rng(6)
  stats = update(jr.init_running_stats(GROUPS), _batch(GROUPS, (4,), rng))
  huge = jax.tree.map(lambda v: np.full_like(v, 1e30), _batch(GROUPS, (4,),
                                                               rng))
  batches = [_batch(GROUPS, (4,), rng), huge]   # huge: left out
  with count_compiles() as c:
    for x in batches:
      stats = update(stats, x)
  assert c.count == 0
  assert (stats.exact_count(), int(stats.nonfinite)) == (8, 4)


def test_masked_samples_change_nothing_even_as_nan():
  stats = _update(jr.init_running_stats(), np.array([1.0, 3.0], F32),
                  np.ones(2, bool))
  x = np.full((4,), np.nan, np.float32)
  for s in (stats, jr.init_running_stats()):   # all masked: the same bits
    assert_same_bits(_update(s, x, np.zeros(4, bool)), s)


def test_constant_samples_have_zero_variance_never_negative():
  for value in (1e3, -7.1, 3.0e7, 1e-30):
    stats = jr.init_running_stats()
    for _ in range(5):
      stats = _update(stats, jnp.full((33,), value, jnp.float32),
                      np.ones(33, bool))
    assert float(stats.variance) == 0.0, value
    assert float(stats.mean) == np.float32(value)


@st.composite
def streams(draw):
  # Few distinct shapes, so that the jitted update compiles a few times only.
  sample_shape = draw(st.sampled_from([(), (2,), (2, 3)]))
  leads = draw(st.lists(st.sampled_from([(0,), (5,), (64,)]),
                        min_size=1, max_size=5))
  masked = draw(st.lists(st.booleans(), min_size=len(leads),
                         max_size=len(leads)))
  loc = draw(st.sampled_from([0.0, 1e3, -5e4]))
  scale = draw(st.sampled_from([1e-1, 1.0, 30.0]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  data = []
  for lead, m in zip(leads, masked):
    x = (loc + scale * rng.standard_normal(lead + sample_shape)).astype(
        np.float32)
    # An all-True mask, not None: the same compiled update serves both.
    data.append((x, rng.random(lead) < 0.6 if m else np.ones(lead, bool)))
  allx = np.concatenate([x.reshape((-1,) + sample_shape)[m.reshape(-1)]
                         for x, m in data])
  return sample_shape, data, scale, allx


@given(streams(), st.randoms(use_true_random=False))
def test_updates_and_merges_in_any_order_equal_numpy_on_the_concatenation(
    stream, random):
  sample_shape, data, scale, allx = stream
  count, mean, var = ref_stats(allx, sample_ndim=len(sample_shape))
  empty = jr.init_running_stats(sample_shape)
  stats = empty
  for x, mask in data:
    stats = _update(stats, x, mask)
  # One update with the concatenation (padded to a fixed 320 rows and
  # masked: one compile per sample shape).
  padded = np.zeros((320,) + sample_shape, np.float32)
  padded[:len(allx)] = allx
  once = _update(empty, padded, np.arange(320) < len(allx))
  parts = [_update(empty, x, m) for x, m in data]
  order = list(range(len(parts)))
  random.shuffle(order)
  merged = empty
  for i in order:
    merged = _merge(merged, parts[i])
  tree = list(parts)   # a balanced tree of merges, too
  while len(tree) > 1:
    tree = [_merge(*tree[i:i + 2]) if i + 1 < len(tree) else tree[i]
            for i in range(0, len(tree), 2)]
  for got in (stats, once, merged, tree[0]):
    assert got.exact_count() == count
    np.testing.assert_allclose(host_mean(got), mean, rtol=0,
                               atol=1e-6 * scale)
    if count:
      np.testing.assert_allclose(host_var(got), var, rtol=1e-5)
      assert (np.asarray(got.variance) >= 0).all()


# --- Counts beyond float32 and int32. ---


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_count_is_exact_beyond_2_to_the_40(transform):
  big = 2**40 + 12345
  a = _synthetic(big, 2.0, 0.25)
  x = np.arange(1000, dtype=np.float32) / 1000 + 2.0   # mean 2.4995
  update = transform(jr.update_running_stats)
  one = update(a, x)
  assert one.exact_count() == big + 1000
  assert update(one, x, valid=np.arange(1000) < 3).exact_count() == big + 1003
  # The float64 merge formula (Chan et al.) for the first update.
  n_b, m_b, v_b = ref_stats(x)
  n = big + n_b
  delta = m_b - 2.0
  np.testing.assert_allclose(host_mean(one), 2.0 + delta * n_b / n,
                             rtol=1e-12)
  np.testing.assert_allclose(
      host_var(one), (0.25 * big + v_b * n_b + delta**2 * big * n_b / n) / n,
      rtol=1e-6)
  # The mean moved by 5e-10, far below a float32 ulp of 2.0: in mean_lo.
  assert float(one.mean_hi) == 2.0 and float(one.mean_lo) > 0
  for big in (2**32 - 3, 2**33 - 1, 2**63 + 2**32 - 5):   # the carry
    stats = update(_synthetic(big, 0.0, 1.0), jnp.zeros(10, jnp.float32))
    assert stats.exact_count() == big + 10, big
  a, b = _synthetic(2**40 - 1, 1.0, 1.0), _synthetic(2**41 + 1, 1.0, 1.0)
  assert jr.merge_running_stats(a, b).exact_count() == 3 * 2**40
  stats = _synthetic(2**40 + 7, 0.0, 1.0)
  assert float(stats.count) == float(2**40)   # rounded to float32
  assert stats.count.dtype == jnp.float32


@pytest.mark.slow
def test_long_stream_accuracy_1e8_samples():
  """1e8 float32 samples, mean 1e3, std 1e-1, in batches of 1e4: within
  1e-7 (mean) and 1e-6 (variance) of float64 numpy."""
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

# Finite float32 batches whose statistics float32 holds, though squaring
# the samples (or summing them) overflows.
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


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_sample_the_statistics_cannot_hold_is_left_out_and_counted(
    transform):
  """1e30 (M2 ~ 1e60) alone is left out and counted, its batch kept."""
  update = transform(lambda s, x, m: jr.update_running_stats(s, x, valid=m))
  stats = update(jr.init_running_stats(), np.array([1.0, 2.0, 3.0], F32),
                 np.ones(3, bool))
  x = np.array([4.0, 1e30, 5.0, -1e30, 6.0], F32)
  out = update(stats, x, np.array([True, True, True, False, True]))
  assert int(out.nonfinite) == 1   # the masked -1e30 is not counted
  assert_stats(out, *ref_stats(np.array([1, 2, 3, 4, 5, 6], F32)), rtol=1e-6)
  # A reach just inside sqrt((F - M2) * (n + 1) / n) is kept.
  reach = np.sqrt((float(np.finfo(F32).max) - 2.0) * 4 / 3)
  kept = update(stats, np.array([2.0 + reach * 0.999], F32), np.ones(1, bool))
  assert (kept.exact_count(), int(kept.nonfinite)) == (4, 0)
  assert np.isfinite(np.asarray(kept.variance))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_batch_the_statistics_cannot_hold_changes_nothing_but_the_count(
    transform):
  """0 and 1e30, or +-1.5e19 x 4 (M2 = 9e38): kept out, counted, harmless."""
  update = transform(jr.update_running_stats)
  normal = np.random.default_rng(7).normal(2.0, 3.0, (16, 2)).astype(F32)
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


def test_merge_of_statistics_too_far_apart_keeps_a_and_counts_b():
  a = jr.update_running_stats(jr.init_running_stats(),
                              np.array([1., 2., 3.], F32))
  b = jr.update_running_stats(jr.init_running_stats(), np.full((5,), 1e30, F32))
  out = _merge(a, b)
  assert int(out.nonfinite) == 5
  assert_same_bits(out.replace(nonfinite=a.nonfinite), a)
  empty = _merge(jr.init_running_stats(), b)   # takes b whole
  assert_stats(empty, 5, 1e30, 0.0, rtol=1e-7, atol=0)
  assert int(empty.nonfinite) == 0


@settings(max_examples=12)
@given(x=hnp.arrays(np.float32, (5, 2),
                    elements=st.sampled_from([0.5, -2.0, 3.0, 1e3, math.nan,
                                              math.inf, -math.inf])),
       use_mask=st.booleans(), jit=st.booleans())
def test_nonfinite_samples_are_skipped_and_counted(x, use_mask, jit):
  mask = (np.arange(x.shape[0]) % 3 != 1) if use_mask else None
  update = jax.jit(jr.update_running_stats) if jit else jr.update_running_stats
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


# --- Pytree samples (observation groups, NamedTuples). ---

# Fixed leaf shapes and leading axes: one compile per kind, three per leaf.
LEAF_SHAPES = {"dict": {"a": (2,), "b": ()},
               "namedtuple": Obs(pixels=(1, 3), vec=(2,)),
               "tuple": ((2,), (), (1, 3)),
               "nested": {"obs": Obs(pixels=(2,), vec=()), "extra": ((1, 3),)}}


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(sorted(
    LEAF_SHAPES)), masked=st.booleans())
def test_each_leaf_equals_numpy_and_one_array_fed_the_same_samples(
    seed, kind, masked):
  rng = np.random.default_rng(seed)
  shapes, leading = LEAF_SHAPES[kind], (2, 3)
  batches = [_batch(shapes, leading, rng, loc) for loc in (3.0, -1e3)]
  masks = [rng.random(leading) < 0.7 if masked else np.ones(leading, bool)
           for _ in batches]
  stats = jr.init_running_stats(shapes)
  for x, m in zip(batches, masks, strict=True):
    stats = _update(stats, x, m)
  assert stats.shape == shapes and type(stats.mean) is type(shapes)
  keep = np.concatenate([m.reshape(-1) for m in masks])
  for i, leaf_shape in enumerate(jax.tree.leaves(shapes, is_leaf=_is_shape)):
    xs = [jax.tree.leaves(x)[i] for x in batches]
    whole = np.concatenate([x.reshape((-1,) + leaf_shape) for x in xs])
    got = _leaf(stats, i)
    assert_stats(got, *ref_stats(whole, keep, sample_ndim=len(leaf_shape)),
                 rtol=1e-4, atol=1e-3)
    alone = jr.init_running_stats(leaf_shape)   # bit for bit one array's
    for x, m in zip(xs, masks, strict=True):
      alone = _update(alone, x, m)
    assert_same_bits(got, alone)


@pytest.mark.parametrize("bad", ["nan", "inf", "too far"])
def test_a_bad_value_in_one_leaf_leaves_the_whole_sample_out(bad):
  rng = np.random.default_rng(0)
  prior = _update(jr.init_running_stats(GROUPS), _batch(GROUPS, (6,), rng),
                  np.ones(6, bool))   # one program for every update here
  x = _batch(GROUPS, (6,), rng)
  leaf, where = {"nan": ("critic", (2, 1, 0)), "inf": ("scalar", (4,)),
                 "too far": ("policy", (1, 0))}[bad]
  x[leaf][where] = {"nan": np.nan, "inf": np.inf, "too far": 3e38}[bad]
  stats = _update(prior, x, np.ones(6, bool))
  assert stats.exact_count() == 11 and int(stats.nonfinite) == 1
  merged = _merge(prior, _update(jr.init_running_stats(GROUPS), x,
                                 np.arange(6) != where[0]))
  chex.assert_trees_all_close(stats.mean, merged.mean, rtol=1e-6)
  chex.assert_trees_all_close(stats.variance, merged.variance, rtol=1e-5)
  for v in jax.tree.leaves(stats.m2_hi):
    assert np.isfinite(np.asarray(v)).all()


# --- vmap, axis_name, shard_map, shard_rows. ---


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_vmap_over_a_stack_of_statistics_equals_each_alone(transform):
  rng = np.random.default_rng(4)
  arrays = [rng.normal(size=6).astype(F32), np.full((6,), 1e30, F32),
            F32(5e19) + np.arange(-3, 3).astype(F32) * F32(1e13)]
  groups = {"policy": (3,), "critic": ()}
  for shapes, xs in (((), arrays), (groups, [_batch(groups, (6,), rng, loc)
                                             for loc in (1., 9.)])):
    stack = jax.vmap(lambda _, s=shapes: jr.init_running_stats(s))(
        jnp.arange(len(xs)))
    assert stack.shape == shapes
    out = transform(jax.vmap(jr.update_running_stats))(
        stack, jax.tree.map(lambda *v: np.stack(v), *xs))
    for k, x in enumerate(xs):
      alone = jr.update_running_stats(jr.init_running_stats(shapes), x)
      assert_same_bits(jax.tree.map(lambda v, k=k: v[k], out), alone)


def _split_data(n=8 * 6, loc=1e3):
  rng = np.random.default_rng(3)
  x = (loc + rng.normal(size=(n, 3))).astype(np.float32)
  mask = rng.random(n) < 0.7
  prior = jr.update_running_stats(jr.init_running_stats((3,)), (
      loc + rng.normal(size=(5, 3))).astype(np.float32))
  return prior, x, mask, jr.update_running_stats(prior, x, valid=mask)


def _assert_close_stats(a, b):
  assert a.exact_count() == b.exact_count()
  chex.assert_trees_all_close(host_mean(a), host_mean(b), rtol=1e-7)
  chex.assert_trees_all_close(host_var(a), host_var(b), rtol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_axis_name_under_vmap_equals_one_device(transform):
  rng = np.random.default_rng(3)
  shapes = {"policy": (3,), "critic": ()}
  prior = jr.update_running_stats(jr.init_running_stats(shapes),
                                  _batch(shapes, (5,), rng))
  x = _batch(shapes, (D, 6), rng, loc=1e3)
  mask = rng.random((D, 6)) < 0.8
  one = jr.update_running_stats(prior, jax.tree.map(
      lambda v: v.reshape((-1,) + v.shape[2:]), x), valid=mask.reshape(-1))
  out = transform(jax.vmap(lambda x, m: jr.update_running_stats(
      prior, x, valid=m, axis_name="d"), axis_name="d"))(x, mask)
  for leaf in jax.tree.leaves(out):   # every device, bit-equal
    assert (np.asarray(leaf) == np.asarray(leaf)[:1]).all()
  first = jax.tree.map(lambda v: v[0], out)
  assert first.exact_count() == one.exact_count()
  chex.assert_trees_all_close(first.mean, one.mean, rtol=1e-6)
  chex.assert_trees_all_close(first.variance, one.variance, rtol=1e-5)
  # Huge samples: 1e30 alone is held; 1e30 and 7 together are not.
  huge = np.full((D * 2,), 1e30, F32)
  for data in (huge, np.where(np.arange(D * 2) == 3, F32(7), huge)):
    one = jr.update_running_stats(jr.init_running_stats(), data)
    out = transform(jax.vmap(lambda v: jr.update_running_stats(
        jr.init_running_stats(), v, axis_name="d"), axis_name="d"))(
            data.reshape(D, 2))
    for device in range(D):
      assert_same_bits(jax.tree.map(lambda v, d=device: v[d], out), one)


@needs_8
@pytest.mark.parametrize("axes", [("envs",), ("hosts", "envs")], ids=str)
def test_axis_name_under_shard_map_equals_one_device(axes):
  prior, x, mask, one = _split_data()
  mesh = jax.make_mesh((D,) if len(axes) == 1 else (2, 4), axes)
  f = jax.jit(jax.shard_map(
      lambda s, x, m: jr.update_running_stats(s, x, valid=m, axis_name=axes),
      mesh=mesh, in_specs=(P(), P(axes), P(axes)), out_specs=P()))
  out = f(prior, *jr.shard_rows((x, mask), mesh, axes))
  _assert_close_stats(out, one)
  for leaf in jax.tree_util.tree_leaves(out):   # the same on every device
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == D
    assert all((s == shards[0]).all() for s in shards)


@needs_8
def test_rows_sharded_with_shard_rows_equal_one_device():
  prior, x, mask, one = _split_data()
  mesh = jax.make_mesh((D,), ("envs",))
  xs, ms = jr.shard_rows((x, mask), mesh)
  assert xs.sharding.spec == P("envs")
  _assert_close_stats(jax.jit(jr.update_running_stats)(prior, xs, valid=ms),
                      one)
  stats = jax.device_put(prior, NamedSharding(mesh, P()))
  np.testing.assert_allclose(jax.jit(jr.normalize)(stats, xs),
                             jr.normalize(prior, x), rtol=1e-6)


# --- normalize / denormalize. ---


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_normalize_and_denormalize_match_numpy(transform):
  rng = np.random.default_rng(4)
  data = rng.normal(3.0, 5.0, (50, 2)).astype(np.float32)
  stats = jr.update_running_stats(jr.init_running_stats((2,)), data)
  x = rng.normal(3.0, 20.0, (4, 6, 2)).astype(np.float32)
  _, mean, var = ref_stats(data, sample_ndim=1)
  got = transform(lambda s, x: jr.normalize(s, x, clip=1.5, eps=0.1))(
      stats, x)
  np.testing.assert_allclose(
      got, np.clip((x - mean) / np.sqrt(var + 0.1), -1.5, 1.5), rtol=1e-5,
      atol=1e-6)
  assert got.dtype == jnp.float32 and got.shape == x.shape
  half = x.astype(jnp.bfloat16)
  y = transform(jr.normalize)(stats, half)
  assert y.dtype == jnp.bfloat16   # the input's dtype kept
  np.testing.assert_allclose(np.asarray(y, np.float32), (
      half.astype(np.float64) - mean) / np.sqrt(var + 1e-8), rtol=1e-2,
                             atol=1e-2)
  np.testing.assert_array_equal(transform(jr.normalize)(
      jr.init_running_stats(), jnp.array([2.])), [2.])   # empty: unchanged
  # eps=2**40 is a valid (if odd) float, not an int32 overflow.
  np.testing.assert_allclose(
      jr.normalize(jr.init_running_stats(), np.ones(3, F32), eps=2**40),
      np.ones(3) / np.sqrt(1 + 2.0**40), rtol=1e-6)
  # Each leaf of a pytree, and denormalize undoing it.
  shapes = Obs(pixels=(2, 2), vec=(3,))
  data = _batch(shapes, (4, 5), rng)
  stats = jr.update_running_stats(jr.init_running_stats(shapes), data)
  y = transform(lambda s, x: jr.normalize(s, x, clip=1.5))(stats, data)
  assert isinstance(y, Obs)
  for leaf, got, shape in zip(data, y, shapes, strict=True):
    _, mean, var = ref_stats(leaf, sample_ndim=len(shape))
    np.testing.assert_allclose(
        got, np.clip((leaf - mean) / np.sqrt(var + 1e-8), -1.5, 1.5),
        rtol=1e-4, atol=1e-5)
  # Each leaf's leading axes may differ when normalising.
  one = Obs(pixels=data.pixels[0, 0], vec=data.vec[:2, :1])
  back = transform(jr.denormalize)(stats, transform(jr.normalize)(stats, one))
  chex.assert_trees_all_close(back, one, rtol=1e-5, atol=1e-5)
  # A stack of statistics normalises under vmap.
  stack = jax.vmap(
      lambda x: jr.update_running_stats(jr.init_running_stats(), x))(
      jnp.array([[0., 2.], [10., 30.]]))
  np.testing.assert_allclose(
      transform(jax.vmap(jr.normalize))(stack, jnp.array([[2.], [40.]])),
      [[1.], [2.]], rtol=1e-6)


# --- Serialisation. ---


def _reward_stream(seed, t, e):
  rng = np.random.default_rng(seed)
  return (rng.normal(-2.0, 3.0, (t, e)).astype(np.float32),
          rng.random((t, e)) < 0.15)


def test_round_trips_through_flax_serialization_and_the_checkpoint(tmp_path):
  """Statistics past 2**40 and a scaler come back bit for bit and resume."""
  pytest.importorskip("orbax.checkpoint")
  shapes = {"policy": (3,), "critic": ()}
  stats = jr.init_running_stats(shapes).replace(
      count_lo=jnp.uint32(5), count_hi=jnp.uint32(256))
  stats = jr.update_running_stats(stats, _batch(shapes, (4,),
                                                np.random.default_rng(7)))
  rewards, dones = _reward_stream(9, 6, 4)
  _, scaler = jr.scale_rollout_rewards(jr.init_reward_scaler(4), rewards,
                                       dones, gamma=0.9)
  item = {"obs_stats": stats, "scaler": scaler}
  target = {"obs_stats": jr.init_running_stats(shapes),
            "scaler": jr.init_reward_scaler(4)}
  assert set(flax.serialization.to_state_dict(scaler)) == {"returns", "stats"}
  back = flax.serialization.from_bytes(target,
                                       flax.serialization.to_bytes(item))
  assert_same_bits(back, item)
  jr.save_rollout(tmp_path / "ckpt", item)
  back = jr.restore_rollout(tmp_path / "ckpt", target)
  assert back["obs_stats"].exact_count() == 2**40 + 9
  assert_same_bits(back, item)
  x = _batch(shapes, (4,), np.random.default_rng(8))
  assert_same_bits(jr.update_running_stats(back["obs_stats"], x),
                   jr.update_running_stats(stats, x))
  more = rewards[::-1]
  np.testing.assert_array_equal(
      jr.scale_rollout_rewards(back["scaler"], more, dones, gamma=0.9)[0],
      jr.scale_rollout_rewards(scaler, more, dones, gamma=0.9)[0])


# --- Reward scaling. ---


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_scale_rewards_matches_the_reference(transform, truncate):
  # The episode ends where either flag is set: the reference takes their or.
  rewards, term = _reward_stream(11, 30, 5)
  trunc = np.random.default_rng(12).random(term.shape) < 0.1
  want, g = ref_scale_rewards(rewards, term | trunc if truncate else term,
                              0.9, clip=4.0)
  kwargs = {"gamma": 0.9, "clip": 4.0}
  step = transform(lambda s, r, d, c: jr.scale_rewards(
      s, r, d, truncations=c if truncate else None, **kwargs))
  scaler, got = jr.init_reward_scaler(5), []
  for r, d, c in zip(rewards, term, trunc, strict=True):
    scaled, scaler = step(scaler, r, d, c)
    got.append(scaled)
  np.testing.assert_allclose(np.stack(got), want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(scaler.returns, g, rtol=1e-5, atol=1e-6)
  assert scaler.stats.exact_count() == 30 * 5
  # The rollout form equals T one-step calls.
  scaled, rolled = transform(lambda s, r, d, c: jr.scale_rollout_rewards(
      s, r, d, truncations=c if truncate else None, **kwargs))(
          jr.init_reward_scaler(5), rewards, term, trunc)
  np.testing.assert_allclose(scaled, np.stack(got), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(rolled.returns, scaler.returns, rtol=1e-6)


def test_scale_rewards_matches_gymnasiums_wrapper():
  """gymnasium's NormalizeReward, its pseudo-count prior made negligible."""
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
  scaled, _ = transform(jax.vmap(lambda s, g: jr.scale_rollout_rewards(
      s, rewards, dones, gamma=g)))(scalers, gammas)
  for i, g in enumerate([0.0, 0.5, 0.99]):
    np.testing.assert_allclose(scaled[i], ref_scale_rewards(
        rewards, dones, g)[0], rtol=2e-5, atol=1e-6)


def test_scale_rewards_with_axis_name_equals_one_device():
  rewards, dones = _reward_stream(8, 10, 16)
  one, one_state = jr.scale_rollout_rewards(jr.init_reward_scaler(16), rewards,
                                            dones, gamma=0.9)
  split = lambda a: a.reshape(10, D, 2).transpose(1, 0, 2)   # noqa: E731
  scaled, state = jax.vmap(lambda r, d: jr.scale_rollout_rewards(
      jr.init_reward_scaler(2), r, d, gamma=0.9, axis_name="d"),
                           axis_name="d")(split(rewards), split(dones))
  np.testing.assert_allclose(scaled.transpose(1, 0, 2).reshape(10, 16), one,
                             rtol=1e-5)
  assert int(state.stats.exact_count()[3]) == one_state.stats.exact_count()


# --- Misuse: errors raised at trace time, naming the function, the argument
# (and the leaf), what was expected and what was given. ---


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_update_errors_under_jit_and_without(transform):
  stats = jr.init_running_stats((3,))
  update = transform(lambda s, x, m: jr.update_running_stats(s, x, valid=m))
  for x, m, exc, match in (   # shapes and dtypes of `x`: ERRORS
      (jnp.zeros((4, 3)), jnp.ones(5, bool), ValueError, r"`valid` has shape "
       r"\(5,\), expected \(4,\) = the leading axes of `x`"),
      (jnp.zeros((4, 3)), jnp.ones(4), TypeError, r"`valid` has dtype "
       r"float32, expected bool")):
    with pytest.raises(exc, match=r"^update_running_stats: " + match):
      update(stats, x, m)
  scale = transform(lambda s, r, d: jr.scale_rewards(s, r, d, gamma=0.99))
  scaler, r, d = jr.init_reward_scaler(4), jnp.zeros(4), jnp.zeros(4, bool)
  for r_, d_, exc, match in (
      (jnp.zeros(3), d, ValueError, r"`rewards` has shape \(3,\), expected "
       r"\(4,\) = \[E\]"),
      (r, jnp.zeros((2, 4), bool), ValueError, r"`terminations` has shape "
       r"\(2, 4\), expected \(4,\) = \[E\]"),
      (jnp.zeros(4, jnp.int32), d, TypeError, r"`rewards` has dtype int32, "
       r"expected a floating dtype")):
    with pytest.raises(exc, match=r"^scale_rewards: " + match):
      scale(scaler, r_, d_)


STATS3 = jr.init_running_stats((3,))
GOOD = {"policy": jnp.ones((4, 3)), "critic": jnp.ones((4, 2))}
TREE = jr.update_running_stats(
    jr.init_running_stats({"policy": (3,), "critic": (2,)}), GOOD)
STACK = jax.vmap(lambda _: jr.init_running_stats())(jnp.arange(2))
NT = jr.init_running_stats(Obs(pixels=(2,), vec=(3,)))
U = "update_running_stats"


def _up(stats, x, **kwargs):
  return lambda: jr.update_running_stats(stats, x, **kwargs)


ERRORS = [
    # update_running_stats: the statistics, the structure and each leaf.
    (_up({"mean": 0}, jnp.zeros((4, 3))), TypeError,
     rf"^{U}: `stats` must be a RunningStats .*got dict"),
    (_up(STACK, jnp.zeros(2)), ValueError,
     rf"^{U}: `stats` is a stack .*jax.vmap"),
    (_up(TREE, {"policy": GOOD["policy"]}),
     ValueError, rf"^{U}: `x` has structure PyTreeDef\(\{{'policy': \*\}}\), "
     r"expected .*'critic'.*: missing leaves \[\"\['critic'\]\"\], "
     r"unexpected leaves \[\]$"),
    (_up(TREE, {**GOOD, "extra": jnp.ones(4)}),
     ValueError, r"unexpected leaves \[\"\['extra'\]\"\]"),
    (_up(TREE, {**GOOD, "critic": jnp.ones((4, 3))}),
     ValueError, rf"^{U}: `x\['critic'\]` has shape \(4, 3\), expected "
     r"\[\.\.\., \*\(2,\)\]"),
    (_up(TREE, {**GOOD, "policy": jnp.ones((4, 3), int)}),
     TypeError, rf"^{U}: `x\['policy'\]` has dtype int32, expected a "
     "floating dtype"),
    (_up(TREE, {**GOOD, "policy": jnp.ones((5, 3))}),
     ValueError, rf"^{U}: `x\['policy'\]` has leading axes \(5,\), expected "
     r"\(4,\) like `x\['critic'\]`"),
    (_up(TREE, jnp.ones((4, 3))), TypeError,
     rf"^{U}: `x` has structure PyTreeDef\(\*\), expected PyTreeDef\("
     r"\{'critic': \*, 'policy': \*\}\), the statistics' sample structure$"),
    (_up(STATS3, {"policy": jnp.ones((4, 3))}),
     TypeError, rf"^{U}: `x` has structure PyTreeDef\(\{{'policy': \*\}}\), "
     r"expected PyTreeDef\(\*\)"),
    (_up(NT, (jnp.ones((4, 2)), jnp.ones((4, 3)))),
     TypeError, rf"^{U}: `x` has structure PyTreeDef\(\(\*, \*\)\), "
     "expected .*Obs"),
    # normalize, denormalize.
    (lambda: jr.normalize(STATS3, jnp.zeros(2)), ValueError,
     r"^normalize: `x` has shape \(2,\), expected \[\.\.\., \*\(3,\)\]"),
    (lambda: jax.jit(jr.normalize)(STATS3, jnp.zeros(3, jnp.int32)),
     TypeError, r"^normalize: `x` has dtype int32"),
    (lambda: jr.normalize(TREE, {**GOOD, "critic": jnp.ones((4, 3))}),
     ValueError, r"^normalize: `x\['critic'\]` has shape"),
    (lambda: jr.denormalize(STATS3, jnp.zeros((3, 1))), ValueError,
     r"^denormalize: `y` has shape \(3, 1\)"),
    (lambda: jr.denormalize(STATS3, jnp.zeros(3, bool)), TypeError,
     r"^denormalize: `y` has dtype bool"),
    (lambda: jr.denormalize(TREE, {"policy": GOOD["policy"]}), ValueError,
     r"^denormalize: `y` has structure .*missing leaves"),
    # merge_running_stats.
    (lambda: jr.merge_running_stats(jr.init_running_stats(), STACK),
     ValueError, r"^merge_running_stats: `b` is a stack of statistics "
     r"\(count of shape \(2,\)\); map over the stack with jax\.vmap$"),
    (lambda: jr.merge_running_stats(1.0, STATS3), TypeError,
     r"^merge_running_stats: `a` must be a RunningStats \(from "
     r"jr\.init_running_stats\), got "),
    (lambda: jr.merge_running_stats(jr.init_running_stats(),
                                    jr.init_running_stats(2)),
     ValueError, r"^merge_running_stats: `b` holds samples of shape \(2,\), "
     r"expected \(\) like `a`"),
    (lambda: jr.merge_running_stats(jr.init_running_stats(),
                                    jr.init_running_stats(dtype=jnp.bfloat16)),
     TypeError, r"^merge_running_stats: `b` has dtype bfloat16, expected "
     "float32 like `a`"),
    (lambda: jr.merge_running_stats(TREE, STATS3), ValueError,
     r"^merge_running_stats: `b` holds samples of structure"),
    # init_running_stats (a tree's paths), init_reward_scaler.
    (lambda: jr.init_running_stats({"policy": (3,), "critic": "abc"}),
     TypeError, r"^init_running_stats: `shape\['critic'\]` must be a tuple "
     "of ints, got 'abc'"),
    (lambda: jr.init_running_stats(((3,), (-1,))), ValueError,
     r"^init_running_stats: `shape\[1\]` must be non-negative"),
    (lambda: jr.init_running_stats({}), ValueError,
     r"^init_running_stats: `shape` \{\} holds no shape"),
    (lambda: jr.init_reward_scaler((2, True)), TypeError,
     r"^init_reward_scaler: .*bool"),
    (lambda: jr.init_reward_scaler(0), ValueError,
     r"^init_reward_scaler: `num_envs` must be positive, got 0"),
    # scale_rewards, scale_rollout_rewards.
    (lambda: jr.scale_rewards(jr.init_running_stats(), jnp.zeros(4),
                              jnp.zeros(4, bool)),
     TypeError, r"^scale_rewards: `scaler` must be a RewardScaler"),
    (lambda: jr.scale_rewards(jr.init_reward_scaler(4), jnp.zeros(4),
                              jnp.zeros(4, bool), truncations=jnp.zeros(4)),
     TypeError, r"^scale_rewards: `truncations`"),
    (lambda: jr.scale_rollout_rewards(jr.init_reward_scaler(4), jnp.zeros(4),
                                      jnp.zeros(4, bool)),
     ValueError, r"^scale_rollout_rewards: `rewards` has shape \(4,\), "
     r"expected \(T, 4\) = \[T, E\]"),
    (lambda: jr.scale_rollout_rewards(
        jr.init_reward_scaler(5), jnp.zeros((30, 5)), jnp.zeros((30, 5), bool),
        truncations=jnp.zeros(30, bool)),
     ValueError, r"^scale_rollout_rewards: `truncations` has shape \(30,\), "
     r"expected \(T, 5\)"),
]


@pytest.mark.parametrize("call, exc, match", ERRORS,
                         ids=[str(i) for i in range(len(ERRORS))])
def test_errors_name_the_function_the_argument_and_the_leaf(call, exc, match):
  before = jax.tree.map(np.array, TREE)
  with pytest.raises(exc, match=match):
    call()
  assert_same_bits(TREE, before)   # the statistics are values


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
