"""Tests of jrollout._sharding on 8 fake CPU devices (set by conftest):
sharded results against the single-device functions on unsharded copies of
the same data, exactly in global mode, per shard (key ``fold_in(key, d)``,
batch size ``B / D``) in local mode."""

import functools
import json
import re

import chex
from hypothesis import given
from hypothesis import strategies as st
import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from tests import _multihost_worker
from tests import reference
from tests._helpers import run_workers
from tests._misuse import NOT_BOOLS
from tests.conftest import TRANSFORMS

D = 8
pytestmark = pytest.mark.skipif(
    jax.device_count() < D, reason=f"needs {D} devices (conftest fakes 8 CPUs)")

_order = reference.epoch_order
_model = reference.plan_rows
MOVES_DATA = ("all-gather", "all-to-all", "collective-permute")


def _mesh(kind="auto", shape=(D,), names=("envs",)):
  types = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[kind]
  return jax.make_mesh(shape, names, axis_types=(types,) * len(names))


def _collectives(fn, *args):
  """The collective op kinds in the compiled (SPMD-partitioned) HLO."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  return set(re.findall(
      r"\b(all-gather|all-to-all|collective-permute|all-reduce|"
      r"reduce-scatter)(?:-start)?\(", text))


def _assert_sharding(x, mesh, spec):
  expected = NamedSharding(mesh, spec)
  assert x.sharding.is_equivalent_to(expected, x.ndim), (x.sharding, spec)


def _host(tree):
  """An unsharded numpy copy (for the single-device reference)."""
  return jax.tree_util.tree_map(np.asarray, tree)


def _filled_state(num_envs=16, num_steps=4, seed=0):
  """A complete rollout with distinct values, unsharded, and its contents."""
  rng = np.random.default_rng(seed)
  values = {
      "obs": rng.standard_normal((num_steps, num_envs, 3)).astype(np.float32),
      "action": rng.integers(0, 5, (num_steps, num_envs)).astype(np.int32),
      "done": rng.random((num_steps, num_envs)) < 0.3,
  }
  return jr.update_all(_registered(num_envs, num_steps), values), values


def _registered(num_envs=16, num_steps=4):
  """A zero-filled rollout with the keys of ``_filled_state``."""
  state = jr.init(num_envs, num_steps)
  for key, (shape, dtype) in {"obs": ((3,), jnp.float32),
                              "action": ((), jnp.int32),
                              "done": ((), jnp.bool_)}.items():
    state = jr.register(state, key, shape, dtype)
  return state


def _rows_fn(carry, mb):
  """Returns the minibatch itself, so the outputs show which rows were used."""
  return carry, mb


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("axis_name", ["envs", None])
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_shard_places_envs_and_replicates_tracking(kind, axis_name,
                                                   transform):
  """None: the only axis of a 1-D mesh. Under jit a sharding constraint
  (Auto axes) or a reshard (Explicit axes)."""
  mesh = _mesh(kind)
  state, values = _filled_state()
  sharded = transform(lambda s: jr.shard(s, mesh, axis_name))(state)
  for key in state.names:
    arr = sharded.data[key]
    _assert_sharding(arr, mesh, P(None, "envs"))
    assert {s.data.shape[:2] for s in arr.addressable_shards} == {(4, 2)}
    np.testing.assert_array_equal(np.asarray(arr), values[key])
  _assert_sharding(sharded.counts, mesh, P())
  _assert_sharding(sharded.out_of_range, mesh, P())


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_shard_rows_eager_and_under_jit(kind, transform):
  mesh = _mesh(kind)
  tree = {"a": np.arange(16.0, dtype=np.float32).reshape(16, 1),
          "b": np.ones((4, 16), np.int32)}
  out = transform(lambda t: {
      "a": jr.shard_rows(t["a"], mesh),
      "b": jr.shard_rows(t["b"], mesh, dim=1)})(tree)
  _assert_sharding(out["a"], mesh, P("envs"))
  _assert_sharding(out["b"], mesh, P(None, "envs"))
  chex.assert_trees_all_equal(out, tree)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_writes_and_make_batch_keep_the_layout(kind, transform):
  mesh = _mesh(kind)
  state, values = _filled_state()
  empty = jr.shard(_registered(), mesh)

  def rows(t):
    return jr.shard_rows({k: jnp.asarray(v)[t] for k, v in values.items()},
                         mesh)

  # Traced steps under jit, or concrete steps eagerly: the pure write (odd
  # steps), then the donating writer's.
  if transform is jax.jit:
    written = jax.jit(lambda s: jax.lax.fori_loop(
        0, 4, lambda t, s: jr.update_at(s, t, rows(t)), s))(empty)
  else:
    written = empty
    for t in range(4):
      if t % 2:
        written = jr.update_at(written, t, rows(t))
      else:
        writer = jr.RolloutWriter(written, flush_every=1)
        writer.update_at(t, rows(t))
        written = writer.state
  whole = transform(lambda s, v: jr.update_all(s, v))(
      written, jr.shard_rows({"obs": values["obs"]}, mesh, dim=1))
  batch, after = transform(lambda s: jr.make_batch(s, check="off"))(written)
  finished = jr.finish_rollout(written)   # eager write check passes

  for s in (written, whole, after, finished):
    _assert_sharding(s.counts, mesh, P())
    _assert_sharding(s.out_of_range, mesh, P())
    for key in s.names:
      _assert_sharding(s.data[key], mesh, P(None, "envs"))
      np.testing.assert_array_equal(np.asarray(s.data[key]), values[key])
  for s, writes in ((written, 1), (whole, 2), (after, 0)):
    np.testing.assert_array_equal(
        np.asarray(jr.write_counts(s)["obs"].per_step), [writes] * 4)
  unsharded_batch, _ = jr.make_batch(state)
  for key in state.names:
    _assert_sharding(batch[key], mesh, P("envs"))
    np.testing.assert_array_equal(np.asarray(batch[key]),
                                  np.asarray(unsharded_batch[key]))


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_jitted_rollout_compiles_no_collective(kind):
  """Writes of every step, update_all, make_batch: nothing leaves a device."""
  mesh = _mesh(kind)
  state = jr.shard(_filled_state()[0], mesh)
  obs = jr.shard_rows(jnp.ones((16, 3)), mesh)

  def rollout(state, obs):
    def step(s, t):
      return jr.update_at(s, t, {"obs": obs * t.astype(jnp.float32),
                                 "action": jnp.zeros(16, jnp.int32)}), None
    state, _ = jax.lax.scan(step, state, jnp.arange(4))
    state = jr.update_all(state, {"done": state.data["obs"][..., 0] > 1})
    return jr.make_batch(state, check="off")

  assert _collectives(rollout, state, obs) == set()
  batch, state = jax.jit(rollout)(state, obs)
  _assert_sharding(batch["obs"], mesh, P("envs"))
  _assert_sharding(state.data["done"], mesh, P(None, "envs"))


def _dict_batch(lengths=(64, 32, 16), seed=1):
  rng = np.random.default_rng(seed)
  return {f"k{i}": {"x": rng.standard_normal((n, 2)).astype(np.float32),
                    "i": np.arange(n, dtype=np.int32)}
          for i, n in enumerate(lengths)}


def _shard_of(batch, d):
  """Shard ``d`` of a batch dict: rows [d*L/D, (d+1)*L/D) of every key."""
  return jax.tree_util.tree_map(
      lambda x: x[d * (x.shape[0] // D):(d + 1) * (x.shape[0] // D)], batch)


def _state_shard(state, d):
  e = state.num_envs // D
  return jr.RolloutState(
      data={k: v[:, d * e:(d + 1) * e] for k, v in _host(state.data).items()},
      counts=None, out_of_range=None, num_envs=e, num_steps=state.num_steps)


@pytest.mark.parametrize("mode, shuffle", [("global", True),
                                           ("global", False),
                                           ("local", True)])
@pytest.mark.parametrize("source", ["state", "dict", "sequences"])
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_each_mode_equals_its_one_device_reference(mode, shuffle, source,
                                                   kind, rng_key):
  """Global: device d holds part d of each one-device minibatch; local:
  device d runs the one-device scan of its shard, key ``fold_in(key, d)``.
  Rows of a state or a dict, or sequences (``seq_len=2``: S = 32 chunks)."""
  mesh = _mesh(kind)
  seq_len, size = (2, 8) if source == "sequences" else (None, 16)
  if source == "dict":
    batch = _dict_batch()   # lengths 64, 32, 16: the modulo wrap
    sharded = jr.shard_rows(batch, mesh)
    shards = [_shard_of(batch, d) for d in range(D)]
  else:
    batch, _ = _filled_state(num_envs=16, num_steps=4)
    sharded = jr.shard(batch, mesh)
    shards = [_state_shard(batch, d) for d in range(D)]
  key = rng_key if shuffle else None
  carry, outs = jax.jit(lambda s, k: jr.scan_minibatches(
      _rows_fn, jnp.int32(7), k, s, size, mesh=mesh, mode=mode, num_epochs=2,
      shuffle=shuffle, seq_len=seq_len))(sharded, key)
  assert int(carry) == 7
  _assert_sharding(carry, mesh, P())
  # [D, epochs, M, B/D, ...], sequences [D, epochs, M, L, B/D, ...]
  lead = (D, 2, 4, 2, 1) if seq_len else (D, 2, 4, 2)
  for leaf in jax.tree_util.tree_leaves(outs):
    assert leaf.shape[:len(lead)] == lead
    _assert_sharding(leaf, mesh, P("envs"))
  if mode == "global":
    _, single = jr.scan_minibatches(_rows_fn, jnp.int32(7), key, _host(batch),
                                    size, num_epochs=2, shuffle=shuffle,
                                    seq_len=seq_len)
    b_axis = len(lead) - 2   # the one-device B axis, D parts of B / D
    chex.assert_trees_all_equal(jax.tree_util.tree_map(
        lambda x, r: np.moveaxis(np.asarray(x), 0, b_axis).reshape(r.shape),
        outs, single), single)
    return
  for d in range(D):
    _, ref = jr.scan_minibatches(_rows_fn, jnp.int32(7),
                                 jax.random.fold_in(rng_key, d), shards[d],
                                 size // D, num_epochs=2, seq_len=seq_len)
    chex.assert_trees_all_equal(
        jax.tree_util.tree_map(lambda x, d=d: np.asarray(x)[d], outs), ref)


@given(num_shards=st.sampled_from([1, 8]), rows=st.sampled_from([1, 5]),
       b=st.sampled_from([1, 3]), extra=st.sampled_from([1, 2]),
       remainder=st.sampled_from(["error", "drop", "wrap"]),
       seed=st.integers(0, 2**31 - 1), epoch=st.integers(0, 3),
       shuffle=st.booleans())
def test_property_shard_indices_follow_the_model(num_shards, rows, b, extra,
                                                 remainder, seed, epoch,
                                                 shuffle):
  """Local: device d's rows with key fold_in(key, d); global: D parts."""
  n = b * rows + (remainder != "error") * extra   # rows per device
  num_rows, batch_size = n * num_shards, b * num_shards
  key = jax.random.key(seed)
  m = -(-n // b) if remainder == "wrap" else n // b
  for mode in ("local", "global"):
    idx = np.asarray(jr.minibatch_indices(
        key if shuffle else None, num_rows, batch_size, shuffle=shuffle,
        num_shards=num_shards, mode=mode, epoch=epoch, remainder=remainder))
    assert idx.shape == (num_shards, m, b) and idx.dtype == np.int32
    if remainder == "error":
      np.testing.assert_array_equal(np.sort(idx.ravel()),
                                    np.arange(num_rows))
    if mode == "local":
      for d in range(num_shards):
        p = _order(jax.random.fold_in(key, d), n, epoch, shuffle)
        np.testing.assert_array_equal(idx[d], d * n + _model(p, b, remainder))
    else:
      p = _order(key, num_rows, epoch, shuffle)
      np.testing.assert_array_equal(
          np.moveaxis(idx, 0, 1).reshape(-1, batch_size),
          _model(p, batch_size, remainder))


@pytest.mark.parametrize("remainder", ["drop", "wrap"])
@pytest.mark.parametrize("mode", ["global", "local"])
def test_remainder_modes_scan_the_indices_rows(remainder, mode,
                                               count_compiles):
  """Device d's minibatch j takes rows idx[d, j] % L_k of each field; a
  second eager call, with another key, compiles nothing."""
  n, b = D * 7, D * 3                   # 24 does not divide 56
  batch = {"x": np.arange(n, dtype=np.int32),
           "y": np.arange(16, dtype=np.int32)}
  key, mesh = jax.random.key(5), _mesh()
  sharded = jr.shard_rows(batch, mesh)

  def run(k):
    return jr.scan_minibatches(_rows_fn, 0, k, sharded, b, mesh=mesh,
                               mode=mode, num_epochs=2, remainder=remainder)

  _, outs = run(key)
  with count_compiles() as c:
    jax.block_until_ready(run(jax.random.key(6)))
  assert c.count == 0
  _, single = jr.scan_minibatches(_rows_fn, 0, key, batch, b, num_epochs=2,
                                  remainder=remainder)
  for e in range(2):
    idx = np.asarray(jr.minibatch_indices(
        key, n, b, num_shards=D, mode=mode, epoch=e,
        remainder=remainder))                 # [D, M, B/D] global rows
    np.testing.assert_array_equal(np.asarray(outs["x"])[:, e], idx)
    if mode == "global":
      np.testing.assert_array_equal(
          np.swapaxes(np.asarray(outs["x"])[:, e], 0, 1).reshape(-1, b),
          single["x"][e])
      np.testing.assert_array_equal(np.asarray(outs["y"])[:, e], idx % 16)


def _sgd_step(w, mb, pmean=None):
  """Linear regression of the actions on the obs; ``pmean`` averages the
  loss (``"loss"``) or the gradients (``"grads"``) over the devices."""
  def loss_fn(w):
    loss = jnp.mean((mb["obs"] @ w - mb["action"].astype(jnp.float32)) ** 2)
    return jax.lax.pmean(loss, "envs") if pmean == "loss" else loss
  loss, grads = jax.value_and_grad(loss_fn)(w)
  if pmean == "grads":
    grads, loss = jax.lax.pmean((grads, loss), "envs")
  return w - 0.1 * grads, loss


def _ppo_like_epoch(mode, check_vma=True):
  """Two training epochs on the 8 devices, gradients averaged."""
  step = functools.partial(_sgd_step, pmean="loss" if check_vma else "grads")
  return lambda w, key, state: jr.scan_minibatches(
      step, w, key, state, 16, mesh=_mesh(), mode=mode, num_epochs=2,
      check_vma=check_vma)


@pytest.mark.parametrize("check_vma", [True, False])
def test_averaged_gradients_equal_single_device_training(check_vma, rng_key):
  """Global mode + averaged gradients = single-device SGD on the same rows."""
  state, _ = _filled_state(num_envs=16, num_steps=4)
  w0 = jnp.full((3,), 0.5, jnp.float32)
  w, losses = jax.jit(_ppo_like_epoch("global", check_vma))(
      w0, rng_key, jr.shard(state, _mesh()))
  w_ref, losses_ref = jr.scan_minibatches(_sgd_step, w0, rng_key,
                                          _host(state), 16, num_epochs=2)
  _assert_sharding(w, _mesh(), P())
  np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(losses)[0], np.asarray(losses_ref),
                             rtol=1e-5)
  # The loss was averaged over devices: every device reports the same one.
  losses = np.asarray(losses)
  np.testing.assert_array_equal(losses, np.broadcast_to(losses[:1],
                                                        losses.shape))


