"""jrollout.torch: DLPack round trips both ways, copies and their reports,
the fast paths, TensorDicts and misuse, each checked against numpy."""

import gc
import logging
import re
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

import chex  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

import jrollout as jr  # noqa: E402
import jrollout.torch as jt  # noqa: E402
from jrollout.torch import exported_views_alive  # noqa: E402
from jrollout.torch import from_torch  # noqa: E402
from jrollout.torch import from_torch_copied  # noqa: E402
from jrollout.torch import to_torch  # noqa: E402
from jrollout.torch import to_torch_copied  # noqa: E402
from tests._misuse import assert_writer_applies_only_good_writes  # noqa: E402
from tests._misuse import assert_writes_refused_with_the_fix  # noqa: E402
from tests._misuse import call_named  # noqa: E402
from tests._misuse import E as MISUSE_E  # noqa: E402
from tests._misuse import NOT_BOOLS  # noqa: E402
from tests._misuse import T as MISUSE_T  # noqa: E402
from tests._misuse import WRITER_VALUES  # noqa: E402


def _dense_permuted(t):
  """Whether JAX imports `t` as it is: the strides of its dims longer than
  1, sorted, are a dense row-major array's."""
  dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
  dense = np.cumprod([1] + [n for _, n in dims])[:-1]
  return [s for s, _ in dims] == dense.tolist()


# torch dtype -> numpy integer dtype of the same width, for bit-exact checks.
DTYPES = {
    torch.float16: np.int16, torch.float32: np.int32, torch.float64: np.int64,
    torch.bfloat16: np.int16, torch.int8: np.int8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8,
    torch.bool: np.uint8,
}
WIDE = (torch.float64, torch.int64)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or jax.default_backend() != "gpu",
    reason="needs CUDA in torch and JAX's GPU backend")


def _x64(dtype):
  return jax.enable_x64(dtype in WIDE)


def _sample(dtype, shape=(3, 5)):
  n = int(np.prod(shape))
  if dtype == torch.bool:
    return (torch.arange(n) % 3 == 0).reshape(shape)
  if dtype.is_floating_point:
    t = torch.linspace(-3.5, 7.25, n, dtype=torch.float32).to(dtype)
    t[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
    return t.reshape(shape)
  info = torch.iinfo(dtype)
  t = torch.arange(n, dtype=torch.int64) * 7 - 3 * int(info.min < 0)
  t[0], t[1] = info.min, info.max
  return t.to(dtype).reshape(shape)


def _bits(x, dtype):
  """A numpy integer view of a tensor or array, for bit-exact comparison."""
  if isinstance(x, torch.Tensor):
    x = x.contiguous().cpu()
    if dtype == torch.bool:
      x = x.to(torch.uint8)
    return x.view(getattr(torch, np.dtype(DTYPES[dtype]).name)).numpy()
  return np.asarray(x).view(DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_zero_copy_both_ways_every_dtype(dtype):
  t = _sample(dtype)
  with _x64(dtype):
    a, copied = from_torch_copied(t, copy=False)
    assert not copied
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == tuple(t.shape)
    assert a.dtype == jnp.dtype(str(t.dtype).removeprefix("torch."))
    np.testing.assert_array_equal(_bits(a, dtype), _bits(t, dtype))
    own, copied = from_torch_copied(t, copy=True)
    assert copied and own.unsafe_buffer_pointer() != t.data_ptr()
    want = _bits(t, dtype).copy()
    t.zero_()   # the view sees the write, the copy does not
    np.testing.assert_array_equal(_bits(own, dtype), want)
    np.testing.assert_array_equal(_bits(a, dtype), _bits(t, dtype))
    # And back: an array JAX owns, exported without a copy.
    a = jnp.asarray(_bits(_sample(dtype), dtype)).view(
        str(dtype).removeprefix("torch."))
    t, copied = to_torch_copied(a, copy=False)
    assert not copied and t.dtype == dtype and tuple(t.shape) == a.shape
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(_bits(t, dtype), _bits(a, dtype))
    back = from_torch(t)
    assert back.unsafe_buffer_pointer() == a.unsafe_buffer_pointer()
    # copy=True: numpy's view cloned, or DLPack's where numpy lacks the dtype.
    fresh = jnp.copy(a)
    own, copied = to_torch_copied(fresh, copy=True)
    assert copied and own.dtype == dtype
    assert own.data_ptr() != fresh.unsafe_buffer_pointer()
    assert not exported_views_alive(fresh)   # the copy is no live export
    own.zero_() if dtype != torch.bool else own.logical_not_()
    np.testing.assert_array_equal(_bits(fresh, dtype), _bits(a, dtype))


@pytest.mark.parametrize("shape", [(), (0, 3), (1,), (2, 1, 3)], ids=str)
def test_round_trip_edge_shapes_bare_or_in_a_tree(shape):
  """A bare leaf converts as it does in a tree: shared, not copied."""
  t = torch.ones(shape, dtype=torch.float32)
  a, copied = from_torch_copied(t)
  assert a.shape == shape and not copied
  back, copied = to_torch_copied(a)
  tree, tree_copied = to_torch_copied({"a": a})
  assert copied is False and tree_copied == {"a": False}
  assert torch.equal(back, t) and torch.equal(tree["a"], t)
  assert exported_views_alive(a) == bool(a.size)
  if a.size:
    assert back.data_ptr() == tree["a"].data_ptr() == t.data_ptr()


@pytest.mark.parametrize("copy", [None, False])
def test_permuted_layout_imports_without_copy(copy):
  base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
  t = base.permute(2, 0, 1)
  a, copied = from_torch_copied(t, copy=copy)
  assert not copied and a.unsafe_buffer_pointer() == t.data_ptr()
  np.testing.assert_array_equal(np.asarray(a), t.numpy())
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x + 1)(a)),
                                t.numpy() + 1)
  back = to_torch(a)
  assert back.stride() == t.stride() and torch.equal(back, t)


