"""The pure write path (init, register, update_at, update_all, make_batch,
finish_rollout, batch_rows) against the numpy model of tests/reference.py."""

import functools
from typing import NamedTuple

import chex
import flax.serialization
from hypothesis import given
from hypothesis import strategies as st
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout import _ledger
from jrollout import _write
from jrollout import _writer
from tests.conftest import TRANSFORMS
from tests.reference import assert_state_equals as _assert_state_equals
from tests.reference import make_pair as _make
from tests.reference import NumpyBuffer
from tests.reference import random_value as _random_value


# --- init / register ---------------------------------------------------------


def test_init_and_register_zero_storage(transition_spec):
  state, _ = _make(transition_spec, num_envs=4, num_steps=6)
  assert (state.num_envs, state.num_steps) == (4, 6)
  assert state.names == tuple(sorted(transition_spec))
  for key, (shape, dtype) in transition_spec.items():
    assert state.data[key].shape == (6, 4, *shape)
    assert state.data[key].dtype == dtype
    assert not np.asarray(state.data[key]).any()
    assert state.spec(key) == (shape, np.dtype(dtype))
  assert state.obs is state.data["obs"]
  default = jr.register(state, "v").data["v"]
  assert default.shape == (6, 4) and default.dtype == jnp.float32


@pytest.mark.parametrize("call, exc, match", [
    (lambda s: jr.init(0, 4), ValueError,
     r"init: `num_envs` must be positive, got 0"),
    (lambda s: jr.init(2.5, 4), TypeError,
     r"init: `num_envs` must be an int, got float 2.5"),
    (lambda s: jr.init(True, 4), TypeError,
     r"init: `num_envs` must be an int, got bool"),
    (lambda s: jr.init(3, np.bool_(True)), TypeError,
     r"init: `num_steps` must be an int, got bool"),
    (lambda s: jr.register(s, "obs", (5,)), ValueError,
     r"register: field 'obs' is already registered \(shape \(4,\), dtype "
     r"float32\)"),
    (lambda s: jr.register(s, 3), TypeError,
     r"register: `name` must be a str, got int 3"),
    (lambda s: jr.register(s, "x", (-1,)), ValueError,
     r"register: field 'x': `shape` must be non-negative, got \(-1,\)"),
    (lambda s: jr.register(s, "x", ("a",)), TypeError,
     r"register: field 'x': `shape` must be a tuple of ints"),
])
def test_init_and_register_errors_leave_state_unchanged(call, exc, match):
  state = jr.register(jr.init(2, 3), "obs", (4,))
  with pytest.raises(exc, match=match):
    call(state)
  assert state.names == ("obs",) and state.data["obs"].shape == (3, 2, 4)


def test_register_keeps_write_counts_and_traces_no_sort():
  """A field registered between others gets a zero count row at its sorted
  place, traced without a sort."""
  state = jr.register(jr.register(jr.init(2, 3), "c"), "a")
  state = jr.update_at(state, 1, {"a": np.ones(2), "c": np.ones(2)})
  state = jr.update_at(state, 2, {"c": np.ones(2)})
  register_b = jax.jit(lambda s: jr.register(s, "b", (2,), jnp.int8))
  new = register_b(state)
  assert new.names == ("a", "b", "c") and new.row("c") == 2
  assert new.spec("b") == ((2,), np.dtype(np.int8))
  np.testing.assert_array_equal(new.counts, [[0, 1, 0], [0, 0, 0], [0, 1, 1]])
  np.testing.assert_array_equal(new.out_of_range, [0, 0, 0])
  text = register_b.lower(state).as_text()
  assert "sort" not in text and "cumsum" not in text


