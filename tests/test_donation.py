"""Donation in the RolloutWriter's flushes when torch views the storage: the
warning when a view blocks it (donation without views, which needs no
torch, is checked in test_writer.py)."""

import gc
import warnings

import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jrollout as jr  # noqa: E402
from jrollout.torch import exported_views_alive  # noqa: E402
from jrollout.torch import to_torch  # noqa: E402

E, T = 3, 4
MATCH = (r"RolloutWriter: the storage of \['x'\] was copied, "
         r"not updated in place")


def _inplace(state, step, data):
  """One donated write of ``state``: a writer that flushes every call."""
  writer = jr.RolloutWriter(state, flush_every=1)
  writer.update_at(step, data)
  return writer.state


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
  return _inplace(state, 0, {"x": _row(1.0)})


def test_no_warning_with_a_copied_export():
  state = _state_after_step0()
  copy = to_torch(state.data["x"], copy=True)   # independent memory
  assert not exported_views_alive(state.data["x"])
  old = state
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = _inplace(state, 1, {"x": _row(2.0)})
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
    s2 = _inplace(s1, 1, {"x": _row(2.0)})
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
    s3 = _inplace(s2, 2, {"x": _row(3.0)})
  assert s2.data["x"].is_deleted()
  np.testing.assert_array_equal(view.numpy(),
                                old if kind == "full" else old[0])
  np.testing.assert_array_equal(np.asarray(s3.data["x"]),
                                _expected(1.0, 2.0, 3.0))

  # Once the view is gone, the buffer it pinned is donatable again.
  del view
  gc.collect()
  assert not exported_views_alive(s1.data["x"])


def _copying_loop(steps):
  """Writes ``steps`` from one line, each while a view blocks donation.

  Returns ``(states, views)``: the state before each write and the last.
  """
  states, views = [_state_after_step0()], []
  for t in steps:
    views.append(to_torch(states[-1].data["x"]))
    states.append(_inplace(states[-1], t, {"x": _row(t + 1.0)}))
  return states, views


def _donation_warnings(caught):
  return [w for w in caught if issubclass(w.category, jr.DonationWarning)]


def test_warns_once_per_call_site_under_the_default_filter():
  """"Once" is Python's warning filter: under the "default" action (a
  RuntimeWarning's by default) the same warning from the same line shows
  once, and it names the caller's line."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    states, views = _copying_loop([1, 2])
  caught = _donation_warnings(caught)
  assert len(caught) == 1
  assert str(caught[0].message).startswith(
      "RolloutWriter: the storage of ['x'] was copied")
  assert caught[0].filename == __file__
  assert isinstance(caught[0].message.state, jr.RolloutState)
  # Both calls copied (nothing donated: the old states are whole) ...
  assert not any(s.data["x"].is_deleted() for s in states[:-1])
  # ... and the views still see what they saw.
  np.testing.assert_array_equal(views[0].numpy(), _expected(1.0))
  np.testing.assert_array_equal(views[1].numpy(), _expected(1.0, 2.0))
  np.testing.assert_array_equal(np.asarray(states[-1].data["x"]),
                                _expected(1.0, 2.0, 3.0))


@pytest.mark.parametrize("action, count", [("always", 3), ("ignore", 0),
                                           ("once", 1)])
def test_the_warning_filter_decides_how_often(action, count):
  """Three copying writes, two from one line and one from another:
  ``"once"`` shows the first only, whatever the line."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter(action, jr.DonationWarning)
    states, views = _copying_loop([1, 2])
    state = _state_after_step0()
    view = to_torch(state.data["x"])
    new = _inplace(state, 1, {"x": _row(2.0)})
  assert len(_donation_warnings(caught)) == count
  assert not state.data["x"].is_deleted()   # it did copy
  np.testing.assert_array_equal(np.asarray(new.data["x"]), _expected(1.0, 2.0))
  np.testing.assert_array_equal(np.asarray(states[-1].data["x"]),
                                _expected(1.0, 2.0, 3.0))
  del views, view


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
    state = _inplace(state, 1, {"x": _row(2.0)})
  assert old.data["x"].is_deleted()
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
      state = _inplace(state, t, {"x": _row(t + 1.0)})
      assert old.data["x"].is_deleted()
      assert seen == 2 * E * sum(range(1, t + 1))