@pytest.mark.parametrize("make", [lambda b: b[:, ::2], lambda b: b[:, 1:3],
                                  lambda b: b[:, :1].expand(4, 3)],
                         ids=["step", "slice", "broadcast"])
def test_strides_with_gaps_copy(make):
  t = make(torch.arange(32, dtype=torch.float32).reshape(4, 8))
  a, copied = from_torch_copied({"x": t})
  assert copied == {"x": True}
  np.testing.assert_array_equal(np.asarray(a["x"]), t.numpy())
  with pytest.raises(ValueError, match=r"from_torch: leaf \['x'\].*gaps"):
    from_torch({"x": t}, copy=False)


def test_allow_downcast_casts_explicitly():
  small = torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int64)
  floats = torch.tensor([0.1, -3e38, float("inf"), float("nan")],
                        dtype=torch.float64)
  tree = {"i": small, "f": floats}
  out, copied = from_torch_copied(tree, allow_downcast=True)
  assert copied == {"i": True, "f": True}
  assert out["i"].dtype == jnp.int32 and out["f"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out["i"]), small.numpy())
  np.testing.assert_array_equal(np.asarray(out["f"]),
                                floats.numpy().astype(np.float32))
  with pytest.raises(ValueError,
                     match=r"\['f'\].*float64 to torch.float32.*copy=False"):
    from_torch(tree, allow_downcast=True, copy=False)
  # The largest float32 itself, in float64, is kept.
  top = torch.tensor([float(np.finfo(np.float32).max)], dtype=torch.float64)
  np.testing.assert_array_equal(
      np.asarray(from_torch(top, allow_downcast=True)),
      np.array([np.finfo(np.float32).max], np.float32))


def test_nested_pytree_structure_and_passthrough():
  tree = {"a": {"b": torch.ones(2), "c": None},
          "d": (torch.zeros(3, dtype=torch.int32), [torch.ones(4)[1:], 1.5]),
          "e": 3, "f": "name"}
  out, copied = from_torch_copied(tree)
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(
      jax.tree_util.tree_map(lambda x: 0, tree))
  assert out["a"]["c"] is None and out["e"] == 3 and out["d"][1][1] == 1.5
  assert isinstance(out["d"][0], jax.Array)
  assert copied == {"a": {"b": False, "c": None},
                    "d": (False, [True, False]), "e": False, "f": False}
  back = to_torch(out)
  assert isinstance(back["d"][1][0], torch.Tensor) and back["f"] == "name"
  assert torch.equal(back["d"][1][0], torch.ones(3))


