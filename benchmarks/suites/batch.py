"""From a full buffer to a batch: make_batch, and batch + first epoch.

Measurements: make_batch_W2 (<= 1.0x torch transpose+reshape) and
batch_plus_epoch_W2 (scan_minibatches straight on the RolloutState,
<= 0.35x torch make_dict + DictDataset epoch). ``make_batch(name)`` makes
the first for any workload (the GPU run: make_batch_GPU).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import torch

import jrollout as jr
from benchmarks import harness as h
from benchmarks import workloads as wl
from benchmarks.baselines import jax_idiom
from benchmarks.baselines import torch_ref
from benchmarks.suites import _common as c

TORCH = "torch transpose(0,1).reshape"


def _torch_buffer(w: wl.Workload, data: dict[str, np.ndarray],
                  device: str = "cpu"):
  buf = torch_ref.buffer_from(w.num_envs, w.num_steps, w.shapes, device)
  for k, v in data.items():
    buf.storage[k].copy_(torch.from_numpy(v))
  return buf


def _make_batch_build(name: str, config: h.Config):
  w = wl.get(name, config.quick)
  data = wl.rollout(w)
  state = wl.full_state(w, data)
  buf = _torch_buffer(w, data, config.torch_device)
  sync = c.torch_sync(config.torch_device)

  def jr_make_batch(check: str):
    def setup():
      def run():
        batch, new_state = jr.make_batch(state, check=check)
        jax.block_until_ready((batch, new_state))
        return batch
      return run
    return setup

  def torch_make_dict():
    def run():
      batch = buf.make_dict()
      sync()
      return batch
    return run

  def jit_flatten():
    f = jax.jit(jax_idiom.flatten)
    d = dict(state.data)
    return lambda: jax.block_until_ready(f(d))

  def numpy_bound():
    return lambda: wl.env_major(data)

  impls = [
      h.Impl("jr.make_batch", jr_make_batch("error"), "jrollout", c.same),
      h.Impl("jr.make_batch(check='off')", jr_make_batch("off"), "jrollout",
             c.same),
      h.Impl(TORCH, torch_make_dict, "torch", c.same),
      h.Impl("jax.jit(swapaxes+reshape) of data only", jit_flatten,
             "jax-idiom", c.same),
  ]
  if config.on_host:
    impls.append(h.Impl("numpy ascontiguousarray(swapaxes) (bound)",
                        numpy_bound, "numpy", c.same))
  return impls


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


def make_batch(name: str) -> h.Measurement:
  """A full rollout of workload ``name`` to its env-major batch."""
  w = wl.get(name, False)
  return h.Measurement(
      name=f"make_batch_{name}",
      description=(f"[T, E, ...] storage to an env-major [E*T, ...] batch, "
                   f"{w.label()}, {len(w.shapes)} keys"),
      build=functools.partial(_make_batch_build, name),
      baseline=TORCH,
      targets=[h.Target("jr.make_batch", TORCH, 1.0)],
  )


MEASUREMENTS = [
    make_batch("W2"),
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
