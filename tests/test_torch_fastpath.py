"""from_torch's fast paths: what they share, what they copy, what they report.

``copy=None`` shares every tensor that can be shared, small ones included
(the aliasing is the contract, whatever the size); ``copy=True`` returns
independent memory, through numpy on the CPU.
"""

import logging

from hypothesis import given
from hypothesis import strategies as st
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jrollout.torch import from_torch  # noqa: E402
from jrollout.torch import from_torch_copied  # noqa: E402

SIZES = [(1024, 4), (1024, 64), (4096, 4), (4096, 64), (4096, 512)]


def aligned(shape, dtype=torch.float32):
  t = torch.arange(int(np.prod(shape))).reshape(shape).to(dtype)
  assert t.data_ptr() % 64 == 0   # torch's CPU allocator aligns to 64
  return t


@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_copy_none_shares_every_size(shape):
  t = aligned(shape)
  a, copied = from_torch_copied(t)
  assert not copied and a.unsafe_buffer_pointer() == t.data_ptr()
  t[0, 0] = -1.0   # the JAX array sees the tensor's writes
  assert float(a[0, 0]) == -1.0
  tree, copied = from_torch_copied({"a": t, "b": [t[16:32]], "c": None,
                                    "d": 3})
  assert copied == {"a": False, "b": [False], "c": None, "d": False}
  assert tree["c"] is None and tree["d"] == 3
  assert tree["b"][0].unsafe_buffer_pointer() == t[16:32].data_ptr()


@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_copy_true_is_independent_every_size(shape):
  t = aligned(shape)
  want = t.numpy().copy()
  a, copied = from_torch_copied(t, copy=True)
  assert copied and a.unsafe_buffer_pointer() != t.data_ptr()
  t.add_(1)
  np.testing.assert_array_equal(np.asarray(a), want)
  assert a.dtype == jnp.float32 and a.shape == shape


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8,
                                   torch.int16, torch.int32, torch.float16,
                                   torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("copy", [None, True])
def test_dtypes_both_ways(dtype, copy):
  t = (torch.arange(96) % 5).reshape(8, 12).to(dtype)
  want = t.float().numpy().copy()
  a, copied = from_torch_copied(t, copy=copy)
  assert copied == bool(copy)
  assert (a.unsafe_buffer_pointer() == t.data_ptr()) == (not copy)
  t.zero_()
  got = np.asarray(a.astype(jnp.float32))
  if copy:
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_array_equal(got, 0.0)


def test_copy_true_of_strided_and_grad_tensors():
  base = torch.arange(32, dtype=torch.float32).reshape(4, 8)
  for t in (base[:, ::2], base.T, base[1:3]):
    a = from_torch(t, copy=True)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert a.unsafe_buffer_pointer() != t.data_ptr()
  w = torch.ones(4, requires_grad=True)
  with pytest.raises(ValueError, match=r"requires grad"):
    from_torch(w, copy=True)
  np.testing.assert_array_equal(from_torch(w, copy=True, detach=True), 1.0)


def test_copies_are_reported_with_the_leaf_path(caplog):
  t = aligned((4, 4))
  with caplog.at_level(logging.DEBUG, logger="jrollout.torch"):
    from_torch({"obs": t, "r": t[0]}, copy=True)
    from_torch({"obs": t}, copy=None)
  assert [r.getMessage() for r in caplog.records] == [
      "from_torch: leaf ['obs'] was copied (copy=True)",
      "from_torch: leaf ['r'] was copied (copy=True)"]


def test_a_leaf_off_the_fast_path_leaves_the_others_on_it():
  t = aligned((16,))
  odd = torch.arange(20, dtype=torch.float32)[1:17]   # misaligned: copied
  tree, copied = from_torch_copied({"a": t, "b": odd, "c": t.double()},
                                   allow_downcast=True)
  assert copied == {"a": False, "b": True, "c": True}
  assert tree["a"].unsafe_buffer_pointer() == t.data_ptr()
  assert tree["c"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(tree["b"]), odd.numpy())


def test_copy_true_of_trees_the_all_tensor_copy_refuses():
  """copy=True trees with a leaf the one-dispatch copy must not take."""
  t = aligned((4, 4))
  arr = np.ones(3)
  tree, copied = from_torch_copied({"t": t, "np": arr, "n": None, "s": 2.5},
                                   copy=True)
  assert tree["np"] is arr and tree["n"] is None and tree["s"] == 2.5
  assert copied == {"t": True, "np": False, "n": None, "s": False}
  neg = torch._neg_view(t)   # numpy() and DLPack refuse the neg bit
  for copy in (None, True):
    np.testing.assert_array_equal(
        np.asarray(from_torch({"a": t, "neg": neg}, copy=copy)["neg"]),
        -t.numpy())
  with pytest.raises(ValueError, match=r"leaf \['neg'\] has its negative"):
    from_torch({"a": t, "neg": neg}, copy=False)
  with pytest.raises(TypeError, match=r"leaf \['b'\] has dtype torch.int64"):
    from_torch({"a": t, "b": t.long()}, copy=True)
  got = from_torch({"a": t, "b": t.long()}, copy=True, allow_downcast=True)
  assert got["b"].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got["b"]), t.numpy())
  assert from_torch({}, copy=True) == {}
  assert from_torch_copied([None], copy=True) == ([None],
                                                               [None])


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


