"""Pytree fields and transition containers: a field's value may be any
pytree of ``[E, ...]`` arrays, and ``init(like=Transition(...))`` comes back
in its own type; checked against a numpy model of the storage and rows over
hypothesis-drawn structures, leaf dtypes and shapes.
"""

import dataclasses
import os
from typing import Any, NamedTuple

import chex
from flax import struct
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr


# ------------------------------------------------------------ structures


class Pair(NamedTuple):
  p: Any
  q: Any


class OtherPair(NamedTuple):   # Pair's leaf paths, another container
  p: Any
  q: Any


@struct.dataclass
class Group:
  u: Any
  v: Any


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """A leaf of a drawn structure: one step's per-env shape and dtype (a
  plain object: a pytree leaf)."""
  shape: tuple[int, ...]
  dtype: Any


DTYPES = [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_]

leaf_specs = st.builds(LeafSpec, st.lists(st.integers(1, 3), max_size=2)
                       .map(tuple), st.sampled_from(DTYPES))


def _nodes(children):
  return st.one_of(
      st.dictionaries(st.sampled_from(["a", "b", "c"]), children,
                      min_size=1, max_size=3),
      st.lists(children, min_size=1, max_size=2).map(tuple),
      st.builds(Pair, children, children),
      st.builds(Group, children, children))


specs = st.recursive(leaf_specs, _nodes, max_leaves=4)
# {field name: spec tree}: at least one field, at least one nested.
field_specs = st.dictionaries(st.sampled_from(["obs", "act", "rew"]), specs,
                              min_size=1, max_size=3)

_is_spec = lambda x: isinstance(x, LeafSpec)  # noqa: E731


def _values(spec, lead, rng):
  """A numpy value of ``spec`` with leading axes ``lead``, every leaf."""
  def leaf(s):
    shape = (*lead, *s.shape)
    if s.dtype == jnp.bool_:
      return rng.random(shape) < 0.5
    if s.dtype == jnp.int32:
      return rng.integers(-1000, 1000, shape).astype(np.int32)
    return rng.normal(size=shape).astype(np.float32).astype(s.dtype)
  return jax.tree_util.tree_map(leaf, spec, is_leaf=_is_spec)


def _np(tree):
  return jax.tree_util.tree_map(np.asarray, tree)


def assert_same(got, want):
  """Same structure (container types included), dtypes and bits."""
  chex.assert_trees_all_equal(got, want, strict=True)


