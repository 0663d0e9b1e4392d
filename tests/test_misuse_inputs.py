"""Misuse of the inputs (issue 40, item 5), without torch: each case raises
an error naming the function, the argument (and the key) and what was
given, at trace time where it is static, and leaves its inputs unchanged.

- non-numeric leaves (str, objects, numpy arrays of str or objects) and
  dict keys that are not str, in the inputs of ``take``, ``minibatches``,
  ``scan_minibatches``, the sequence functions and ``DictDataset``;
- a scan's step function that does not return a ``(carry, out)`` pair;
- string and NaN flags in ``gae`` / ``normalize_advantages``;
- unparsable device strings in ``compat.ExperienceBuffer``.

Running statistics fed samples too large to square are in
``tests/test_stats.py``.
"""

import re

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout.compat import DictDataset
from jrollout.compat import ExperienceBuffer
from tests._misuse import assert_same
from tests._misuse import snapshot

N, B, T, E = 8, 4, 3, 4


def _step(carry, mb):
  del mb
  return carry, None


def _flat(batch, jit):
  """Each flat entry point on ``batch``; with ``jit``, called inside a
  jitted function (the batch closed over: a str leaf cannot be a jit
  argument), where the checks run at trace time."""
  key = jax.random.key(0)
  idx = jnp.arange(B, dtype=jnp.int32)
  calls = {
      "take": lambda i: jr.take(batch, i),
      "minibatches": lambda i: next(jr.minibatches(key, batch, B)),
      "scan_minibatches": lambda i: jr.scan_minibatches(
          _step, jnp.zeros(()), key, batch, B),
  }
  if jit:
    return {fn: (lambda f=f: jax.jit(f)(idx)) for fn, f in calls.items()}
  return {fn: (lambda f=f: f(idx)) for fn, f in calls.items()}


def _sequences(data, jit):
  key = jax.random.key(0)
  idx = jnp.arange(2, dtype=jnp.int32)
  calls = {
      "take_sequences": lambda i: jr.take_sequences(data, i),
      "sequence_minibatches": lambda i: next(
          jr.sequence_minibatches(key, data, 2)),
      "scan_sequence_minibatches": lambda i: jr.scan_sequence_minibatches(
          _step, jnp.zeros(()), key, data, 2),
  }
  if jit:
    return {fn: (lambda f=f: jax.jit(f)(idx)) for fn, f in calls.items()}
  return {fn: (lambda f=f: f(idx)) for fn, f in calls.items()}


# --- Non-numeric leaves and non-str keys in a batch. ---

# (bad value of field 's', the path and what the message says it is)
BAD_LEAVES = [
    (np.array(["a"] * N), r"`{arg}\['s'\]` is a numpy array of str "
     r"\(dtype <U1\), expected numbers"),
    (np.array([object()] * N), r"`{arg}\['s'\]` is a numpy array of Python "
     r"objects \(dtype object\), expected numbers"),
    ({"x": np.array([b"a"] * N)}, r"`{arg}\['s'\]\['x'\]` is a numpy array "
     r"of bytes \(dtype \|S1\), expected numbers"),
    ("abcdefgh", r"`{arg}\['s'\]` is a str, not an array or a number"),
    ((np.zeros(N), object()), r"`{arg}\['s'\]\[1\]` is an object, not an "
     r"array or a number"),
]
BAD_KEYS = [
    ({1: np.zeros(N), "a": np.zeros(N)},
     r"`{arg}` has the key 1 of type int; expected str keys"),
    ({1: np.zeros(N), 2: np.zeros(N)},
     r"`{arg}` has the key 1 of type int; expected str keys"),
    ({"a": {"x": np.zeros(N), (0, 1): np.zeros(N)}},
     r"`{arg}\['a'\]` has the key \(0, 1\) of type tuple; expected str keys"),
    ({"a": [np.zeros(N), {None: np.zeros(N)}]},
     r"`{arg}\['a'\]\[1\]` has the key None of type NoneType"),
]