def test_local_epoch_hlo_moves_no_data(rng_key):
  """The issue's acceptance check, on the compiled HLO of whole epochs."""
  state = jr.shard(_filled_state(num_envs=16, num_steps=8)[0], _mesh())
  w0 = jnp.zeros((3,), jnp.float32)
  ops = _collectives(_ppo_like_epoch("local"), w0, rng_key, state)
  assert not ops & set(MOVES_DATA), ops
  assert ops == {"all-reduce"}   # the gradient pmean, the user's choice
  assert "all-gather" in _collectives(_ppo_like_epoch("global"), w0,
                                      rng_key, state)
  # The minibatching alone (no gradients): no collective at all.
  assert _collectives(
      lambda s, k: jr.scan_minibatches(
          lambda c, mb: (c, mb["obs"].sum()), jnp.float32(0), k, s, 16,
          mesh=_mesh(), num_epochs=2), state, rng_key) == set()


_A64 = {"a": np.zeros((64, 1), np.float32)}


def _scan(batch, size, **kw):
  kw = {"mesh": _mesh(), **kw}
  return jr.scan_minibatches(_rows_fn, 0, jax.random.key(0), batch, size,
                             **kw)


def _obs_state(num_envs=16):
  return jr.register(jr.init(num_envs, 4), "obs")