def test_sharded_arrays():
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices (tests/conftest.py sets XLA_FLAGS)")
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  x = jnp.arange(8.0, dtype=jnp.float32)
  sharded = jax.device_put(x, NamedSharding(mesh, P("d")))
  with pytest.raises(ValueError, match=r"leaf \['s'\].*sharded over 2"):
    to_torch({"s": sharded})
  with pytest.raises(ValueError, match=r"leaf \(the tree itself\).*sharded"):
    to_torch(sharded)   # bare: the same check
  replicated = jax.device_put(x, NamedSharding(mesh, P()))
  t, copied = to_torch_copied(replicated)
  assert not copied and torch.equal(t, torch.arange(8.0))
  assert t.data_ptr() == replicated.addressable_data(0).unsafe_buffer_pointer()


def test_donation_skipped_while_exported_view_alive():
  x = jnp.arange(64.0, dtype=jnp.float32)
  view = to_torch(x)[8:]
  gc.collect()  # The full tensor is gone; its slice keeps the storage.
  assert exported_views_alive(x)
  donate = jax.jit(lambda a: a * 2, donate_argnums=0)
  donate(x)
  assert not x.is_deleted()  # JAX skipped the donation, silently.
  assert float(view[0]) == 8.0
  del view
  gc.collect()
  assert not exported_views_alive(x)
  donate(x)
  assert x.is_deleted() and not exported_views_alive(x)


@pytest.mark.parametrize("copy", [None, True, False])
def test_tensors_without_dense_data_are_refused(copy):
  """Meta, sparse, quantized, nested: a TypeError naming leaf and fix."""
  with warnings.catch_warnings():   # torch: CSR (beta), nested (prototype)
    warnings.simplefilter("ignore")
    cases = [
        (torch.empty(3, device="meta"), r"is on the meta device.*no data"),
        (torch.eye(3).to_sparse(), r"has layout torch.sparse_coo.*to_dense"),
        (torch.eye(3).to_sparse_csr(),
         r"has layout torch.sparse_csr.*to_dense"),
        (torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
         r"is quantized.*dequantize\(\)"),
        (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
         r"is a nested \(ragged\) tensor.*unbind"),
    ]
  for t, match in cases:
    with pytest.raises(TypeError, match=r"^from_torch: leaf \['m'\] " + match):
      from_torch({"m": t, "ok": torch.ones(2)}, copy=copy)


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       data=st.data())
def test_property_layouts(shape, data):
  base = torch.arange(int(np.prod(shape)) * 4, dtype=torch.float32)
  offset = data.draw(st.integers(0, 3), label="offset")
  t = base[offset:offset + int(np.prod(shape))].reshape(shape)
  t = t.permute(*data.draw(st.permutations(range(len(shape))), label="perm"))
  step = data.draw(st.integers(1, 2), label="step")
  t = t[(slice(None, None, step),)]
  a, copied = from_torch_copied(t)
  np.testing.assert_array_equal(np.asarray(a), t.numpy())
  assert copied == (a.unsafe_buffer_pointer() != t.data_ptr())
  assert copied == (offset != 0 or not _dense_permuted(t))


# --- CUDA (issue 19): run by benchmarks/gpu/check.sh on a GPU machine.


def _busy_torch_stream():
  """Keeps torch's current CUDA stream busy for milliseconds: a missing
  synchronisation then shows as stale or half-written values."""
  if hasattr(torch.cuda, "_sleep"):
    torch.cuda._sleep(20_000_000)   # GPU clock cycles: about 10 ms
  else:
    x = torch.ones(2048, 2048, device="cuda")
    for _ in range(16):
      x = torch.tanh(x @ x)


