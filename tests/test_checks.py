"""Tests of the trace-time validators in jrollout._checks."""

import re

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


@pytest.mark.parametrize("steps, text", [
    ([3], "[3]"), ([0, 1, 2], "[0-2]"), ([0, 2, 3, 7], "[0, 2-3, 7]"),
    ([5, 6, 9, 10, 11], "[5-6, 9-11]"),
])
def test_step_ranges_are_compact(steps, text):
  assert _checks._ranges(steps) == text


def test_describe_problems_lists_only_bad_keys():
  counts = {"a": np.array([1, 1, 1]), "b": np.array([0, 2, 1]),
            "c": np.array([1, 1, 1])}
  oor = {"a": np.array(0), "b": np.array(0), "c": np.array(2)}
  lines = _checks.describe_problems(counts, oor)
  assert lines == [
      "key 'b': missing steps [0]; duplicated steps 1 (x2)",
      "key 'c': 2 write(s) aimed outside [0, 3) (dropped)"]
  with pytest.raises(_checks.IncompleteRolloutError, match="key 'b'"):
    _checks.raise_if_incomplete(counts, oor)
  _checks.raise_if_incomplete({"a": counts["a"]}, {"a": oor["a"]})


@pytest.mark.parametrize("value, exc, match", [
    (0, ValueError, r"f: `n` must be positive, got 0"),
    (-3, ValueError, r"must be positive, got -3"),
    ("4", TypeError, r"f: `n` must be an int, got str '4'"),
    (2.0, TypeError, r"must be an int, got float 2.0"),
])
def test_check_size(value, exc, match):
  with pytest.raises(exc, match=match):
    _checks.check_size("f", "n", value)
  assert _checks.check_size("f", "n", np.int64(3)) == 3


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "4", None])
def test_check_positive_int_refuses(value):
  with pytest.raises(ValueError, match=r"^f: `n` must be a positive int, got "
                     + re.escape(repr(value)) + "$"):
    _checks.check_positive_int("f", "n", value)


def test_check_positive_int_accepts_python_and_numpy_ints():
  assert _checks.check_positive_int("f", "n", 3) == 3
  value = _checks.check_positive_int("f", "n", np.int64(5))
  assert value == 5 and type(value) is int


def test_concrete_int():
  assert _checks.concrete_int(3) == 3
  assert _checks.concrete_int(np.int32(4)) == 4
  assert _checks.concrete_int(jnp.int32(5)) == 5
  with pytest.raises(TypeError, match="bool"):
    _checks.concrete_int(True)
  with pytest.raises(TypeError, match=r"shape \(2,\)"):
    _checks.concrete_int(np.array([1, 2]))
