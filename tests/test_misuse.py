"""Misuse of the public API and of ``jrollout._checks``: a refused call
raises a documented error naming its function, changes nothing and never
aborts; one that succeeds matches a numpy model (torch: ``test_torch.py``)."""

import math
import re
import subprocess
import sys
import textwrap
import warnings

from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout import _casts
from jrollout import _checks
from jrollout.compat import DictDataset
from jrollout.compat import ExperienceBuffer
from tests._misuse import assert_same
from tests._misuse import assert_writer_applies_only_good_writes
from tests._misuse import assert_writes_refused_with_the_fix
from tests._misuse import call_named
from tests._misuse import E
from tests._misuse import fresh_state
from tests._misuse import NOT_BOOLS
from tests._misuse import snapshot
from tests._misuse import T
from tests._misuse import WRITER_VALUES


# --- The validators: sizes, shapes, dtypes, array arguments. ---

NOT_FLOAT = (r"expected a floating dtype \(cast it, e\.g\. "
             r"`x\.astype\(jnp\.float32\)`\)$")
TRAILING = (r"^f: `x` has shape .*, expected \[\.\.\., \*\(2,\)\] \(any "
            r"leading axes, then the sample shape \(2,\)\)$")
# (check, its arguments, the error, its message)
REFUSED = [
    ("positive_ints", ("n", (2, 0)), ValueError, r"^f: `n` must be positive, "
     r"got 0$"),
    ("check_shape", ((True,), "x"), TypeError, r"^f: field 'x': `shape` must "
     r"be a tuple of ints, got \(True,\) \(a bool is not a dimension\)$"),
    ("check_shape", (True,), TypeError, r"^f: `shape` must be a tuple of "
     r"ints, got bool True$"),
    ("check_shape", ((2.0,),), TypeError, r"^f: `shape` must be a tuple of "
     r"ints, got \(2.0,\)$"),
    ("check_floating", ("x", np.zeros(2, np.int32)), TypeError,
     r"^f: `x` has dtype int32, " + NOT_FLOAT),
    ("check_floating", ("x", [[1.0], [1.0, 2.0]]), TypeError,
     r"^f: `x` is not an array of numbers \(list, ragged\?\)"),
    ("check_floating", ("v", [True], "it must be"), TypeError,
     r"^f: `v` has dtype bool, expected a floating dtype \(it must be\)$"),
    ("check_bool_array", ("x", np.zeros(2, np.uint8)), TypeError,
     r"^f: `x` has dtype uint8, expected bool \(e\.g\. `x\.astype\(bool\)`"
     r", True where it applies\)$"),
    ("check_real", ("x", np.zeros(2, np.complex64)), TypeError,
     r"^f: `x` has dtype complex64, expected a real \(bool, integer or "
     r"floating\) dtype; a complex value would lose its imaginary part$"),
    ("check_flags", ("x", np.array(["a"])), TypeError, r"^f: `x` has dtype "
     r"<U1, expected bool or numeric flags \(nonzero is True\)$"),
    ("check_shape_equal", ("v", np.zeros((3, 2)), (2, 3), "r.shape"),
     ValueError, r"^f: `v` has shape \(3, 2\), expected \(2, 3\) = "
     r"r\.shape$"),
    ("check_trailing", ("x", np.zeros((2, 3)), (2,), "the sample shape"),
     ValueError, TRAILING),
    ("check_trailing", ("x", np.zeros(()), (2,), "the sample shape"),
     ValueError, TRAILING),
    ("check_instance", ("s", {}, jr.RunningStats, "init_running_stats"),
     TypeError, r"^f: `s` must be a RunningStats \(from "
     r"jr\.init_running_stats\), got dict$"),
    ("check_unstacked", ("s", jnp.zeros(3), "things"), ValueError,
     r"^f: `s` is a stack of things \(count of shape \(3,\)\); map over the "
     r"stack with jax\.vmap$"),
    ("check_dtype", (None, np.int32, True), TypeError, r"^f: `dtype` must be "
     r"a floating dtype, got int32$"),
    ("check_dtype", (None, np.float64, True), TypeError, r"^f: `dtype` "
     r"float64 is not available with jax_enable_x64 disabled \(JAX would "
     r"store float32\); use float32$"),
    ("check_dtype", ("k", np.int64), TypeError, r"^f: field 'k': dtype int64 "
     r"is not available with jax_enable_x64 disabled \(JAX would store "
     r"int32\); register int32 or enable x64$"),
    ("check_str_keys", ("b", {"a": {1: np.ones(2)}}), TypeError,
     r"^f: `b\['a'\]` has the key 1 of type int; expected str keys"),
    ("check_str_keys", ("b", (np.ones(2), {"a": {None: 1}})), TypeError,
     r"^f: `b\[1\]\['a'\]` has the key None"),
    ("check_arrays", ("b", {"x": {1: np.ones(2), "a": np.ones(2)}}),
     TypeError, r"^f: `b\['x'\]` has dict keys of types \['int', 'str'\] "
     r"that cannot be sorted"),
]