@needs_cuda
def test_cuda_zero_copy_both_ways_by_device_pointer():
  t = torch.arange(64 * 64, dtype=torch.float32, device="cuda").reshape(64, 64)
  a, copied = from_torch_copied(t, copy=False)
  assert not copied and a.unsafe_buffer_pointer() == t.data_ptr()
  assert {d.platform for d in a.devices()} == {"gpu"}
  y = jnp.sin(a) * 2   # a buffer JAX owns, on the GPU
  back, copied = to_torch_copied(y, copy=False)
  assert not copied and back.device == t.device
  assert back.data_ptr() == y.unsafe_buffer_pointer()
  torch.testing.assert_close(back, torch.sin(t) * 2)
  again, copied = from_torch_copied(back)
  assert not copied
  assert again.unsafe_buffer_pointer() == y.unsafe_buffer_pointer()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.int64],
                         ids=str)
def test_cuda_dtypes_zero_copy_bit_exact(dtype):
  t = _sample(dtype).cuda()
  with _x64(dtype):
    a, copied = from_torch_copied(t, copy=False)
    assert not copied and a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    np.testing.assert_array_equal(_bits(a, dtype), _bits(t, dtype))
    owned = jnp.copy(a)
    back, copied = to_torch_copied(owned, copy=False)
    assert not copied and back.dtype == dtype and back.is_cuda
    assert back.data_ptr() == owned.unsafe_buffer_pointer()
    np.testing.assert_array_equal(_bits(back, dtype), _bits(t, dtype))


@needs_cuda
@pytest.mark.parametrize("side_stream", [False, True], ids=["default", "side"])
def test_cuda_from_torch_waits_for_torchs_stream(side_stream):
  stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
  with torch.cuda.stream(stream):
    t = torch.zeros(1 << 22, device="cuda")
    _busy_torch_stream()
    t.fill_(3.0)   # queued behind ~10 ms of work
    a = from_torch(t)   # inside the block: torch's current stream is `stream`
  assert float(jnp.min(a)) == float(jnp.max(a)) == 3.0


@needs_cuda
def test_cuda_to_torch_waits_for_jax():
  x = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.float32)
  y = x
  for _ in range(4):   # dispatched asynchronously; milliseconds of work
    y = jnp.tanh(y @ x / 64.0)
  t = to_torch(y)
  got = float(t.double().sum())   # a torch kernel, queued at once
  want = float(np.asarray(y, np.float64).sum())
  assert got == pytest.approx(want, rel=1e-9, abs=1e-6)


@needs_cuda
def test_cuda_torch_write_after_export_does_not_race_jax():
  t = torch.ones(1 << 22, device="cuda")
  kept = from_torch(t, copy=True)   # a snapshot, cloned on torch's stream
  shared = from_torch(t)            # zero-copy: aliases t
  total = jax.block_until_ready(jnp.sum(shared))
  _busy_torch_stream()
  t.fill_(2.0)                      # torch writes after the exports
  assert float(jnp.min(kept)) == float(jnp.max(kept)) == 1.0
  assert float(total) == float(1 << 22)
  torch.cuda.synchronize()          # the write is done: the alias sees it
  assert float(jnp.min(shared)) == float(jnp.max(shared)) == 2.0


@needs_cuda
def test_cuda_writer_keeps_steps_of_a_buffer_torch_overwrites():
  """A simulator reusing one output tensor: with copy=True each step the
  writer queues is a snapshot that torch's later in-place writes miss."""
  num_envs, num_steps, dim = 256, 12, 8
  writer = jr.RolloutWriter(
      jr.register(jr.init(num_envs, num_steps), "obs", (dim,)), flush_every=4)
  buf = torch.empty((num_envs, dim), device="cuda")
  for step in range(num_steps):
    _busy_torch_stream()
    buf.fill_(float(step))   # the simulator overwrites its buffer in place
    writer.update_at(step, {"obs": from_torch(buf, copy=True)})
  obs = np.asarray(writer.state.data["obs"])
  want = np.broadcast_to(np.arange(num_steps, dtype=np.float32)[:, None, None],
                         obs.shape)
  np.testing.assert_array_equal(obs, want)


