"""Tests of jrollout._minibatch against the numpy DictDataset model."""

import collections

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from tests import reference
from tests._helpers import assert_tree_equal, random_batch
from tests.conftest import TRANSFORMS


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shuffle", [True, False])
def test_minibatch_indices_is_a_partition(transform, shuffle, rng_key):
  fn = transform(lambda k: jr.minibatch_indices(k, 96, 16, shuffle=shuffle))
  idx = np.asarray(fn(rng_key))
  assert idx.shape == (6, 16) and idx.dtype == np.int32
  np.testing.assert_array_equal(np.sort(idx.ravel()), np.arange(96))
  if not shuffle:
    np.testing.assert_array_equal(idx.ravel(), np.arange(96))
  else:
    assert not (idx.ravel() == np.arange(96)).all()


def test_shuffle_false_accepts_none_key_and_shuffle_needs_key():
  np.testing.assert_array_equal(
      jr.minibatch_indices(None, 6, 2, shuffle=False), [[0, 1], [2, 3], [4, 5]])
  with pytest.raises(ValueError, match=r"minibatch_indices: `key` is None but "
                     "shuffle=True"):
    jr.minibatch_indices(None, 6, 2)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_take_matches_numpy_modulo_wrap(transform, rng_key):
  batch = random_batch([12, 5, 3, 12])
  idx = jr.minibatch_indices(rng_key, 12, 4)
  got = [transform(jr.take)(batch, idx[j]) for j in range(3)]
  expected = reference.minibatches(batch, idx)
  for g, e in zip(got, expected):
    assert_tree_equal(g, e)


def test_minibatches_iterator_equals_indices_and_reference(rng_key):
  batch = random_batch([24, 7, 1, 24])
  batch["nested"] = {"a": np.arange(6), "b": (np.arange(12.0).reshape(6, 2),)}
  got = list(jr.minibatches(rng_key, batch, 8, num_epochs=2))
  assert len(got) == 6
  for epoch in range(2):
    idx = jr.minibatch_indices(rng_key, 24, 8, epoch=epoch)
    for j, expected in enumerate(reference.minibatches(
        {k: v for k, v in batch.items() if k != "nested"}, idx)):
      mb = got[epoch * 3 + j]
      assert_tree_equal({k: v for k, v in mb.items() if k != "nested"},
                        expected)
      np.testing.assert_array_equal(mb["nested"]["a"], np.asarray(idx[j]) % 6)
      np.testing.assert_array_equal(
          mb["nested"]["b"][0],
          batch["nested"]["b"][0][np.asarray(idx[j]) % 6])
  # Epochs differ.
  assert not np.array_equal(jr.minibatch_indices(rng_key, 24, 8, epoch=0),
                            jr.minibatch_indices(rng_key, 24, 8, epoch=1))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_scan_minibatches_equals_iterator(transform, rng_key):
  batch = random_batch([32, 8, 5])

  def fn(carry, mb):
    return carry + 1, {k: v for k, v in mb.items()}

  def run(key, batch):
    return jr.scan_minibatches(fn, jnp.int32(0), key, batch, 8, num_epochs=3)

  carry, outs = transform(run)(rng_key, batch)
  assert int(carry) == 12
  got = list(jr.minibatches(rng_key, batch, 8, num_epochs=3))
  for e in range(3):
    for j in range(4):
      assert_tree_equal({k: v[e, j] for k, v in outs.items()}, got[e * 4 + j])


