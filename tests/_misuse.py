"""Helpers of the misuse tests: a refused call names its function and
changes nothing; check bodies shared with the other families' tests."""

import re

import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr

DOCUMENTED = (TypeError, ValueError, KeyError, IndexError)
E, T = 3, 4
# Flags that are not bools (``shuffle="no"`` used to mean True).
NOT_BOOLS = ["no", "yes", 1, 0, 1.0, np.array(True), [], "True"]


def call_named(fn, call):
  """``(result, None)`` or ``(None, error)``; an error must be documented and
  its message must start with ``fn``."""
  try:
    return call(), None
  except DOCUMENTED as err:
    message = err.args[0] if err.args else ""
    assert isinstance(message, str) and message.startswith(f"{fn}"), (
        f"{type(err).__name__} does not name {fn}: {message!r}")
    return None, err


def snapshot(tree):
  """Host copies of the array leaves (none deleted), containers and key
  order; dicts walked by hand (their keys may not sort)."""
  if isinstance(tree, dict):
    return (dict, list(tree), [snapshot(v) for v in tree.values()])
  if type(tree) in (list, tuple):
    return (type(tree), [snapshot(v) for v in tree])
  if hasattr(tree, "shape"):
    if isinstance(tree, jax.Array):
      assert not tree.is_deleted(), "a failed call deleted a buffer"
    return np.array(tree)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if len(leaves) == 1 and leaves[0] is tree:
    return tree
  return (treedef, [snapshot(v) for v in leaves])


def assert_same(tree, snap):
  """``tree`` as ``snapshot`` saw it."""
  np.testing.assert_equal(snapshot(tree), snap)


def fresh_state(dtype=jnp.float32, shape=()):
  return jr.register(jr.init(E, T), "x", shape, dtype)


def assert_writes_refused_with_the_fix(entry, bad_values):
  """Each ``(bad, match)`` of ``bad_values(lead)`` written through ``entry``
  is a TypeError naming the function and field 'x'; nothing changes."""
  state = fresh_state()
  before = snapshot(state)
  writer = jr.RolloutWriter(jax.tree_util.tree_map(jnp.copy, state))
  lead = (T, E) if entry == "update_all" else (E,)
  calls = {"update_at": lambda v: jr.update_at(state, 0, {"x": v}),
           "writer": lambda v: writer.update_at(0, {"x": v}),
           "update_all": lambda v: jr.update_all(state, {"x": v})}
  fn = {"writer": "RolloutWriter.update_at"}.get(entry, entry)
  for bad, match in bad_values(lead):
    _, err = call_named(fn, lambda b=bad: calls[entry](b))
    assert isinstance(err, TypeError) and err.args[0].startswith(
        f"{fn}: field 'x'"), err
    assert re.search(match, err.args[0]), err
  assert writer.pending == 0
  assert_same(state, before)


# Values fed to a writer: "shape" is refused, the others kept as float32.
WRITER_VALUES = {"f32": np.arange(E, dtype=np.float32),
                 "f64": np.arange(E, dtype=np.float64) * 2,
                 "int64-big": np.array([2**40] * E, np.int64),
                 "u8": np.arange(E, dtype=np.uint8) + 7,
                 "shape": np.ones(E + 1, np.float32)}


def assert_writer_applies_only_good_writes(ops, flush_every, values,
                                           refused):
  """A writer fed ``values[what]`` at each ``(step, what)`` of ``ops`` ends
  as the numpy model of only the good ones (step in [0, T), ``what`` not
  ``refused``); a refused write queues nothing."""
  writer = jr.RolloutWriter(fresh_state(), flush_every=flush_every)
  model = np.zeros((T, E), np.float32)
  for step, what in ops:
    pending = writer.pending
    _, err = call_named("RolloutWriter.update_at",
                        lambda s=step, w=what: writer.update_at(
                            s, {"x": values[w]}))
    good = 0 <= step < T and what not in refused
    assert (err is None) == good, (step, what, err)
    if good:
      model[step] = values[what].astype(np.float32)
    else:
      assert writer.pending == pending
  np.testing.assert_array_equal(np.asarray(writer.state.data["x"]), model)