def _env_major(tree):
  return jax.tree_util.tree_map(
      lambda x: np.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


def _state(fields, num_envs, num_steps):
  state = jr.init(num_envs=num_envs, num_steps=num_steps)
  rng = np.random.default_rng(0)
  for name, spec in fields.items():
    state = jr.register(state, name, like=_values(spec, (num_envs,), rng))
  return state


# ------------------------------------------- storage and rows: the model


WRITERS = ["update_at", "jit", "writer", "writer_jax", "update_all",
           "writer_update_all"]


@given(fields=field_specs, num_envs=st.integers(1, 3),
       num_steps=st.integers(1, 3), how=st.sampled_from(WRITERS),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=12)
def test_writes_and_make_batch_follow_the_model(fields, num_envs, num_steps,
                                                how, seed):
  rng = np.random.default_rng(seed)
  state = _state(fields, num_envs, num_steps)
  for name, spec in fields.items():   # registered: zeros of each leaf
    want = _values(spec, (num_steps, num_envs), rng)
    assert_same(state.data[name], jax.tree_util.tree_map(
        lambda x: np.zeros_like(x), want))
  whole = {n: _values(s, (num_steps, num_envs), rng)
           for n, s in fields.items()}
  if how in ("update_all", "writer_update_all"):
    if how == "update_all":
      state = jr.update_all(state, whole)
    else:
      writer = jr.RolloutWriter(state)
      writer.update_all(whole)
      state = writer.state
  else:
    writer = (jr.RolloutWriter(state, flush_every=int(rng.integers(1, 4)))
              if how.startswith("writer") else None)
    write = jax.jit(jr.update_at) if how == "jit" else jr.update_at
    for t in rng.permutation(num_steps):
      # Each step as one write or one write per field, in a random order.
      names = list(rng.permutation(sorted(fields)))
      groups = ([names] if rng.random() < 0.5 else [[n] for n in names])
      for group in groups:
        values = {n: jax.tree_util.tree_map(lambda x, t=t: x[t], whole[n])
                  for n in group}
        if how == "writer_jax":   # JAX rows are held, not staged
          writer.update_at(int(t), jax.tree_util.tree_map(jnp.asarray,
                                                          values))
        elif how == "writer":   # host rows: staged per leaf
          writer.update_at(int(t), values)
        else:
          state = write(state, int(t), values)
    if writer is not None:
      state = writer.state
  for name in fields:
    assert_same(state.data[name], whole[name])
    assert jr.write_counts(state)[name].per_step.tolist() == [1] * num_steps
  batch, state = jr.make_batch(state)
  assert_same(batch, _env_major(whole))
  assert not jr.is_complete(state)


@given(fields=field_specs, num_envs=st.integers(1, 3),
       num_steps=st.integers(1, 4), batch_size=st.integers(1, 4),
       from_state=st.booleans(), jit=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=8)
def test_minibatches_and_take_gather_the_model_rows(
    fields, num_envs, num_steps, batch_size, from_state, jit, seed):
  rng = np.random.default_rng(seed)
  n = num_envs * num_steps
  batch_size = min(batch_size, n)
  whole = {k: _values(s, (num_steps, num_envs), rng)
           for k, s in fields.items()}
  state = jr.update_all(_state(fields, num_envs, num_steps), whole)
  rows = _env_major(whole)
  source = state if from_state else jr.make_batch(state)[0]
  key = jax.random.key(seed)
  idx = np.asarray(jr.minibatch_indices(key, n, batch_size,
                                        remainder="drop"))
  pick = lambda i: jax.tree_util.tree_map(lambda x: x[i], rows)  # noqa: E731
  # take
  take = jax.jit(jr.take) if jit else jr.take
  assert_same(take(source, jnp.asarray(idx[0])), pick(idx[0]))
  # minibatches: one epoch
  got = list(jr.minibatches(key, source, batch_size, remainder="drop"))
  assert len(got) == len(idx)
  for mb, i in zip(got, idx):
    assert_same(mb, pick(i))
  # scan_minibatches: two epochs, every minibatch returned

  def scan(source):
    return jr.scan_minibatches(lambda c, mb: (c + 1, mb), jnp.int32(0), key,
                               source, batch_size, num_epochs=2,
                               remainder="drop")

  count, out = (jax.jit(scan) if jit else scan)(source)
  assert int(count) == 2 * len(idx)
  idx1 = np.asarray(jr.minibatch_indices(key, n, batch_size, epoch=1,
                                         remainder="drop"))
  want = pick(np.stack([idx, idx1]))
  assert_same(out, want)


@given(fields=field_specs, num_envs=st.integers(1, 4),
       num_steps=st.sampled_from([2, 4]), seq_len=st.sampled_from([None, 2]),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=10)
def test_sequences_keep_each_leaf_time_major(fields, num_envs, num_steps,
                                             seq_len, seed):
  rng = np.random.default_rng(seed)
  whole = {k: _values(s, (num_steps, num_envs), rng)
           for k, s in fields.items()}
  state = jr.update_all(_state(fields, num_envs, num_steps), whole)
  key = jax.random.key(seed)
  length = num_steps if seq_len is None else seq_len
  chunks = num_steps // length
  num = num_envs * chunks

  def chunk(s):   # chunk s: env s // C, steps [c L, (c + 1) L)
    e, c = s // chunks, s % chunks
    return jax.tree_util.tree_map(
        lambda x: x[c * length:(c + 1) * length, e], whole)

  idx = np.asarray(jr.minibatch_indices(key, num, 1))
  for source in (state, whole):
    got = list(jr.minibatches(key, source, 1, seq_len=length))
    for mb, i in zip(got, idx):
      want = jax.tree_util.tree_map(lambda x: x[:, None], chunk(int(i[0])))
      assert_same(mb, want)
    taken = jr.take(source, jnp.asarray([num - 1]), seq_len=length)
    assert_same(taken, jax.tree_util.tree_map(lambda x: x[:, None],
                                              chunk(num - 1)))


# ---------------------------------------------------------- transitions


class Transition(NamedTuple):
  obs: Any
  action: Any
  reward: Any
  done: Any


@struct.dataclass
class FlaxTransition:
  obs: Any
  action: Any
  reward: Any
  done: Any


@chex.dataclass
class ChexTransition:
  obs: Any
  action: Any
  reward: Any
  done: Any


E, T = 3, 4


def _transition(cls, t, num_envs=E):
  """One step of every env, its values made from ``t``."""
  base = jnp.arange(num_envs, dtype=jnp.float32) + 10 * jnp.float32(t)
  return cls(obs={"pixels": jnp.broadcast_to(base[:, None, None],
                                             (num_envs, 2, 2)),
                  "vec": (base.astype(jnp.bfloat16),)},
             action=base.astype(jnp.int32), reward=base,
             done=(base.astype(jnp.int32) % 2) == 0)


def _stack(steps):
  return jax.tree_util.tree_map(lambda *x: np.stack(x), *steps)


@pytest.mark.parametrize("cls", [Transition, FlaxTransition, ChexTransition])
def test_a_transition_container_comes_back_in_its_own_type(cls):
  state = jr.init(num_envs=E, num_steps=T, like=_transition(cls, 0))
  assert state.names == ("action", "done", "obs", "reward")
  steps = [_transition(cls, t) for t in range(T)]

  @jax.jit
  def rollout(state):
    def body(state, t):
      return jr.update_at(state, t, _transition(cls, t)), None
    return jax.lax.scan(body, state, jnp.arange(T))[0]

  state = rollout(state)
  batch, done = jr.make_batch(state)
  assert type(batch) is cls
  want = _env_major(_np(_stack(steps)))
  assert_same(_np(batch), want)
  # Every minibatch function keeps the type, from the batch and the state.
  key = jax.random.key(1)
  for source in (batch, done):
    mb = next(iter(jr.minibatches(key, source, 4)))
    assert type(mb) is cls and mb.obs["pixels"].shape == (4, 2, 2)
    assert type(jr.take(source, jnp.arange(2))) is cls
    _, out = jr.scan_minibatches(lambda c, mb: (c, mb.reward), 0, key,
                                 source, 4)
    idx = np.asarray(jr.minibatch_indices(key, E * T, 4))
    np.testing.assert_array_equal(np.asarray(out[0]), want.reward[idx])
  seq = next(iter(jr.minibatches(key, done, 1, seq_len=2)))
  assert type(seq) is cls and seq.obs["vec"][0].shape == (2, 1)
  # The writer takes and gives the container too.
  writer = jr.RolloutWriter(done)
  for t in range(T):
    writer.update_at(t, jax.tree_util.tree_map(np.asarray, steps[t]))
  got = writer.make_batch()
  assert type(got) is cls
  assert_same(_np(got), want)


def test_a_dict_transition_registers_every_field_and_returns_a_dict():
  step = _transition(Transition, 0)._asdict()
  state = jr.init(num_envs=E, num_steps=T, like=step)
  assert state.container is None
  state = jr.register(state, "extra")   # a dict state takes more fields
  state = jr.update_all(state, {**_stack([step] * T),
                                "extra": np.zeros((T, E), np.float32)})
  batch, _ = jr.make_batch(state)
  assert type(batch) is dict and sorted(batch) == sorted([*step, "extra"])


def test_a_container_state_refuses_a_field_outside_its_type():
  state = jr.init(num_envs=E, num_steps=T, like=_transition(Transition, 0))
  with pytest.raises(ValueError, match="register: this state holds the "
                     "fields of a Transition .*field 'adv' would not be"):
    jr.register(state, "adv")
  with pytest.raises(TypeError, match="init: `like` must be one step of a "
                     "transition.*got list"):
    jr.init(num_envs=E, num_steps=T, like=[np.zeros(E)])
  with pytest.raises(ValueError, match="init: field 'done' of `like` is "
                     "None"):
    jr.init(num_envs=E, num_steps=T,
            like=_transition(Transition, 0)._replace(done=None))


def test_states_with_pytree_fields_vmap_and_scan():
  num = 2

  def one(seed):
    state = jr.init(num_envs=E, num_steps=T, like=_transition(Transition, 0))

    def body(state, t):
      step = jax.tree_util.tree_map(lambda x: x + seed.astype(x.dtype)
                                    if x.dtype != jnp.bool_ else x,
                                    _transition(Transition, t))
      return jr.update_at(state, t, step), None

    state = jax.lax.scan(body, state, jnp.arange(T))[0]
    return jr.make_batch(state)

  batch, state = jax.jit(jax.vmap(one))(jnp.arange(num, dtype=jnp.int32))
  assert type(batch) is Transition
  assert batch.obs["pixels"].shape == (num, E * T, 2, 2)
  want = _env_major(_np(_stack([_transition(Transition, t)
                                for t in range(T)])))
  np.testing.assert_array_equal(np.asarray(batch.reward[1]),
                                want.reward + 1)
  np.testing.assert_array_equal(np.asarray(batch.obs["vec"][0][0]),
                                want.obs["vec"][0])
  assert state.data["obs"]["pixels"].shape == (num, T, E, 2, 2)


def test_pure_jax_rl_transition_end_to_end():
  """PureJaxRL's Transition: init(like=), update_at in a lax.scan,
  make_batch -> Transition, scan_minibatches reading mb.obs."""

  class PureTransition(NamedTuple):
    done: jax.Array
    action: jax.Array
    value: jax.Array
    reward: jax.Array
    log_prob: jax.Array
    obs: jax.Array

  num_envs, num_steps, obs_dim, batch_size = 4, 8, 3, 8

  def env_step(key, t):
    k1, k2 = jax.random.split(jax.random.fold_in(key, t))
    obs = jax.random.normal(k1, (num_envs, obs_dim))
    return PureTransition(
        done=jax.random.bernoulli(k2, 0.1, (num_envs,)),
        action=jnp.arange(num_envs, dtype=jnp.int32) + t,
        value=obs.sum(-1), reward=jnp.ones(num_envs) * t.astype(jnp.float32),
        log_prob=-obs[:, 0], obs=obs)

  key = jax.random.key(0)
  like = jax.eval_shape(env_step, key, jnp.int32(0))
  state = jr.init(num_envs=num_envs, num_steps=num_steps, like=like)

  @jax.jit
  def train(state, key):
    def collect(state, t):
      return jr.update_at(state, t, env_step(key, t)), None
    state = jax.lax.scan(collect, state, jnp.arange(num_steps))[0]
    batch, state = jr.make_batch(state)

    def loss(total, mb):
      return total + jnp.sum(mb.obs) + jnp.sum(mb.reward), mb.obs
    total, obs = jr.scan_minibatches(loss, jnp.float32(0), key, batch,
                                     batch_size, num_epochs=2)
    return batch, total, obs

  batch, total, obs = train(state, key)
  assert type(batch) is PureTransition
  traj = _np(jax.vmap(lambda t: env_step(key, t))(jnp.arange(num_steps)))
  want = _env_major(traj)   # value: a sum, compiled in another program
  jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(
      np.asarray(g), w, rtol=1e-6, atol=1e-6), batch, want)
  idx = np.stack([np.asarray(jr.minibatch_indices(
      key, num_envs * num_steps, batch_size, epoch=e)) for e in range(2)])
  np.testing.assert_allclose(np.asarray(obs), want.obs[idx], rtol=1e-6)
  np.testing.assert_allclose(
      float(total), 2 * (want.obs.sum() + want.reward.sum()), rtol=1e-5)