def test_result_is_usable_under_jit():
  t = aligned((8, 4))
  a, b = from_torch(t), from_torch(t, copy=True)
  np.testing.assert_array_equal(jax.jit(lambda x, y: x + y)(a, b),
                                2 * t.numpy())


def test_copies_land_where_views_do():
  # The copy is pinned to the tensors' CPU device and committed there, as a
  # DLPack import is (8 fake CPU devices in this suite: device 0).
  t = aligned((8, 4))
  view, copy = from_torch(t), from_torch(t, copy=True)
  cpu0 = jax.devices("cpu")[0]
  for a in (view, copy):
    assert a.committed and a.devices() == {cpu0}
  tree = from_torch({"a": t, "b": t[0], "c": t.bool()}, copy=True)
  assert {d for a in tree.values() for d in a.devices()} == {cpu0}
  assert tree["c"].dtype == jnp.bool_


def _mixed_tree():
  """Leaves of every route: fast, detached, strided, misaligned, downcast."""
  t = aligned((8, 4))
  w = torch.ones(5, requires_grad=True)
  return {"fast": t, "flag": t[0] > 1, "grad": w, "gaps": t[:, ::2],
          "odd": torch.arange(20, dtype=torch.float32)[1:17],
          "wide": t.double(), "n": None, "s": 1.5}


@pytest.mark.parametrize("copy", [None, True])
def test_each_leaf_is_decided_once(monkeypatch, copy):
  """One walk: _plan_import runs once per tensor leaf, whatever its route,
  and copy=True's fast leaves (detached ones too) share one jitted copy."""
  import jrollout.torch as jt   # noqa: PLC0415
  plans, batches = [], []
  real_plan, real_copy = jt._plan_import, jt._copy_views

  def plan(tree, i, t, *args):
    plans.append(i)
    return real_plan(tree, i, t, *args)

  def copy_views(views):
    batches.append(len(views))
    return real_copy(views)

  monkeypatch.setattr(jt, "_plan_import", plan)
  monkeypatch.setattr(jt, "_copy_views", copy_views)
  tree = _mixed_tree()
  out, copied = from_torch_copied(tree, copy=copy, detach=True,
                                  allow_downcast=True)
  leaves = jax.tree_util.tree_leaves(tree)
  tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
  assert sorted(plans) == tensors
  # copy=True: fast, flag (bool), grad (detached), gaps and odd (numpy
  # copies any strides and alignment) go in one dispatch; wide is cast.
  assert batches == ([5] if copy else [])
  want_copied = {"fast": bool(copy), "flag": bool(copy), "grad": bool(copy),
                 "gaps": True, "odd": True, "wide": True, "n": None,
                 "s": False}
  assert copied == want_copied
  for key in ("fast", "flag", "grad", "gaps", "odd"):
    np.testing.assert_array_equal(np.asarray(out[key]),
                                  tree[key].detach().numpy())
  np.testing.assert_array_equal(np.asarray(out["wide"]),
                                tree["wide"].numpy().astype(np.float32))


def test_copy_false_refuses_a_misaligned_tensor_before_importing(monkeypatch):
  """copy=False and misaligned CPU data: refused before JAX copies it."""
  calls = []
  real = jax.dlpack.from_dlpack

  def counting(t, **kwargs):
    calls.append(t)
    return real(t, **kwargs)

  monkeypatch.setattr(jax.dlpack, "from_dlpack", counting)
  odd = torch.arange(20, dtype=torch.int8)[1:17]
  with pytest.raises(ValueError, match=r"^from_torch: leaf \['o'\] has "
                     r"data_ptr % 64 = \d+; .*aligned.*copy=False"):
    from_torch({"a": aligned((4,)), "o": odd}, copy=False)
  assert len(calls) == 1   # the aligned leaf only
  got, copied = from_torch_copied({"o": odd})
  assert copied == {"o": True}
  np.testing.assert_array_equal(np.asarray(got["o"]), odd.numpy())


def test_a_failed_call_logs_no_copy(caplog):
  """Copies are reported once the call succeeded: a leaf that raises later
  leaves no record of the earlier leaves' copies."""
  t = aligned((4, 4))
  with caplog.at_level(logging.DEBUG, logger="jrollout.torch"):
    with pytest.raises(TypeError, match=r"leaf \['b'\] has dtype torch.int64"):
      from_torch({"a": t, "b": t.long()}, copy=True)
    with pytest.raises(ValueError, match=r"leaf \['b'\] requires grad"):
      from_torch({"a": t[:, ::2], "b": torch.ones(2, requires_grad=True)})
  assert caplog.records == []