def test_rollout_state_is_a_batch_without_flattening(rng_key):
  state = jr.register(jr.init(4, 6), "obs", (3,))
  state = jr.register(state, "r")
  rng = np.random.default_rng(0)
  state = jr.update_all(state, {
      "obs": rng.standard_normal((6, 4, 3)).astype(np.float32),
      "r": rng.standard_normal((6, 4)).astype(np.float32)})
  flat, _ = jr.make_batch(state)
  idx = jr.minibatch_indices(rng_key, 24, 6)
  for j, mb in enumerate(jr.minibatches(rng_key, state, 6)):
    assert_tree_equal(mb, jr.take(flat, idx[j]))
    assert_tree_equal(jax.jit(jr.take)(state, idx[j]), jr.take(flat, idx[j]))
  c1, o1 = jr.scan_minibatches(lambda c, mb: (c, mb), 0, rng_key, state, 6,
                               num_epochs=2)
  c2, o2 = jr.scan_minibatches(lambda c, mb: (c, mb), 0, rng_key, flat, 6,
                               num_epochs=2)
  assert_tree_equal(o1, o2)


def test_vmap_over_keys(rng_key):
  batch = random_batch([16, 4])
  keys = jax.random.split(rng_key, 3)
  idx = jax.vmap(lambda k: jr.minibatch_indices(k, 16, 4))(keys)
  mbs = jax.vmap(lambda k: jr.scan_minibatches(
      lambda c, mb: (c, mb), 0, k, batch, 4)[1])(keys)
  for i, k in enumerate(keys):
    np.testing.assert_array_equal(idx[i], jr.minibatch_indices(k, 16, 4))
    assert_tree_equal({n: v[i, 0] for n, v in mbs.items()},
                      {n: np.stack([
                          np.asarray(batch[n])[np.asarray(r) % len(batch[n])]
                          for r in idx[i]]) for n in batch})


def _count_rows(carry, mb):
  return carry + mb["k0"].shape[0], None


def test_no_recompile_across_epochs_and_rollouts(rng_key, count_compiles):
  def epochs(batch, key):
    for _ in jr.minibatches(key, batch, 8, num_epochs=2):
      pass
    jax.block_until_ready(jr.minibatch_indices(key, 32, 8))
    jr.scan_minibatches(_count_rows, 0, key, batch, 8)
    jax.jit(jr.scan_minibatches, static_argnums=(0, 4))(
        _count_rows, 0, key, batch, 8)

  keys = jax.random.split(rng_key, 4)
  epochs(random_batch([32, 5], 0), keys[0])
  with count_compiles() as counter:
    for seed in range(1, 4):
      epochs(random_batch([32, 5], seed), keys[seed])
  assert counter.count == 0


@pytest.mark.parametrize("batch, size, exc, match", [
    ({}, 4, ValueError, r"minibatches: `batch` is empty \(no fields\)"),
    ({"a": np.zeros((0, 2))}, 4, ValueError,
     r"minibatches: field 'a' has zero rows"),
    ({"a": np.zeros(8)}, 0, ValueError,
     r"minibatches: `batch_size` must be positive, got 0"),
    ({"a": np.zeros(8)}, -2, ValueError, r"must be positive, got -2"),
    ({"a": np.zeros(8)}, 16, ValueError,
     r"minibatches: `batch_size` 16 is larger than the number of rows "
     r"N = 8"),
    ({"a": np.zeros(1024), "b": np.zeros(3)}, 48, ValueError,
     r"minibatches: `batch_size` 48 does not divide the number of rows "
     r"N = 1024 \(1024 % 48 = 16\); the nearest valid batch sizes are "
     r"32 or 64"),
    ({"a": {"x": np.zeros(8), "y": np.zeros(6)}}, 4, ValueError,
     r"minibatches: field 'a' has mismatched leading shapes: 'a'\['x'\] has 8 "
     r"rows but 'a'\['y'\] has 6"),
    ({"a": np.float32(1.0)}, 1, ValueError,
     r"minibatches: field 'a' is a scalar"),
    ({"a": np.zeros(8)}, 2.0, TypeError, r"`batch_size` must be an int"),
    ([np.zeros(8)], 2, TypeError, r"`batch` must be a dict"),
])
def test_errors_are_raised_at_the_call(batch, size, exc, match, rng_key):
  with pytest.raises(exc, match=match):
    jr.minibatches(rng_key, batch, size)   # raises before iterating
  with pytest.raises(exc, match=match.replace("minibatches:",
                                              "scan_minibatches:")):
    jr.scan_minibatches(lambda c, mb: (c, None), 0, rng_key, batch, size)


