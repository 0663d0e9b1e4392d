"""One shuffled epoch over a flat batch, and the share of the permutation.

epoch_<W>_B<B>[_expert] (``epoch(name, b)``, for any workload: the GPU run
makes epoch_GPU_B4096): jrollout (jitted ``scan_minibatches`` whose body
sums every key, from a flat batch and, without the expert key, from the
RolloutState) vs the torch DictDataset loop (<= 0.5x), the numpy ``np.take``
bound (<= 1.5x; on the host only) and the JAX idiom (no target). The expert
variants add ``expert_obs [N/4, 128]``, read with modulo wrap. The row
"jax scan, contiguous minibatches (no gather)" runs the same body over
minibatches sliced in order from a batch made ``N`` rows long beforehand:
no shuffle and no gather, so it is the floor for any JAX epoch with this
body, and it shows what XLA:CPU's scheduling of the body alone costs.

epoch_W2_remainder: the jrollout epoch at W2 with B=4096 (divides N) beside
B=5000 with ``remainder="drop"`` (26 minibatches) and ``"wrap"`` (27): time
per row used is time / (M * B), to compare with the divisible case.

permutation_share_W2: ``jr.minibatch_indices`` / the jrollout epoch at W2,
B=4096 (<= 0.10), with jax.random.permutation, np.random.permutation and
torch.randperm of N for reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jrollout as jr
from benchmarks import harness as h
from benchmarks import workloads as wl
from benchmarks.baselines import torch_ref
from benchmarks.suites import _common as c

JR = "jr.scan_minibatches (jit)"
JR_STATE = "jr.scan_minibatches on RolloutState"
TORCH = "torch DictDataset loop"
NUMPY = "numpy np.take (bound)"
CONTIGUOUS = "jax scan, contiguous minibatches (no gather)"


def _epoch_build(name: str, b: int, expert: bool, config: h.Config):
  w = wl.get(name, config.quick)
  b = wl.batch_size(name, b, config.quick)
  device = config.torch_device
  if expert:
    nbatch = wl.flat_batch(w, expert=True)
  else:   # the rollout's env-major rows: the same batch as its RolloutState
    data = wl.rollout(w)
    nbatch = wl.env_major(data)
  jbatch = {k: jnp.asarray(v) for k, v in nbatch.items()}
  tbatch = {k: torch.from_numpy(v).to(device) for k, v in nbatch.items()}
  key = jax.random.key(0)
  expected = wl.sums_of(nbatch)
  sync = c.torch_sync(device)

  def torch_epoch():
    def run():
      sums = torch_ref.epoch_sums(tbatch, b)
      sync()
      return sums
    return run

  def minibatches_loop():
    acc = jax.jit(c.sum_fn)
    carry0 = c.zero_sums(c.shapes_of(jbatch))

    def run():
      carry = carry0
      for mb in jr.minibatches(key, jbatch, b):
        carry, _ = acc(carry, mb)
      return jax.block_until_ready(carry)
    return run

  impls = [h.Impl(JR, c.jr_epoch_impl(jbatch, b, key), "jrollout", c.same)]
  if not expert:
    impls.append(h.Impl(JR_STATE,
                        c.jr_epoch_impl(wl.full_state(w, data), b, key),
                        "jrollout", c.same))
  impls += [
      h.Impl(CONTIGUOUS, functools.partial(_contiguous_setup, nbatch, b),
             "jax-idiom", c.same),
      h.Impl(TORCH, torch_epoch, "torch", c.same),
  ]
  if config.on_host:
    impls.append(h.Impl(NUMPY, c.numpy_take_impl(nbatch), "numpy", c.same))
  return impls + [
      h.Impl("jax idiom permutation+gather+scan",
             c.idiom_epoch_impl(jbatch, b, key), "jax-idiom", c.same),
      h.Impl("jr.minibatches python loop + jitted fn", minibatches_loop,
             "reference", c.same),
      h.Impl("numpy model", lambda: lambda: expected, "numpy", c.same,
             timed=False),
  ]


def _contiguous_setup(nbatch: dict[str, np.ndarray], b: int):
  """The epoch body over ``[N / B, B, ...]`` slices of a wrapped copy.

  Shorter keys are tiled to ``N`` rows up front (not timed), which is the
  modulo wrap's row multiset, so the sums equal every other row's.
  """
  n = max(len(v) for v in nbatch.values())
  split = {k: jnp.asarray(np.resize(v, (n, *v.shape[1:]))
                          .reshape(n // b, b, *v.shape[1:]))
           for k, v in nbatch.items()}
  carry = c.zero_sums(c.shapes_of(nbatch))
  epoch = jax.jit(lambda cr, x: jax.lax.scan(c.sum_fn, cr, x)[0])
  return lambda: jax.block_until_ready(epoch(carry, split))


def epoch(name: str, b: int, expert: bool = False) -> h.Measurement:
  """One shuffled epoch of workload ``name`` in minibatches of ``b`` rows."""
  w = wl.get(name, False)
  suffix = "_expert" if expert else ""
  return h.Measurement(
      name=f"epoch_{name}_B{b}{suffix}",
      description=(f"one shuffled epoch summing every key, {w.label()}, "
                   f"N={w.num_rows}, B={b}"
                   + (", + expert_obs [N/4, 128]" if expert else "")),
      build=functools.partial(_epoch_build, name, b, expert),
      baseline=TORCH,
      targets=[h.Target(JR, TORCH, 0.5),
               h.Target(JR, NUMPY, 1.5, optional=True),
               # The floor under the same bound: rounds where it misses too
               # are XLA:CPU running the body, not jrollout's gathers.
               h.Target(CONTIGUOUS, NUMPY, 1.5, optional=True)],
  )


def _remainder_build(config: h.Config):
  w = wl.get("W2", config.quick)
  nbatch = wl.flat_batch(w)
  jbatch = {k: jnp.asarray(v) for k, v in nbatch.items()}
  key = jax.random.key(0)
  impls = []
  for full_b, mode in ((4096, "error"), (5000, "drop"), (5000, "wrap")):
    b = wl.batch_size("W2", full_b, config.quick)
    idx = np.asarray(jr.minibatch_indices(key, w.num_rows, b,
                                          remainder=mode)).ravel()
    expected = {k: v[idx % len(v)].sum(0) for k, v in nbatch.items()}

    def check(out, expected=expected, label=f"B={b} {mode}"):
      for k, v in expected.items():   # the rows the mode's model uses
        np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=label)
      return True

    epoch = jax.jit(functools.partial(_remainder_epoch, b, mode))
    impls.append(h.Impl(
        f"B={full_b} remainder={mode!r}",
        functools.partial(_remainder_setup, epoch, jbatch, key), "jrollout",
        check))
  return impls


def _remainder_epoch(b, mode, carry, key, batch):
  return jr.scan_minibatches(c.sum_fn, carry, key, batch, b,
                             remainder=mode)[0]


def _remainder_setup(epoch, batch, key):
  carry = c.zero_sums(c.shapes_of(batch))
  return lambda: jax.block_until_ready(epoch(carry, key, batch))


def _permutation_build(config: h.Config):
  w = wl.get("W2", config.quick)
  n = w.num_rows
  b = wl.batch_size("W2", 4096, config.quick)
  key = jax.random.key(0)
  jbatch = {k: jnp.asarray(v) for k, v in wl.flat_batch(w).items()}

  def indices():
    idx = jr.minibatch_indices(key, n, b)
    got = np.sort(np.asarray(idx).ravel())
    assert idx.shape == (n // b, b) and (got == np.arange(n)).all(), (
        "minibatch_indices is not a permutation of range(N)")
    return lambda: jr.minibatch_indices(key, n, b).block_until_ready()

  def jax_perm():
    f = jax.jit(lambda k: jax.random.permutation(k, n))
    return lambda: f(key).block_until_ready()

  return [
      h.Impl("jr.minibatch_indices", indices, "jrollout"),
      h.Impl("jrollout epoch (scan_minibatches)",
             c.jr_epoch_impl(jbatch, b, key), "jrollout"),
      h.Impl("jax.random.permutation (jit)", jax_perm, "jax-idiom"),
      h.Impl("np.random.permutation", lambda: lambda: np.random.permutation(n),
             "numpy"),
      h.Impl("torch.randperm", lambda: lambda: torch.randperm(n), "torch"),
  ]


MEASUREMENTS = [
    epoch(name, b, expert)
    for name, b in (("W1", 512), ("W1", 2048), ("W2", 4096), ("W2", 32768))
    for expert in (False, True)
] + [
    h.Measurement(
        name="epoch_W2_remainder",
        description=("one shuffled epoch summing every key, W2, "
                     f"N={wl.W2.num_rows}: B=4096 (32 x 4096 = 131072 rows "
                     "used) vs B=5000 with remainder='drop' (26 x 5000 = "
                     "130000) and 'wrap' (27 x 5000 = 135000)"),
        build=_remainder_build,
        baseline="B=4096 remainder='error'",
    ),
    h.Measurement(
        name="permutation_share_W2",
        description=("the shuffle order alone vs a whole jrollout epoch, W2, "
                     f"N={wl.W2.num_rows}, B=4096"),
        build=_permutation_build,
        baseline="jrollout epoch (scan_minibatches)",
        targets=[h.Target("jr.minibatch_indices",
                          "jrollout epoch (scan_minibatches)", 0.10)],
    ),
]
