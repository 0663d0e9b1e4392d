"""Minibatches of rows and of sequences, against numpy models of the plan.

The plan (``reference.epoch_order``, ``reference.plan_rows``): an epoch's
keyed order ``p`` of ``range(N)``; minibatch ``j`` takes ``p[(j*B + i) %
N]``, and field ``k`` reads rows ``idx % L_k``. With ``seq_len=L`` the units
are chunks of a ``[T, E, ...]`` batch: chunk ``s`` is env ``s // C``, steps
``[c*L, (c+1)*L)``, ``c = s % C``, ``C = T // L``. Sharded scans:
tests/test_sharding.py.
"""

import functools
import re
import time

import chex
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout import _plan
from jrollout import compat
from tests import reference
from tests._helpers import random_batch
from tests._misuse import assert_same
from tests._misuse import call_named
from tests._misuse import NOT_BOOLS
from tests._misuse import snapshot
from tests.conftest import TRANSFORMS

MODES = ("error", "drop", "wrap")
eq = chex.assert_trees_all_equal
_order = reference.epoch_order
_model = reference.plan_rows


@st.composite
def _request(draw, max_rows=64):
  n = draw(st.integers(1, max_rows))
  b = draw(st.integers(1, n))
  mode = draw(st.sampled_from(MODES if n % b == 0 else MODES[1:]))
  return n, b, mode


def _collect(carry, mb):
  return carry + 1, mb


# --- The keyed permutation. ---------------------------------------------


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 100, 1023, 1024, 1025, 131072])
def test_permutation_is_a_bijection_of_range_n(transform, n):
  keys = _plan.round_keys(jax.random.key(n))
  p = np.asarray(transform(lambda k, x: _plan.permute(k, x, n))(
      keys, jnp.arange(n)))
  assert p.dtype == np.int32
  np.testing.assert_array_equal(np.sort(p), np.arange(n))


@given(n=st.sampled_from([1, 7, 1000, 4097]), seed=st.integers(0, 2**31 - 1),
       start=st.integers(0, 4999), size=st.sampled_from([1, 64]))
def test_any_subset_of_positions_matches_the_whole(n, seed, start, size):
  keys = _plan.round_keys(jax.random.key(seed))
  whole = np.asarray(_plan.permute(keys, jnp.arange(n), n))
  positions = (np.arange(start, start + size) % n).astype(np.int32)
  part = np.asarray(_plan.permute(keys, jnp.asarray(positions), n))
  np.testing.assert_array_equal(part, whole[positions])


def test_round_keys_and_the_mixer():
  k = jax.random.key(3)
  a, b = _plan.round_keys(k, 0), _plan.round_keys(k, 1)
  assert a.shape == (6,) and a.dtype == jnp.uint32
  assert not np.array_equal(a, b)
  assert not np.array_equal(a, _plan.round_keys(jax.random.key(4), 0))
  np.testing.assert_array_equal(a, _plan.round_keys(k, jnp.int32(0)))
  x = jnp.arange(1 << 16, dtype=jnp.uint32) * jnp.uint32(65537)
  assert np.unique(np.asarray(_plan._fmix32(x))).size == 1 << 16


def test_permutation_is_roughly_uniform():
  # The first position's value over many keys is close to uniform (chi^2),
  # and the mean number of fixed points matches a random permutation's.
  n, trials = 16, 4000
  keys = jax.random.split(jax.random.key(7), trials)
  perms = np.asarray(jax.vmap(lambda k: jr.minibatch_indices(k, n, n)[0])(keys))
  counts = np.bincount(perms[:, 0], minlength=n)
  assert ((counts - trials / n) ** 2 / (trials / n)).sum() < 45   # p ~ 1e-4
  assert 0.85 < (perms == np.arange(n)).sum(1).mean() < 1.15


# --- minibatch_indices: the plan. ---------------------------------------


@given(req=_request(200), seed=st.integers(0, 2**31 - 1),
       epoch=st.integers(0, 4), shuffle=st.booleans())