@pytest.mark.parametrize("check, args, exc, match", REFUSED)
def test_validators_refuse(check, args, exc, match):
  with pytest.raises(exc, match=match):
    getattr(_checks, check)("f", *args)


def test_validators_accept():
  for value in (np.int64(5), np.uint8(5), jnp.int32(5)):
    got = _checks.positive_int("f", "n", value)
    assert got == 5 and type(got) is int
  assert _checks.positive_ints("f", "n", 3) == (3,)
  assert _checks.positive_ints("f", "n", [2, np.int64(3)]) == (2, 3)
  _checks.check_floating("f", "x", jnp.zeros(2, jnp.bfloat16))
  _checks.check_bool_array("f", "m", np.zeros(2, bool))
  _checks.check_real("f", "r", np.zeros(2, np.uint8))
  _checks.check_flags("f", "d", np.zeros(2, np.complex64))
  _checks.check_shape_equal("f", "v", np.zeros((2, 3)), (2, 3), "r.shape")
  assert _checks.check_trailing("f", "x", np.zeros((4, 5, 2)), (2,),
                                "s") == (4, 5)
  _checks.check_unstacked("f", "s", jnp.zeros(()), "things")
  assert _checks.check_dtype("f", None, jnp.bfloat16,
                             floating=True) == jnp.bfloat16
  _checks.check_str_keys("f", "b", {"a": [np.ones(2), {"b": 1.0}]})


# --- The cast rule on every write path. ---

# Key dtypes a write may target, and the dtypes values arrive in.
KEY_DTYPES = [np.float32, np.float16, jnp.bfloat16, np.int32, np.int8,
              np.uint8, np.bool_]
VALUE_DTYPES = [np.bool_, np.int8, np.uint8, np.int32, np.uint32, np.int64,
                np.float16, np.float32, np.float64, np.complex64]
# The cast table of the README, by kind: the kinds each kind may go to.
ALLOWED = {"b": "biufc", "u": "iufc", "i": "iufc", "f": "fc", "c": "c"}


def kind(dtype):
  dtype = np.dtype(dtype)
  return "f" if dtype == jnp.bfloat16 else dtype.kind


def allowed_kind(src, dst):
  return kind(dst) in ALLOWED[kind(src)]


def test_can_cast_policy():
  for src in KEY_DTYPES + VALUE_DTYPES:
    for dst in KEY_DTYPES + VALUE_DTYPES:
      assert _casts.can_cast(np.dtype(src), np.dtype(dst)) == (
          allowed_kind(src, dst)), (src, dst)


def np_cast(v, dst):
  """``v.astype(dst)``, quietly (the model of XLA's conversion)."""
  with np.errstate(all="ignore"):
    return v.astype(dst)


