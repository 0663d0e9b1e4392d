"""Write path: a rollout written step by step from Python, and inside a scan.

Measurements: writes_W2, writes_W1 (targets <= 1.0x / 1.5x of the torch
``copy_`` loop), writes_scaling (T=256 / T=32 <= 10), scan_write (<= 1.1x of
a scan carrying the storage directly). ``writes(name)`` makes the writes
measurement of any workload (the GPU run: writes_GPU).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import torch

import jrollout as jr
from benchmarks import harness as h
from benchmarks import workloads as wl
from benchmarks.baselines import jax_idiom
from benchmarks.baselines import torch_ref
from benchmarks.suites._common import same
from benchmarks.suites._common import torch_sync

POOL = 32  # distinct per-step value dicts, reused cyclically


def _data_of_state(s):
  return dict(s.data)


def _threaded_loop(state, write, pool: list[dict], num_steps: int):
  """A ``run()`` writing ``num_steps`` steps, ``state = write(state, t, v)``.

  The state carries over between calls (a donated one cannot be reused).
  """
  holder = [state]

  def run():
    s = holder[0]
    for t in range(num_steps):
      s = write(s, t, pool[t % len(pool)])
    holder[0] = s
    return jax.block_until_ready(s)
  return run


def _write_impls(w: wl.Workload, with_references: bool, prefix: str = "",
                 device: str = "cpu") -> list[h.Impl]:
  """A whole rollout written step by step, one Impl per way of doing it.

  ``device``: the torch loop's device. The references (numpy bounds, the
  JAX ways jrollout replaces, the writer's flushes alone) are built only
  with ``with_references`` on the CPU: they diagnose the CPU write path.
  """
  with_references = with_references and device == "cpu"
  T = w.num_steps
  pool_np = wl.step_pool(w, min(T, POOL))
  P = len(pool_np)
  pool_jax = [{k: jnp.asarray(v) for k, v in d.items()} for d in pool_np]
  pool_torch = [{k: torch.from_numpy(v).to(device) for k, v in d.items()}
                for d in pool_np]
  sync = torch_sync(device)
  jax.block_until_ready(pool_jax)
  impls = []

  def jr_writer(pool):
    def setup():
      writer = jr.RolloutWriter(wl.empty_state(w))

      def run():
        for t in range(T):
          writer.update_at(t, pool[t % P])
        return jax.block_until_ready(writer.state)
      return run
    return setup

  def check_writer(s):
    # The flush donated: the state it consumed is deleted, not copied.
    first = wl.empty_state(w)
    writer = jr.RolloutWriter(first, flush_every=1)
    writer.update_at(0, pool_jax[0])
    assert all(v.is_deleted() for v in first.data.values()), (
        "RolloutWriter did not donate (copied the storage)")
    return _data_of_state(s)

  impls.append(h.Impl(prefix + "jr.RolloutWriter", jr_writer(pool_jax),
                      "jrollout", check_writer))
  # Host values, like the torch loop's CPU tensors. No target: each step is
  # copied twice (staged when queued, since the caller may reuse its buffer;
  # written at the flush) where torch copies once, so at W2, where the copies
  # dominate, expect about 2x.
  impls.append(h.Impl(prefix + "jr.RolloutWriter, numpy steps",
                      jr_writer(pool_np), "jrollout", check_writer))
  if with_references:
    impls.append(h.Impl("RolloutWriter's flushes alone (queue prebuilt)",
                        lambda: _flushes_alone(w, pool_jax), "reference",
                        _data_of_state))

  def torch_loop():
    buf = torch_ref.buffer_from(w.num_envs, T, w.shapes, device)
    storage = buf.storage

    def run():
      for t in range(T):
        vals = pool_torch[t % P]
        for k, v in vals.items():
          storage[k][t].copy_(v)
      sync()
      return storage
    return run

  impls.append(h.Impl(prefix + "torch copy_ loop", torch_loop, "torch", same))
  if not with_references:
    return impls
  return impls + _host_bounds(w, pool_np) + _jax_references(w, pool_jax)


def _host_bounds(w: wl.Workload, pool_np: list[dict]) -> list[h.Impl]:
  """The same writes in numpy on the host: a copyto loop and one memcpy."""
  T, P = w.num_steps, len(pool_np)
  impls = []

  def numpy_loop():
    storage = {k: np.zeros((T, w.num_envs, *s), np.float32)
               for k, s in w.shapes.items()}

    def run():
      for t in range(T):
        for k, v in pool_np[t % P].items():
          np.copyto(storage[k][t], v)
      return storage
    return run

  impls.append(h.Impl("numpy copyto loop", numpy_loop, "numpy", same))

  def memcpy():
    src = np.ones(w.nbytes // 4, np.float32)
    dst = np.zeros_like(src)

    def run():
      np.copyto(dst, src)
      return dst
    return run

  impls.append(h.Impl("numpy one memcpy (bound)", memcpy, "numpy"))
  return impls


def _jax_references(w: wl.Workload, pool_jax: list[dict]) -> list[h.Impl]:
  """The same writes the JAX ways jrollout replaces (and flashbax's)."""
  T, P = w.num_steps, len(pool_jax)
  impls = []

  def idiom_stack():
    def run():
      steps = []
      for t in range(T):
        steps.append(pool_jax[t % P])
      return jax.block_until_ready(jax_idiom.stack_steps(steps))
    return run

  impls.append(h.Impl("jax idiom list+jnp.stack", idiom_stack, "jax-idiom",
                      same))

  def jr_jit_naive():
    return _threaded_loop(wl.empty_state(w), jax.jit(jr.update_at), pool_jax,
                          T)

  impls.append(h.Impl("jax.jit(jr.update_at), no donation", jr_jit_naive,
                      "reference", _data_of_state))

  def jr_eager():
    return _threaded_loop(wl.empty_state(w), jr.update_at, pool_jax, T)

  impls.append(h.Impl("jr.update_at (pure, eager)", jr_eager, "reference",
                      _data_of_state))

  try:
    import flashbax as fbx  # noqa: PLC0415 - optional `bench` extra.
  except ImportError:
    pass
  else:
    def flashbax_add():
      buffer = fbx.make_trajectory_buffer(
          add_batch_size=w.num_envs, sample_batch_size=1,
          sample_sequence_length=1, period=1, min_length_time_axis=1,
          max_length_time_axis=T)
      one = {k: jnp.zeros(s, jnp.float32) for k, s in w.shapes.items()}

      def add(state, step):  # [E, ...] -> [E, 1, ...]: one time step
        return buffer.add(state, jax.tree.map(lambda x: x[:, None], step))
      add = jax.jit(add, donate_argnums=0)
      return _threaded_loop(buffer.init(one), lambda s, t, v: add(s, v),
                            pool_jax, T)

    def flashbax_check(s):
      return {k: jnp.swapaxes(v, 0, 1) for k, v in s.experience.items()}

    impls.append(h.Impl("flashbax trajectory buffer add (donated)",
                        flashbax_add, "flashbax", flashbax_check))
  return impls


def _flushes_alone(w: wl.Workload, pool_jax: list[dict]):
  """The writer's jitted flushes with their arguments built beforehand.

  No Python per step: what is left is XLA's in-place copy of the steps
  (dynamic-update-slices) plus one dispatch per 16 steps. The gap between
  this and the torch loop is the XLA copy, not jrollout's Python.
  """
  from jrollout import _writer  # noqa: PLC0415 - internal, diagnosis only.
  T, P, K = w.num_steps, len(pool_jax), 16
  calls = []
  for lo in range(0, T, K):
    ts = list(range(lo, min(lo + K, T)))
    runs = {k: tuple(pool_jax[t % P][k] for t in ts)
            for k in sorted(w.shapes)}
    calls.append((np.asarray(ts * len(runs), np.int32), runs))
  holder = [wl.empty_state(w)]

  def run():
    s = holder[0]
    for steps, runs in calls:
      s, _ = _writer.write_inplace("benchmark", s, steps, runs,
                                   contiguous=True, signal=True)
    holder[0] = s
    return jax.block_until_ready(s)
  return run


def writes(name: str, limit: float = 1.0) -> h.Measurement:
  """A whole rollout of workload ``name`` written step by step from Python."""
  def build(config: h.Config):
    w = wl.get(name, config.quick)
    return _write_impls(w, with_references=True, device=config.torch_device)

  return h.Measurement(
      name=f"writes_{name}",
      description=(f"one whole rollout written step by step from Python, "
                   f"{wl.get(name, False).label()}, all 6 keys per step"),
      build=build,
      baseline="torch copy_ loop",
      targets=[h.Target("jr.RolloutWriter", "torch copy_ loop", limit)],
  )


def _scaling_build(config: h.Config):
  e = 1024 // wl.QUICK_DIVISOR if config.quick else 1024
  impls = []
  for t in (256, 32):
    w = wl.with_envs(wl.W2, e, t)
    for impl in _write_impls(w, with_references=False, prefix=f"T={t}: "):
      impl.check = None  # different T: nothing to compare
      impls.append(impl)
  return impls


def _scan_write_build(config: h.Config):
  w = wl.get("W2", config.quick)
  T = w.num_steps
  xs = {k: jnp.asarray(v) for k, v in wl.rollout(w).items()}
  steps = jnp.arange(T, dtype=jnp.int32)
  state0 = wl.empty_state(w)

  @jax.jit
  def with_update_at(state, xs):
    def body(s, t_x):
      t, x = t_x
      return jr.update_at(s, t, x), None
    return lax.scan(body, state, (steps, xs))[0]

  @jax.jit
  def with_at_set(data, xs):
    def body(d, t_x):
      t, x = t_x
      return {k: d[k].at[t].set(x[k]) for k in d}, None
    return lax.scan(body, data, (steps, xs))[0]

  @jax.jit
  def with_stacked_ys(xs):
    return lax.scan(lambda c, x: (c, x), None, xs)[1]

  def s_update_at():
    return lambda: jax.block_until_ready(with_update_at(state0, xs))

  def s_at_set():
    data0 = dict(state0.data)
    return lambda: jax.block_until_ready(with_at_set(data0, xs))

  def s_stacked():
    return lambda: jax.block_until_ready(with_stacked_ys(xs))

  def check_counts(s):
    assert bool(jr.is_complete(s)), "scan of update_at left incomplete counts"
    return _data_of_state(s)

  return [
      h.Impl("jr.update_at in scan", s_update_at, "jrollout", check_counts),
      h.Impl("scan carrying storage, .at[t].set", s_at_set, "jax-idiom", same),
      h.Impl("jax idiom: scan ys stacked", s_stacked, "jax-idiom", same),
  ]


MEASUREMENTS = [
    writes("W2", 1.0),
    writes("W1", 1.5),
    h.Measurement(
        name="writes_scaling",
        description=("jrollout rollout (RolloutWriter) at "
                     "T=256 vs T=32, 1024 envs, W2 keys; torch for reference"),
        build=_scaling_build,
        baseline="T=32: jr.RolloutWriter",
        targets=[h.Target("T=256: jr.RolloutWriter",
                          "T=32: jr.RolloutWriter", 10.0)],
    ),
    h.Measurement(
        name="scan_write",
        description=("a whole W2 rollout written inside one jitted lax.scan "
                     "(values from xs)"),
        build=_scan_write_build,
        baseline="scan carrying storage, .at[t].set",
        targets=[h.Target("jr.update_at in scan",
                          "scan carrying storage, .at[t].set", 1.1)],
    ),
]