def test_warns_for_a_viewed_key_that_was_not_written():
  state = jr.register(jr.register(jr.init(E, T), "x", (2,)), "y", (8,))
  state = _inplace(state, 0, {"x": _row(1.0),
                                          "y": np.ones((E, 8), np.float32)})
  view = to_torch(state.data["y"])
  with pytest.warns(jr.DonationWarning,
                    match=r"the storage of \['y'\] was copied"):
    new = _inplace(state, 1, {"x": _row(2.0)})
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
      _inplace(state, 1, {"x": _row(2.0)})
  new = info.value.state
  np.testing.assert_array_equal(np.asarray(new.data["x"]), _expected(1.0, 2.0))
  np.testing.assert_array_equal(
      np.asarray(jr.write_counts(new)["x"].per_step), [1, 1, 0, 0])
  np.testing.assert_array_equal(view.numpy(), _expected(1.0))
  del view


def _warned_as_error(call):
  with warnings.catch_warnings():
    warnings.simplefilter("error", jr.DonationWarning)
    with pytest.raises(jr.DonationWarning, match="was copied"):
      call()


@pytest.mark.parametrize("entry", ["RolloutWriter.update_at",
                                   "RolloutWriter.state",
                                   "RolloutWriter.update_all",
                                   "ExperienceBuffer.update_data"])
def test_warning_as_error_loses_nothing_in_objects(entry):
  """The writer and ExperienceBuffer hold the new state before the warning
  is issued: raised as an error, it leaves them with the write done, live
  buffers and nothing queued, and they go on writing."""
  from jrollout.compat import ExperienceBuffer  # noqa: PLC0415
  y = np.full((E, 8), 7.0, np.float32)
  if entry.startswith("ExperienceBuffer"):
    holder = ExperienceBuffer(E, T)
    holder.register_key("x", (2,))
    holder.register_key("y", (8,))
    holder.update_data("x", 0, _row(1.0))
    view = to_torch(holder.state.data["x"])
    _warned_as_error(lambda: holder.update_data("x", 1, _row(2.0)))
    holder.update_data("y", 1, y)
  else:
    state = jr.register(jr.register(jr.init(E, T), "x", (2,)), "y", (8,))
    holder = jr.RolloutWriter(state, flush_every=1 if entry.endswith(
        "update_at") else 16)
    holder.update_at(0, {"x": _row(1.0)})
    view = to_torch(holder.state.data["x"])
    if entry.endswith("update_all"):   # 'x' is copied, not written whole
      whole = np.zeros((T, E, 8), np.float32)
      whole[1] = y
      _warned_as_error(lambda: holder.update_all({"y": whole}))
      holder.update_at(1, {"x": _row(2.0)})
    elif entry.endswith("update_at"):  # the flush of this call copies 'x'
      _warned_as_error(lambda: holder.update_at(1, {"x": _row(2.0)}))
      assert holder.pending == 0
      holder.update_at(1, {"y": y})
    else:                              # reading .state flushes, copying 'x'
      holder.update_at(1, {"x": _row(2.0)})
      _warned_as_error(lambda: holder.state)
      assert holder.pending == 0
      holder.update_at(1, {"y": y})
  new = holder.state
  assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(new))
  np.testing.assert_array_equal(np.asarray(new.data["x"]), _expected(1.0, 2.0))
  expected_y = np.zeros((T, E, 8), np.float32)
  expected_y[1] = y
  np.testing.assert_array_equal(np.asarray(new.data["y"]), expected_y)
  np.testing.assert_array_equal(view.numpy(), _expected(1.0))
  del view