@pytest.mark.parametrize("call, exc, match", [
    (lambda: jr.shard(_obs_state(12), _mesh(), "envs"), ValueError,
     r"shard: num_envs E = 12 is not divisible by the size 8 of mesh axis "
     r"'envs'.*8 or 16"),
    (lambda: jr.shard(_obs_state(), _mesh(), "batch"), ValueError,
     r"shard: `axis_name` 'batch' is not an axis of the mesh "
     r"\(axes: \('envs',\)\)"),
    (lambda: jr.shard(_obs_state(), _mesh(shape=(4, 2), names=("a", "b"))),
     ValueError, r"shard: the mesh has axes \('a', 'b'\); pass `axis_name=`"),
    (lambda: jr.shard(_obs_state(), "envs"), TypeError,
     r"shard: `mesh` must be a jax.sharding.Mesh"),
    (lambda: jr.shard({"obs": np.zeros((4, 16))}, _mesh()), TypeError,
     r"shard: `state` must be a RolloutState, got dict"),
    (lambda: jr.shard_rows({"obs": np.zeros((12, 3))}, _mesh()), ValueError,
     r"shard_rows: leaf \"\['obs'\]\" has 12 rows along axis 0, not "
     r"divisible by the size 8"),
    (lambda: jr.shard_rows({"r": np.zeros(8)}, _mesh(), dim=1), ValueError,
     r"shard_rows: .*shape \(8,\), with no axis 1"),
    *[(lambda dim=dim: jr.shard_rows(jnp.ones((8, 8)), _mesh(), dim=dim), exc,
       r"shard_rows: `dim`")
      for dim, exc in [(-1, ValueError), (True, TypeError), (1.0, TypeError)]],
    (lambda: _scan({"a": np.zeros((60, 1))}, 12), ValueError,
     r"scan_minibatches: field 'a' has L_k = 60 rows, not divisible by the "
     r"size D = 8 of mesh axis 'envs'"),
    (lambda: _scan(_A64, 12), ValueError, r"scan_minibatches: `batch_size` "
     r"B = 12 \(the global minibatch size\) is not divisible by the size "
     r"D = 8.*8 or 16"),
    (lambda: jr.scan_minibatches(
        lambda c, mb: (c + mb["obs"].sum(), None), jnp.float32(0),
        jax.random.key(0), jr.shard(_obs_state(), _mesh()), 16,
        mesh=_mesh()), ValueError, r"scan_minibatches: `fn` returned a carry "
     r"that varies across the devices of mesh axis 'envs'.*pmean"),
    (lambda: _scan(_obs_state(12), 8), ValueError,
     r"scan_minibatches: num_envs E = 12 is not divisible by the size 8"),
    (lambda: _scan(_A64, 8, mode="all"), ValueError, r"scan_minibatches: "
     r"`mode` must be 'local' or 'global', got 'all'"),
    (lambda: jr.scan_minibatches(_rows_fn, 0, None, _A64, 8, mesh=_mesh()),
     ValueError, r"scan_minibatches: `key` is None but shuffle=True"),
    (lambda: _scan(_A64, 8, mesh="envs"), TypeError,
     r"scan_minibatches: `mesh` must be a jax.sharding.Mesh"),
    (lambda: jr.minibatch_indices(None, 64, 8, num_shards=0), ValueError,
     r"minibatch_indices: `num_shards` must be positive"),
    (lambda: jr.minibatch_indices(None, 60, 8, num_shards=8,
                                  remainder="drop"), ValueError,
     r"minibatch_indices: the number of rows N = 60 is not divisible by the "
     r"size D = 8"),
    (lambda: jr.minibatch_indices(None, 64, 8, shuffle=False, num_shards=8,
                                  mode="all"), ValueError,
     r"minibatch_indices: `mode` must be 'local' or 'global'"),
    *[(lambda flag=flag: _scan(_A64, 8, check_vma=flag), TypeError,
       r"scan_minibatches: `check_vma`") for flag in NOT_BOOLS],
])
def test_errors(call, exc, match):
  with pytest.raises(exc, match="^" + match):
    call()


