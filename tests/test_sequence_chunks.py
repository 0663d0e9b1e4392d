"""Chunked sequence minibatches (``seq_len``) and the index rule of
``take_sequences``, against a numpy model of the rule.

The rule: with ``C = T // L`` chunks per env, chunk ``s`` is env ``s // C``,
steps ``[c*L, (c+1)*L)`` with ``c = s % C``; minibatch ``j`` of epoch ``ep``
holds the chunks ``minibatch_indices(key, E*C, Sb, shuffle, epoch=ep,
remainder)[j]``, time-major ``[L, Sb, ...]``. Indices given to
``take_sequences`` are refused eagerly outside ``[0, S)`` and read modulo S
when traced.
"""

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from tests._helpers import assert_tree_equal
from tests.conftest import TRANSFORMS

MODES = ("error", "drop", "wrap")


def _data(t, e, seed=0):
  """A dict of [T, E, ...] with a nested pytree, floats, ints and bools."""
  rng = np.random.default_rng(seed)
  return {"obs": rng.standard_normal((t, e, 2)).astype(np.float32),
          "done": rng.random((t, e)) < 0.3,
          "nested": {"a": rng.integers(-9, 9, (t, e)).astype(np.int32),
                     "b": rng.standard_normal((t, e, 2, 3)).astype(
                         np.float32)}}


def _state(data):
  """A RolloutState holding ``data``'s flat keys (no nesting in a state)."""
  t, e = data["obs"].shape[:2]
  state = jr.register(jr.init(e, t), "obs", (2,))
  state = jr.register(state, "done", (), jnp.bool_)
  state = jr.register(state, "a", (), jnp.int32)
  return jr.update_all(state, {"obs": data["obs"], "done": data["done"],
                               "a": data["nested"]["a"]})


def _flat(data):
  return {"obs": data["obs"], "done": data["done"], "a": data["nested"]["a"]}


def _model_chunks(data, chunks, seq_len):
  """numpy: ``out[:, b] = x[c*L:(c+1)*L, e]`` for chunk ``chunks[b]``."""
  def leaf(x):
    x = np.asarray(x)
    num_chunks = x.shape[0] // seq_len
    cols = []
    for s in np.asarray(chunks).ravel():
      e, c = divmod(int(s), num_chunks)
      cols.append(x[c * seq_len:(c + 1) * seq_len, e])
    out = (np.stack(cols, axis=1) if cols
           else np.zeros((seq_len, 0, *x.shape[2:]), x.dtype))
    return out.reshape(seq_len, *np.shape(chunks), *x.shape[2:])
  return jax.tree_util.tree_map(leaf, data)