def _like(tree, leading):
  """``tree`` with each numpy array resized to ``leading`` axes, its dicts'
  keys kept as they are (``tree_map`` would sort them)."""
  if isinstance(tree, dict):
    return {k: _like(v, leading) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return type(tree)(_like(v, leading) for v in tree)
  return np.resize(tree, leading) if isinstance(tree, np.ndarray) else tree


def _with_leaf(value, leading):
  return {"a": np.zeros(leading, np.float32), "s": _like(value, leading)}


def _refused_everywhere(batch, data, match, jit, sharded=False):
  """Every flat minibatch function (on ``batch``), every sequence function
  (on ``data``), ``DictDataset`` and, with ``sharded``, the sharded scan
  raise the TypeError ``match`` names, and leave ``batch`` as it was."""
  before = snapshot(batch)
  for fn, call in _flat(batch, jit).items():
    with pytest.raises(TypeError, match="^" + fn + ": "
                       + match.format(arg="batch")):
      call()
  assert_same(batch, before)
  for fn, call in _sequences(data, jit).items():
    with pytest.raises(TypeError, match="^" + fn + ": "
                       + match.format(arg="data")):
      call()
  with pytest.raises(TypeError, match="^DictDataset: "
                     + match.format(arg="tensor_dict")):
    DictDataset(B, batch)
  if sharded:
    mesh = jax.make_mesh((2,), ("d",))
    with pytest.raises(TypeError, match="^scan_minibatches_sharded: "
                       + match.format(arg="batch")):
      jr.scan_minibatches_sharded(lambda c, mb: (c, None), 0.0,
                                  jax.random.key(0), batch, B, mesh=mesh,
                                  axis_name="d")
  assert_same(batch, before)


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("value, match", BAD_LEAVES)
def test_non_numeric_leaves_are_refused_naming_the_path(value, match, jit):
  _refused_everywhere(_with_leaf(value, (N,)), _with_leaf(value, (T, E)),
                      match, jit)


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("batch, match", BAD_KEYS)
def test_dict_keys_that_are_not_str_are_refused_naming_the_dict(
    batch, match, jit):
  _refused_everywhere(batch, _like(batch, (T, E)), match, jit, sharded=True)


@pytest.mark.parametrize("fn", [jr.scan_minibatches,
                                jr.scan_sequence_minibatches])
def test_a_carry_with_keys_jax_cannot_sort_is_refused(fn):
  carry = {"a": jnp.zeros(()), 1: jnp.zeros(())}
  data = {"x": np.zeros((4, 4), np.float32)}   # N = 4 rows, E = 4 envs
  with pytest.raises(TypeError, match=(
      rf"^{fn.__name__}: `carry` has dict keys of types \['int', 'str'\] "
      "that cannot be sorted")):
    fn(_step, carry, None, data, 2, shuffle=False)
  # Keys of one type (not str) are a fine carry: JAX sorts them.
  out, _ = fn(lambda c, mb: (c, None), {1: jnp.ones(()), 2: jnp.zeros(())},
              None, data, 2, shuffle=False)
  assert list(out) == [1, 2]


def test_good_batches_still_pass_and_are_not_recompiled(count_compiles):
  """The checks read only structure and dtypes, in Python: the second call
  of each entry point compiles nothing."""
  key = jax.random.key(0)
  batch = {"a": np.arange(N, dtype=np.float32),
           "n": {"x": np.ones((N, 2), np.int32), "b": np.zeros(N, bool)}}
  data = {"a": np.zeros((T, E), np.float32)}

  def run():
    jr.take(batch, np.arange(B))
    list(jr.minibatches(key, batch, B))
    jr.scan_minibatches(_step, jnp.zeros(()), key, batch, B)
    jr.take_sequences(data, np.arange(2))
    list(jr.sequence_minibatches(key, data, 2))
    jr.scan_sequence_minibatches(_step, jnp.zeros(()), key, data, 2)
    DictDataset(B, batch)[0]

  run()
  with count_compiles() as c:
    run()
  assert c.count == 0


# --- A step function that does not return (carry, out). ---

NOT_PAIRS = [
    (lambda c, mb: c, "an array of dtype float32 and shape (3,)"),
    (lambda c, mb: None, "None"),
    (lambda c, mb: (c, c, c), "a tuple of length 3"),
    (lambda c, mb: [c], "a list of length 1"),
    (lambda c, mb: {"carry": c}, "a dict"),
]


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("step, what", NOT_PAIRS)
@pytest.mark.parametrize("fn", ["scan_minibatches",
                                "scan_sequence_minibatches"])
def test_a_step_function_must_return_a_pair(fn, step, what, jit):
  carry = jnp.arange(3.0)
  before = snapshot(carry)
  data = {"x": np.zeros((4, 4), np.float32)}   # N = 4 rows, E = 4 envs

  def call(carry):
    return getattr(jr, fn)(step, carry, jax.random.key(1), data, 2)

  with pytest.raises(TypeError, match=(
      rf"^{fn}: `fn` must return a pair \(carry, out\), it returned "
      rf"{re.escape(what)}; return \(carry, None\)")):
    (jax.jit(call) if jit else call)(carry)
  assert_same(carry, before)


# --- Flags of gae and normalize_advantages: str and NaN. ---


def _rollout(flags=None, where="terminations"):
  r = np.ones((T, E), np.float32)
  kwargs = {"terminations": np.zeros((T, E), np.float32)}
  if flags is not None:
    kwargs[where] = flags
  if where == "truncations":
    kwargs["final_values"] = r
  return (r, r, r[0]), kwargs


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("where", ["terminations", "truncations", "valid"])
def test_gae_refuses_string_flags_at_trace_time(where, jit):
  flags = np.full((T, E), "no")
  args, kwargs = _rollout(flags, where)
  before = snapshot((args, kwargs))

  def call():
    return jr.gae(*args, **kwargs)

  with pytest.raises(TypeError, match=(
      rf"^gae: `{where}` has dtype <U2, expected bool or numeric flags")):
    jax.jit(call)() if jit else call()
  assert_same((args, kwargs), before)


@pytest.mark.parametrize("where", ["terminations", "truncations", "valid"])
def test_gae_refuses_nan_flags_eagerly(where):
  flags = np.zeros((T, E), np.float32)
  flags[1, 2] = flags[2, 0] = np.nan
  for given in (flags, jnp.asarray(flags)):
    args, kwargs = _rollout(given, where)
    before = snapshot((args, kwargs))
    with pytest.raises(ValueError, match=(
        rf"^gae: `{where}` has NaN at 2 of 12 elements \(the first at flat "
        r"index 6\); a flag is True or False and NaN would read as True")):
      jr.gae(*args, **kwargs)
    assert_same((args, kwargs), before)


@pytest.mark.parametrize("vmap", [False, True], ids=["jit", "jit_vmap"])
@pytest.mark.parametrize("where", ["terminations", "truncations", "valid"])
def test_gae_reports_traced_nan_flags_through_checkify(where, vmap):
  """Under jit the values cannot raise: a checkify check reports them when
  the caller functionalises the function (finish_rollout's mechanism), and
  compiles to nothing otherwise (NaN then reads as True, as documented)."""
  flags = np.zeros((T, E), np.float32)
  flags[2, 1] = np.nan
  r = np.ones((T, E), np.float32)

  def f(r, flags):   # every other flag false, final values 1
    zeros = jnp.zeros(r.shape, r.dtype)
    kwargs = {"terminations": zeros, where: flags}
    if where == "truncations":
      kwargs["final_values"] = r
    return jr.gae(r, r, r[0], **kwargs)

  if vmap:   # over envs: each call sees [T] columns
    f = jax.vmap(f, in_axes=1)
  err, _ = jax.jit(checkify.checkify(f))(r, flags)
  size = T if vmap else T * E
  assert err.get().startswith(
      f"gae: `{where}` has NaN at 1 of {size} elements (the first at flat "
      f"index {2 if vmap else 9})")
  err, _ = jax.jit(checkify.checkify(f))(r, np.zeros((T, E), np.float32))
  assert err.get() is None
  adv = jax.jit(f)(r, flags)[0]   # no checkify: no error, no NaN
  assert np.isfinite(np.asarray(adv)).all()


def test_numeric_flags_without_nan_are_accepted_without_recompiling(
    count_compiles):
  gae = jax.jit(jr.gae)
  r = jnp.ones((T, E))
  gae(r, r, r[0], jnp.zeros((T, E)))
  flags = jnp.asarray(np.eye(T, E, dtype=np.float32))
  with count_compiles() as c:
    adv, _ = gae(r, r, r[0], flags)
  assert c.count == 0
  want, _ = jr.gae(r, r, r[0], flags.astype(bool))
  np.testing.assert_array_equal(adv, want)
  # Integer and bool flags cannot hold a NaN: nothing is read back.
  jr.gae(r, r, r[0], np.eye(T, E, dtype=np.int32))


@pytest.mark.parametrize("name", ["terminations", "truncations"])
def test_autoreset_valid_refuses_nan_flags(name):
  """The gae rule holds in autoreset_valid too: NaN would read as True."""
  flags = {"terminations": np.zeros((3, 2), np.float32),
           "truncations": np.zeros((3, 2), np.float32)}
  flags[name][1, 0] = np.nan
  before = {k: v.copy() for k, v in flags.items()}
  msg = (f"autoreset_valid: `{name}` has NaN at 1 of 6 elements (the first "
         "at flat index 2)")
  with pytest.raises(ValueError, match="^" + re.escape(msg)):
    jr.autoreset_valid(**flags, mode="next_step")
  for k in flags:
    np.testing.assert_array_equal(flags[k], before[k])
  err, _ = jax.jit(checkify.checkify(
      lambda f: jr.autoreset_valid(**f, mode="next_step", check="off")))(
          flags)
  assert err.get().startswith(msg), err.get()
  # Without a NaN the same float flags are accepted, and give the same
  # mask as bools.
  clean = {k: np.nan_to_num(v) for k, v in flags.items()}
  np.testing.assert_array_equal(
      jr.autoreset_valid(**clean, mode="next_step"),
      jr.autoreset_valid(**{k: v.astype(bool) for k, v in clean.items()},
                         mode="next_step"))
  with pytest.raises(TypeError, match=r"autoreset_valid: `terminations` has "
                     r"dtype <U1, expected bool or numeric flags"):
    jr.autoreset_valid(np.array([["a", "b"]]), np.zeros((1, 2)),
                       mode="next_step")


def test_normalize_advantages_valid_flags():
  adv = np.arange(6, dtype=np.float32)
  with pytest.raises(TypeError, match=(
      r"^normalize_advantages: `valid` has dtype <U1, expected bool or "
      "numeric flags")):
    jax.jit(lambda a: jr.normalize_advantages(a, valid=np.array(["1"] * 6)))(
        adv)
  valid = np.array([1, 1, np.nan, 1, 0, 1], np.float32)
  before = valid.copy()
  with pytest.raises(ValueError, match=(
      r"^normalize_advantages: `valid` has NaN at 1 of 6 elements \(the "
      r"first at flat index 2\)")):
    jr.normalize_advantages(adv, valid=valid)
  np.testing.assert_array_equal(valid, before)
  err, _ = jax.jit(checkify.checkify(
      lambda a, v: jr.normalize_advantages(a, valid=v)))(adv, valid)
  assert err.get().startswith("normalize_advantages: `valid` has NaN at 1")


# --- Device strings of the compat classes. ---


@pytest.mark.parametrize("device", ["cpu:abc", "cpu:", "cpu:-1", "cpu:01",
                                    "cpu:1:2", "", " cpu", "CPU", "cpu:\u0663",
                                    "cpu 0"])
def test_unparsable_device_strings_are_refused(device):
  with pytest.raises(ValueError, match=(
      rf"^ExperienceBuffer: `device` {re.escape(repr(device))} is not a "
      r"device name; expected 'platform' or 'platform:index', e\.g\. 'cpu' "
      r"or 'cuda:1'$")):
    ExperienceBuffer(2, 3, device=device)


def test_device_strings_that_parse_still_work():
  assert ExperienceBuffer(2, 3, device="cpu").device == jax.devices("cpu")[0]
  assert ExperienceBuffer(2, 3, device="cpu:0").device == jax.devices(
      "cpu")[0]
  with pytest.raises(ValueError, match=(
      r"^ExperienceBuffer: device 'cpu:99' is not available to JAX")):
    ExperienceBuffer(2, 3, device="cpu:99")