# --- update_at, update_all, make_batch ---------------------------------------


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_writes_and_make_batch_match_reference(transform, transition_spec):
  """Writes leave their input state as it was; make_batch is env-major
  (row ``e * T + t``), keeps the storage and restarts the counts."""
  state, ref = _make(transition_spec, 4, 5)
  rng = np.random.default_rng(0)
  write = transform(jr.update_at)
  for step in [2, 0, 4, 1, 3]:
    values = {k: _random_value(rng, (4, *s), d)
              for k, (s, d) in transition_spec.items()}
    before = jax.tree_util.tree_map(np.asarray, state)
    new_state = write(state, step, values)
    chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, state),
                                before)
    state = new_state
    ref.update_at(step, values)
    _assert_state_equals(state, ref)
  batch, new = transform(jr.make_batch)(state)
  for k, want in ref.make_batch().items():
    assert batch[k].shape == (20, *transition_spec[k][0])
    np.testing.assert_array_equal(np.asarray(batch[k]), want)
    np.testing.assert_array_equal(batch[k][2 * 5 + 3], state.data[k][3, 2])
    np.testing.assert_array_equal(new.data[k], state.data[k])
  assert not np.asarray(new.counts).any() and not bool(jr.is_complete(new))
  assert bool(jr.is_complete(state))   # the old state keeps its counts
  state, ref = _make(transition_spec, 4, 5)
  values = {k: _random_value(rng, (5, 4, *s), d)
            for k, (s, d) in transition_spec.items()}
  state = transform(jr.update_all)(state, values)
  ref.update_all(values)
  _assert_state_equals(state, ref)
  assert bool(jr.is_complete(state))
  state = transform(jr.update_all)(state, {"obs": values["obs"]})
  assert not bool(jr.is_complete(state))
  np.testing.assert_array_equal(jr.write_counts(state)["obs"].per_step,
                                [2] * 5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_write_errors_name_function_field_and_shapes(transform):
  state = jr.register(jr.init(3, 4), "obs", (2,), jnp.float32)
  state = jr.register(state, "act", (), jnp.int32)
  state = jr.register(state, "done", (), jnp.bool_)
  at = functools.partial(transform(jr.update_at), state, 0)
  every = functools.partial(transform(jr.update_all), state)
  cases = [
      (at, {"nope": np.zeros(3)}, KeyError,
       r"update_at: field 'nope' is not registered \(registered: 'act', "
       r"'done', 'obs'\)"),
      (at, {"obs": np.zeros((3, 3), np.float32)}, ValueError,
       r"update_at: field 'obs' has shape \(3, 3\), expected \(3, 2\) = "
       r"\[E\] \+ \(2,\)"),
      (at, {"act": np.zeros(3, np.float32)}, TypeError,
       r"update_at: field 'act' has dtype float32, which cannot be cast "
       r"safely to the registered dtype int32"),
      (at, [np.zeros(3)], TypeError, r"update_at: `data` must be a dict"),
      (every, {"obs": np.zeros((3, 4, 2), np.float32)}, ValueError,
       r"update_all: field 'obs' has shape \(3, 4, 2\), "
       r"expected \(4, 3, 2\) = \[T, E\] \+ \(2,\)"),
  ]
  for write, values, exc, match in cases:
    with pytest.raises(exc, match=match):
      write(values)


@pytest.mark.parametrize("step", [-1, -4, 4, 7, 2**31 - 1, -2**31])
def test_update_at_traced_out_of_range_never_lands(step):
  state = jr.register(jr.init(2, 4), "x")
  state = jr.update_all(state, {"x": jnp.arange(8.0).reshape(4, 2)})
  write = jax.jit(jr.update_at)
  new = write(state, jnp.int32(step), {"x": jnp.full(2, -5.0)})
  np.testing.assert_array_equal(new.data["x"], state.data["x"])
  counts = jr.write_counts(new)["x"]
  np.testing.assert_array_equal(counts.per_step, [1, 1, 1, 1])
  assert int(counts.out_of_range) == 1
  assert not bool(jr.is_complete(new))
  with pytest.raises(jr.IncompleteRolloutError,
                     match=r"field 'x': 1 write\(s\) aimed outside \[0, 4\) "
                     r"\(dropped\)"):
    jr.make_batch(new)


def test_make_batch_names_missing_and_duplicated_steps():
  state = jr.register(jr.init(2, 6), "obs")
  state = jr.register(state, "r")
  state = jr.update_all(state, {"r": np.zeros((6, 2), np.float32)})
  for t in [0, 1, 1, 4, 4, 4]:
    state = jr.update_at(state, t, {"obs": np.zeros(2, np.float32)})
  with pytest.raises(jr.IncompleteRolloutError) as info:
    jr.make_batch(state)
  msg = str(info.value)
  assert "make_batch: the rollout is not complete" in msg
  assert ("field 'obs': missing steps [2-3, 5]; duplicated steps 1 (x2), "
          "4 (x3)") in msg
  assert "'r'" not in msg
  assert isinstance(info.value, ValueError)
  for t in [2, 3, 5]:
    state = jr.update_at(state, t, {"obs": np.ones(2, np.float32)})
  state = jax.tree_util.tree_map(lambda x: x, state)
  with pytest.raises(jr.IncompleteRolloutError, match="duplicated steps"):
    jr.make_batch(state)


@pytest.mark.parametrize("close", ["make_batch", "finish_rollout"])
def test_default_check_under_jit_is_a_checkify_check(close):
  fn = getattr(jr, close)
  state = jr.register(jr.init(2, 3), "obs")
  state = jr.register(state, "a", (), jnp.int32)
  state = jr.update_at(state, 0, {"obs": np.zeros(2, np.float32)})
  state = jr.update_all(state, {"a": np.zeros((3, 2), np.int32)})
  state = jr.update_at(state, 0, {"a": np.zeros(2, np.int32)})
  state = jax.jit(jr.update_at)(state, 7, {"a": np.zeros(2, np.int32)})
  # Functionalised: the failure comes back as a value, raised on the host.
  err, _ = jax.jit(checkify.checkify(fn))(state)
  message = err.get()
  assert message.startswith(f"{close}: the rollout is not complete")
  assert ("per field of ('a', 'obs'): steps never written [0 2], steps "
          "written more than once [1 0], writes aimed outside [0, 3) [1 0]"
          in message)
  with pytest.raises(Exception, match=f"{close}: the rollout is not complete"):
    err.throw()
  # A complete rollout reports nothing.
  done = jr.update_at(jr.update_at(state, 1, {"obs": np.ones(2)}), 2,
                      {"obs": np.ones(2)})
  done = jr.update_all(jr.finish_rollout(done, check="off"),
                       {"obs": np.ones((3, 2)), "a": np.ones((3, 2), np.int32)})
  err, _ = jax.jit(checkify.checkify(fn))(done)
  assert err.get() is None
  # Under vmap the stack's failing buffer is reported.
  stack = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), done, state)
  err, _ = jax.jit(checkify.checkify(jax.vmap(fn)))(stack)
  assert "steps never written [0 2]" in err.get()
  # Not functionalised: nothing is compiled for the check (no callback, no
  # error), and the result is the same as with check="off".
  out = jax.jit(fn)(state)
  ref = jax.jit(functools.partial(fn, check="off"))(state)
  chex.assert_trees_all_equal(out, ref)


