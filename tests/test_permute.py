"""Tests of the keyed Feistel permutation (jrollout._permute)."""

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrollout import _permute
from tests.conftest import TRANSFORMS


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 100, 1023, 1024, 1025, 131072])
def test_is_a_bijection_of_range_n(transform, n):
  keys = _permute.round_keys(jax.random.key(n))
  p = np.asarray(transform(lambda k, x: _permute.permute(k, x, n))(
      keys, jnp.arange(n)))
  assert p.dtype == np.int32
  np.testing.assert_array_equal(np.sort(p), np.arange(n))


@given(n=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1),
       start=st.integers(0, 4999), size=st.integers(1, 64))
def test_any_subset_of_positions_matches_the_whole(n, seed, start, size):
  keys = _permute.round_keys(jax.random.key(seed))
  whole = np.asarray(_permute.permute(keys, jnp.arange(n), n))
  positions = (np.arange(start, start + size) % n).astype(np.int32)
  part = np.asarray(_permute.permute(keys, jnp.asarray(positions), n))
  np.testing.assert_array_equal(part, whole[positions])


def test_round_keys_depend_on_key_and_epoch():
  k = jax.random.key(3)
  a, b = _permute.round_keys(k, 0), _permute.round_keys(k, 1)
  c = _permute.round_keys(jax.random.key(4), 0)
  assert a.shape == (6,) and a.dtype == jnp.uint32
  assert not np.array_equal(a, b) and not np.array_equal(a, c)
  np.testing.assert_array_equal(a, _permute.round_keys(k, jnp.int32(0)))


def test_fmix32_is_a_bijection_on_a_sample():
  x = jnp.arange(1 << 16, dtype=jnp.uint32) * jnp.uint32(65537)
  assert np.unique(np.asarray(_permute._fmix32(x))).size == 1 << 16


def test_vmap_over_keys_equals_loop():
  keys = jax.random.split(jax.random.key(0), 4)
  batched = jax.vmap(lambda k: _permute.permute(
      _permute.round_keys(k), jnp.arange(50), 50))(keys)
  for i, k in enumerate(keys):
    np.testing.assert_array_equal(
        batched[i],
        _permute.permute(_permute.round_keys(k), jnp.arange(50), 50))