def keeps_values(v, dst):
  """Whether ``v.astype(dst)`` keeps every value, up to float rounding."""
  cast = np_cast(v, dst)
  if kind(dst) in "iu":
    return np.array_equal(cast.astype(object), v.astype(object))
  if kind(dst) == "b":
    return True
  finite = np.isfinite(v) if kind(v.dtype) in "fc" else np.ones(v.shape, bool)
  return not np.any(finite & ~np.isfinite(cast.astype(np.float32)))


def values_of(dtype):
  """Elements at every edge of a cast (no subnormals: XLA may flush them)."""
  dtype = np.dtype(dtype)
  if dtype.kind == "b":
    return st.booleans()
  if dtype.kind in "iu":
    info = np.iinfo(dtype)
    return st.one_of(st.integers(-3, 3).filter(lambda i: i >= info.min),
                     st.sampled_from([int(info.min), int(info.max),
                                      min(int(info.max), 255),
                                      max(int(info.min), -129)]))
  top = float(np.finfo(dtype if dtype.kind == "f" else np.float32).max)
  return st.sampled_from([0.0, 0.5, -3.0, 1e3, 7e4, 1e30, 3.4e38, 1e300,
                          math.nan, math.inf, -math.inf]).filter(
                              lambda x: not math.isfinite(x) or abs(x) <= top)


@st.composite
def write_cases(draw, leading):
  dst = draw(st.sampled_from(KEY_DTYPES))
  src = draw(st.sampled_from(VALUE_DTYPES))
  value = draw(hnp.arrays(src, leading, elements=values_of(src)))
  return np.dtype(dst), value


def expected_error(value, dst):
  if not allowed_kind(value.dtype, dst):
    return TypeError
  if not keeps_values(value, dst):
    return ValueError
  return None


ONE_STEP = ["update_at", "RolloutWriter.update_at",
            "ExperienceBuffer.update_data"]
WHOLE = ["update_all", "RolloutWriter.update_all",
         "ExperienceBuffer.batch_update_data"]


def write_entry(entry, state, step, value):
  """``(call, read)``: a write of ``value`` to field 'x' through ``entry``
  (at ``step``) and the storage after it."""
  out = {}
  if entry.startswith("RolloutWriter"):
    writer = jr.RolloutWriter(jax.tree_util.tree_map(jnp.copy, state),
                              flush_every=1)
  if entry.startswith("ExperienceBuffer"):
    buf = ExperienceBuffer(E, T)
    buf.register_key("x", dtype=state.data["x"].dtype)
  calls = {
      "update_at": lambda: out.update(s=jr.update_at(state, step,
                                                     {"x": value})),
      "update_all": lambda: out.update(s=jr.update_all(state, {"x": value})),
      "RolloutWriter.update_at": lambda: writer.update_at(step, {"x": value}),
      "RolloutWriter.update_all": lambda: writer.update_all({"x": value}),
      "ExperienceBuffer.update_data": lambda: buf.update_data("x", step,
                                                              value),
      "ExperienceBuffer.batch_update_data": lambda: buf.batch_update_data(
          "x", value),
  }
  reads = {"u": lambda: out["s"].data["x"],
           "R": lambda: writer.state.data["x"], "E": lambda: buf.x}
  return calls[entry], reads[entry[0]]


@st.composite
def writes(draw):
  """``(entry, step, dtype, value)`` (``step`` None: a whole rollout)."""
  whole = draw(st.booleans())
  entry = draw(st.sampled_from(WHOLE if whole else ONE_STEP))
  step = None if whole else draw(st.sampled_from([0, 3, np.int64(2),
                                                  jnp.int32(1)]))
  return (entry, step, *draw(write_cases((T, E) if whole else (E,))))


BIG_INT64 = np.array([2**40, -3, 7], np.int64)


@settings(max_examples=60)
@given(write=writes())
@example(write=("update_at", 0, np.dtype(np.float32), BIG_INT64))
@example(write=("RolloutWriter.update_at", 0, np.dtype(np.float32),
                BIG_INT64))