def test_check_mode_is_validated():
  state = jr.register(jr.init(2, 3), "obs")
  with pytest.raises(ValueError, match="make_batch: `check` must be 'error', "
                     "'callback' or 'off', got 'raise'"):
    jr.make_batch(state, check="raise")
  # 0.1's bools are refused, with their 0.2 spelling in the message.
  for old, new in ((True, "error"), (False, "off")):
    with pytest.raises(ValueError, match=rf"finish_rollout: `check` must be "
                       rf".* got {old} \(0.1's check={old} is "
                       rf"check='{new}'\)"):
      jr.finish_rollout(state, check=old)


# --- vmap, serialization, recompilation, in-place -----------------------------


def test_vmap_stack_of_independent_buffers():
  n, num_envs, num_steps = 4, 2, 3

  def make(_):
    return jr.register(jr.init(num_envs, num_steps), "x", (2,))

  states = jax.vmap(make)(jnp.arange(n))
  assert states.data["x"].shape == (n, num_steps, num_envs, 2)
  rng = np.random.default_rng(4)
  xs = rng.standard_normal((num_steps, n, num_envs, 2)).astype(np.float32)
  order = np.stack([rng.permutation(num_steps) for _ in range(n)], 1)
  for i in range(num_steps):
    states = jax.vmap(jr.update_at)(states, jnp.asarray(order[i]),
                                    {"x": xs[i]})
  batch, new = jax.vmap(jr.make_batch)(states)
  for b in range(n):
    ref = NumpyBuffer(num_envs, num_steps)
    ref.register("x", (2,))
    for i in range(num_steps):
      ref.update_at(order[i, b], {"x": xs[i, b]})
    np.testing.assert_array_equal(batch["x"][b], ref.make_batch()["x"])
  assert not np.asarray(new.counts).any()