def test_bridge_stays_silent_and_never_imports_tensordict():
  """Warnings as errors: no read-only warning, tensordict never imported."""
  code = (
      "import sys, jax.numpy as jnp, torch\n"
      "from jrollout.torch import from_torch, to_torch_copied\n"
      "x = jnp.arange(6.0)\n"
      "t, copied = to_torch_copied({'x': x})\n"
      "assert not copied['x']\n"
      "assert t['x'].data_ptr() == x.unsafe_buffer_pointer()\n"
      "assert torch.equal(t['x'], torch.arange(6.0))\n"
      "from_torch({'a': torch.ones(2)})\n"
      "assert 'tensordict' not in sys.modules, 'imported'\n")
  result = subprocess.run([sys.executable, "-W", "error", "-c", code],
                          capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr


def test_copies_are_reported_with_the_leaf_path_once_the_call_succeeds(
    caplog):
  t = aligned((4, 4))
  odd = torch.arange(20, dtype=torch.float32)[1:17]
  assert odd.data_ptr() % 64 != 0
  gone = jnp.arange(3.0)
  gone.delete()
  with caplog.at_level(logging.DEBUG, logger="jrollout.torch"):
    with pytest.raises(TypeError, match=r"leaf \['b'\] has dtype torch.int64"):
      from_torch({"a": t, "b": t.long()}, copy=True)
    with pytest.raises(ValueError, match=r"leaf \['b'\] requires grad"):
      from_torch({"a": t[:, ::2], "b": torch.ones(2, requires_grad=True)})
    with pytest.raises(ValueError,
                       match=r"to_torch: leaf \['a'\]\[1\] is a deleted"):
      to_torch({"a": [jnp.ones(2), gone], "b": None}, copy=True)
    from_torch({"obs": t, "r": t[0]}, copy=True)
    from_torch({"obs": t}, copy=None)
    from_torch([odd])
    to_torch({"z": 1, "a": {"b": jnp.arange(3.0)}}, copy=True)
  assert {r.name for r in caplog.records} == {"jrollout.torch"}
  messages = [r.getMessage() for r in caplog.records]
  assert messages[:2] == ["from_torch: leaf ['obs'] was copied (copy=True)",
                          "from_torch: leaf ['r'] was copied (copy=True)"]
  assert messages[2].startswith("from_torch: leaf [0] was copied (data_ptr "
                                "% 64 = ")
  assert messages[3:] == ["to_torch: leaf ['a']['b'] was copied (copy=True)"]


@pytest.mark.parametrize("fn, flag", [
    ("to_torch", "copy"), ("from_torch_copied", "copy"),
    ("from_torch", "detach"), ("from_torch", "allow_downcast")])
def test_flags_that_are_not_bools_are_refused(fn, flag):
  arg = jnp.zeros(2) if fn == "to_torch" else torch.zeros(2)
  allowed = "None, True or False" if flag == "copy" else "True or False"
  for value in NOT_BOOLS + ([] if flag == "copy" else [None]):
    got = re.escape(f"{type(value).__name__} {value!r}")
    with pytest.raises(TypeError, match=rf"^{fn}: `{flag}` must be "
                       rf"{allowed}, got {got}$"):
      getattr(jt, fn)(arg, **{flag: value})
  # numpy bools mean their bool.
  x = jnp.arange(4.0)
  t, copied = to_torch_copied(x, copy=np.True_)
  assert copied and t.tolist() == [0.0, 1.0, 2.0, 3.0]
  assert not to_torch_copied(x, copy=np.False_)[1]
  a, copied = from_torch_copied(torch.arange(4.0), copy=np.True_,
                                detach=np.False_)
  assert copied and a.tolist() == [0.0, 1.0, 2.0, 3.0]


# --- from_torch's fast paths -------------------------------------------------

def aligned(shape, dtype=torch.float32):
  t = torch.arange(int(np.prod(shape))).reshape(shape).to(dtype)
  assert t.data_ptr() % 64 == 0   # torch's CPU allocator aligns to 64
  return t


@given(rows=st.integers(0, 300), cols=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.int32, torch.bool,
                              torch.uint8]),
       copy=st.sampled_from([None, True, False]),
       as_dict=st.booleans())
