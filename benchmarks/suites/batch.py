"""From a full buffer to a batch: make_batch, and batch + first epoch.

Measurements: make_batch_W2 (<= 1.0x torch transpose+reshape) and
batch_plus_epoch_W2 (scan_minibatches straight on the RolloutState,
<= 0.35x torch make_dict + DictDataset epoch).
"""

from __future__ import annotations

import jax
import numpy as np
import torch

import jrollout as jr
from benchmarks import harness as h
from benchmarks import workloads as wl
from benchmarks.baselines import jax_idiom
from benchmarks.baselines import torch_ref
from benchmarks.suites import _common as c


def _torch_buffer(w: wl.Workload, data: dict[str, np.ndarray]):
  buf = torch_ref.buffer_from(w.num_envs, w.num_steps, w.shapes)
  for k, v in data.items():
    buf.storage[k].copy_(torch.from_numpy(v))
  return buf


def _make_batch_build(config: h.Config):
  w = wl.get("W2", config.quick)
  data = wl.rollout(w)
  state = wl.full_state(w, data)
  buf = _torch_buffer(w, data)

  def jr_make_batch(check: bool):
    def setup():
      def run():
        batch, new_state = jr.make_batch(state, check=check)
        jax.block_until_ready((batch, new_state))
        return batch
      return run
    return setup

  def torch_make_dict():
    return buf.make_dict

  def jit_flatten():
    f = jax.jit(jax_idiom.flatten)
    d = dict(state.data)
    return lambda: jax.block_until_ready(f(d))

  def numpy_bound():
    return lambda: wl.env_major(data)

  return [
      h.Impl("jr.make_batch", jr_make_batch(True), "jrollout", c.same),
      h.Impl("jr.make_batch(check=False)", jr_make_batch(False), "jrollout",
             c.same),
      h.Impl("torch transpose(0,1).reshape", torch_make_dict, "torch",
             c.same),
      h.Impl("jax.jit(swapaxes+reshape) of data only", jit_flatten,
             "jax-idiom", c.same),
      h.Impl("numpy ascontiguousarray(swapaxes) (bound)", numpy_bound,
             "numpy", c.same),
  ]


def _batch_plus_epoch_build(config: h.Config):
  w = wl.get("W2", config.quick)
  b = wl.batch_size("W2", 4096, config.quick)
  data = wl.rollout(w)
  state = wl.full_state(w, data)
  buf = _torch_buffer(w, data)
  key = jax.random.key(0)
  expected = wl.sums_of(wl.env_major(data))

  def torch_full():
    def run():
      return torch_ref.epoch_sums(buf.make_dict(), b)
    return run

  def make_batch_then_scan():
    epoch = c.make_jr_epoch(b)
    carry = c.zero_sums(w.shapes)

    def run():
      batch, _ = jr.make_batch(state)
      return jax.block_until_ready(epoch(carry, key, batch))
    return run

  def idiom():
    epoch = jax_idiom.make_flatten_epoch(c.sum_fn, b)
    carry = c.zero_sums(w.shapes)
    d = dict(state.data)
    return lambda: jax.block_until_ready(epoch(carry, key, d)[0])

  def numpy_model():
    return lambda: expected

  return [
      h.Impl("jr.scan_minibatches on RolloutState",
             c.jr_epoch_impl(state, b, key), "jrollout", c.same),
      h.Impl("torch make_dict + DictDataset epoch", torch_full, "torch",
             c.same),
      h.Impl("jr.make_batch + jr.scan_minibatches", make_batch_then_scan,
             "reference", c.same),
      h.Impl("jax idiom flatten+permutation+gather+scan", idiom, "jax-idiom",
             c.same),
      # Untimed: the independent expected sums.
      h.Impl("numpy model", numpy_model, "numpy", c.same, timed=False),
  ]


MEASUREMENTS = [
    h.Measurement(
        name="make_batch_W2",
        description=("[T, E, ...] storage to an env-major [E*T, ...] batch, "
                     "W2 (E=4096, T=32), 6 keys"),
        build=_make_batch_build,
        baseline="torch transpose(0,1).reshape",
        targets=[h.Target("jr.make_batch", "torch transpose(0,1).reshape",
                          1.0)],
    ),
    h.Measurement(
        name="batch_plus_epoch_W2",
        description=("full buffer to the end of the first shuffled epoch, W2, "
                     "B=4096 (fn sums every key)"),
        build=_batch_plus_epoch_build,
        baseline="torch make_dict + DictDataset epoch",
        targets=[h.Target("jr.scan_minibatches on RolloutState",
                          "torch make_dict + DictDataset epoch", 0.35)],
    ),
]