def test_serialization_round_trip_resumes_half_written_rollout():
  state = jr.register(jr.init(2, 4), "obs", (3,))
  state = jr.register(state, "a", (), jnp.int32)
  for t in range(2):
    state = jr.update_at(state, t, {"obs": np.full((2, 3), t, np.float32),
                                    "a": np.full(2, t, np.int32)})
  blob = flax.serialization.to_bytes(state)
  template = jr.register(jr.register(jr.init(2, 4), "obs", (3,)), "a", (),
                         jnp.int32)
  restored = flax.serialization.from_bytes(template, blob)
  chex.assert_trees_all_equal(restored, state)
  for t in range(2, 4):
    restored = jr.update_at(restored, t, {
        "obs": np.full((2, 3), t, np.float32), "a": np.full(2, t, np.int32)})
  batch, _ = jr.make_batch(restored)
  np.testing.assert_array_equal(batch["a"], [0, 1, 2, 3, 0, 1, 2, 3])


def test_second_rollout_does_not_recompile(count_compiles):
  def rollout(state, seed):
    for t in range(4):
      state = jr.update_at(state, t,
                           {"x": jnp.full((2,), seed + t, jnp.float32)})
    state = jr.update_at(state, 0, {"x": jnp.zeros(2, jnp.float32)})
    state = jr.update_all(state, {"y": jnp.zeros((4, 2), jnp.int32)})
    return state

  state = jr.register(jr.register(jr.init(2, 4), "x"), "y", (), jnp.int32)
  state = rollout(state, 0)
  with pytest.raises(jr.IncompleteRolloutError):
    jr.make_batch(state)
  _, state = jr.make_batch(state, check="off")
  with count_compiles() as counter:
    for seed in range(1, 3):
      state = rollout(state, seed)
      with pytest.raises(jr.IncompleteRolloutError):
        jr.make_batch(state)
      _, state = jr.make_batch(state, check="off")
  assert counter.count == 0


# --- property test against numpy ---------------------------------------------

_DTYPES = [np.float32, np.int32, np.uint8, np.bool_, np.int8]