def test_a_two_axis_mesh_shards_over_both_axes(rng_key):
  """``axis=("a", "b")`` on a 4x2 mesh behaves as the 8-device 1-D axis."""
  state, _ = _filled_state(num_envs=16, num_steps=4)
  mesh2 = _mesh(shape=(4, 2), names=("a", "b"))
  sharded = jr.shard(state, mesh2, ("a", "b"))
  _assert_sharding(sharded.data["obs"], mesh2, P(None, ("a", "b")))
  _, outs = jr.scan_minibatches(
      _rows_fn, jnp.int32(0), rng_key, sharded, 16, mesh=mesh2,
      axis_name=("a", "b"), num_epochs=1)
  _, ref = jr.scan_minibatches(
      _rows_fn, jnp.int32(0), rng_key, jr.shard(state, _mesh()), 16,
      mesh=_mesh(), num_epochs=1)
  chex.assert_trees_all_equal(outs, ref)
  # Sharded over "a" only: 4 shards, each replicated over "b".
  _, outs_a = jr.scan_minibatches(
      _rows_fn, jnp.int32(0), rng_key, jr.shard(state, mesh2, "a"), 16,
      mesh=mesh2, axis_name="a", num_epochs=1)
  assert outs_a["obs"].shape[:4] == (4, 1, 4, 4)
  _assert_sharding(outs_a["obs"], mesh2, P("a"))


