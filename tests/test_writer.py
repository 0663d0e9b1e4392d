"""jr.RolloutWriter: queued host-loop writes flushed into the donated state,
and the DonationWarning when a torch view blocks the donation."""

import gc
import warnings

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout import _write
from jrollout import _writer
from tests.reference import assert_state_equals
from tests.reference import make_pair
from tests.reference import random_value

try:
  import torch
  from jrollout.torch import exported_views_alive
  from jrollout.torch import to_torch
except ImportError:   # the torch extra is optional
  torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")

_DTYPES = [np.float32, np.int32, np.uint8, np.bool_]


@given(
    num_envs=st.integers(1, 3),
    num_steps=st.integers(1, 5),
    specs=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=2),
                             st.sampled_from(_DTYPES)), min_size=1, max_size=3),
    ops=st.lists(st.tuples(st.integers(-1, 6), st.integers(0, 7),
                           st.sampled_from(["step", "jax", "whole",
                                            "read"])),
                 max_size=14),
    flush_every=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_property_writer_matches_numpy(num_envs, num_steps, specs, ops,
                                       flush_every, seed):
  """Any sequence of writes (gaps, repeats, bad steps, whole rollouts, reads;
  staged numpy and held JAX values mixed) leaves the numpy model's state."""
  spec = {f"k{i}": (tuple(s), d) for i, (s, d) in enumerate(specs)}
  state, ref = make_pair(spec, num_envs, num_steps)
  writer = jr.RolloutWriter(state, flush_every=flush_every)
  rng = np.random.default_rng(seed)
  for step, key_mask, op in ops:
    keys = [k for i, k in enumerate(spec) if key_mask >> i & 1] or ["k0"]
    lead = (num_steps, num_envs) if op == "whole" else (num_envs,)
    values = {k: random_value(rng, (*lead, *spec[k][0]), spec[k][1])
              for k in keys}
    if op == "whole":
      writer.update_all(values)
      ref.update_all(values)
    elif op == "read":
      assert_state_equals(writer.state, ref)
      assert writer.pending == 0
    elif 0 <= step < num_steps:
      ref.update_at(step, values)
      if op == "jax":
        values = {k: jnp.asarray(v) for k, v in values.items()}
      writer.update_at(step, values)
      assert writer.pending < flush_every
    else:
      pending = writer.pending
      with pytest.raises(IndexError, match="RolloutWriter.update_at: step"):
        writer.update_at(step, values)
      assert writer.pending == pending
  assert_state_equals(writer.state, ref)
  if ref.complete():
    batch = writer.make_batch()
    expected = ref.make_batch()
    for k in expected:
      np.testing.assert_array_equal(np.asarray(batch[k]), expected[k])
    assert_state_equals(writer.state, ref)   # tracking restarted, storage kept
  else:
    with pytest.raises(jr.IncompleteRolloutError):
      writer.make_batch()


def _state(num_envs=2, num_steps=4):
  state = jr.register(jr.init(num_envs, num_steps), "obs", (3,))
  return jr.register(state, "act", (), jnp.int32)


def _step(t, num_envs=2):
  return {"obs": jnp.full((num_envs, 3), t, jnp.float32),
          "act": jnp.full((num_envs,), t, jnp.int32)}


def test_writes_are_queued_then_flushed_in_place():
  first = _state()
  writer = jr.RolloutWriter(first, flush_every=3)
  writer.update_at(0, _step(0))
  writer.update_at(1, _step(1))
  assert writer.pending == 2
  assert not first.data["obs"].is_deleted()      # nothing dispatched yet
  writer.update_at(2, _step(2))                  # third call: flush
  assert writer.pending == 0
  assert all(v.is_deleted() for v in first.data.values())   # donated
  writer.update_at(3, _step(3))
  batch = writer.make_batch()
  np.testing.assert_array_equal(batch["act"], [0, 1, 2, 3] * 2)
  assert "pending=0" in repr(writer) and "flush_every=3" in repr(writer)