@given(
    num_envs=st.integers(1, 3),
    num_steps=st.integers(1, 5),
    specs=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=2),
                             st.sampled_from(_DTYPES)), min_size=1, max_size=3),
    ops=st.lists(st.tuples(st.integers(-2, 7), st.booleans(), st.integers(0, 7),
                           st.booleans()), max_size=10),
    seed=st.integers(0, 2**16),
)
def test_property_writes_and_batch_match_numpy(num_envs, num_steps, specs, ops,
                                               seed):
  spec = {f"k{i}": (tuple(s), d) for i, (s, d) in enumerate(specs)}
  state, ref = _make(spec, num_envs, num_steps)
  rng = np.random.default_rng(seed)
  traced_write = jax.jit(jr.update_at)
  for step, traced, key_mask, whole in ops:
    keys = [k for i, k in enumerate(spec) if key_mask >> i & 1] or ["k0"]
    if whole:
      values = {k: _random_value(rng, (num_steps, num_envs, *spec[k][0]),
                                 spec[k][1]) for k in keys}
      state = jr.update_all(state, values)
      ref.update_all(values)
      continue
    values = {k: _random_value(rng, (num_envs, *spec[k][0]), spec[k][1])
              for k in keys}
    if traced:
      state = traced_write(state, jnp.int32(step), values)
      ref.update_at(step, values)
    elif 0 <= step < num_steps:
      state = jr.update_at(state, step, values)
      ref.update_at(step, values)
    else:
      with pytest.raises(IndexError):
        jr.update_at(state, step, values)
  _assert_state_equals(state, ref)
  assert bool(jr.is_complete(state)) == ref.complete()
  if ref.complete():
    batch, _ = jr.make_batch(state)
    expected = ref.make_batch()
    for k in expected:
      np.testing.assert_array_equal(np.asarray(batch[k]), expected[k])
  else:
    with pytest.raises(jr.IncompleteRolloutError):
      jr.make_batch(state)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_finish_rollout_checks_and_resets_without_flattening(transform):
  state = jr.register(jr.init(2, 3), "x")
  full = jr.update_all(state, {"x": np.ones((3, 2), np.float32)})
  new = transform(jr.finish_rollout)(full)
  np.testing.assert_array_equal(new.data["x"], full.data["x"])
  assert not np.asarray(new.counts).any()
  half = jr.update_at(state, 1, {"x": np.ones(2, np.float32)})
  finish = functools.partial(jr.finish_rollout, check="callback")
  with pytest.raises(Exception, match=r"finish_rollout: the rollout is not "
                     r"complete (.|\n)*field 'x': missing steps \[0, 2\]"):
    jax.block_until_ready(transform(finish)(half))
  assert int(transform(
      lambda s: jr.finish_rollout(s, check="off"))(half).counts.sum()) == 0


@pytest.mark.parametrize("close", [jr.finish_rollout,
                                   lambda s, **kw: jr.make_batch(s, **kw)[0]],
                         ids=["finish_rollout", "make_batch"])
def test_only_the_callback_check_puts_a_host_callback_in_the_program(
    close):
  state = jr.register(jr.init(2, 3), "x")

  def callbacks(check):
    step = lambda s: jr.update_at(s, jnp.int32(1), {"x": jnp.ones(2)})  # noqa: E731
    return jax.jit(lambda s: close(step(s), check=check)).lower(
        state).as_text().count("callback")

  assert callbacks("callback") >= 1
  assert callbacks("error") == 0
  assert callbacks("off") == 0


def test_make_batch_and_finish_keep_storage_buffers():
  state = jr.register(jr.init(4, 8), "obs", (16,))
  state = jr.update_all(state, {"obs": np.ones((8, 4, 16), np.float32)})
  _, after_batch = jr.make_batch(state)
  after_finish = jr.finish_rollout(state)
  for new in (after_batch, after_finish):
    assert new.data["obs"] is state.data["obs"]
    assert (new.data["obs"].unsafe_buffer_pointer()
            == state.data["obs"].unsafe_buffer_pointer())