def test_minibatch_indices_match_the_model(req, seed, epoch, shuffle):
  n, b, mode = req
  key = jax.random.key(seed)
  got = np.asarray(jr.minibatch_indices(key, n, b, shuffle=shuffle,
                                        epoch=epoch, remainder=mode))
  np.testing.assert_array_equal(got, _model(_order(key, n, epoch, shuffle),
                                            b, mode))
  uses = np.bincount(got.ravel(), minlength=n)
  if mode == "drop":
    assert uses.max() <= 1 and uses.sum() == (n // b) * b
  elif mode == "wrap":
    assert uses.min() >= 1 and uses.max() <= 2
    assert (uses == 2).sum() == got.size - n
  else:
    assert (uses == 1).all()


def test_drop_leaves_different_rows_out_each_epoch():
  key, n, b = jax.random.key(11), 1000, 64
  left_out = [set(range(n)) - set(np.ravel(jr.minibatch_indices(
      key, n, b, epoch=e, remainder="drop")).tolist()) for e in range(4)]
  assert all(len(s) == n % b for s in left_out)
  assert len(set.union(*left_out)) > n % b


# --- Rows: take, minibatches, scan_minibatches. -------------------------


@settings(max_examples=8)
@given(req=st.sampled_from([(12, 4, "error"), (12, 5, "drop"),
                            (12, 5, "wrap"), (7, 7, "wrap"), (1, 1, "error")]),
       seed=st.integers(0, 2**31 - 1),
       extra=st.lists(st.sampled_from([1, 5, 12]), max_size=2),
       num_epochs=st.integers(1, 2))
def test_flat_entry_points_match_the_model(req, seed, extra, num_epochs):
  """Shorter fields wrap; a nested field's leaves share its length."""
  n, b, mode = req
  lengths = [n] + [min(x, n) for x in extra]
  batch = {f"k{i}": np.arange(length, dtype=np.int32) * 10 + i
           for i, length in enumerate(lengths)}
  short = lengths[-1]
  batch["nested"] = {"a": np.arange(short), "b": (
      np.arange(2.0 * short).reshape(short, 2),)}
  key = jax.random.key(seed)
  want = [jax.tree_util.tree_map(lambda x, r=rows: x[r % len(x)], batch)
          for e in range(num_epochs)
          for rows in _model(_order(key, n, e), b, mode)]
  got = list(jr.minibatches(key, batch, b, num_epochs=num_epochs,
                            remainder=mode))
  _, outs = jr.scan_minibatches(_collect, 0, key, batch, b,
                                num_epochs=num_epochs, remainder=mode)
  outs = jax.tree_util.tree_map(
      lambda v: np.asarray(v).reshape(-1, *v.shape[2:]), outs)
  assert len(got) == len(want)
  for i, mb in enumerate(want):
    eq(got[i], mb)
    eq(jax.tree_util.tree_map(lambda v, i=i: v[i], outs), mb)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mode", MODES[1:])
def test_a_rollout_state_is_its_make_batch_batch(transform, mode):
  num_envs, num_steps, b = 3, 7, 5          # N = 21: 5 does not divide it
  state = jr.register(jr.init(num_envs, num_steps), "obs", (2,))
  state = jr.register(state, "act", (), jnp.int32)
  rng = np.random.default_rng(0)
  state = jr.update_all(state, {
      "obs": rng.standard_normal((num_steps, num_envs, 2)).astype(np.float32),
      "act": rng.integers(0, 9, (num_steps, num_envs)).astype(np.int32)})
  batch, _ = jr.make_batch(state)
  key = jax.random.key(3)
  run = transform(functools.partial(jr.scan_minibatches, _collect,
                                    batch_size=b, num_epochs=2,
                                    remainder=mode))
  _, from_state = run(0, key, state)
  eq(from_state, run(0, key, batch)[1])
  for e in range(2):
    idx = _model(_order(key, num_envs * num_steps, e), b, mode)
    eq({k: v[e] for k, v in from_state.items()},
       {k: np.asarray(v)[idx] for k, v in batch.items()})
  for j, mb in enumerate(jr.minibatches(key, state, b, remainder=mode)):
    idx = jr.minibatch_indices(key, 21, b, remainder=mode)[j]
    eq(mb, jr.take(batch, idx))
    eq(transform(jr.take)(state, idx), jr.take(batch, idx))


@pytest.mark.parametrize("seq_len", [None, 2])
def test_vmap_over_keys(rng_key, seq_len):
  batch = random_batch([16, 4]) if seq_len is None else _data(8, 2)
  num = 16 if seq_len is None else 8   # N rows, or S = 2 * 8 / 2 chunks
  keys = jax.random.split(rng_key, 3)
  idx = jax.vmap(lambda k: jr.minibatch_indices(k, num, 4))(keys)
  outs = jax.vmap(lambda k: jr.scan_minibatches(
      _collect, 0, k, batch, 4, seq_len=seq_len)[1])(keys)
  for i, k in enumerate(keys):
    np.testing.assert_array_equal(idx[i], jr.minibatch_indices(k, num, 4))
    for j, rows in enumerate(np.asarray(idx[i])):
      want = (_model_chunks(batch, rows, seq_len) if seq_len else
              {n: np.asarray(v)[rows % len(v)] for n, v in batch.items()})
      eq(jax.tree_util.tree_map(lambda x, i=i, j=j: x[i, 0, j], outs), want)


def test_nothing_recompiles_across_epochs_keys_and_rollouts(rng_key,
                                                            count_compiles):
  """A second call of each entry point, rows or sequences, compiles nothing."""
  keys = jax.random.split(rng_key, 4)
  state = _state(_data(8, 4, seed=9))

  def run(i):
    batch = {**random_batch([21, 5], i), "n": {"b": np.zeros(21, bool)}}
    data = _data(8, 4, seed=i)
    for mode in MODES[1:]:
      for _ in jr.minibatches(keys[i], batch, 5, num_epochs=2,
                              remainder=mode):
        pass
      jr.scan_minibatches(_collect, 0, keys[i], batch, 5, remainder=mode)
      jr.minibatch_indices(keys[i], 21, 5, remainder=mode)
    jax.jit(jr.scan_minibatches, static_argnums=(0, 4))(
        _collect, 0, keys[i], batch, 7)
    jr.take(batch, np.arange(2))
    list(jr.minibatches(keys[i], data, 4, num_epochs=2, seq_len=2))
    jr.scan_minibatches(_collect, 0, keys[i], data, 4, num_epochs=2,
                        seq_len=2, remainder="wrap")
    jr.scan_minibatches(_collect, 0.0, keys[i], state, 4, seq_len=4)
    jr.take(data, np.array([i, 15 - i]), seq_len=2)
    jr.take(state, np.array([i, 7 - i]), seq_len=4)
    compat.DictDataset(7, batch)[0]

  run(0)
  with count_compiles() as counter:
    for i in range(1, 3):
      run(i)
  assert counter.count == 0


def test_default_program_is_unchanged_by_the_modes():
  """For a B that divides N, every mode compiles the same program."""
  key = jax.random.key(0)

  def text(mode):
    return jax.jit(functools.partial(
        jr.scan_minibatches, _collect, batch_size=4, remainder=mode)).lower(
            0, key, {"x": jnp.zeros(16)}).as_text()
  assert text("error") == text("drop") == text("wrap")


@settings(max_examples=6)
@given(req=_request(12), seed=st.integers(0, 2**31 - 1),
       short=st.integers(1, 12))
def test_dict_dataset_follows_the_mode(req, seed, short):
  n, b, mode = req
  data = {"x": np.arange(n), "y": np.arange(min(short, n)) + 100}
  key = jax.random.key(seed)
  ds = compat.DictDataset(b, data, key=key, remainder=mode)
  for e in range(-1, 2):       # the identity order, then epochs 0 and 1
    if e >= 0:
      ds.shuffle()
    idx = _model(_order(key, n, e, shuffle=e >= 0), b, mode)
    assert len(ds) == len(idx) and ds.num_batches() == len(idx)
    for j, mb in enumerate(ds):
      eq(mb, {"x": idx[j], "y": data["y"][idx[j] % len(data["y"])]})
    np.testing.assert_array_equal(ds[-1]["x"], idx[-1])


# --- Sequences: seq_len=L chunks of [T, E, ...], in time order. ---------


def _data(t, e, seed=0):
  """A dict of [T, E, ...] with a nested pytree, floats, ints and bools."""
  rng = np.random.default_rng(seed)
  return {"obs": rng.standard_normal((t, e, 2)).astype(np.float32),
          "done": rng.random((t, e)) < 0.3,
          "nested": {"a": rng.integers(-9, 9, (t, e)).astype(np.int32),
                     "b": rng.standard_normal((t, e, 2, 3)).astype(
                         np.float32)}}


def _flat(data):
  return {"obs": data["obs"], "done": data["done"], "a": data["nested"]["a"]}


def _state(data):
  """A RolloutState holding ``_flat(data)``."""
  t, e = data["obs"].shape[:2]
  state = jr.register(jr.init(e, t), "obs", (2,))
  state = jr.register(state, "done", (), jnp.bool_)
  state = jr.register(state, "a", (), jnp.int32)
  return jr.update_all(state, _flat(data))


def _model_chunks(data, chunks, seq_len):
  """numpy: ``out[:, b] = x[c*L:(c+1)*L, e]`` for chunk ``chunks[b]``."""
  def leaf(x):
    x = np.asarray(x)
    num_chunks = x.shape[0] // seq_len
    cols = [x[c * seq_len:(c + 1) * seq_len, e] for e, c in
            (divmod(int(s), num_chunks) for s in np.ravel(chunks))]
    out = (np.stack(cols, axis=1) if cols
           else np.zeros((seq_len, 0, *x.shape[2:]), x.dtype))
    return out.reshape(seq_len, *np.shape(chunks), *x.shape[2:])
  return jax.tree_util.tree_map(leaf, data)


@st.composite
def _chunk_request(draw):
  """``(E, T, L, Sb, mode)`` on two shapes (few compiles), L | T (L = T:
  whole rollouts) and Sb valid for the mode."""
  num_envs, t = draw(st.sampled_from([(3, 4), (1, 6)]))
  seq_len = draw(st.sampled_from([d for d in range(1, t + 1) if t % d == 0]))
  s = num_envs * (t // seq_len)
  mode = draw(st.sampled_from(MODES))
  divisors = [d for d in range(1, s + 1) if s % d == 0]
  sb = draw(st.sampled_from(divisors) if mode == "error"
            else st.integers(1, s))
  return num_envs, t, seq_len, sb, mode


@settings(max_examples=6)
@given(req=_chunk_request(), shuffle=st.booleans(), state=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_every_sequence_entry_point_follows_the_model(req, shuffle, state,
                                                      seed):
  """The iterator, the scan and take, on a dict or a RolloutState."""
  num_envs, t, seq_len, sb, mode = req
  data = _data(t, num_envs, seed % 1000)
  source, data = (_state(data), _flat(data)) if state else (data, data)
  key = jax.random.key(seed)
  num = num_envs * (t // seq_len)
  want = [_model_chunks(data, rows, seq_len) for e in range(2)
          for rows in _model(_order(key, num, e, shuffle), sb, mode)]
  kw = dict(shuffle=shuffle, num_epochs=2, remainder=mode, seq_len=seq_len)
  for g, w in zip(jr.minibatches(key, source, sb, **kw), want, strict=True):
    eq(g, w)
  n, outs = jr.scan_minibatches(_collect, 0, key, source, sb, **kw)
  m = len(want) // 2
  assert int(n) == len(want)
  for i, w in enumerate(want):
    eq(jax.tree_util.tree_map(lambda x, i=i: x[i // m, i % m], outs), w)
  idx = _model(_order(key, num, 1, shuffle), sb, mode)
  eq(jr.take(source, idx, seq_len=seq_len), _model_chunks(data, idx, seq_len))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_chunk_numbering_by_hand(transform):
  # T = 4, E = 2, L = 2: chunk 0 = env 0 steps 0-1, 1 = env 0 steps 2-3,
  # 2 = env 1 steps 0-1, 3 = env 1 steps 2-3.
  x = {"x": np.array([[0, 10], [1, 11], [2, 12], [3, 13]], np.int32)}
  take = transform(functools.partial(jr.take, seq_len=2))
  np.testing.assert_array_equal(take(x, np.array([1, 2, 3, 0]))["x"],
                                [[2, 10, 12, 0], [3, 11, 13, 1]])
  got = take(x, np.array([[3], [0]]))["x"]
  assert got.shape == (2, 2, 1)
  np.testing.assert_array_equal(got[:, :, 0], [[12, 0], [13, 1]])
  _, outs = transform(lambda d: jr.scan_minibatches(   # L = T: the env split
      _collect, 0, None, d, 1, shuffle=False, seq_len=4))(x)
  np.testing.assert_array_equal(outs["x"][0, :, :, 0], x["x"].T)


# --- take's index rule: refused when concrete, modulo N when traced. ----

_jit_take = jax.jit(jr.take, static_argnames="seq_len")


@pytest.mark.parametrize("make_idx, exc, match", [
    ([0, -1], IndexError, r"`idx` must be in \[0, 8\), got \[-1\] \(1 out "
     r"of range\); under jit, traced indices are read modulo 8$"),
    ([1, 8, 7, 24], IndexError, r"`idx` must be in \[0, 8\), got \[8, 24\] "
     r"\(2 out of range\)"),
    ([1.7], TypeError, r"`idx` must be integers, got float(32|64) "
     r"\[1\.7\d*\]$"),
    ([True, False], TypeError, r"`idx` must be integers, got bool"),
])
def test_take_refuses_bad_chunk_indices_eagerly(make_idx, exc, match):
  data = _data(6, 4)   # seq_len 3: S = 8 chunks
  idx = np.array(make_idx)
  for source in (data, _state(data)):
    for i in (idx, jnp.asarray(idx)):
      with pytest.raises(exc, match="^take: " + match):
        jr.take(source, i, seq_len=3)
    # Concrete indices are checked inside a jit too (JAX adds a line).
    with pytest.raises(exc, match=match.removesuffix("$")):
      jax.jit(lambda d: jr.take(d, idx, seq_len=3))(source)


def test_take_refuses_ragged_and_object_indices():
  data = {"x": np.arange(12).reshape(3, 4)}
  with pytest.raises(TypeError, match=r"^take: `idx` must be an integer "
                     r"array, got list \("):
    jr.take(data, [[0, 1], [2]], seq_len=3)
  with pytest.raises(TypeError, match=r"^take: `idx` must be integers, got "
                     r"object \[None\]"):
    jr.take(data, [None])


@settings(max_examples=10)
@given(req=_chunk_request(), dtype=st.sampled_from(
    [np.int32, np.int8, np.uint8, np.uint32, np.int16]),
       seed=st.integers(0, 2**31 - 1), size=st.sampled_from([0, 5]))
def test_traced_chunk_indices_are_read_modulo_s(req, dtype, seed, size):
  num_envs, t, seq_len, _, _ = req
  num = num_envs * (t // seq_len)
  info = np.iinfo(dtype)
  rng = np.random.default_rng(seed)
  idx = rng.integers(max(info.min, -5 * num), min(info.max, 5 * num) + 1,
                     size).astype(dtype)
  if dtype == np.uint32:   # and near the top of the range
    idx[: size // 2] = info.max - idx[: size // 2]
  data = _data(t, num_envs, seed % 1000)
  rows = idx.astype(np.int64) % num
  want = _model_chunks(data, rows, seq_len)
  eq(_jit_take(data, idx, seq_len=seq_len), want)
  eq(_jit_take(_state(data), idx, seq_len=seq_len),
     _model_chunks(_flat(data), rows, seq_len))
  got = jax.vmap(lambda i: jr.take(data, i, seq_len=seq_len))(idx)
  eq(got, jax.tree_util.tree_map(lambda x: np.moveaxis(x, 1, 0), want))


@st.composite
def _take_indices(draw):
  dtype = draw(st.sampled_from([np.int8, np.int32, np.uint32, np.int64,
                                np.float32, np.bool_]))
  elements = (st.booleans() if dtype == np.bool_ else
              st.floats(-13, 13, width=32) if dtype == np.float32 else
              st.integers(0, 13) if np.dtype(dtype).kind == "u" else
              st.integers(-13, 13))
  return draw(hnp.arrays(dtype, draw(st.sampled_from([(4,), (2, 2)])),
                         elements=elements))


@settings(max_examples=20)
@given(idx=_take_indices(), transform=st.sampled_from(["eager", "jit",
                                                      "vmap"]))
def test_take_state_equals_take_batch_for_every_index(idx, transform):
  """Refused if concrete and bad, else rows idx % N % L_k, for every source."""
  state = jr.register(jr.register(jr.init(2, 3), "a", (2,)), "b", (),
                      jnp.int32)
  state = jr.update_all(state, {
      "a": np.arange(12, dtype=np.float32).reshape(3, 2, 2),
      "b": np.arange(6, dtype=np.int32).reshape(3, 2) + 100})
  batch, state = jr.make_batch(state)
  batch = {k: np.asarray(v) for k, v in batch.items()}
  short = {"a": batch["a"], "c": batch["a"][:4]}   # L = 6 and 4, N = 6
  integer = idx.dtype.kind in "iu"
  for source, data in [(state, batch), (batch, batch), (short, short)]:
    before = snapshot(source)
    rows = np.asarray(idx).astype(np.int64)
    if transform == "eager":
      got, err = call_named("take", lambda s=source: jr.take(s, idx))
      if not integer:
        assert isinstance(err, TypeError), err
      elif idx.size and (idx.min() < 0 or idx.max() >= 6):
        assert isinstance(err, IndexError), err
        assert "must be in [0, 6)" in err.args[0]
      else:
        assert err is None, err
        eq(got, {k: v[rows % len(v)] for k, v in data.items()})
    elif not integer:
      with pytest.raises(TypeError, match="^take: `idx` must be integers"):
        jax.jit(jr.take)(source, idx)
    else:
      if transform == "jit":
        got = jax.jit(jr.take)(source, idx)
      else:   # one index per mapped call
        got = jax.vmap(lambda i, s=source: jr.take(s, i))(idx.reshape(-1))
        rows = rows.reshape(-1)
      eq(got, {k: v[(rows % 6) % len(v)] for k, v in data.items()})
    assert_same(source, before)


# --- Misuse: every refusal names the function, the argument, the fix. ---


def _scan_call(batch, size, **kw):
  return jr.scan_minibatches(lambda c, mb: (c, None), 0, jax.random.key(0),
                             batch, size, **kw)


def _iter_call(batch, size, **kw):
  return jr.minibatches(jax.random.key(0), batch, size, **kw)


S1, S3 = {"seq_len": 1}, {"seq_len": 3}


@pytest.mark.parametrize("call", [_iter_call, _scan_call])
@pytest.mark.parametrize("batch, size, kw, exc, match", [
    ({}, 4, {}, ValueError, r"`batch` is empty \(no fields\)"),
    ({"a": np.zeros((0, 2))}, 4, {}, ValueError, r"field 'a' has zero rows"),
    ({"a": np.zeros(8)}, 0, {}, ValueError,
     r"`batch_size` must be positive, got 0"),
    ({"a": np.zeros(8)}, -2, {}, ValueError,
     r"`batch_size` must be positive, got -2"),
    ({"a": np.zeros(8)}, 16, {}, ValueError, r"`batch_size` 16 is larger "
     r"than the number of rows N = 8; use a batch size of at most 8$"),
    ({"a": np.zeros(1024), "b": np.zeros(3)}, 48, {}, ValueError,
     r"`batch_size` 48 does not divide the number of rows N = 1024 "
     r"\(1024 % 48 = 16\); the nearest valid batch sizes are 32 or 64; or "
     r"pass remainder='drop' \(leave the last 16 rows of each epoch's "
     r"order out\) or remainder='wrap'"),
    ({"a": {"x": np.zeros(8), "y": np.zeros(6)}}, 4, {}, ValueError,
     r"field 'a' has mismatched leading shapes: 'a'\['x'\] has 8 rows but "
     r"'a'\['y'\] has 6"),
    ({"a": np.float32(1.0)}, 1, {}, ValueError, r"field 'a' is a scalar"),
    ({"a": np.zeros(8)}, 2.0, {}, TypeError, r"`batch_size` must be an int"),
    ({"a": np.zeros(4)}, 2, {"num_epochs": 0}, ValueError,
     r"`num_epochs` must be positive, got 0"),
    ([np.zeros(8)], 2, {}, TypeError, r"`batch` must be a dict"),
    (jr.init(2, 2), 2, {}, ValueError,
     r"the RolloutState has no registered fields"),
    ({}, 2, S1, ValueError, r"`data` is empty"),
    ({"a": np.zeros((3, 4)), "b": np.zeros((3, 5))}, 2, S3, ValueError,
     r"leaf \['b'\] has leading shape \(3, 5\) but \['a'\] has \(3, 4\); "
     r"every leaf must share \[T, E\]"),
    ({"a": np.zeros(4)}, 2, S1, ValueError, r"leaf \['a'\] has shape "
     r"\(4,\), expected time-major \[T, E, \.\.\.\]"),
    ({"a": np.zeros((0, 8))}, 2, S1, ValueError, r"\[T, E\] = \(0, 8\) has "
     r"a zero-length axis"),
    ({"a": np.zeros((3, 8))}, 3, S3, ValueError, r"`batch_size` 3 does not "
     r"divide the number of rows E = 8 \(8 % 3 = 2\); the nearest valid "
     r"batch sizes are 2 or 4"),
    ({"a": np.zeros((2, 4))}, 5, {"seq_len": 2, "remainder": "wrap"},
     ValueError, r"`batch_size` 5 is larger than the number of rows E = 4"),
    ({"a": np.zeros((6, 4))}, 5, {"seq_len": 2}, ValueError,
     r"`batch_size` 5 does not divide the number of rows S = E \* T / "
     r"seq_len = 12 \(12 % 5 = 2\); the nearest valid batch sizes are 4 "
     r"or 6"),
    ({"a": np.zeros((6, 4))}, 13, {"seq_len": 2, "remainder": "wrap"},
     ValueError, r"`batch_size` 13 is larger than the number of rows "
     r"S = E \* T / seq_len = 12"),
])
def test_bad_batches_are_refused_at_the_call(call, batch, size, kw, exc,
                                             match):
  """Rows and sequences; the iterator raises at the call, not later."""
  fn = "minibatches" if call is _iter_call else "scan_minibatches"
  with pytest.raises(exc, match=f"^{fn}: {match}"):
    call(batch, size, **kw)


SEQ_CALLS = {
    "take": lambda d, **kw: jr.take(d, [0], **kw),
    "minibatches": lambda d, **kw: _iter_call(d, 2, **kw),
    "scan_minibatches": lambda d, **kw: _scan_call(d, 2, **kw),
}


@pytest.mark.parametrize("fn", SEQ_CALLS)
@pytest.mark.parametrize("seq_len, exc, match", [
    (5, ValueError, r"`seq_len` 5 does not divide the rollout length T = 12;"
     r" valid lengths are 1, 2, 3, 4, 6, 12 \(T: whole rollouts\)"),
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
      SEQ_CALLS[fn](source, seq_len=seq_len)


def test_many_divisors_are_summarised():
  data = {"x": np.zeros((720, 1), np.float32)}
  with pytest.raises(ValueError, match=r"`seq_len` 7 does not divide the "
                     r"rollout length T = 720; valid lengths are the 30 "
                     r"divisors of T, nearest 6 or 8 \(T: whole"):
    jr.take(data, [0], seq_len=7)


def test_sharding_options_need_a_mesh():
  batch = {"a": np.zeros(8)}
  for kw, word in [({"axis_name": "d"}, "axis_name"),
                   ({"mode": "global"}, "mode"),
                   ({"check_vma": False}, "check_vma")]:
    with pytest.raises(ValueError, match=rf"^scan_minibatches: `{word}` "
                       r"applies to sharded minibatches only; pass `mesh=`"):
      _scan_call(batch, 4, **kw)
  with pytest.raises(ValueError, match=r"^minibatch_indices: `mode` applies "
                     r"to sharded"):
    jr.minibatch_indices(None, 8, 4, shuffle=False, mode="global")


def test_plan_errors_name_the_argument(rng_key):
  with pytest.raises(ValueError, match=r"^minibatch_indices: `key` is None "
                     "but shuffle=True"):
    jr.minibatch_indices(None, 6, 2)
  with pytest.raises(ValueError, match=r"^minibatch_indices: `remainder` must "
                     r"be one of \('error', 'drop', 'wrap'\), got 'pad'"):
    jr.minibatch_indices(rng_key, 21, 5, remainder="pad")
  with pytest.raises(ValueError, match=r"^DictDataset: `remainder` must be "
                     r"one of"):
    compat.DictDataset(5, {"x": np.zeros(21)}, remainder=None)


BAD_SCALARS = [None, "4", 4.0, True, np.bool_(False), -1, 0, 2**31,
               np.float32(2), jnp.array([2, 2]), object()]
GOOD_KEYS = [jax.random.key(1), jax.random.PRNGKey(1)]
BAD_PRNG_KEYS = ["key", 0, 1.5, np.zeros(2, np.float32),
                 jnp.zeros(3, jnp.uint32),
                 jax.random.split(jax.random.key(0), 2), np.uint32(7)]


@settings(max_examples=40)
@given(
    num_rows=st.one_of(st.integers(1, 24), st.sampled_from(BAD_SCALARS)),
    batch_size=st.one_of(st.integers(1, 24), st.sampled_from(BAD_SCALARS)),
    shuffle=st.sampled_from([True, False, "no", 0, None, np.bool_(True)]),
    key=st.sampled_from([None, *GOOD_KEYS, *BAD_PRNG_KEYS]),
    epoch=st.one_of(st.integers(0, 3), st.sampled_from(
        [-1, 1.5, True, "0", 2**31, np.int64(2), jnp.int32(1),
         jnp.array([0, 1]), jnp.float32(1)])),
    remainder=st.sampled_from(["error", "drop", "wrap", "none", None, 1]))
def test_minibatch_indices_validates_or_matches_the_plan(
    num_rows, batch_size, shuffle, key, epoch, remainder):
  """Every argument is checked; a call that passes gives the plan."""
  def is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(
        v, (bool, np.bool_))
  n_ok = is_int(num_rows) and 1 <= num_rows < 2**31
  b_ok = is_int(batch_size) and batch_size >= 1
  valid = (n_ok and b_ok and batch_size <= num_rows
           and remainder in MODES
           and (remainder != "error" or num_rows % batch_size == 0)
           and isinstance(shuffle, (bool, np.bool_))
           and (key is None and not shuffle
                or any(key is k for k in GOOD_KEYS))
           and ((is_int(epoch) and 0 <= epoch < 2**31)
                or (isinstance(epoch, jax.Array) and epoch.shape == ()
                    and jnp.issubdtype(epoch.dtype, jnp.integer)
                    and int(epoch) >= 0)))
  got, err = call_named("minibatch_indices", lambda: jr.minibatch_indices(
      key, num_rows, batch_size, shuffle=shuffle, epoch=epoch,
      remainder=remainder))
  if not valid:
    assert err is not None, "accepted"
    return
  assert err is None, err
  m = num_rows // batch_size + (remainder == "wrap" and
                                num_rows % batch_size > 0)
  assert got.shape == (m, batch_size) and got.dtype == jnp.int32
  order = np.arange(m * batch_size) % num_rows
  if shuffle:
    p = _order(key, num_rows, epoch)
    assert sorted(p.tolist()) == list(range(num_rows))
    order = p[order]
  np.testing.assert_array_equal(np.asarray(got).reshape(-1), order)


def test_nearest_batch_size_hint_is_bounded():
  """The message naming the nearest valid sizes takes O(sqrt N), not O(N)."""
  start = time.perf_counter()
  for n in (1_000_000_007, 2**31 - 1, 2 * 3 * 5 * 7 * 11 * 13 * 17 * 19 * 23):
    with pytest.raises(ValueError, match="nearest valid batch sizes are"):
      jr.minibatch_indices(None, n, 1000, shuffle=False)
  assert time.perf_counter() - start < 2.0
  with pytest.raises(ValueError, match=r"are 1 or 1000000007;"):
    jr.minibatch_indices(None, 1_000_000_007, 2, shuffle=False)
  for n, b in [(2 * 3 * 5 * 7 * 11 * 13, 1000), (97 * 89, 90), (64, 5)]:
    below = max(d for d in range(1, b + 1) if n % d == 0)   # brute force
    above = min(d for d in range(b + 1, n + 1) if n % d == 0)
    with pytest.raises(ValueError, match=rf"are {below} or {above};"):
      jr.minibatch_indices(None, n, b, shuffle=False)


_ONES = {"x": np.ones(4, np.float32)}


def _scan_ones(fn=_collect, carry=0, key=None, **kw):
  return jr.scan_minibatches(fn, carry, key, _ONES, 2, **kw)


@pytest.mark.parametrize("fn, exc, call", [
    *[("minibatches", (TypeError, ValueError), lambda v=v: jr.minibatches(
        None, _ONES, 2, shuffle=v)) for v in NOT_BOOLS],
    *[("scan_minibatches", (TypeError, ValueError),
       lambda v=v: _scan_ones(shuffle=v)) for v in NOT_BOOLS],
    *[("scan_minibatches", (TypeError, ValueError),
       lambda k=k: _scan_ones(key=k)) for k in BAD_PRNG_KEYS],
    ("scan_minibatches", TypeError, lambda: _scan_ones(None, shuffle=False)),
    ("scan_minibatches", TypeError, lambda: _scan_ones(carry="carry",
                                                       shuffle=False)),
    ("scan_minibatches", ValueError, lambda: _scan_ones(carry=2**40,
                                                        shuffle=False)),
    ("take", TypeError, lambda: jr.take(_ONES, None)),
])
def test_bad_arguments_are_refused_naming_the_function(fn, exc, call):
  """Flags, keys, step functions and carries, through JAX and NumPy too."""
  _, err = call_named(fn, call)
  assert isinstance(err, exc), err


# Bad leaves and keys of a batch: (the value of field 's', the message).
N, B, T, E = 8, 4, 3, 4
BAD_LEAVES = [
    (np.array(["a"] * N), r"`{arg}\['s'\]` is a numpy array of str "
     r"\(dtype <U1\), expected numbers"),
    (np.array([object()] * N), r"`{arg}\['s'\]` is a numpy array of Python "
     r"objects \(dtype object\), expected numbers"),
    ({"x": np.array([b"a"] * N)}, r"`{arg}\['s'\]\['x'\]` is a numpy array "
     r"of bytes \(dtype \|S1\), expected numbers"),
    ("abcdefgh", r"`{arg}\['s'\]` is a str, not an array or a number"),
    ((np.zeros(N), object()), r"`{arg}\['s'\]\[1\]` is an object, not an "
     r"array or a number"),
]
BAD_KEYS = [
    ({1: np.zeros(N), "a": np.zeros(N)},
     r"`{arg}` has the key 1 of type int; expected str keys"),
    ({1: np.zeros(N), 2: np.zeros(N)},
     r"`{arg}` has the key 1 of type int; expected str keys"),
    ({"a": {"x": np.zeros(N), (0, 1): np.zeros(N)}},
     r"`{arg}\['a'\]` has the key \(0, 1\) of type tuple; expected str keys"),
    ({"a": [np.zeros(N), {None: np.zeros(N)}]},
     r"`{arg}\['a'\]\[1\]` has the key None of type NoneType"),
]


def _entry_points(batch, size, seq_len):
  """Every entry point on ``batch`` (rows, or sequences with ``seq_len``)."""
  key = jax.random.key(0)
  return {
      "take": lambda i: jr.take(batch, i, seq_len=seq_len),
      "minibatches": lambda i: next(jr.minibatches(key, batch, size,
                                                   seq_len=seq_len)),
      "scan_minibatches": lambda i: jr.scan_minibatches(
          _collect, jnp.zeros(()), key, batch, size, seq_len=seq_len),
  }


def _like(tree, leading):
  """``tree`` with each numpy array resized to ``leading`` axes, its dicts'
  keys kept as they are (``tree_map`` would sort them)."""
  if isinstance(tree, dict):
    return {k: _like(v, leading) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return type(tree)(_like(v, leading) for v in tree)
  return np.resize(tree, leading) if isinstance(tree, np.ndarray) else tree


def _refused_everywhere(batch, data, match, jit, sharded=False):
  """Every entry point on rows (``batch``) and sequences (``data``),
  ``DictDataset`` and, with ``sharded``, the sharded scan raise the
  TypeError ``match`` names, and leave their input as it was (under ``jit``
  the batch is closed over: a str leaf cannot be a jit argument)."""
  idx = jnp.arange(2, dtype=jnp.int32)
  for source, arg, size, seq_len in [(batch, "batch", B, None),
                                     (data, "data", 2, T)]:
    before = snapshot(source)
    for fn, call in _entry_points(source, size, seq_len).items():
      with pytest.raises(TypeError, match=f"^{fn}: " + match.format(arg=arg)):
        (jax.jit(call) if jit else call)(idx)
    assert_same(source, before)
  with pytest.raises(TypeError, match="^DictDataset: "
                     + match.format(arg="tensor_dict")):
    compat.DictDataset(B, batch)
  if sharded:
    with pytest.raises(TypeError, match="^scan_minibatches: "
                       + match.format(arg="batch")):
      _scan_call(batch, B, mesh=jax.make_mesh((2,), ("d",)), axis_name="d")


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("value, match", BAD_LEAVES)
def test_non_numeric_leaves_are_refused_naming_the_path(value, match, jit):
  def with_leaf(leading):
    return {"a": np.zeros(leading, np.float32), "s": _like(value, leading)}
  _refused_everywhere(with_leaf((N,)), with_leaf((T, E)), match, jit)


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("batch, match", BAD_KEYS)
def test_dict_keys_that_are_not_str_are_refused_naming_the_dict(
    batch, match, jit):
  _refused_everywhere(batch, _like(batch, (T, E)), match, jit, sharded=True)


@pytest.mark.parametrize("seq_len", [None, 4])
def test_a_carry_with_keys_jax_cannot_sort_is_refused(seq_len):
  carry = {"a": jnp.zeros(()), 1: jnp.zeros(())}
  data = {"x": np.zeros((4, 4), np.float32)}   # N = 4 rows, E = 4 envs
  with pytest.raises(TypeError, match=(
      r"^scan_minibatches: `carry` has dict keys of types \['int', 'str'\] "
      "that cannot be sorted")):
    jr.scan_minibatches(_collect, carry, None, data, 2, shuffle=False,
                        seq_len=seq_len)
  # Keys of one type (not str) are a fine carry: JAX sorts them.
  out, _ = jr.scan_minibatches(lambda c, mb: (c, None),
                               {1: jnp.ones(()), 2: jnp.zeros(())}, None,
                               data, 2, shuffle=False, seq_len=seq_len)
  assert list(out) == [1, 2]


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("step, what", [
    (lambda c, mb: c, "an array of dtype float32 and shape (3,)"),
    (lambda c, mb: None, "None"),
    (lambda c, mb: (c, c, c), "a tuple of length 3"),
    (lambda c, mb: [c], "a list of length 1"),
    (lambda c, mb: {"carry": c}, "a dict"),
])
@pytest.mark.parametrize("seq_len", [None, 4])
def test_a_step_function_must_return_a_pair(seq_len, step, what, jit):
  carry = jnp.arange(3.0)
  before = snapshot(carry)
  data = {"x": np.zeros((4, 4), np.float32)}   # N = 4 rows, E = 4 envs

  def call(carry):
    return jr.scan_minibatches(step, carry, jax.random.key(1), data, 2,
                               seq_len=seq_len)

  with pytest.raises(TypeError, match=(
      r"^scan_minibatches: `fn` must return a pair \(carry, out\), it "
      rf"returned {re.escape(what)}; return \(carry, None\)")):
    (jax.jit(call) if jit else call)(carry)
  assert_same(carry, before)