def _no_gloo(logs):
  missing = "gloo" in logs.lower() and "not" in logs.lower()
  return "CPU collectives (gloo) unavailable in jaxlib" if missing else None


def test_two_processes_with_jax_distributed_agree_with_one(tmp_path):
  """2 processes x 4 CPU devices (jax.distributed, gloo) = 1 x 8 devices."""
  run_workers(["tests._multihost_worker"],
              lambda i: [str(tmp_path / f"out{i}.json")], timeout=180,
              log_dir=tmp_path, skip_if=_no_gloo)
  results = [json.loads((tmp_path / f"out{i}.json").read_text())
             for i in range(2)]
  expected = _multihost_worker.compute(jax, jr, _mesh())
  for got in results:
    assert (got["process_count"], got["device_count"]) == (2, D)
    assert got["spec"] == expected["spec"] == str(P(None, "envs"))
    for mode in ("local", "global"):
      np.testing.assert_allclose(got[mode]["w"], expected[mode]["w"],
                                 rtol=1e-5)
      np.testing.assert_allclose(got[mode]["loss"], expected[mode]["loss"],
                                 rtol=1e-5)


@pytest.mark.usefixtures("standard_promotion")
def test_ppo_sharded_example_smoke(tmp_path):
  pytest.importorskip("gymnax")
  pytest.importorskip("optax")
  from examples import ppo_sharded  # noqa: PLC0415 - needs gymnax, optax
  summary = ppo_sharded.main(
      ["--total-steps", "2048", "--num-envs", "16", "--num-steps", "32",
       "--num-minibatches", "2", "--num-epochs", "2", "--chunks", "2",
       "--out", str(tmp_path)])
  assert summary["devices"] == D and summary["mode"] == "local"
  assert summary["finite_losses"]
  assert summary["updates"] == 4
  assert not set(summary["update_collectives"]) & set(MOVES_DATA)
  assert summary["rollout_sharding"] == str(P(None, "envs"))