def test_writes_cast_or_refuse(write):
  """Eager writes store ``value.astype(dtype)`` (int64 straight to it: not
  via int32, 2**40 -> 0); a cast refused by kind is a TypeError, one that
  would change a value a ValueError; the state is unchanged after either."""
  entry, step, dst, value = write
  state = fresh_state(dst)
  before = snapshot(state)
  call, read = write_entry(entry, state, step, value)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, err = call_named(entry, call)
  want = expected_error(value, dst)
  assert_same(state, before)
  if want is None:
    assert err is None, err
    expected = value.astype(dst)
    if step is not None:
      expected = np.zeros((T, E), dst)
      expected[int(step)] = value.astype(dst)
    np.testing.assert_array_equal(np.asarray(read()), expected)
  else:
    assert isinstance(err, want), (err, want)


def _write_step_1(state, v):
  return jr.update_at(state, 1, {"x": v})


# Made once: each (key dtype, value dtype) pair compiles once per process.
_TRACED = {
    "jit": jax.jit(checkify.checkify(lambda s, v: _write_step_1(s, v[0]))),
    "vmap": jax.jit(checkify.checkify(jax.vmap(_write_step_1))),
}


@st.composite
def traced_cases(draw):
  """A key dtype and a ``(2, E)`` 32-bit value of a kind it takes."""
  dst = draw(st.sampled_from(KEY_DTYPES))
  src = draw(st.sampled_from([d for d in VALUE_DTYPES if allowed_kind(d, dst)
                              and np.dtype(d).itemsize < 8]))
  return np.dtype(dst), draw(hnp.arrays(src, (2, E), elements=values_of(src)))


INT32_MIN = np.array([[0, 0, np.iinfo(np.int32).min]] * 2, np.int32)


@settings(max_examples=15)
@given(case=traced_cases(), transform=st.sampled_from(["jit", "vmap"]))
@example(case=(np.dtype(np.float16), INT32_MIN), transform="jit")
@example(case=(np.dtype(np.float16), INT32_MIN), transform="vmap")
def test_traced_writes_convert_as_xla_and_checkify_reports(case, transform):
  """Traced narrowing writes convert as numpy's ``astype`` (ints wrap, floats
  overflow to inf) and ``checkify`` reports each changed value (int32 min
  is -inf in float16: its magnitude must not wrap and hide it)."""
  dst, value = case
  state = fresh_state(dst)
  if transform == "jit":
    err, out = _TRACED["jit"](state, value)
    got, value = out.data["x"][1], value[0]
  else:   # vmap of update_at: values traced, the same rule
    stack = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    err, out = _TRACED["vmap"](stack, value)
    got = out.data["x"][:, 1]
  np.testing.assert_array_equal(np.asarray(got), np_cast(value, dst))
  changed = not keeps_values(value, dst)
  assert (err.get() is not None) == changed, err.get()
  if changed:
    assert "update_at: field 'x'" in err.get()


@pytest.mark.parametrize("entry", ["update_at", "writer", "update_all"])
def test_ragged_lists_and_non_numbers_are_refused_with_the_fix(entry):
  """(Torch tensors: test_misuse_torch.py.)"""
  assert_writes_refused_with_the_fix(entry, lambda lead: [
      ([[1.0, 2.0], [3.0]] if entry == "update_all"
       else [1.0, [2.0], 3.0], r"not an array of numbers "
       r"\(list, ragged\?\)"),
      (np.array(["a"] * E), r"not an array of numbers"),
      (None, r"not an array of numbers")])


