"""Tests of the trace-time validators in jrollout._checks and the cast rule
of writes."""

import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout import _casts
from jrollout import _checks

BOOL, INTS, FLOATS, COMPLEX = (
    [np.bool_], [np.int8, np.int32, np.uint8, np.int64],
    [np.float16, np.float32, np.float64, jnp.bfloat16], [np.complex64])


def _expected(src, dst):
  """The cast policy written as a table: which kinds may go where."""
  kind = {**{d: "b" for d in BOOL}, **{d: "i" for d in INTS},
          **{d: "f" for d in FLOATS}, **{d: "c" for d in COMPLEX}}
  allowed = {"b": "bifc", "i": "ifc", "f": "fc", "c": "c"}
  return kind[dst] in allowed[kind[src]]


@pytest.mark.parametrize("src", BOOL + INTS + FLOATS + COMPLEX)
@pytest.mark.parametrize("dst", BOOL + INTS + FLOATS + COMPLEX)
def test_can_cast_policy(src, dst):
  assert _casts.can_cast(np.dtype(src), np.dtype(dst)) == _expected(src, dst)


@pytest.mark.parametrize("value, exc, match", [
    (0, ValueError, r"^f: `n` must be positive, got 0$"),
    (-3, ValueError, r"^f: `n` must be positive, got -3$"),
    ("4", TypeError, r"^f: `n` must be an int, got str '4'$"),
    (2.0, TypeError, r"^f: `n` must be an int, got float 2.0$"),
    (None, TypeError, r"^f: `n` must be an int, got NoneType None$"),
    (True, TypeError, r"^f: `n` must be an int, got bool True$"),
    (np.bool_(True), TypeError, r"^f: `n` must be an int, got bool True$"),
    (np.float32(3), TypeError,
     r"^f: `n` must be an int, got float32 np.float32\(3.0\)$"),
])
def test_positive_int_refuses(value, exc, match):
  """One check for every size: TypeError for a type, ValueError for a value."""
  with pytest.raises(exc, match=match):
    _checks.positive_int("f", "n", value)


def test_positive_int_accepts_python_numpy_and_concrete_jax_ints():
  assert _checks.positive_int("f", "n", 3) == 3
  for value in (np.int64(5), np.uint8(5), jnp.int32(5)):
    got = _checks.positive_int("f", "n", value)
    assert got == 5 and type(got) is int


def test_concrete_int():
  assert _casts.concrete_int(3) == 3
  assert _casts.concrete_int(np.int32(4)) == 4
  assert _casts.concrete_int(jnp.int32(5)) == 5
  with pytest.raises(TypeError, match="bool"):
    _casts.concrete_int(True)
  with pytest.raises(TypeError, match=r"shape \(2,\)"):
    _casts.concrete_int(np.array([1, 2]))


# --- One rule for bools: a bool is not an int, a size or a dimension. ---


@pytest.mark.parametrize("shape, got", [
    ((True,), r"\(True,\)"),
    ((2, False), r"\(2, False\)"),
    ([np.bool_(True), 3], r"\[np.True_, 3\]|\[True, 3\]"),
])
def test_check_shape_refuses_a_bool_dimension(shape, got):
  with pytest.raises(TypeError, match=rf"^f: field 'x': `shape` must be a "
                     rf"tuple "
                     rf"of ints, got ({got}) \(a bool is not a dimension\)$"):
    _checks.check_shape("f", shape, "x")


@pytest.mark.parametrize("shape", [True, np.bool_(False)])
def test_check_shape_refuses_a_bool_shape(shape):
  with pytest.raises(TypeError, match=r"^f: `shape` must be a tuple of ints, "
                     rf"got bool {shape!r}$"):
    _checks.check_shape("f", shape)


def test_check_shape_accepts_ints():
  assert _checks.check_shape("f", 3) == (3,)
  assert _checks.check_shape("f", (np.int32(2), 0)) == (2, 0)
  assert _checks.check_shape("f", []) == ()
  with pytest.raises(TypeError, match=r"^f: `shape` must be a tuple of ints, "
                     r"got \(2.0,\)$"):
    _checks.check_shape("f", (2.0,))


def _entry_points():
  state = jr.init(3, 4)
  return [
      ("init", lambda: jr.init(True, 4)),
      ("init", lambda: jr.init(3, np.bool_(True))),
      ("register", lambda: jr.register(state, "x", (True,))),
      ("register", lambda: jr.register(state, "x", (2, False))),
      ("register", lambda: jr.register(state, "x", True)),
  ]


def test_a_bool_is_never_a_size_or_a_dimension():
  """Every entry point that takes a size or a shape refuses a bool in it
  (``shape=(True,)`` is not ``(1,)``) with a TypeError that names the
  function and says a bool was given."""
  for fn, call in _entry_points():
    with pytest.raises(TypeError) as info:
      call()
    message = str(info.value)
    assert message.startswith(f"{fn}: ") and "bool" in message, message