@pytest.mark.parametrize("call, exc, match", [
    (lambda w: w.update_at(0, {"nope": np.zeros(2)}), KeyError,
     "RolloutWriter.update_at: field 'nope' is not registered"),
    (lambda w: w.update_at(0, {"obs": np.zeros((2, 4), np.float32)}),
     ValueError, r"RolloutWriter.update_at: field 'obs' has shape \(2, 4\), "
     r"expected \(2, 3\)"),
    (lambda w: w.update_at(1, [np.zeros(2)]), TypeError,
     r"RolloutWriter.update_at: `data` must be a dict \{name: array\}, got "
     "list"),
    (lambda w: w.update_all({"obs": np.zeros((3, 2, 3), np.float32)}),
     ValueError, r"RolloutWriter.update_all: field 'obs' has shape "
     r"\(3, 2, 3\), "
     r"expected \(4, 2, 3\)"),
])
def test_errors_name_the_call_and_queue_nothing(call, exc, match):
  writer = jr.RolloutWriter(_state(), flush_every=4)
  writer.update_at(0, _step(0))
  with pytest.raises(exc, match=match):
    call(writer)
  assert writer.pending == 1
  for t in range(1, 4):
    writer.update_at(t, _step(t))
  writer.make_batch()   # the rollout is intact


def test_a_traced_step_state_or_value_is_refused_naming_update_at():
  writer = jr.RolloutWriter(_state())
  calls = [
      (lambda t: writer.update_at(t, _step(0)), jnp.int32(1),
       r"^RolloutWriter\.update_at: `step` must be concrete"),
      (lambda x: writer.update_at(0, {"obs": x}), jnp.zeros((2, 3)),
       r"^RolloutWriter\.update_at: got a traced value"),
      (lambda x: writer.update_all({"act": x}), jnp.zeros((4, 2), jnp.int32),
       r"^RolloutWriter\.update_all: got a traced value"),
      (lambda s: jr.RolloutWriter(s), _state(),
       r"^RolloutWriter: got a traced state; the writer is for host loops\. "
       r"Inside jit/scan use jr\.update_at"),
  ]
  for call, arg, match in calls:
    with pytest.raises(TypeError, match=match):
      jax.jit(call)(arg)
  assert writer.pending == 0


@pytest.mark.parametrize("flush_every, exc, got", [
    (0, ValueError, "positive, got 0"),
    (2.0, TypeError, "an int, got float 2.0"),
    (True, TypeError, "an int, got bool True")])
def test_constructor_errors(flush_every, exc, got):
  with pytest.raises(exc, match=f"^RolloutWriter: `flush_every` must be "
                     f"{got}$"):
    jr.RolloutWriter(_state(), flush_every=flush_every)
  with pytest.raises(TypeError, match="RolloutWriter: `state` must be a "
                     "RolloutState, got dict"):
    jr.RolloutWriter({})


def test_failed_flush_queues_nothing_and_consumes_nothing():
  state = _state()
  writer = jr.RolloutWriter(state, flush_every=2)
  writer.update_at(0, _step(0))
  doomed = _step(1)
  doomed["obs"].delete()          # e.g. donated elsewhere meanwhile
  with pytest.raises(RuntimeError, match="deleted"):
    writer.update_at(1, doomed)   # this call's flush fails
  assert writer.pending == 1      # step 0 still queued, step 1 not
  assert not state.data["obs"].is_deleted()
  for t in range(1, 4):
    writer.update_at(t, _step(t))
  np.testing.assert_array_equal(writer.make_batch()["act"], [0, 1, 2, 3] * 2)


def test_finish_rollout_resets_tracking_and_keeps_storage():
  writer = jr.RolloutWriter(_state(), flush_every=3)
  for t in range(4):
    writer.update_at(t, _step(t))
  done = writer.finish_rollout()
  np.testing.assert_array_equal(done.data["act"][:, 1], [0, 1, 2, 3])
  assert not np.asarray(done.counts).any()
  with pytest.raises(jr.IncompleteRolloutError,
                     match=r"RolloutWriter.finish_rollout: the rollout is not "
                     r"complete .*\n  field 'act': missing steps \[0-3\]"):
    writer.finish_rollout()


def test_update_all_keeps_the_order_of_writes():
  writer = jr.RolloutWriter(_state(), flush_every=8)
  writer.update_at(2, {"act": jnp.full((2,), 7, jnp.int32)})   # queued
  writer.update_all({"act": np.arange(8, dtype=np.int32).reshape(4, 2)})
  state = writer.state
  np.testing.assert_array_equal(state.data["act"],
                                np.arange(8).reshape(4, 2))   # later wins
  np.testing.assert_array_equal(jr.write_counts(state)["act"].per_step,
                                [1, 1, 2, 1])