def test_other_errors(rng_key):
  with pytest.raises(ValueError, match=r"scan_minibatches: `num_epochs` must be"
                     " positive, got 0"):
    jr.scan_minibatches(lambda c, mb: (c, None), 0, rng_key,
                        {"a": np.zeros(4)}, 2, num_epochs=0)
  with pytest.raises(ValueError, match=r"minibatches: the RolloutState has no "
                     "registered fields"):
    jr.minibatches(rng_key, jr.init(2, 2), 2)
  with pytest.raises(TypeError, match=r"take: `idx` must be integers"):
    jr.take({"a": np.zeros(4)}, np.zeros(2, np.float32))
  with pytest.raises(ValueError, match=r"minibatch_indices: `batch_size` 1 "
                     r"does not divide|minibatch_indices: `num_rows` must be"):
    jr.minibatch_indices(rng_key, 0, 1)


# --- properties --------------------------------------------------------------


@st.composite
def _sizes(draw):
  num_batches = draw(st.integers(1, 8))
  batch_size = draw(st.integers(1, 16))
  n = num_batches * batch_size
  lengths = draw(st.lists(st.integers(1, n), min_size=0, max_size=3))
  return n, batch_size, [n] + lengths


@given(sizes=_sizes(), seed=st.integers(0, 2**31 - 1),
       epoch=st.integers(0, 5))
def test_property_epoch_visits_every_row_once_and_wraps(sizes, seed, epoch):
  n, batch_size, lengths = sizes
  key = jax.random.key(seed)
  idx = np.asarray(jr.minibatch_indices(key, n, batch_size, epoch=epoch))
  assert idx.shape == (n // batch_size, batch_size)
  np.testing.assert_array_equal(np.sort(idx.ravel()), np.arange(n))
  batch = {f"k{i}": np.arange(length) for i, length in enumerate(lengths)}
  rows = collections.defaultdict(collections.Counter)
  for j in range(idx.shape[0]):
    mb = jr.take(batch, idx[j])
    for k, v in mb.items():
      np.testing.assert_array_equal(v, idx[j] % len(batch[k]))
      rows[k].update(np.asarray(v).tolist())
  for k, length in zip(batch, lengths):
    for r in range(length):
      # Row r of a shorter array appears as often as indices congruent to r.
      assert rows[k][r] == len(range(r, n, length))


@given(n=st.integers(16, 4096), seed=st.integers(0, 2**31 - 2))
def test_property_keys_determine_order(n, seed):
  a = jr.minibatch_indices(jax.random.key(seed), n, 1)
  b = jr.minibatch_indices(jax.random.key(seed), n, 1)
  c = jr.minibatch_indices(jax.random.key(seed + 1), n, 1)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


@given(n=st.integers(1, 300))
def test_property_unshuffled_is_identity(n):
  np.testing.assert_array_equal(
      np.asarray(jr.minibatch_indices(None, n, n, shuffle=False))[0],
      np.arange(n))


def test_permutation_is_roughly_uniform():
  # The first position's value over many keys is close to uniform (chi^2),
  # and the mean displacement matches a random permutation's.
  n, trials = 16, 4000
  keys = jax.random.split(jax.random.key(7), trials)
  perms = np.asarray(jax.vmap(lambda k: jr.minibatch_indices(k, n, n)[0])(keys))
  counts = np.bincount(perms[:, 0], minlength=n)
  chi2 = ((counts - trials / n) ** 2 / (trials / n)).sum()
  assert chi2 < 45   # 15 dof: p ~ 1e-4
  fixed_points = (perms == np.arange(n)).sum(1).mean()
  assert 0.85 < fixed_points < 1.15
