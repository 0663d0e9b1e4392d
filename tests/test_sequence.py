"""Tests of sequence minibatches (env-split, time order kept)."""

import jax
import numpy as np
import pytest

import jrollout as jr
from tests._helpers import assert_tree_equal
from tests.conftest import TRANSFORMS


def _data(t=5, e=8, seed=0):
  rng = np.random.default_rng(seed)
  return {"obs": rng.standard_normal((t, e, 3)).astype(np.float32),
          "done": rng.random((t, e)) < 0.3,
          "nested": {"h": rng.standard_normal((t, e, 2)).astype(np.float32)}}


def _reference(data, env_idx):
  return jax.tree_util.tree_map(lambda x: np.asarray(x)[:, np.asarray(env_idx)],
                                data)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_take_sequences_keeps_time_order(transform):
  data = _data()
  env_idx = np.array([6, 1, 3])
  got = transform(jr.take_sequences)(data, env_idx)
  assert got["obs"].shape == (5, 3, 3)
  assert_tree_equal(got, _reference(data, env_idx))


@pytest.mark.parametrize("shuffle", [True, False])
def test_iterator_partitions_envs_and_matches_indices(shuffle, rng_key):
  data = _data()
  got = list(jr.sequence_minibatches(rng_key, data, 2, shuffle=shuffle,
                                     num_epochs=2))
  assert len(got) == 8
  for epoch in range(2):
    idx = np.asarray(jr.minibatch_indices(rng_key, 8, 2, shuffle=shuffle,
                                          epoch=epoch))
    np.testing.assert_array_equal(np.sort(idx.ravel()), np.arange(8))
    for j in range(4):
      assert_tree_equal(got[epoch * 4 + j], _reference(data, idx[j]))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_scan_equals_iterator(transform, rng_key):
  data = _data()

  def fn(carry, mb):
    return carry + 1, mb

  carry, outs = transform(lambda k, d: jr.scan_sequence_minibatches(
      fn, 0, k, d, 4, num_epochs=3))(rng_key, data)
  assert int(carry) == 6
  got = list(jr.sequence_minibatches(rng_key, data, 4, num_epochs=3))
  for e in range(3):
    for j in range(2):
      assert_tree_equal(
          jax.tree_util.tree_map(lambda x, e=e, j=j: x[e, j], outs),
          got[e * 2 + j])


def test_rollout_state_source(rng_key):
  state = jr.register(jr.init(4, 3), "x", (2,))
  x = np.arange(24, dtype=np.float32).reshape(3, 4, 2)
  state = jr.update_all(state, {"x": x})
  for j, mb in enumerate(jr.sequence_minibatches(rng_key, state, 2)):
    idx = np.asarray(jr.minibatch_indices(rng_key, 4, 2))[j]
    np.testing.assert_array_equal(mb["x"], x[:, idx])


def test_vmap_over_keys(rng_key):
  data = _data()
  keys = jax.random.split(rng_key, 3)
  outs = jax.vmap(lambda k: jr.scan_sequence_minibatches(
      lambda c, mb: (c, mb["obs"]), 0, k, data, 4)[1])(keys)
  for i in range(3):
    idx = np.asarray(jr.minibatch_indices(keys[i], 8, 4))
    np.testing.assert_array_equal(outs[i, 0, 1], data["obs"][:, idx[1]])


def test_no_recompile(rng_key, count_compiles):
  keys = jax.random.split(rng_key, 3)
  # The warm-up has the loop's settings: num_epochs is part of the static
  # plan, so a warm-up with other settings compiled nothing the loop reuses
  # (this passed only when an earlier test in the process had compiled it).
  list(jr.sequence_minibatches(keys[0], _data(seed=0), 2, num_epochs=2))
  with count_compiles() as counter:
    for i in (1, 2):
      list(jr.sequence_minibatches(keys[i], _data(seed=i), 2, num_epochs=2))
  assert counter.count == 0


@pytest.mark.parametrize("data, eb, exc, match", [
    ({}, 2, ValueError, r"sequence_minibatches: `data` is empty"),
    ({"a": np.zeros((3, 4)), "b": np.zeros((3, 5))}, 2, ValueError,
     r"sequence_minibatches: leaf \['b'\] has leading shape \(3, 5\) but "
     r"\['a'\] has \(3, 4\); every leaf must share \[T, E\]"),
    ({"a": np.zeros(4)}, 2, ValueError,
     r"leaf \['a'\] has shape \(4,\), expected time-major \[T, E, \.\.\.\]"),
    ({"a": np.zeros((3, 8))}, 3, ValueError,
     r"sequence_minibatches: `batch_size` 3 does not divide the number "
     r"of rows E = 8 \(8 % 3 = 2\); the nearest valid batch sizes are "
     r"2 or 4"),
    ({"a": np.zeros((3, 8))}, 16, ValueError,
     r"`batch_size` 16 is larger than the number of rows E = 8"),
    ({"a": np.zeros((0, 8))}, 2, ValueError, r"has a zero-length axis"),
])
def test_errors(data, eb, exc, match, rng_key):
  with pytest.raises(exc, match=match):
    jr.sequence_minibatches(rng_key, data, eb)
  with pytest.raises(exc, match=match.replace("sequence_minibatches:",
                                              "scan_sequence_minibatches:")):
    jr.scan_sequence_minibatches(lambda c, mb: (c, None), 0, rng_key, data, eb)
