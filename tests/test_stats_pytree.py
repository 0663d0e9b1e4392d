"""Running statistics of a pytree sample (observation groups, a NamedTuple
of arrays): ``init_running_stats(tree of shapes)``, ``update_running_stats``,
``merge_running_stats``, ``normalize`` and ``denormalize`` leaf by leaf.

The reference is float64 numpy per leaf over the samples kept, a sample
being one index of the leading axes across every leaf (a NaN in any leaf
leaves the whole sample out). Each leaf is also compared bit for bit with
the statistics of a single array fed the same samples.
"""

from typing import NamedTuple

import flax.serialization
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from tests.conftest import TRANSFORMS
from tests.test_stats import ref_stats


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


def _leaves(tree):
  return jax.tree.leaves(tree)


def _same_bits(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


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
  for v in _leaves(stats.variance):
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
    xs = [_leaves(x)[i] for x in batches]
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
    _same_bits(got, alone)


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
  for v in _leaves(after.m2_hi):
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
  for leaf in _leaves(out):
    assert (np.asarray(leaf) == np.asarray(leaf)[:1]).all()
  assert first.exact_count() == one.exact_count()
  for a, b in zip(_leaves(first.mean), _leaves(one.mean), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  for a, b in zip(_leaves(first.variance), _leaves(one.variance),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5)


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
    _same_bits(jax.tree.map(lambda v, k=k: v[k], out), alone)


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
  for a, b in zip(merged.mean, both.mean, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  for a, b in zip(merged.variance, both.variance, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_update_does_not_recompile(count_compiles):
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
  _same_bits(back, stats)
  jr.save_rollout(tmp_path / "ckpt", {"obs_stats": stats})
  restored = jr.restore_rollout(tmp_path / "ckpt",
                                {"obs_stats": jr.init_running_stats(shapes)})
  _same_bits(restored["obs_stats"], stats)
  x = _batch(shapes, (4,), rng)
  _same_bits(jr.update_running_stats(restored["obs_stats"], x),
             jr.update_running_stats(stats, x))


# --- Errors name the function, the argument and the leaf. ---


def test_errors_name_the_leaf():
  stats = jr.init_running_stats({"policy": (3,), "critic": (2,)})
  good = {"policy": jnp.ones((4, 3)), "critic": jnp.ones((4, 2))}
  stats = jr.update_running_stats(stats, good)
  before = jax.tree.map(np.array, stats)
  fn = "update_running_stats"
  with pytest.raises(ValueError, match=rf"{fn}: `x` does not have the "
                     r"statistics' sample structure: missing leaves "
                     r"\[\"\['critic'\]\"\], unexpected leaves \[\]"):
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
  with pytest.raises(TypeError, match=rf"{fn}: `x` is one ArrayImpl, "
                     r"expected a pytree with leaves \[\"\['critic'\]\", "
                     r"\"\['policy'\]\"\]"):
    jr.update_running_stats(stats, jnp.ones((4, 3)))
  flat = jr.init_running_stats((3,))
  with pytest.raises(TypeError, match=rf"{fn}: `x` is a dict with leaves "
                     r"\[\"\['policy'\]\"\], expected one array \[\.\.\., "
                     r"\*\(3,\)\]"):
    jr.update_running_stats(flat, {"policy": jnp.ones((4, 3))})
  nt = jr.init_running_stats(Obs(pixels=(2,), vec=(3,)))
  with pytest.raises(TypeError, match=rf"{fn}: `x` has structure "
                     r"PyTreeDef\(\(\*, \*\)\), expected .*Obs"):
    jr.update_running_stats(nt, (jnp.ones((4, 2)), jnp.ones((4, 3))))
  with pytest.raises(ValueError, match=r"normalize: `x\['critic'\]` has "
                     r"shape"):
    jr.normalize(stats, {**good, "critic": jnp.ones((4, 3))})
  with pytest.raises(ValueError, match=r"denormalize: `y` does not have"):
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
  _same_bits(stats, before)
  assert stats.exact_count() == 4