def test_property_values_and_sharing(rows, cols, dtype, copy, as_dict):
  t = (torch.arange(rows * cols).reshape(rows, cols) % 7).to(dtype)
  want = t.numpy().copy()
  tree = {"x": t} if as_dict else t
  got, copied = from_torch_copied(tree, copy=copy)
  a, c = (got["x"], copied["x"]) if as_dict else (got, copied)
  assert c == bool(copy) and a.shape == (rows, cols)
  np.testing.assert_array_equal(np.asarray(a), want)
  if rows and not copy:
    assert a.unsafe_buffer_pointer() == t.data_ptr()
  if copy:
    t.zero_() if dtype != torch.bool else t.logical_not_()
    np.testing.assert_array_equal(np.asarray(a), want)


def test_views_and_copies_land_on_one_device_and_run_under_jit():
  # The copy is pinned to the tensors' CPU device and committed there, as a
  # DLPack import is (8 fake CPU devices in this suite: device 0).
  t = aligned((8, 4))
  view, copy = from_torch(t), from_torch(t, copy=True)
  cpu0 = jax.devices("cpu")[0]
  for a in (view, copy):
    assert a.committed and a.devices() == {cpu0}
  np.testing.assert_array_equal(jax.jit(lambda x, y: x + y)(view, copy),
                                2 * t.numpy())
  tree = from_torch({"a": t, "b": t[0], "c": t.bool()}, copy=True)
  assert {d for a in tree.values() for d in a.devices()} == {cpu0}
  assert tree["c"].dtype == jnp.bool_


def _mixed_tree():
  """Leaves of every route (fast, grad, gaps, permuted, misaligned, cast,
  negative bit) and ones that pass through."""
  t = aligned((8, 4))
  w = torch.ones(5, requires_grad=True)
  return {"fast": t, "flag": t[0] > 1, "grad": w, "gaps": t[:, ::2],
          "perm": t.T, "odd": torch.arange(20, dtype=torch.float32)[1:17],
          "neg": torch._neg_view(t), "wide": t.double(), "np": np.ones(3),
          "n": None, "s": 1.5}


@pytest.mark.parametrize("copy", [None, True])
def test_copy_true_copies_the_fast_leaves_in_one_dispatch(monkeypatch, copy):
  """copy=True: the leaves numpy can view copied by one jitted call."""
  calls = []
  real = jt._copy_jit

  def counting(views):
    calls.append(len(views))
    return real(views)

  monkeypatch.setattr(jt, "_copy_jit", counting)
  tree = _mixed_tree()
  out, copied = from_torch_copied(tree, copy=copy, detach=True,
                                  allow_downcast=True)
  assert calls == ([5] if copy else [])   # fast, flag, gaps, perm, odd
  assert copied == {"fast": bool(copy), "flag": bool(copy),
                    "grad": bool(copy), "gaps": True, "perm": bool(copy),
                    "odd": True, "neg": True, "wide": True, "np": False,
                    "n": None, "s": False}
  assert out["np"] is tree["np"] and out["n"] is None and out["s"] == 1.5
  for key in ("fast", "flag", "grad", "gaps", "perm", "odd", "neg"):
    np.testing.assert_array_equal(np.asarray(out[key]),
                                  tree[key].detach().resolve_neg().numpy())
    if copy:
      assert out[key].unsafe_buffer_pointer() != tree[key].data_ptr()
  np.testing.assert_array_equal(np.asarray(out["wide"]),
                                tree["wide"].numpy().astype(np.float32))
  if not copy:   # the views, detached ones too, share the tensors' memory
    for key in ("fast", "flag", "grad", "perm"):
      assert out[key].unsafe_buffer_pointer() == tree[key].data_ptr()
  with pytest.raises(ValueError, match=r"^from_torch: leaf \['odd'\] needs a "
                     r"copy \(data_ptr % 64 = \d+: .*aligned.*copy=False"):
    from_torch({"fast": tree["fast"], "odd": tree["odd"]}, copy=False)
  assert from_torch({}, copy=copy) == {}
  assert from_torch_copied([None], copy=copy) == ([None], [None])