def test_load_state_dict_refuses_values_the_cast_would_change():
  buf = ExperienceBuffer(E, T)
  buf.register_key("x", dtype=np.int32)
  saved = {k: np.asarray(v) if not isinstance(v, int) else v
           for k, v in buf.state_dict().items()}
  saved["data"] = {"x": np.full((T, E), 2**40, np.int64)}
  before = snapshot(buf.state)
  fn = "ExperienceBuffer.load_state_dict"
  _, err = call_named(fn, lambda: buf.load_state_dict(saved))
  assert isinstance(err, ValueError) and "int64 values in" in err.args[0]
  assert_same(buf.state, before)
  saved["data"] = {"x": np.full((T, E), -5, np.int64)}
  saved["counts"] = np.full((1, T), 2**33, np.int64)
  _, err = call_named(fn, lambda: buf.load_state_dict(saved))
  assert isinstance(err, ValueError) and "'counts'" in err.args[0]
  saved["counts"] = np.ones((1, T), np.int64)
  buf.load_state_dict(saved)
  np.testing.assert_array_equal(np.asarray(buf.x), np.full((T, E), -5))
  # DictDataset converts its arrays once, by the same rule.
  _, err = call_named("DictDataset", lambda: DictDataset(
      2, {"a": np.array([2**40, 1, 2, 3])}))
  assert isinstance(err, ValueError) and "int64 values in" in err.args[0]
  ds = DictDataset(2, {"a": np.array([-7, 1, 2, 3])})
  np.testing.assert_array_equal(ds[0]["a"], [-7, 1])


# --- Steps. ---


@settings(max_examples=25)
@given(step=st.one_of(
    st.integers(-3, 6), st.sampled_from([True, 1.0, np.float32(1), "1", None,
                                         np.array([1]), jnp.array(1.5),
                                         np.int64(2**40), jnp.int32(-1)])))
def test_steps_are_integers_in_range(step):
  """A concrete step outside [0, T) is an IndexError, a non-integer one a
  TypeError, in every one-step write."""
  state = fresh_state()
  before = snapshot(state)
  value = np.ones(E, np.float32)
  arr = None if isinstance(step, (bool, str)) or step is None else (
      np.asarray(step))
  if arr is None or arr.shape != () or arr.dtype.kind not in "iu":
    verdict = TypeError
  else:
    verdict = None if 0 <= int(arr) < T else IndexError
  for entry in ONE_STEP:
    call, read = write_entry(entry, state, step, value)
    _, err = call_named(entry, call)
    if verdict is None:
      assert err is None, err
      assert np.asarray(read())[int(arr)].tolist() == [1.0] * E
    else:
      assert isinstance(err, verdict), (entry, err)
      assert verdict is TypeError or re.search(
          r"step -?\d+ is outside the rollout \[0, 4\) \(num_steps=4\); "
          "nothing was written", str(err)), err
  assert_same(state, before)


# --- Flags. ---

FLAG_CALLS = {
    "autoreset_valid": lambda v: jr.autoreset_valid(
        np.zeros((2, 2), bool), np.zeros((2, 2), bool), mode="next_step",
        check=v),
    "DictDataset": lambda v: DictDataset(2, {"a": np.ones(4)}, shuffle=v),
    "finish_rollout": lambda v: jr.finish_rollout(fresh_state(), check=v),
}


@settings(max_examples=25)
@given(fn=st.sampled_from(sorted(FLAG_CALLS)),
       flag=st.sampled_from(NOT_BOOLS))
def test_flags_are_bools(fn, flag):
  """``shuffle="no"`` meant True; now every flag must be a bool."""
  _, err = call_named(fn, lambda: FLAG_CALLS[fn](flag))
  assert isinstance(err, (TypeError, ValueError)), err


# --- Shapes and sizes: refused in Python, never an abort. ---


@settings(max_examples=30)
@given(shape=st.one_of(
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([True, (True,), (2, False), -1, (2, -1), 2.0, (2.0,),
                     "3", None, (2**62,), (2**40, 2**40), np.int64(2),
                     (np.int32(2), 3)])),
       fn=st.sampled_from(["register", "init_running_stats"]))