# ----------------------------------------------------------- checkpoints


@given(fields=field_specs, seed=st.integers(0, 2**31 - 1))
@settings(max_examples=6)
def test_checkpoints_of_pytree_fields_restore_bit_exact(tmp_path_factory,
                                                        fields, seed):
  rng = np.random.default_rng(seed)
  whole = {k: _values(s, (2, 3), rng) for k, s in fields.items()}
  state = jr.update_all(_state(fields, 3, 2), whole)
  path = tmp_path_factory.mktemp("ckpt") / "c"
  jr.save_rollout(path, state)
  target = jax.tree_util.tree_map(jnp.zeros_like, state)
  restored = jr.restore_rollout(path, target)
  assert jax.tree_util.tree_structure(restored) == (
      jax.tree_util.tree_structure(state))
  assert_same(_np(restored), _np(state))


def test_a_damaged_leaf_of_a_pytree_field_is_named_by_its_path(tmp_path):
  rng = np.random.default_rng(0)
  state = jr.register(jr.init(num_envs=E, num_steps=T), "obs", like={
      "pixels": np.zeros((E, 64, 64), np.float32),
      "vec": np.zeros((E, 2), np.float32)})
  state = jr.update_all(state, {"obs": {   # random: the largest file
      "pixels": rng.normal(size=(T, E, 64, 64)).astype(np.float32),
      "vec": np.ones((T, E, 2), np.float32)}})
  path = tmp_path / "c"
  jr.save_rollout(path, state)
  files = [os.path.join(root, f) for root, _, names in os.walk(path)
           for f in names if "ocdbt.process_" in root + f]
  largest = max(files, key=os.path.getsize)   # obs['pixels'], the biggest
  with open(largest, "rb") as f:
    data = bytearray(f.read())
  mid = len(data) // 2
  data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
  with open(largest, "wb") as f:
    f.write(data)
  with pytest.raises(jr.CorruptCheckpointError,
                     match=r"leaf \.data\['obs'\]\['pixels'\]: checksum"):
    jr.restore_rollout(path, state)


