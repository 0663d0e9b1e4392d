"""Donation in jr.update_at_inplace; the warning when a torch view blocks it."""

import gc
import warnings

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import jrollout as jr  # noqa: E402
from jrollout import _buffer  # noqa: E402
from jrollout.torch import exported_views_alive  # noqa: E402
from jrollout.torch import to_torch  # noqa: E402

E, T = 3, 4
MATCH = (r"update_at_inplace: the storage of \['x'\] was copied, "
         r"not updated in place")


@pytest.fixture(autouse=True)
def _arm_warning(monkeypatch):
  # The warning is emitted once per process; re-arm it for every test.
  monkeypatch.setattr(_buffer, "_donation_warned", False)


def _row(value):
  return np.full((E, 2), value, np.float32)


def _expected(*values):
  """The ``[T, E, 2]`` storage after writing ``values`` at steps 0, 1, ..."""
  out = np.zeros((T, E, 2), np.float32)
  for t, value in enumerate(values):
    out[t] = value
  return out


def _state_after_step0():
  state = jr.register(jr.init(num_envs=E, num_steps=T), "x", (2,))
  return jr.update_at_inplace(state, 0, {"x": _row(1.0)})


def test_no_warning_and_donated_without_views():
  state = jr.register(jr.init(num_envs=E, num_steps=T), "x", (2,))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for t in range(T):
      old = state
      state = jr.update_at_inplace(state, t, {"x": _row(t + 1.0)})
      assert old.data["x"].is_deleted()
      assert old.counts.is_deleted()
  assert not _buffer._donation_warned
  np.testing.assert_array_equal(np.asarray(state.data["x"]),
                                _expected(1.0, 2.0, 3.0, 4.0))


def test_no_warning_with_a_copied_export():
  state = _state_after_step0()
  copy = to_torch(state.data["x"], copy=True)   # independent memory
  assert not exported_views_alive(state.data["x"])
  old = state
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = jr.update_at_inplace(state, 1, {"x": _row(2.0)})
  assert old.data["x"].is_deleted()
  np.testing.assert_array_equal(copy.numpy(), _expected(1.0))
  np.testing.assert_array_equal(np.asarray(state.data["x"]),
                                _expected(1.0, 2.0))


@pytest.mark.parametrize("kind", ["full", "slice"])
def test_warns_when_a_torch_view_is_alive(kind):
  s1 = _state_after_step0()
  view = to_torch(s1.data["x"])
  if kind == "slice":   # a derived view keeps the exported storage alive
    view = view[0]
    gc.collect()
  assert exported_views_alive(s1.data["x"])

  with pytest.warns(RuntimeWarning, match=MATCH):
    s2 = jr.update_at_inplace(s1, 1, {"x": _row(2.0)})
  # Copied, not donated, and no use-after-free: the view and the old state
  # still hold the old data, the new state has the new data.
  assert not s1.data["x"].is_deleted()
  old = _expected(1.0)
  np.testing.assert_array_equal(view.numpy(),
                                old if kind == "full" else old[0])
  np.testing.assert_array_equal(np.asarray(s1.data["x"]), old)
  np.testing.assert_array_equal(np.asarray(s2.data["x"]), _expected(1.0, 2.0))
  assert (s2.data["x"].unsafe_buffer_pointer()
          != s1.data["x"].unsafe_buffer_pointer())

  # The next write (nothing views s2) is in place and leaves the view intact.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    s3 = jr.update_at_inplace(s2, 2, {"x": _row(3.0)})
  assert s2.data["x"].is_deleted()
  np.testing.assert_array_equal(view.numpy(),
                                old if kind == "full" else old[0])
  np.testing.assert_array_equal(np.asarray(s3.data["x"]),
                                _expected(1.0, 2.0, 3.0))

  # Once the view is gone, the buffer it pinned is donatable again.
  del view
  gc.collect()
  assert not exported_views_alive(s1.data["x"])


def test_warns_once_per_process():
  s1 = _state_after_step0()
  view = to_torch(s1.data["x"])
  with pytest.warns(RuntimeWarning, match=MATCH):
    s2 = jr.update_at_inplace(s1, 1, {"x": _row(2.0)})
  assert _buffer._donation_warned
  view2 = to_torch(s2.data["x"])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    s3 = jr.update_at_inplace(s2, 2, {"x": _row(3.0)})   # silent this time
  assert not s2.data["x"].is_deleted()   # ... though it still copied
  np.testing.assert_array_equal(np.asarray(s3.data["x"]),
                                _expected(1.0, 2.0, 3.0))
  np.testing.assert_array_equal(view.numpy(), _expected(1.0))
  np.testing.assert_array_equal(view2.numpy(), _expected(1.0, 2.0))


def test_deleting_the_view_restores_donation():
  state = _state_after_step0()
  view = to_torch(state.data["x"])
  np.testing.assert_array_equal(view.numpy(), _expected(1.0))
  del view
  gc.collect()
  assert not exported_views_alive(state.data["x"])
  old = state
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # armed by the fixture: would raise
    state = jr.update_at_inplace(state, 1, {"x": _row(2.0)})
  assert old.data["x"].is_deleted()
  assert not _buffer._donation_warned
  np.testing.assert_array_equal(np.asarray(state.data["x"]),
                                _expected(1.0, 2.0))


def test_view_per_step_loop_fixed_by_dropping_the_view():
  """The simulator pattern: read the storage from torch, then write."""
  state = jr.register(jr.init(num_envs=E, num_steps=T), "x", (2,))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for t in range(T):
      view = to_torch(state.data["x"])
      seen = float(view.sum())
      del view   # without this line every write copies the rollout (and warns)
      old = state
      state = jr.update_at_inplace(state, t, {"x": _row(t + 1.0)})
      assert old.data["x"].is_deleted()
      assert seen == 2 * E * sum(range(1, t + 1))


def test_warns_for_a_viewed_key_that_was_not_written():
  state = jr.register(jr.register(jr.init(E, T), "x", (2,)), "y", (8,))
  state = jr.update_at_inplace(state, 0, {"x": _row(1.0),
                                          "y": np.ones((E, 8), np.float32)})
  view = to_torch(state.data["y"])
  with pytest.warns(jr.DonationWarning,
                    match=r"the storage of \['y'\] was copied"):
    new = jr.update_at_inplace(state, 1, {"x": _row(2.0)})
  np.testing.assert_array_equal(np.asarray(new.data["x"]), _expected(1.0, 2.0))
  np.testing.assert_array_equal(view.numpy(), np.ones((T, E, 8)) * (
      np.arange(T) == 0)[:, None, None])
  del view


def test_warning_as_error_keeps_the_new_state():
  state = _state_after_step0()
  view = to_torch(state.data["x"])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(jr.DonationWarning) as info:
      jr.update_at_inplace(state, 1, {"x": _row(2.0)})
  new = info.value.state
  np.testing.assert_array_equal(np.asarray(new.data["x"]), _expected(1.0, 2.0))
  np.testing.assert_array_equal(
      np.asarray(jr.write_counts(new)["x"].per_step), [1, 1, 0, 0])
  np.testing.assert_array_equal(view.numpy(), _expected(1.0))
  del view