def test_traced_check_calls_back_only_on_failure(monkeypatch):
  calls = []
  real = _ledger.raise_stack
  monkeypatch.setattr(_ledger, "raise_stack",
                      lambda *a: (calls.append(a), real(*a)))
  finish = functools.partial(jr.finish_rollout, check="callback")
  state = jr.register(jr.init(2, 3), "x")
  full = jr.update_all(state, {"x": np.ones((3, 2), np.float32)})
  half = jr.update_at(state, 1, {"x": np.ones(2, np.float32)})
  stack = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), full, half, full)
  nested = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), stack)
  complete = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), full)
  jax.block_until_ready(jax.jit(finish)(full))
  jax.block_until_ready(jax.jit(jax.vmap(finish))(complete))
  jax.effects_barrier()
  assert not calls   # a complete rollout costs no host round trip
  with pytest.raises(Exception, match=r"buffer \(1,\) of a vmapped stack"):
    jax.block_until_ready(jax.jit(jax.vmap(finish))(stack))
  with pytest.raises(Exception, match=r"buffer \(0, 1\) of a vmapped stack"):
    jax.block_until_ready(
        jax.jit(jax.vmap(jax.vmap(finish)))(nested))
  assert len(calls) == 2


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_write_counts_and_is_complete_with_and_without_jit(transform):
  state = jr.register(jr.register(jr.init(2, 3), "b"), "a", (), jnp.int32)
  state = jr.update_at(state, 2, {"b": np.ones(2, np.float32)})
  state = jax.jit(jr.update_at)(state, -1, {"a": np.ones(2, np.int32)})
  counts = transform(jr.write_counts)(state)
  assert set(counts) == {"a", "b"}
  np.testing.assert_array_equal(counts["b"].per_step, [0, 0, 1])
  np.testing.assert_array_equal(counts["a"].per_step, [0, 0, 0])
  assert int(counts["a"].out_of_range) == 1
  assert int(counts["b"].out_of_range) == 0
  assert not bool(transform(jr.is_complete)(state))
  full = jr.update_all(state, {"a": np.ones((3, 2), np.int32),
                               "b": np.ones((3, 2), np.float32)})
  assert not bool(transform(jr.is_complete)(full))   # 'b' step 2 twice
  fresh = jr.finish_rollout(full, check="off")
  fresh = jr.update_all(fresh, {"a": np.ones((3, 2), np.int32),
                                "b": np.ones((3, 2), np.float32)})
  assert bool(transform(jr.is_complete)(fresh))


def test_a_list_is_written_and_checked_as_one_array():
  state = jr.register(jr.init(3, 2), "x", (), jnp.int32)
  np.testing.assert_array_equal(
      jr.update_at(state, 0, {"x": [1, -2, 3]}).data["x"][0], [1, -2, 3])
  with pytest.raises(ValueError, match=r"^update_at: field 'x' has int64 "
                     r"values in \[1, 1099511627776\], outside the range"):
    jr.update_at(state, 0, {"x": [1, 2**40, 2]})


def test_concrete_step_inside_jit_leaks_no_tracer():
  # A Python-int step inside a trace must not cache a tracer.
  state = jr.register(jr.init(2, 3), "x")
  jax.jit(lambda s: jr.update_at(s, 2, {"x": jnp.ones(2)}))(state)
  eager = jr.update_at(state, 2, {"x": np.ones(2, np.float32)})
  np.testing.assert_array_equal(eager.data["x"][2], [1, 1])
  again = jax.jit(lambda s: jr.update_at(s, 2, {"x": jnp.ones(2) * 2}))(state)
  np.testing.assert_array_equal(again.data["x"][2], [2, 2])


# --- one write path: the check cache, host copies ----------------------------


def _write_with(entry, state, values):
  """One step of ``values`` at step 0 through a host-loop entry point."""
  if entry == "update_at":
    return jr.update_at(state, 0, values)
  writer = jr.RolloutWriter(state, flush_every=1)
  writer.update_at(0, values)
  return writer.state


_ENTRIES = ["update_at", "RolloutWriter"]


@pytest.mark.parametrize("second", _ENTRIES)
@pytest.mark.parametrize("first", _ENTRIES)
def test_a_checked_write_is_checked_again_for_a_new_layout(first, second):
  """The same name with another dtype or shape is checked again."""
  value = np.ones((2, 2), np.float32)
  state = jr.register(jr.init(2, 3), "x", (2,))
  state = _write_with(first, state, {"x": value})
  np.testing.assert_array_equal(state.data["x"][0], value)
  ints = jr.register(jr.init(2, 3), "x", (2,), jnp.int32)
  with pytest.raises(TypeError, match="cannot be cast safely to the "
                     "registered dtype int32"):
    _write_with(second, ints, {"x": value})
  wider = jr.register(jr.init(2, 3), "x", (3,))
  with pytest.raises(ValueError, match=r"field 'x' has shape \(2, 2\), "
                     r"expected \(2, 3\)"):
    _write_with(second, wider, {"x": value})
  assert not ints.data["x"].is_deleted() and not wider.counts.is_deleted()