# --------------------------------------------------------------- errors


def _obs_state():
  state = jr.init(num_envs=2, num_steps=3)
  return jr.register(state, "obs", like={
      "pixels": np.zeros((2, 4), np.uint8),
      "group": Pair(np.zeros((2,), np.float32), np.zeros((2, 2), np.int32))})


def _good(lead=(2,)):
  return {"pixels": np.ones((*lead, 4), np.uint8),
          "group": Pair(np.ones(lead, np.float32),
                        np.ones((*lead, 2), np.int32))}


BAD = {
    "missing": (lambda v: {"group": v["group"]}, ValueError,
                r"field 'obs' is missing leaf \['pixels'\]"),
    "missing-nested": (lambda v: {**v, "group": (v["group"].p,)}, ValueError,
                       r"field 'obs' is missing leaf \['group'\]\.p"),
    "extra": (lambda v: {**v, "depth": v["pixels"]}, ValueError,
              r"field 'obs' has leaf \['depth'\], which is not registered"),
    "shape": (lambda v: {**v, "pixels": v["pixels"][..., :3]}, ValueError,
              r"field 'obs' leaf \['pixels'\] has shape .*, expected"),
    "dtype": (lambda v: {**v, "group": Pair(v["group"].p,
                                            v["group"].q.astype(np.float32))},
              TypeError, r"field 'obs' leaf \['group'\]\.q has dtype float32, "
              "which cannot be cast safely to the registered dtype int32"),
    "range": (lambda v: {**v, "pixels": v["pixels"].astype(np.int32) + 300},
              ValueError, r"field 'obs' leaf \['pixels'\] has int32 values "
              r"in \[301, 301\], outside the range of its dtype uint8"),
    "container": (lambda v: {**v, "group": OtherPair(*v["group"])}, TypeError,
                  r"field 'obs' has structure .*same leaves, other "
                  "containers"),
    "not-a-tree": (lambda v: v["pixels"], ValueError,
                   r"field 'obs' is missing leaf"),
}