def _model_epochs(data, key, num_envs, t, seq_len, sb, *, shuffle, epochs,
                  mode):
  """Every minibatch of every epoch, in order, by the rule."""
  length = t if seq_len is None else seq_len
  num = num_envs * (t // length)
  out = []
  for ep in range(epochs):
    idx = np.asarray(jr.minibatch_indices(key, num, sb, shuffle=shuffle,
                                          epoch=ep, remainder=mode))
    out += [_model_chunks(data, row, length) for row in idx]
  return out


def _collect(carry, mb):
  return carry + 1, mb


def _scan(key, data, sb, **kw):
  return jr.scan_sequence_minibatches(_collect, 0, key, data, sb, **kw)


# Module-level jits: hypothesis examples of the same shapes compile once.
_jit_scan = jax.jit(_scan, static_argnames=(
    "sb", "shuffle", "num_epochs", "remainder", "seq_len"))
_jit_take = jax.jit(jr.take_sequences, static_argnames="seq_len")


@st.composite
def _request(draw):
  """``(E, T, L, Sb, mode)`` with L | T and Sb valid for the mode."""
  num_envs = draw(st.integers(1, 4))
  num_chunks = draw(st.integers(1, 3))
  seq_len = draw(st.integers(1, 3))
  s = num_envs * num_chunks
  mode = draw(st.sampled_from(MODES))
  if mode == "error":
    sb = draw(st.sampled_from([d for d in range(1, s + 1) if s % d == 0]))
  else:
    sb = draw(st.integers(1, s))
  return num_envs, num_chunks * seq_len, seq_len, sb, mode


@settings(max_examples=8)
@given(req=_request(), epochs=st.integers(1, 3), shuffle=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_every_entry_point_follows_the_model(req, epochs, shuffle, seed):
  num_envs, t, seq_len, sb, mode = req
  data = _data(t, num_envs, seed % 1000)
  key = jax.random.key(seed)
  want = _model_epochs(data, key, num_envs, t, seq_len, sb, shuffle=shuffle,
                       epochs=epochs, mode=mode)
  kw = dict(shuffle=shuffle, num_epochs=epochs, remainder=mode,
            seq_len=seq_len)
  got = list(jr.sequence_minibatches(key, data, sb, **kw))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert_tree_equal(g, w)
  m = len(want) // epochs
  for scan in (_scan, _jit_scan):
    n, outs = scan(key, data, sb, **kw)
    assert int(n) == len(want)
    for i, w in enumerate(want):
      assert_tree_equal(
          jax.tree_util.tree_map(lambda x, i=i: x[i // m, i % m], outs), w)
  # take_sequences of each minibatch's chunks, eager and jitted
  idx = np.asarray(jr.minibatch_indices(key, num_envs * (t // seq_len), sb,
                                        shuffle=shuffle, epoch=epochs - 1,
                                        remainder=mode))
  for take in (jr.take_sequences, _jit_take):
    assert_tree_equal(take(data, idx, seq_len=seq_len),
                      _model_chunks(data, idx, seq_len))


@settings(max_examples=5)
@given(req=_request(), shuffle=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_rollout_state_equals_its_dict(req, shuffle, seed):
  num_envs, t, seq_len, sb, mode = req
  data = _data(t, num_envs, seed % 1000)
  state, flat = _state(data), _flat(data)
  key = jax.random.key(seed)
  kw = dict(shuffle=shuffle, num_epochs=2, remainder=mode, seq_len=seq_len)
  from_state = list(jr.sequence_minibatches(key, state, sb, **kw))
  want = _model_epochs(flat, key, num_envs, t, seq_len, sb, shuffle=shuffle,
                       epochs=2, mode=mode)
  for g, w in zip(from_state, want, strict=True):
    assert_tree_equal(g, w)
  assert_tree_equal(_jit_scan(key, state, sb, **kw)[1],
                    jax.device_get(_jit_scan(key, flat, sb, **kw)[1]))
  idx = np.arange(num_envs * (t // seq_len))[::-1]
  assert_tree_equal(jr.take_sequences(state, idx, seq_len=seq_len),
                    _model_chunks(flat, idx, seq_len))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_seq_len_t_is_the_env_split(transform, rng_key):
  data = _data(6, 4)
  for kw in ({}, {"seq_len": 6}, {"seq_len": None}):
    got = list(jr.sequence_minibatches(rng_key, data, 2, num_epochs=2, **kw))
    _, outs = transform(lambda k, d, kw=kw: jr.scan_sequence_minibatches(
        _collect, 0, k, d, 2, num_epochs=2, **kw))(rng_key, data)
    for ep in range(2):
      idx = np.asarray(jr.minibatch_indices(rng_key, 4, 2, epoch=ep))
      for j in range(2):
        want = jax.tree_util.tree_map(lambda x, r=idx[j]: x[:, r], data)
        assert_tree_equal(got[ep * 2 + j], want)
        assert_tree_equal(
            jax.tree_util.tree_map(lambda x, ep=ep, j=j: x[ep, j], outs),
            want)
    assert_tree_equal(transform(functools.partial(
        jr.take_sequences, **kw))(data, np.array([3, 0])),
        jax.tree_util.tree_map(lambda x: x[:, [3, 0]], data))


def test_chunk_numbering_by_hand():
  # T = 4, E = 2, L = 2: chunk 0 = env 0 steps 0-1, 1 = env 0 steps 2-3,
  # 2 = env 1 steps 0-1, 3 = env 1 steps 2-3.
  x = np.array([[0, 10], [1, 11], [2, 12], [3, 13]], np.int32)
  got = jr.take_sequences({"x": x}, np.array([1, 2, 3, 0]), seq_len=2)["x"]
  np.testing.assert_array_equal(got, [[2, 10, 12, 0], [3, 11, 13, 1]])
  got = jr.take_sequences({"x": x}, np.array([[3], [0]]), seq_len=2)["x"]
  assert got.shape == (2, 2, 1)
  np.testing.assert_array_equal(got[:, :, 0], [[12, 0], [13, 1]])


def test_vmap_over_keys(rng_key):
  data = _data(8, 3)
  keys = jax.random.split(rng_key, 3)
  outs = jax.vmap(lambda k: jr.scan_sequence_minibatches(
      lambda c, mb: (c, mb["obs"]), 0, k, data, 4, seq_len=2)[1])(keys)
  assert outs.shape == (3, 1, 3, 2, 4, 2)
  for i in range(3):
    idx = np.asarray(jr.minibatch_indices(keys[i], 12, 4))
    for j in range(3):
      np.testing.assert_array_equal(
          outs[i, 0, j], _model_chunks(data["obs"], idx[j], 2))


def test_no_recompile(rng_key, count_compiles):
  keys = jax.random.split(rng_key, 4)
  state = _state(_data(8, 4, seed=9))

  def step(carry, mb):
    return carry + mb["obs"].sum(), None

  def run(i):
    data = _data(8, 4, seed=i)
    list(jr.sequence_minibatches(keys[i], data, 4, num_epochs=2, seq_len=2))
    jr.scan_sequence_minibatches(step, 0.0, keys[i], data, 4, num_epochs=2,
                                 seq_len=2)
    jr.scan_sequence_minibatches(step, 0.0, keys[i], state, 4, seq_len=4)
    jr.take_sequences(data, np.array([i, 15 - i]), seq_len=2)
    jr.take_sequences(state, np.array([i, 7 - i]), seq_len=4)

  run(0)
  with count_compiles() as counter:
    run(1)
    run(2)
  assert counter.count == 0


# ------------------------------------------------------- the index rule


@pytest.mark.parametrize("seq_len, num", [(None, 4), (3, 8), (6, 4)])
@pytest.mark.parametrize("make_idx, exc, match", [
    (lambda s: [0, -1], IndexError, r"got \[-1\] \(1 out of range\)"),
    (lambda s: [1, s, s - 1, 3 * s], IndexError,
     r"got \[(4|8), (12|24)\] \(2 out of range\)"),
    (lambda s: [1.7], TypeError, r"`idx` must be integers, got float"),
    (lambda s: [True, False], TypeError,
     r"`idx` must be integers, got bool"),
])
def test_take_sequences_refuses_bad_indices_eagerly(seq_len, num, make_idx,
                                                     exc, match):
  data = _data(6, 4)
  idx = np.array(make_idx(num))
  for source in (data, _state(data)):
    with pytest.raises(exc, match=r"^take_sequences: `idx`"):
      jr.take_sequences(source, idx, seq_len=seq_len)
    with pytest.raises(exc, match=match):
      jr.take_sequences(source, jnp.asarray(idx), seq_len=seq_len)
    # Concrete indices are checked inside a jit too.
    with pytest.raises(exc, match=match):
      jax.jit(lambda d: jr.take_sequences(d, idx, seq_len=seq_len))(source)


def test_take_sequences_refuses_ragged_and_object_indices():
  data = {"x": np.zeros((3, 4))}
  with pytest.raises(TypeError, match=r"^take_sequences: `idx` must be "
                     r"an integer array, got list \("):
    jr.take_sequences(data, [[0, 1], [2]])
  with pytest.raises(TypeError, match=r"^take_sequences: `idx` must be "
                     r"integers, got object \[None\]"):
    jr.take_sequences(data, [None])


def test_take_sequences_issue_32_cases():
  # [5] of 4 envs gave env 3 and [1.7] gave env 1: both are errors now.
  data = {"x": np.arange(12).reshape(3, 4)}
  with pytest.raises(IndexError, match=r"^take_sequences: `idx` must be "
                     r"in \[0, 4\), got \[5\] \(1 out of range\); under jit, "
                     r"traced indices are read modulo 4$"):
    jr.take_sequences(data, [5])
  with pytest.raises(TypeError, match=r"^take_sequences: `idx` must be "
                     r"integers, got float64 \[1\.7\]$"):
    jr.take_sequences(data, [1.7])
  got = jax.jit(jr.take_sequences)(data, jnp.array([5, -1]))
  np.testing.assert_array_equal(got["x"], np.asarray(data["x"])[:, [1, 3]])
  with pytest.raises(TypeError, match=r"^take_sequences: `idx` must be "
                     r"integers, got float32"):
    jax.jit(jr.take_sequences)(data, jnp.array([1.7]))


@settings(max_examples=10)
@given(req=_request(), dtype=st.sampled_from([np.int32, np.int8, np.uint8,
                                               np.uint32, np.int16]),
       seed=st.integers(0, 2**31 - 1), size=st.integers(0, 6))
def test_traced_indices_are_read_modulo_s(req, dtype, seed, size):
  num_envs, t, seq_len, _, _ = req
  num = num_envs * (t // seq_len)
  info = np.iinfo(dtype)
  rng = np.random.default_rng(seed)
  idx = rng.integers(max(info.min, -5 * num), min(info.max, 5 * num) + 1,
                     size).astype(dtype)
  if dtype == np.uint32:   # and near the top of the range
    idx[: size // 2] = info.max - idx[: size // 2]
  data = _data(t, num_envs, seed % 1000)
  want = _model_chunks(data, idx.astype(np.int64) % num, seq_len)
  assert_tree_equal(_jit_take(data, idx, seq_len=seq_len), want)
  flat = _flat(data)
  assert_tree_equal(_jit_take(_state(data), idx, seq_len=seq_len),
                    _model_chunks(flat, idx.astype(np.int64) % num, seq_len))
  # vmap: traced, the same rule
  got = jax.vmap(lambda i: jr.take_sequences(data, i, seq_len=seq_len))(idx)
  assert_tree_equal(
      got, jax.tree_util.tree_map(lambda x: np.moveaxis(x, 1, 0), want))


# ------------------------------------------------------- errors


FNS = {
    "take_sequences": lambda d, sb, **kw: jr.take_sequences(d, [0], **kw),
    "sequence_minibatches": lambda d, sb, **kw: jr.sequence_minibatches(
        jax.random.key(0), d, sb, **kw),
    "scan_sequence_minibatches": lambda d, sb, **kw:
        jr.scan_sequence_minibatches(_collect, 0, jax.random.key(0), d, sb,
                                     **kw),
}


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("seq_len, exc, match", [
    (5, ValueError, r"`seq_len` 5 does not divide the rollout length T = 12;"
     r" valid lengths are 1, 2, 3, 4, 6, 12, or None for whole rollouts"),
    (24, ValueError, r"`seq_len` 24 does not divide the rollout length"),
    (0, ValueError, r"`seq_len` must be positive, got 0"),
    (-4, ValueError, r"`seq_len` must be positive, got -4"),
    (2.0, TypeError, r"`seq_len` must be an int, got float 2\.0"),
    (True, TypeError, r"`seq_len` must be an int, got bool True"),
])
def test_bad_seq_len(fn, seq_len, exc, match):
  data = _data(12, 2)
  for source in (data, _state(data)):
    with pytest.raises(exc, match=rf"^{fn}: {match}"):
      FNS[fn](source, 2, seq_len=seq_len)


def test_many_divisors_are_summarised():
  data = {"x": np.zeros((720, 1), np.float32)}
  with pytest.raises(ValueError, match=r"`seq_len` 7 does not divide the "
                     r"rollout length T = 720; valid lengths are the 30 "
                     r"divisors of T, nearest 6 or 8, or None"):
    jr.take_sequences(data, [0], seq_len=7)


@pytest.mark.parametrize("fn", ["sequence_minibatches",
                                "scan_sequence_minibatches"])
def test_chunks_per_batch_errors_name_s(fn):
  data = _data(6, 4)   # seq_len 2: C = 3, S = 12
  with pytest.raises(ValueError, match=(
      rf"^{fn}: `batch_size` 5 does not divide the number of rows "
      r"S = E \* T / seq_len = 12 \(12 % 5 = 2\); the nearest valid batch "
      r"sizes are 4 or 6")):
    FNS[fn](data, 5, seq_len=2)
  with pytest.raises(ValueError, match=(
      rf"^{fn}: `batch_size` 13 is larger than the number of rows "
      r"S = E \* T / seq_len = 12")):
    FNS[fn](data, 13, seq_len=2)
  # 5 of 12 chunks is fine with a remainder mode
  FNS[fn](data, 5, seq_len=2, remainder="wrap")
