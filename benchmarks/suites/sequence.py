"""One shuffled epoch of sequence minibatches: chunks against whole rollouts.

sequence_epoch_E64_T256: the W1 keys over a rollout of E = 64 envs x T = 256
steps, four minibatches of 4,096 steps each, the body summing every key of
every minibatch (so every implementation's result is the rollout's sums):

- ``seq_len=16``: S = 64 * 16 = 1,024 chunks, Sb = 256 per minibatch
  (``[16, 256, ...]``), from a dict and from a RolloutState;
- ``seq_len=T``: whole rollouts, Eb = 16 envs per minibatch
  (``[256, 16, ...]``);
- the same gathers done by ``np.take`` (the numpy bound, one take of the
  epoch's rows per key, order drawn in setup): chunks as rows
  ``(c*L + l) * E + e`` of the ``[T * E, ...]`` view, whole rollouts as
  ``np.take(x, perm, axis=1)``.

The targets reuse the epoch suite's bound (within 1.5x of ``np.take``); the
issue asked for the ratio, not a limit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr
from benchmarks import harness as h
from benchmarks import workloads as wl
from benchmarks.suites._common import same

E, T, L = 64, 256, 16
M = 4                                  # minibatches per epoch
SB = E * (T // L) // M                 # 256 chunks of L steps
EB = E // M                            # 16 envs of T steps
JR_CHUNKS = f"jr.scan_minibatches seq_len={L} (jit)"
JR_STATE = f"jr.scan_minibatches seq_len={L}, RolloutState (jit)"
JR_WHOLE = f"jr.scan_minibatches seq_len=T={T} (jit)"
NP_CHUNKS = f"numpy np.take seq_len={L} (bound)"
NP_WHOLE = f"numpy np.take seq_len=T={T} (bound)"


def _sum_fn(carry, mb):
  """Every key of a time-major minibatch, summed over time and sequences."""
  return {k: carry[k] + jnp.sum(mb[k], axis=(0, 1)) for k in carry}, None


def _jr_setup(source, per_batch: int, seq_len: int, key):
  shapes = {k: tuple(v.shape[2:]) for k, v in
            (source.data if isinstance(source, jr.RolloutState)
             else source).items()}

  @jax.jit
  def epoch(carry, key, data):
    return jr.scan_minibatches(_sum_fn, carry, key, data, per_batch,
                               seq_len=seq_len)[0]

  carry = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
  return lambda: jax.block_until_ready(epoch(carry, key, source))


def _np_chunks_setup(data: dict[str, np.ndarray], seed: int = 0):
  num_chunks = T // L
  perm = np.random.default_rng(seed).permutation(E * num_chunks)
  env, chunk = perm // num_chunks, perm % num_chunks
  rows = (chunk * L + np.arange(L)[:, None]) * E + env      # [L, S]
  flat = {k: v.reshape(T * E, *v.shape[2:]) for k, v in data.items()}

  def run():
    return {k: np.take(v, rows, axis=0, mode="clip").sum(axis=(0, 1))
            for k, v in flat.items()}
  return run


def _np_whole_setup(data: dict[str, np.ndarray], seed: int = 0):
  perm = np.random.default_rng(seed).permutation(E)

  def run():
    return {k: np.take(v, perm, axis=1, mode="clip").sum(axis=(0, 1))
            for k, v in data.items()}
  return run


def _build(config: h.Config) -> list[h.Impl]:
  del config   # W1-sized: the same in --quick
  w = wl.with_envs(wl.W1, E, T)
  data = wl.rollout(w)                                 # {k: [T, E, ...]}
  jdata = {k: jnp.asarray(v) for k, v in data.items()}
  state = wl.full_state(w, data)
  key = jax.random.key(0)
  expected = {k: v.sum(axis=(0, 1), dtype=np.float64).astype(np.float32)
              for k, v in data.items()}
  return [
      h.Impl(JR_CHUNKS, functools.partial(_jr_setup, jdata, SB, L, key),
             "jrollout", same),
      h.Impl(JR_STATE, functools.partial(_jr_setup, state, SB, L, key),
             "jrollout", same),
      h.Impl(JR_WHOLE, functools.partial(_jr_setup, jdata, EB, T, key),
             "jrollout", same),
      h.Impl(NP_CHUNKS, functools.partial(_np_chunks_setup, data), "numpy",
             same),
      h.Impl(NP_WHOLE, functools.partial(_np_whole_setup, data), "numpy",
             same),
      h.Impl("numpy model", lambda: lambda: expected, "numpy", same,
             timed=False),
  ]


MEASUREMENTS = [
    h.Measurement(
        name=f"sequence_epoch_E{E}_T{T}",
        description=(f"one shuffled epoch of sequence minibatches summing "
                     f"every key, W1 keys, E={E}, T={T}, {M} minibatches of "
                     f"{E * T // M} steps: seq_len={L} ({SB} chunks each) vs "
                     f"whole rollouts ({EB} envs each)"),
        build=_build,
        baseline=NP_CHUNKS,
        targets=[
            h.Target(JR_CHUNKS, NP_CHUNKS, 1.5,
                     "the epoch suite's bound; no issue target"),
            h.Target(JR_STATE, NP_CHUNKS, 1.5,
                     "the epoch suite's bound; no issue target"),
            h.Target(JR_WHOLE, NP_WHOLE, 1.5,
                     "the epoch suite's bound; no issue target")],
    ),
]