@pytest.mark.parametrize("how", ["update_at", "jit",
                                 "RolloutWriter.update_at", "update_all",
                                 "RolloutWriter.update_all"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_leaf_is_refused_naming_function_field_and_path(bad, how):
  make, error, match = BAD[bad]
  if how == "jit" and bad == "range":
    return   # traced values: a checkify check (test below)
  whole = how.endswith("update_all")
  state = _obs_state()
  before = _np(state)
  value = make(_good((3, 2) if whole else (2,)))
  if how == "jit":
    value = jax.tree_util.tree_map(jnp.asarray, value)
  name = "update_at" if how == "jit" else how
  writer = jr.RolloutWriter(state) if how.startswith("Rollout") else None
  with pytest.raises(error, match=f"^{name}: {match}"):
    if writer is not None:
      getattr(writer, how.split(".")[1])(*(() if whole else (0,)),
                                         {"obs": value})
    elif how == "jit":
      jax.jit(jr.update_at)(state, 0, {"obs": value})
    elif whole:
      getattr(jr, how)(state, {"obs": value})
    else:
      getattr(jr, how)(state, 0, {"obs": value})
  if writer is not None:
    assert writer.pending == 0
    state = writer.state
  assert_same(_np(state), before)   # unchanged, not consumed


def test_the_write_check_cache_never_passes_a_bad_leaf_after_a_good_one():
  """A write that passed is cached by its signature (treedef, each leaf's
  type, shape and dtype); every bad variant of it is still refused."""
  writer = jr.RolloutWriter(_obs_state())
  for _ in range(2):   # the second time from the cache
    writer.update_at(0, {"obs": _good()})
  for bad in sorted(BAD):
    make, error, match = BAD[bad]
    with pytest.raises(error, match=f"^RolloutWriter.update_at: {match}"):
      writer.update_at(1, {"obs": make(_good())})
  assert writer.pending == 2


def test_a_consumed_state_with_a_pytree_field_is_named():
  old = _obs_state()
  writer = jr.RolloutWriter(old, flush_every=1)
  writer.update_at(0, {"obs": _good()})
  new = writer.state
  assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(old.data))
  with pytest.raises(ValueError, match=r"update_at: `state` was consumed: "
                     r"the buffers of \['obs', 'counts', 'out_of_range'\]"):
    jr.update_at(old, 1, {"obs": _good()})
  assert jr.write_counts(new)["obs"].per_step.tolist() == [1, 0, 0]


def test_a_traced_narrowing_leaf_is_a_checkify_error_naming_its_path():
  state = _obs_state()
  value = jax.tree_util.tree_map(jnp.asarray, _good())
  value["pixels"] = value["pixels"].astype(jnp.int32) + 300
  err, _ = jax.jit(checkify.checkify(jr.update_at))(state, 0, {"obs": value})
  assert "field 'obs' leaf ['pixels']: a traced int32 value outside" in (
      err.get())


def test_a_flat_field_given_a_pytree_and_register_misuse_are_named():
  state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
  with pytest.raises(TypeError, match="update_at: field 'r' is registered as "
                     "one array, got a dict; register a pytree field with "
                     r"jr.register\(state, 'r', like=value\)"):
    jr.update_at(state, 0, {"r": {"a": np.zeros(2)}})
  with pytest.raises(TypeError, match="give either `like` or"):
    jr.register(state, "x", (2,), like=np.zeros((2, 2)))
  with pytest.raises(ValueError, match=r"register: field 'x' leaf \['a'\] of "
                     r"`like` has shape \(3, 1\), expected \[E, ...\] with "
                     "E = 2"):
    jr.register(state, "x", like={"a": np.zeros((3, 1), np.float32)})
  with pytest.raises(ValueError, match="register: field 'x': `like` holds no "
                     "arrays"):
    jr.register(state, "x", like={})
  with pytest.raises(TypeError, match="register: field 'x': dtype float64 "
                     "is not available with jax_enable_x64 disabled"):
    jr.register(state, "x", like={"a": np.zeros((2, 1))})   # as dtype=
  state = jr.register(state, "x", like={"a": np.zeros((2, 1), np.float32)})
  with pytest.raises(ValueError, match="field 'x' is already registered"):
    jr.register(state, "x", like={"a": np.zeros((2, 1), np.float32)})
  assert state.spec("x") == {"a": jax.ShapeDtypeStruct((1,), jnp.float32)}


# ------------------------------------------------------------- sharding


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_shard_and_sharded_minibatches_keep_pytree_fields():
  num = 2
  mesh = jax.make_mesh((num,), ("envs",))
  steps = [_transition(Transition, t, num_envs=4) for t in range(T)]
  state = jr.init(num_envs=4, num_steps=T, like=steps[0])
  state = jr.shard(state, mesh, "envs")
  assert state.data["obs"]["pixels"].sharding.spec[1] == "envs"
  state = jr.update_all(state, _stack(steps))
  batch, state = jr.make_batch(state)
  assert type(batch) is Transition
  placed = jr.shard_rows(batch, mesh, "envs")
  assert type(placed) is Transition
  assert placed.obs["vec"][0].sharding.spec[0] == "envs"
  key = jax.random.key(0)
  _, out = jr.scan_minibatches(
      lambda c, mb: (c, mb.reward), 0, key, batch, 4, mesh=mesh,
      axis_name="envs", mode="global")
  _, want = jr.scan_minibatches(lambda c, mb: (c, mb.reward), 0, key, batch,
                                4)
  # Global mode: device d gathers its B / D slice of every minibatch.
  np.testing.assert_array_equal(np.concatenate(list(np.asarray(out)), -1),
                                np.asarray(want))
