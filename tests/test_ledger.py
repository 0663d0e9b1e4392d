"""Tests of the write ledger's host-side report (jrollout._ledger)."""

import numpy as np
import pytest

from jrollout import _ledger


@pytest.mark.parametrize("steps, text", [
    ([3], "[3]"), ([0, 1, 2], "[0-2]"), ([0, 2, 3, 7], "[0, 2-3, 7]"),
    ([5, 6, 9, 10, 11], "[5-6, 9-11]"),
])
def test_step_ranges_are_compact(steps, text):
  assert _ledger._ranges(steps) == text


def test_describe_problems_lists_only_bad_keys():
  counts = {"a": np.array([1, 1, 1]), "b": np.array([0, 2, 1]),
            "c": np.array([1, 1, 1])}
  oor = {"a": np.array(0), "b": np.array(0), "c": np.array(2)}
  lines = _ledger.describe_problems(counts, oor)
  assert lines == [
      "field 'b': missing steps [0]; duplicated steps 1 (x2)",
      "field 'c': 2 write(s) aimed outside [0, 3) (dropped)"]
  with pytest.raises(_ledger.IncompleteRolloutError, match="field 'b'"):
    _ledger.raise_stack("f", ("a", "b", "c"), np.stack(list(counts.values())),
                       np.stack(list(oor.values())))
  _ledger.raise_stack("f", ("a",), counts["a"][None], oor["a"][None])


