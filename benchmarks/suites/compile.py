"""Compilation time of a one-epoch ``scan_minibatches`` at W2 (<= 1.0 s).

Every call builds a fresh body function (a new Python object), so nothing
can come from JAX's caches: each sample is a full trace + lower + XLA
compile. The first-call column of the epoch measurements (first call minus
median) tells the same story from the caller's side.
"""

from __future__ import annotations

import jax

import jrollout as jr
from benchmarks import harness as h
from benchmarks import workloads as wl
from benchmarks.baselines import jax_idiom
from benchmarks.suites import _common as c

DICT = "lower+compile, flat batch dict"
STATE = "lower+compile, RolloutState"


def _build(config: h.Config):
  w = wl.get("W2", config.quick)
  b = wl.batch_size("W2", 4096, config.quick)
  key = jax.random.key(0)
  batch = {k: jax.ShapeDtypeStruct((w.num_rows, *s), "float32")
           for k, s in w.shapes.items()}
  state = wl.empty_state(w)
  carry = c.zero_sums(w.shapes)

  def fresh_fn():
    def fn(carry, mb):  # a new function object on every call: no cache hit
      return c.sum_fn(carry, mb)
    return fn

  def jr_jit():
    fn = fresh_fn()
    return jax.jit(lambda carry, key, batch: jr.scan_minibatches(
        fn, carry, key, batch, b)[0])

  def lower_compile(batch_like):
    def setup():
      return lambda: jr_jit().lower(carry, key, batch_like).compile()
    return setup

  def lower_only():
    return lambda: jr_jit().lower(carry, key, batch)

  def idiom():
    return lambda: jax_idiom.make_epoch(fresh_fn(), b).lower(
        carry, key, batch).compile()

  return [
      h.Impl(DICT, lower_compile(batch), "jrollout", reps=1),
      h.Impl(STATE, lower_compile(state), "jrollout", reps=1),
      h.Impl("trace+lower only, flat batch dict", lower_only, "reference",
             reps=1),
      h.Impl("jax idiom lower+compile", idiom, "jax-idiom", reps=1),
  ]


MEASUREMENTS = [
    h.Measurement(
        name="compile_scan_epoch_W2",
        description=("trace + lower + compile of a one-epoch "
                     "scan_minibatches, W2, B=4096 (a fresh fn per call)"),
        build=_build,
        baseline="jax idiom lower+compile",
        targets=[h.Target(DICT, None, 1.0, "absolute"),
                 h.Target(STATE, None, 1.0, "absolute")],
        max_rounds=5,
    ),
]