# --- TensorDicts and unknown leaves ------------------------------------------

tensordict = pytest.importorskip("tensordict")
TD_E = 4


def _groups():
  gen = torch.Generator().manual_seed(0)
  return tensordict.TensorDict(
      {"policy": torch.randn(TD_E, 48, generator=gen),
       "critic": torch.randn(TD_E, 60, generator=gen),
       "extras": {"time_outs": torch.tensor([0, 1, 0, 0], dtype=torch.bool)}},
      batch_size=(TD_E,))


def _shares(array, tensor):
  return np.shares_memory(np.asarray(array), tensor.numpy())


@pytest.mark.parametrize("where", ["bare", "nested"])
def test_from_torch_converts_a_tensordict_sharing_memory(where):
  td = _groups()
  tree = td if where == "bare" else {"obs": td, "reward": torch.ones(TD_E)}
  out, copied = from_torch_copied(tree, batch_size=(TD_E,))
  groups = out if where == "bare" else out["obs"]
  assert isinstance(groups, dict) and set(groups) == {
      "policy", "critic", "extras"}
  for name in ("policy", "critic"):
    assert isinstance(groups[name], jax.Array)
    np.testing.assert_array_equal(groups[name], td[name].numpy())
    assert _shares(groups[name], td[name])
  np.testing.assert_array_equal(groups["extras"]["time_outs"],
                                [False, True, False, False])
  assert not any(jax.tree_util.tree_leaves(copied))
  if where == "nested":
    np.testing.assert_array_equal(out["reward"], np.ones(TD_E, np.float32))
    before = td.clone()
    with pytest.raises(ValueError, match=r"^from_torch: TensorDict \['obs'\] "
                       r"has batch size \(4,\); expected batch_size=\(8,\)$"):
      from_torch(tree, batch_size=(8,))
    assert (td == before).all()
  own, copied = from_torch_copied(td, copy=True)
  assert all(jax.tree_util.tree_leaves(copied))
  assert not _shares(own["policy"], td["policy"])
  np.testing.assert_array_equal(own["critic"], td["critic"].numpy())


def test_to_torch_output_builds_a_tensordict_that_round_trips():
  """to_torch's dict makes a TensorDict that from_torch reads back, shared."""
  tree = {"policy": jnp.arange(TD_E * 3, dtype=jnp.float32).reshape(TD_E, 3),
          "critic": {"priv": jnp.ones((TD_E, 2), jnp.int32)}}
  groups = tensordict.TensorDict(to_torch(tree), batch_size=(TD_E,))
  assert _shares(tree["policy"], groups["policy"])
  back = from_torch(groups, batch_size=(TD_E,))
  chex.assert_trees_all_equal(back, tree)
  assert back["policy"].unsafe_buffer_pointer() == (
      tree["policy"].unsafe_buffer_pointer())


# --- Misuse ------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["update_at", "writer", "update_all"])
def test_torch_tensors_are_refused_with_the_fix(entry):
  assert_writes_refused_with_the_fix(entry, lambda lead: [
      (torch.ones(lead), r"torch.Tensor.*t\.numpy\(\).*from_torch")])


@settings(max_examples=15)
@given(ops=st.lists(st.tuples(st.integers(-1, MISUSE_T), st.sampled_from(
    [*WRITER_VALUES, "torch"])), max_size=12),
       flush_every=st.integers(1, 4))
def test_writer_failures_with_torch_tensors_leave_the_queue_as_it_was(
    ops, flush_every):
  assert_writer_applies_only_good_writes(
      ops, flush_every, {**WRITER_VALUES, "torch": torch.ones(MISUSE_E)},
      refused={"shape", "torch"})


NAMED_ERRORS = [
    ("take", TypeError, lambda: jr.take({"x": torch.ones(4)}, np.arange(2))),
    ("minibatch_indices", TypeError, lambda: jr.minibatch_indices(
        torch.ones(2), 4, 2)),
    ("shard_rows", TypeError, lambda: jr.shard_rows(
        {"x": torch.ones(8)}, jax.make_mesh((jax.device_count(),), ("d",)))),
    ("register", TypeError, lambda: jr.register(
        jr.init(MISUSE_E, MISUSE_T), "x", dtype=torch.float32)),
    ("init_running_stats", TypeError,
     lambda: jr.init_running_stats(dtype=torch.ones(2))),
]


