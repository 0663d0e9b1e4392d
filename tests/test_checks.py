"""Tests of the trace-time validators in jrollout._checks."""

import jax.numpy as jnp
import numpy as np
import pytest

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
  assert _checks.can_cast(np.dtype(src), np.dtype(dst)) == _expected(src, dst)


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
  assert _checks.concrete_int(3) == 3
  assert _checks.concrete_int(np.int32(4)) == 4
  assert _checks.concrete_int(jnp.int32(5)) == 5
  with pytest.raises(TypeError, match="bool"):
    _checks.concrete_int(True)
  with pytest.raises(TypeError, match=r"shape \(2,\)"):
    _checks.concrete_int(np.array([1, 2]))