# --- Array arguments: dtype and shape validators. ---


def test_check_floating():
  _checks.check_floating("f", "x", np.zeros(2, np.float32))
  _checks.check_floating("f", "x", jnp.zeros(2, jnp.bfloat16))
  with pytest.raises(TypeError, match=r"^f: `x` has dtype int32, expected a "
                     r"floating dtype \(cast it, e\.g\. "
                     r"`x\.astype\(jnp\.float32\)`\)$"):
    _checks.check_floating("f", "x", np.zeros(2, np.int32))
  with pytest.raises(TypeError, match=r"^f: `v` has dtype bool, expected a "
                     r"floating dtype \(it must be\)$"):
    _checks.check_floating("f", "v", [True], "it must be")
  with pytest.raises(TypeError, match=r"^f: `x` is not an array of numbers"):
    _checks.check_floating("f", "x", [[1.0], [1.0, 2.0]])


def test_check_bool_array():
  _checks.check_bool_array("f", "m", np.zeros(2, bool))
  for bad, name in ((np.zeros(2, np.float32), "float32"),
                    (np.zeros(2, np.uint8), "uint8"), ([1, 0], "int64")):
    with pytest.raises(TypeError, match=rf"^f: `m` has dtype {name}, expected "
                       r"bool \(e\.g\. `m\.astype\(bool\)`, True where it "
                       r"applies\)$"):
      _checks.check_bool_array("f", "m", bad)


def test_check_shape_equal_and_trailing():
  _checks.check_shape_equal("f", "v", np.zeros((2, 3)), (2, 3), "r.shape")
  with pytest.raises(ValueError, match=r"^f: `v` has shape \(3, 2\), expected "
                     r"\(2, 3\) = r\.shape$"):
    _checks.check_shape_equal("f", "v", np.zeros((3, 2)), (2, 3), "r.shape")
  assert _checks.check_trailing("f", "x", np.zeros((4, 5, 2)), (2,),
                                "the sample shape") == (4, 5)
  assert _checks.check_trailing("f", "x", np.zeros(2), (2,), "s") == ()
  for bad in (np.zeros((2, 3)), np.zeros(())):
    with pytest.raises(ValueError, match=r"^f: `x` has shape .*, expected "
                       r"\[\.\.\., \*\(2,\)\] \(any leading axes, then the "
                       r"sample shape \(2,\)\)$"):
      _checks.check_trailing("f", "x", bad, (2,), "the sample shape")


def test_check_instance_and_unstacked():
  class Thing:
    pass
  _checks.check_instance("f", "s", Thing(), Thing, "thing")
  with pytest.raises(TypeError, match=r"^f: `s` must be a Thing \(from "
                     r"jr\.thing\), got dict$"):
    _checks.check_instance("f", "s", {}, Thing, "thing")
  _checks.check_unstacked("f", "s", jnp.zeros((), jnp.uint32), "things")
  with pytest.raises(ValueError, match=r"^f: `s` is a stack of things \(count "
                     r"of shape \(3,\)\); map over the stack with jax\.vmap$"):
    _checks.check_unstacked("f", "s", jnp.zeros(3, jnp.uint32), "things")


def test_check_float_dtype():
  assert _casts.check_float_dtype("f", "dtype", jnp.bfloat16) == jnp.bfloat16
  with pytest.raises(TypeError, match=r"^f: `dtype` must be a floating dtype, "
                     r"got int32$"):
    _casts.check_float_dtype("f", "dtype", np.int32)
  with pytest.raises(TypeError, match=r"^f: `dtype` float64 is not available "
                     r"with jax_enable_x64 disabled \(JAX would store "
                     r"float32\); use float32$"):
    _casts.check_float_dtype("f", "dtype", np.float64)
  with pytest.raises(TypeError, match=r"^f: field 'k': dtype int64 is not "
                     r"available with jax_enable_x64 disabled \(JAX would "
                     r"store int32\); register int32 or enable x64$"):
    _casts.check_dtype("f", "k", np.int64)


def test_positive_ints():
  assert _checks.positive_ints("f", "n", 3) == (3,)
  assert _checks.positive_ints("f", "n", (2, np.int64(3))) == (2, 3)
  assert _checks.positive_ints("f", "n", [4]) == (4,)
  with pytest.raises(TypeError, match=r"^f: `n` must be an int, got bool "
                     r"True$"):
    _checks.positive_ints("f", "n", (2, True))
  with pytest.raises(ValueError, match=r"^f: `n` must be positive, got 0$"):
    _checks.positive_ints("f", "n", (2, 0))