def test_shapes(shape, fn):
  def ok(s):
    dims = (s,) if isinstance(s, (int, np.integer)) else s
    return (not isinstance(s, (bool, np.bool_, str, float)) and s is not None
            and all(isinstance(d, (int, np.integer))
                    and not isinstance(d, (bool, np.bool_)) and d >= 0
                    for d in dims)
            and math.prod(dims) * T * E * 4 < 2**63)

  call = {"register": lambda: jr.register(jr.init(E, T), "x", shape),
          "init_running_stats": lambda: jr.init_running_stats(shape)}[fn]
  got, err = call_named(fn, call)
  if ok(shape):
    assert err is None, err
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    if fn == "register":
      assert got.data["x"].shape == (T, E, *map(int, dims))
    else:
      assert got.mean.shape == tuple(map(int, dims))
  else:
    assert isinstance(err, (TypeError, ValueError)), err


def test_sizes_that_aborted_the_process_are_value_errors():
  """In a subprocess: each call used to end the interpreter with XLA's
  ``overflow in static extent product`` abort."""
  script = textwrap.dedent("""
      import jax, jrollout as jr
      calls = [
          lambda: jr.register(jr.init(3, 4), "x", shape=(2**40, 2**40)),
          lambda: jr.register(jr.init(3, 4), "x", shape=(2**62,)),
          lambda: jr.register(jr.init(2**31, 2**31), "x", shape=(2**2,)),
          lambda: jr.init_running_stats((2**62, 4)),
          lambda: jr.init_reward_scaler((2**40, 2**40)),
          lambda: jr.minibatch_indices(None, 2**40, 2**39, shuffle=False),
      ]
      for call in calls:
        try:
          call()
          print("accepted")
        except ValueError as err:
          print(str(err).split(":")[0])
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["register"] * 3 + [
      "init_running_stats", "init_reward_scaler", "minibatch_indices"], (
          out.stdout)


def test_dtypes_and_keys():
  for dtype in [str, object, "U3", np.dtype("M8[s]"), [("a", np.int32)],
                jax.random.key(0)]:
    _, err = call_named("register", lambda d=dtype: jr.register(
        jr.init(E, T), "x", dtype=d))
    assert isinstance(err, TypeError), (dtype, err)
  ds = DictDataset(2, {"a": np.arange(4)})
  for j in [True, np.bool_(False), 1.0, "0"]:
    with pytest.raises(TypeError, match="^DictDataset indices must be"):
      ds[j]


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "cpu:99", "cpu:abc",
                                    "cpu:", "cpu:-1", "cpu:01", "cpu:1:2",
                                    "", " cpu", "CPU", "cpu:\u0663", "cpu 0"])
def test_device_strings(device):
  """'cpu' and 'cpu:0' are the first CPU; a string that is not a device
  name, or one JAX does not have, is a ValueError with the fix."""
  if device in ("cpu", "cpu:0"):
    assert ExperienceBuffer(2, 3, device=device).device == jax.devices(
        "cpu")[0]
    return
  with pytest.raises(ValueError, match=(
      rf"^ExperienceBuffer: device {re.escape(repr(device))} is not "
      r"available to JAX \(its devices: .*\); expected 'platform' or "
      r"'platform:index' \(e\.g\. 'cpu' or 'cuda:1'\), None or a "
      r"jax\.Device$")):
    ExperienceBuffer(2, 3, device=device)


# --- Scalar hyperparameters: 0-d arrays are checked like numbers. ---

SCALAR_ARGS = {
    # fn: (call(value), low, high, low_open)
    ("gae", "gamma"): (lambda v: jr.gae(
        np.ones((2, 1), np.float32), np.ones((2, 1), np.float32),
        np.ones(1, np.float32), np.zeros((2, 1), bool), gamma=v), 0, 1, False),
    ("normalize", "eps"): (lambda v: jr.normalize(
        jr.init_running_stats(), np.ones(3, np.float32), eps=v),
     0, None, False),
    ("normalize", "clip"): (lambda v: jr.normalize(
        jr.init_running_stats(), np.ones(3, np.float32), clip=v),
     0, None, True),
    ("denormalize", "eps"): (lambda v: jr.denormalize(
        jr.init_running_stats(), np.ones(3, np.float32), eps=v),
     0, None, False),
    ("scale_rewards", "gamma"): (lambda v: jr.scale_rewards(
        jr.init_reward_scaler(2), np.ones(2, np.float32), np.zeros(2, bool),
        gamma=v), 0, 1, False),
    ("scale_rewards", "clip"): (lambda v: jr.scale_rewards(
        jr.init_reward_scaler(2), np.ones(2, np.float32), np.zeros(2, bool),
        gamma=0.9, clip=v), 0, None, True),
    ("scale_rollout_rewards", "eps"): (lambda v: jr.scale_rollout_rewards(
        jr.init_reward_scaler(2), np.ones((3, 2), np.float32),
        np.zeros((3, 2), bool), gamma=0.9, eps=v), 0, None, False),
    ("normalize_advantages", "eps"): (lambda v: jr.normalize_advantages(
        np.arange(4, dtype=np.float32), eps=v), 0, None, False),
}
NUMBERS = [0.0, 0.5, 1.0, 1.5, -1.0, 2, 0, math.nan, math.inf]
SCALAR_VALUES = st.one_of(
    st.sampled_from(NUMBERS),
    st.sampled_from(NUMBERS).map(np.float32),
    st.sampled_from(NUMBERS).map(lambda x: jnp.asarray(x, jnp.float32)),
    st.sampled_from([None, "0.9", True, np.bool_(True), jnp.array(True),
                     0.5 + 0j, np.complex64(0.5), jnp.array(0.5 + 1j),
                     jnp.array([0.5, 0.5]), np.array([0.5]), [0.5],
                     jnp.array(1, jnp.int32), np.int64(1)]))


def scalar_verdict(value, low, high, low_open, optional):
  """The rule of ``_checks.check_scalar``, written out independently."""
  if value is None and optional:
    return None
  if value is None or isinstance(value, (str, bool, np.bool_, complex, list)):
    return TypeError
  dtype = np.asarray(value).dtype
  if dtype.kind not in "iuf":
    return TypeError
  if np.shape(value) != ():
    return ValueError
  x = float(np.asarray(value))
  if math.isnan(x) or (x <= low if low_open else x < low) or (
      high is not None and x > high):
    return ValueError
  return None


_JITTED = {}


@settings(max_examples=30)
@given(which=st.sampled_from(sorted(SCALAR_ARGS)), value=SCALAR_VALUES,
       traced=st.booleans())
def test_scalar_hyperparameters(which, value, traced):
  """``scalar_verdict``'s errors; a call that passes equals the call with
  the plain float. Traced 0-d values pass unchecked."""
  fn, name = which
  call, low, high, low_open = SCALAR_ARGS[which]
  optional = name == "clip"
  verdict = scalar_verdict(value, low, high, low_open, optional)
  real_scalar = (verdict is not TypeError and value is not None
                 and np.shape(value) == ())
  if traced and real_scalar:
    if which not in _JITTED:
      _JITTED[which] = jax.jit(call)
    got = _JITTED[which](jnp.asarray(value, jnp.float32))   # not checked
    if verdict is None:
      want = call(float(np.asarray(value)))
      jax.tree_util.tree_map(np.testing.assert_allclose, got, want)
    return
  got, err = call_named(fn, lambda: call(value))
  if verdict is None:
    assert err is None, err
    want = call(None if value is None else float(np.asarray(value)))
    jax.tree_util.tree_map(np.testing.assert_allclose, got, want)
  else:
    assert isinstance(err, verdict), (value, err)


# --- Stacks of states (vmap) and consumed (donated) states. ---

STATE_CALLS = {
    "update_at": lambda s: jr.update_at(s, 0, {"x": jnp.ones(E)}),
    "update_all": lambda s: jr.update_all(s, {"x": jnp.ones((T, E))}),
    "make_batch": lambda s: jr.make_batch(s, check="off"),
    "finish_rollout": lambda s: jr.finish_rollout(s, check="off"),
    "write_counts": jr.write_counts,
    "is_complete": jr.is_complete,
    "register": lambda s: jr.register(s, "y"),
    "take": lambda s: jr.take(s, jnp.arange(2)),
    "scan_minibatches": lambda s: jr.scan_minibatches(
        lambda c, mb: (c, mb["x"].sum()), 0.0, None, s, 2, shuffle=False),
    "RolloutWriter": jr.RolloutWriter,
}


@pytest.mark.parametrize("fn", sorted(STATE_CALLS))
def test_a_vmapped_stack_is_refused_outside_vmap(fn):
  """Outside vmap a stack is refused with the fix; under vmap each state is
  one state."""
  stack = jax.vmap(lambda _: fresh_state())(jnp.arange(2))
  stack = jax.vmap(lambda s: jr.update_at(s, 1, {"x": jnp.full(E, 2.0)}))(
      stack)
  before = snapshot(stack)
  _, err = call_named(fn, lambda: STATE_CALLS[fn](stack))
  assert isinstance(err, ValueError) and "stack of states" in err.args[0]
  assert (f"call {fn} under jax.vmap" in err.args[0]) == fn.islower(), err
  assert_same(stack, before)
  if fn == "RolloutWriter":
    return   # host-loop calls: one state at a time, never under vmap
  with pytest.raises(ValueError, match="stack of states"):
    jax.jit(STATE_CALLS[fn])(stack)
  got = jax.vmap(STATE_CALLS[fn])(stack)
  one = STATE_CALLS[fn](jax.tree_util.tree_map(lambda x: x[0], stack))
  jax.tree_util.tree_map(
      lambda g, o: np.testing.assert_array_equal(np.asarray(g)[0], o),
      got, one)


@pytest.mark.parametrize("fn", sorted(STATE_CALLS))
def test_a_consumed_state_is_refused(fn):
  """A state donated to a writer is refused naming the call and the fix."""
  state = fresh_state()
  writer = jr.RolloutWriter(state, flush_every=1)
  writer.update_at(0, {"x": jnp.ones(E)})   # consumes `state`
  _, err = call_named(fn, lambda: STATE_CALLS[fn](state))
  assert isinstance(err, ValueError) and re.search(
      r"`\w+` was consumed: the buffers of \['x', 'counts', 'out_of_range'\] "
      r"were deleted .* Use the state that call holds now \(`writer.state`\)",
      err.args[0]), err


def test_second_writer_on_one_state_and_writes_on_none():
  state = fresh_state()
  first, second = jr.RolloutWriter(state), jr.RolloutWriter(state)
  second.update_at(0, {"x": np.ones(E, np.float32)})   # queued, not written
  for t in range(T):
    first.update_at(t, {"x": np.full(E, t, np.float32)})
  first.flush()   # consumes `state`, which `second` holds too
  _, err = call_named("RolloutWriter", second.flush)
  assert isinstance(err, ValueError) and "consumed by another" in err.args[0]
  assert second.pending == 1
  _, err = call_named("RolloutWriter", lambda: jr.RolloutWriter(state))
  assert isinstance(err, ValueError) and "was consumed" in err.args[0]
  np.testing.assert_array_equal(np.asarray(first.state.data["x"])[:, 0],
                                np.arange(T))
  for bad in [None, {"x": 1}, fresh_state().data]:
    _, err = call_named("update_at", lambda b=bad: jr.update_at(b, 0, {}))
    assert isinstance(err, TypeError) and "must be a RolloutState" in str(err)
  _, err = call_named("update_at", lambda: jr.update_at(fresh_state(),
                                                        [1, [2]], {}))
  assert isinstance(err, TypeError), err


@settings(max_examples=15)
@given(ops=st.lists(st.tuples(st.integers(-1, T), st.sampled_from(
    list(WRITER_VALUES))), max_size=12), flush_every=st.integers(1, 4))
def test_writer_failures_leave_the_queue_as_it_was(ops, flush_every):
  """Good and bad writes in any order: only the good ones land."""
  assert_writer_applies_only_good_writes(ops, flush_every, WRITER_VALUES,
                                         refused={"shape"})