def test_steady_state_does_not_recompile(count_compiles):
  writer = jr.RolloutWriter(_state(num_steps=8), flush_every=3)

  def rollout():
    for t in range(8):   # 8 = 3 + 3 + 2: a full and a partial flush size
      writer.update_at(t, _step(t))
    return writer.make_batch()

  rollout()
  with count_compiles() as counter:
    for _ in range(3):
      rollout()
  assert counter.count == 0


def _count_flushes(monkeypatch):
  """Counts the writer's jitted writes; returns the list of run lengths."""
  calls = []
  write = _writer.write_inplace

  def counting(fn, state, steps, runs, **kwargs):
    calls.append({k: sum(len(p) if np.ndim(p) == state.data[k].ndim else 1
                         for p in v) for k, v in runs.items()})
    return write(fn, state, steps, runs, **kwargs)

  monkeypatch.setattr(_writer, "write_inplace", counting)
  return calls


@pytest.mark.parametrize("as_jax", [False, True])
def test_steps_in_order_are_one_run_per_flush(monkeypatch, as_jax):
  calls = _count_flushes(monkeypatch)
  writer = jr.RolloutWriter(_state(num_steps=10), flush_every=4)
  for t in range(10):
    step = _step(t)
    if not as_jax:
      step = {k: np.asarray(v) for k, v in step.items()}
    writer.update_at(t, step)
  batch = writer.make_batch()
  assert calls == [{"act": 4, "obs": 4}] * 2 + [{"act": 2, "obs": 2}]
  np.testing.assert_array_equal(batch["act"], list(range(10)) * 2)


@pytest.mark.parametrize("as_jax", [False, True])
def test_writes_out_of_order_are_queued_together_and_keep_the_order(
    monkeypatch, as_jax):
  """Gaps and repeats do not flush early: one dispatch, in order (a repeated
  step keeps its last value), each row counted."""
  calls = _count_flushes(monkeypatch)
  writer = jr.RolloutWriter(_state(num_steps=6), flush_every=16)
  order = (0, 1, 2, 1, 2, 3, 5, 4, 4)
  last, counts = np.zeros(6, np.int32), np.zeros(6, np.int32)
  for i, t in enumerate(order):
    value = np.full(2, 10 * t + i, np.int32)
    writer.update_at(t, {"act": jnp.asarray(value) if as_jax else value})
    last[t], counts[t] = 10 * t + i, counts[t] + 1
  assert writer.pending == len(order)
  state = writer.state
  assert calls == [{"act": len(order)}]
  np.testing.assert_array_equal(state.data["act"][:, 0], last)
  np.testing.assert_array_equal(jr.write_counts(state)["act"].per_step,
                                counts)
  with pytest.raises(jr.IncompleteRolloutError,
                     match=r"field 'act': duplicated steps 1 \(x2\)"):
    writer.make_batch()
  batch = writer.make_batch(check="off")    # the state was kept: retry works
  np.testing.assert_array_equal(batch["act"][:6], last)


def test_the_same_step_written_again_and_again_makes_no_extra_dispatch(
    monkeypatch, count_compiles):
  calls = _count_flushes(monkeypatch)
  writer = jr.RolloutWriter(_state(), flush_every=4)
  for i in range(8):
    writer.update_at(3, {"act": np.full(2, i, np.int32)})
  with count_compiles() as counter:
    for i in range(8, 16):
      writer.update_at(3, {"act": np.full(2, i, np.int32)})
  assert counter.count == 0
  assert len(calls) == 4
  state = writer.state
  np.testing.assert_array_equal(state.data["act"][3], [15, 15])
  assert jr.write_counts(state)["act"].per_step.tolist() == [0, 0, 0, 16]


def test_keys_written_in_separate_calls_keep_their_own_runs(monkeypatch):
  """A step's fields written in two calls: each continues its own run."""
  calls = _count_flushes(monkeypatch)
  writer = jr.RolloutWriter(_state(num_steps=4), flush_every=8)
  for t in range(4):
    writer.update_at(t, {"act": jnp.full((2,), t, jnp.int32)})   # held
    writer.update_at(t, {"obs": np.full((2, 3), t, np.float32)})  # staged
  batch = writer.make_batch()
  assert calls == [{"act": 4, "obs": 4}]
  np.testing.assert_array_equal(batch["act"], [0, 1, 2, 3] * 2)
  np.testing.assert_array_equal(batch["obs"][:, 0], [0, 1, 2, 3] * 2)