@pytest.mark.parametrize("fn, exc, call", NAMED_ERRORS,
                         ids=[f"{fn}-{i}" for i, (fn, _, _) in
                              enumerate(NAMED_ERRORS)])
def test_torch_arguments_now_name_the_function(fn, exc, call):
  _, err = call_named(fn, call)
  assert isinstance(err, exc), err


# --- Refusals: each names the function, the leaf and the fix ----------------

class _Opaque:
  pass


def _deleted():
  gone = jnp.ones(3)
  gone.delete()
  return gone


_BIG = torch.arange(4, dtype=torch.int64) + 2**40
_HUGE = torch.tensor([0.5, float("inf"), 1e300], dtype=torch.float64)
_INF = r"has finite torch.(float64|complex128) .*magnitude up to 1e\+300"
_UNKNOWN = [(_Opaque(), "_Opaque"), ({1, 2}, "builtins.set"),
            (range(3), "builtins.range")]
REFUSED = [
    *[(lambda c=c: from_torch({"w": torch.ones(3, requires_grad=True)},
                              copy=c), ValueError,
       r"^from_torch: leaf \['w'\] requires grad; call `\.detach\(\)`")
      for c in (None, True)],
    (lambda: from_torch({"a": _BIG}), TypeError,
     r"^from_torch: leaf \['a'\] has dtype torch.int64.*allow_downcast=True"),
    (lambda: from_torch({"a": _BIG.double()}), TypeError,
     r"^from_torch: leaf \['a'\] has dtype torch.float64.*jax_enable_x64"),
    (lambda: from_torch({"a": _BIG}, allow_downcast=True), ValueError,
     r"^from_torch: leaf \['a'\] has torch.int64 values.*outside.*int32"),
    (lambda: from_torch({"a": _HUGE}, allow_downcast=True), ValueError,
     r"^from_torch: leaf \['a'\] " + _INF),
    (lambda: from_torch({"a": _HUGE.to(torch.complex128)},
                        allow_downcast=True), ValueError,
     r"^from_torch: leaf \['a'\] " + _INF),
    (lambda: from_torch({"neg": torch._neg_view(aligned((4, 4)))},
                        copy=False), ValueError,
     r"^from_torch: leaf \['neg'\] needs a copy \(its negative or conjugate "
     r"bit resolved\), but copy=False"),
    (lambda: from_torch(_groups(), batch_size=4), TypeError,
     r"^from_torch: `batch_size` must be a sequence of non-negative ints"),
    (lambda: from_torch({"obs": tensordict.LazyStackedTensorDict.lazy_stack(
        [_groups()[0], _groups()[1]])}), TypeError,
     r"^from_torch: leaf \['obs'\] is a LazyStackedTensorDict.*call "
     r"`\.contiguous\(\)` first"),
    *[(lambda x=x: from_torch({"x": x, "t": torch.ones(2)}), TypeError,
       rf"^from_torch: leaf \['x'\] is a .*{name}, which the bridge does not "
       "know") for x, name in _UNKNOWN],
    *[(lambda x=x: to_torch({"x": x, "a": jnp.ones(2)}), TypeError,
       rf"^to_torch: leaf \['x'\] is a .*{name}, which the bridge does not "
       "know") for x, name in _UNKNOWN],
    (lambda: jax.jit(to_torch)(jnp.ones(2)), TypeError,
     r"^to_torch: leaf \(the tree itself\) is a tracer"),
    (lambda: to_torch(_deleted()), ValueError,
     r"^to_torch: leaf \(the tree itself\) is a deleted"),
    (lambda: to_torch({"k": jax.random.key(0)}), TypeError,
     r"^to_torch: leaf \['k'\] has dtype key<fry>.*key_data"),
]


@pytest.mark.parametrize("call, exc, match", REFUSED)
def test_refusals_name_the_function_the_leaf_and_the_fix(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