def test_the_writer_check_cache_is_keyed_by_the_x64_setting():
  """Whether int64 -> float32 narrows depends on jax_enable_x64."""
  state = jr.register(jr.init(2, 3), "x", (2,))
  value = np.ones((2, 2), np.int64)
  plans, cache = [], {}
  for x64 in (False, True, False):
    with jax.enable_x64(x64):
      plans.append(_write.check_values("t", state, {"x": value}, (2,),
                                       "[E]", cache))
  narrow = (("x", None, "", np.dtype(np.float32)),)
  assert [p.narrow for p in plans] == [narrow, (), narrow]
  assert len(cache) == 2


def _slow_kernel(donate):
  """``_write.write`` that reads its values only after tens of ms."""
  slow = jnp.full((300, 300), 1 / 300, jnp.float32)

  def delayed(state, steps, runs, **static):
    m = slow
    for _ in range(10):
      m = jnp.tanh(m @ m)
    zero = m[0, 0] * 0
    runs = jax.tree_util.tree_map(lambda v: v + zero.astype(v.dtype), runs)
    return _write.write(state, steps, runs, **static)

  return jax.jit(delayed, donate_argnums=0 if donate else (),
                 static_argnames=_write.STATIC)


_HOST_ENTRIES = ["update_at", "update_all",
                 "RolloutWriter.update_all", "ExperienceBuffer.update_data"]


@pytest.mark.parametrize("entry", _HOST_ENTRIES)
def test_a_numpy_value_may_be_reused_as_soon_as_the_write_returns(
    monkeypatch, entry):
  """An aligned numpy value changed at once changes nothing written, though
  the kernel reads it late."""
  from jrollout.compat import ExperienceBuffer  # noqa: PLC0415
  monkeypatch.setattr(_write, "write_jit", _slow_kernel(donate=False))
  monkeypatch.setattr(_writer, "_write_donated", _slow_kernel(donate=True))
  e, t = 64, 3
  whole = entry.endswith("update_all")
  value = _writer.aligned_empty((t, e, 512) if whole else (e, 512),
                                np.float32)
  value[...] = 1.0
  state = jr.register(jr.init(e, t), "obs", (512,))
  expected = np.zeros((t, e, 512), np.float32)
  expected[slice(None) if whole else 1] = 1.0
  if entry == "ExperienceBuffer.update_data":
    buf = ExperienceBuffer(e, t)
    buf.register_key("obs", (512,))
    buf.update_data("obs", 2, jnp.zeros((e, 512)))
    buf.update_data("obs", 1, value)
    value[...] = -1.0     # the caller reuses its buffer at once
    out = buf.state
  elif entry == "update_all":
    state = jr.update_all(state, {"obs": jnp.zeros((t, e, 512))})
    out = jr.update_all(state, {"obs": value})
    value[...] = -1.0
  elif entry == "RolloutWriter.update_all":
    writer = jr.RolloutWriter(state)
    writer.update_all({"obs": jnp.zeros((t, e, 512))})
    writer.update_all({"obs": value})
    value[...] = -1.0
    out = writer.state
  else:
    write = getattr(jr, entry)
    state = write(state, 2, {"obs": jnp.zeros((e, 512))})
    out = write(state, 1, {"obs": value})
    value[...] = -1.0
  np.testing.assert_array_equal(np.asarray(out.data["obs"]), expected)


# --- batch_rows ------------------------------------------------------------


def _rows_state(num_steps, num_envs):
  return jr.register(jr.init(num_envs=num_envs, num_steps=num_steps), "t")