def test_staging_blocks_are_not_reused_while_a_flush_reads_them(
    monkeypatch):
  """A block set is refilled only once the flush that read it (late, and
  aliased: aligned and large) is done."""
  slow = jnp.full((600, 600), 1 / 600, jnp.float32)

  def delayed(state, steps, runs, **static):
    m = slow
    for _ in range(30):
      m = jnp.tanh(m @ m)               # tens of ms before the blocks are read
    zero = (m[0, 0] * 0).astype(jnp.float32)
    runs = jax.tree_util.tree_map(lambda v: v + zero.astype(v.dtype), runs)
    return _write.write(state, steps, runs, **static)

  monkeypatch.setattr(_writer, "_write_donated",
                      jax.jit(delayed, donate_argnums=0,
                              static_argnames=_write.STATIC))
  e, t_max = 64, 6
  state = jr.register(jr.init(e, t_max), "obs", (512,))
  writer = jr.RolloutWriter(state, flush_every=1)
  for t in range(t_max):
    writer.update_at(t, {"obs": np.full((e, 512), t, np.float32)})
  obs = np.asarray(writer.make_batch()["obs"]).reshape(e, t_max, 512)
  np.testing.assert_array_equal(obs[0, :, 0], np.arange(t_max))


@pytest.mark.parametrize("shape, dtype", [((16, 4096, 128), np.float32),
                                          ((3, 5), np.uint8),
                                          ((2, 7, 3), np.bool_)])
def test_staging_blocks_are_64_byte_aligned(shape, dtype):
  block = _writer.aligned_empty(shape, dtype)
  assert block.ctypes.data % 64 == 0
  assert block.shape == shape and block.dtype == dtype
  assert block.flags.c_contiguous and block.flags.writeable


def test_runs_queued_out_of_sorted_key_order_keep_their_steps():
  """Each field's run starts at its own step, whatever the queue order."""
  state = jr.register(jr.register(jr.init(1, 2), "k0"), "k1")
  writer = jr.RolloutWriter(state, flush_every=2)
  writer.update_at(0, {"k1": np.array([1.0], np.float32)})
  writer.update_at(1, {"k0": np.array([2.0], np.float32)})   # flushes
  data = writer.state.data
  np.testing.assert_array_equal(data["k0"][:, 0], [0.0, 2.0])
  np.testing.assert_array_equal(data["k1"][:, 0], [1.0, 0.0])

def test_a_flush_without_views_donates_without_a_warning():
  writer = jr.RolloutWriter(_state(), flush_every=1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for t in range(4):
      old = writer.state
      writer.update_at(t, _step(t))
      assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(old))
  np.testing.assert_array_equal(writer.state.data["act"][:, 0], [0, 1, 2, 3])


# --- donation blocked by torch views --------------------------------------

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


@needs_torch
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
@needs_torch
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
  """``(states, views)`` of writes from one line, each while a view blocks
  the donation."""
  states, views = [_state_after_step0()], []
  for t in steps:
    views.append(to_torch(states[-1].data["x"]))
    states.append(_inplace(states[-1], t, {"x": _row(t + 1.0)}))
  return states, views


def _donation_warnings(caught):
  return [w for w in caught if issubclass(w.category, jr.DonationWarning)]


@pytest.mark.parametrize("action, count", [("always", 3), ("ignore", 0),
                                           ("once", 1), ("default", 1)])
@needs_torch
def test_the_warning_filter_decides_how_often(action, count):
  """Three copying writes from one line of the caller, which the warning
  names."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter(action, jr.DonationWarning)
    states, views = _copying_loop([1, 2])
    state = _state_after_step0()
    view = to_torch(state.data["x"])
    new = _inplace(state, 1, {"x": _row(2.0)})
  caught = _donation_warnings(caught)
  assert len(caught) == count
  assert all(w.filename == __file__ for w in caught)
  assert not any(s.data["x"].is_deleted() for s in states[:-1])
  assert not state.data["x"].is_deleted()   # it did copy
  np.testing.assert_array_equal(np.asarray(new.data["x"]), _expected(1.0, 2.0))
  np.testing.assert_array_equal(np.asarray(states[-1].data["x"]),
                                _expected(1.0, 2.0, 3.0))
  del views, view


@needs_torch
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


@needs_torch
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
@needs_torch
def test_warning_as_error_loses_nothing_in_objects(entry):
  """Raised as an error, the warning leaves the holder with the write done,
  live buffers and nothing queued; it goes on writing."""
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