def _reference(x):
  """The model's rows of ``[T, E, ...]`` values: row ``e * T + t``."""
  x = np.asarray(x)
  ref = NumpyBuffer(x.shape[1], x.shape[0])
  ref.register("x", x.shape[2:], x.dtype)
  ref.update_all({"x": x})
  return ref.make_batch()["x"]


class Targets(NamedTuple):
  adv: jax.Array
  ret: jax.Array


@pytest.mark.parametrize("transform", TRANSFORMS)
@given(t=st.integers(1, 6), e=st.integers(1, 6), tail=st.sampled_from(
    [(), (3,), (2, 2)]))
def test_rows_match_numpy_and_keep_the_structure(transform, t, e, tail):
  rng = np.random.default_rng(t * 10 + e)
  values = Targets(rng.normal(size=(t, e, *tail)).astype(np.float32),
                   rng.integers(0, 9, size=(t, e)).astype(np.int32))
  out = transform(jr.batch_rows)(_rows_state(t, e), values)
  assert isinstance(out, Targets)
  np.testing.assert_array_equal(out.adv, _reference(values.adv))
  np.testing.assert_array_equal(out.ret, _reference(values.ret))
  assert out.ret.dtype == jnp.int32


def test_rows_line_up_with_make_batch_and_through_minibatches():
  t, e = 4, 3
  steps = np.arange(t)[:, None] + 100 * np.arange(e)[None, :]   # [T, E]
  state = jr.update_all(_rows_state(t, e), {"t": steps.astype(np.float32)})
  batch, state = jr.make_batch(state)
  adv = (steps * 2 + 1).astype(np.float32)
  batch["adv"] = jr.batch_rows(state, adv)
  np.testing.assert_array_equal(batch["adv"], batch["t"] * 2 + 1)
  for mb in jr.minibatches(jax.random.key(0), batch, 4, num_epochs=2):
    np.testing.assert_array_equal(mb["adv"], mb["t"] * 2 + 1)


def test_batch_rows_under_vmap_over_seeds():
  t, e, seeds = 3, 2, 4
  values = np.arange(seeds * t * e, dtype=np.float32).reshape(seeds, t, e)
  out = jax.vmap(lambda v: jr.batch_rows(_rows_state(t, e), v))(values)
  for s in range(seeds):
    np.testing.assert_array_equal(out[s], _reference(values[s]))


@pytest.mark.parametrize("data, exc, match", [
    (np.zeros(6), ValueError, r"leading shape \(6,\), expected"),
    (np.zeros((3, 5)), ValueError, r"leading shape \(3, 5\), expected "
     r"\(T, E\) = \(3, 2\) of the rollout$"),
    ({}, ValueError, "batch_rows: `data` holds no array"),
    ({"x": "adv"}, TypeError, r"batch_rows: leaf \['x'\] is a str"),
])
def test_batch_rows_bad_arguments(data, exc, match):
  with pytest.raises(exc, match=match):
    jr.batch_rows(_rows_state(3, 2), data)
  with pytest.raises(TypeError, match="batch_rows: `state` must be a "
                     "RolloutState"):
    jr.batch_rows({"t": np.zeros((3, 2))}, data)


def test_a_transposed_array_is_an_error_naming_the_leaf():
  adv = np.zeros((3, 2), np.float32)
  with pytest.raises(ValueError, match=(
      r"^batch_rows: leaf \['adv'\] has leading shape \(2, 3\), expected "
      r"\(T, E\) = \(3, 2\) of the rollout: it is \[E, T\]; pass it "
      r"time-major")):
    jax.jit(jr.batch_rows)(_rows_state(3, 2), {"adv": adv.T, "ret": adv})


def test_batch_rows_does_not_recompile(count_compiles):
  f = jax.jit(jr.batch_rows)
  state = _rows_state(4, 2)
  f(state, np.zeros((4, 2), np.float32)).block_until_ready()
  with count_compiles() as c:
    for i in range(3):
      f(state, np.full((4, 2), i, np.float32)).block_until_ready()
  assert c.count == 0
