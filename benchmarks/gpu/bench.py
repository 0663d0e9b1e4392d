"""The hot path on one accelerator, torch on the same device: the GPU rows.

``python -m benchmarks.gpu.bench`` runs, for each workload (default W2 and
GPU = 4096 envs x 64 steps x 512-dim obs, see ``benchmarks/workloads.py``):

- ``writes_<W>``: a whole rollout written step by step from Python with
  ``jr.RolloutWriter`` (and ``jr.update_at_inplace``) vs torch's ``copy_``
  loop into preallocated tensors;
- ``make_batch_<W>``: ``jr.make_batch`` vs torch ``transpose(0,1).reshape``;
- ``epoch_<W>_B4096``: one shuffled epoch summing every key,
  ``jr.scan_minibatches`` (flat batch and straight from the RolloutState) vs
  torch's DictDataset loop and the JAX idiom;
- ``gae_<W>``: ``jr.gae`` (jit) vs the JAX idiom's reverse scan and the
  reverse Python loop of torch PPO code;

then ``bridge_from_torch`` / ``bridge_to_torch`` (zero-copy at 1 and 256 MB
vs a device copy) and ``ppo_seeds_<S>``: the PPO example's agent with S
vmapped seeds, one jitted training run, vs the same agent in the JAX idiom
(env steps per second in RESULTS.md).

torch runs on the device JAX uses (``--torch-device auto``: CUDA when JAX's
default backend is a GPU and torch sees one); its ``run()`` ends with
``torch.cuda.synchronize()``. The timing method, result checks and tables
are the suite's (``benchmarks/harness.py``); RESULTS.md is rewritten after
every measurement, so a run stopped by a time limit keeps what it measured.
On a CPU (``JAX_PLATFORMS=cpu``) with ``--quick`` it is the dry run of
``benchmarks/gpu/check.sh``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jrollout as jr
from benchmarks import harness as h
from benchmarks import run as suite
from benchmarks import workloads as wl
from benchmarks.baselines import ppo_idiom
from benchmarks.baselines import torch_ref
from benchmarks.suites import _common as c

COMMAND = "python -m benchmarks.gpu.bench"
B = 4096                 # minibatch rows of the epochs (shrunk in --quick)
BRIDGE_MB = (1, 256)
GAMMA, LAMBDA = 0.99, 0.95
JR_PPO, IDIOM_PPO = "jrollout PPO", "jax idiom PPO"


def _sync_fn(device: str):
  """What a torch ``run()`` calls last: wait for the device's queue."""
  if device.startswith("cuda"):
    return torch.cuda.synchronize
  return lambda: None


# ----------------------------------------------------------- measurements


def _writes(name: str, device: str) -> h.Measurement:
  sync = _sync_fn(device)

  def build(config: h.Config):
    w = wl.get(name, config.quick)
    T = w.num_steps
    pool_np = wl.step_pool(w, min(T, 8))
    P = len(pool_np)
    pool_jax = jax.block_until_ready(
        [{k: jnp.asarray(v) for k, v in d.items()} for d in pool_np])
    pool_torch = [{k: torch.from_numpy(v).to(device) for k, v in d.items()}
                  for d in pool_np]

    def writer():
      wr = jr.RolloutWriter(wl.empty_state(w))

      def run():
        for t in range(T):
          wr.update_at(t, pool_jax[t % P])
        return jax.block_until_ready(wr.state).data
      return run

    def inplace():
      holder = [wl.empty_state(w)]

      def run():
        s = holder[0]
        for t in range(T):
          s = jr.update_at_inplace(s, t, pool_jax[t % P])
        holder[0] = s
        return jax.block_until_ready(s).data
      return run

    def torch_loop():
      storage = torch_ref.buffer_from(w.num_envs, T, w.shapes,
                                      device).storage

      def run():
        for t in range(T):
          for k, v in pool_torch[t % P].items():
            storage[k][t].copy_(v)
        sync()
        return storage
      return run

    return [h.Impl("jr.RolloutWriter", writer, "jrollout", c.same),
            h.Impl("jr.update_at_inplace", inplace, "jrollout", c.same),
            h.Impl("torch copy_ loop", torch_loop, "torch", c.same)]

  w = wl.get(name, False)
  return h.Measurement(
      name=f"writes_{name}",
      description=(f"one rollout written step by step from Python, "
                   f"{w.label()}, all {len(w.shapes)} keys per step"),
      build=build, baseline="torch copy_ loop",
      targets=[h.Target("jr.RolloutWriter", "torch copy_ loop", 1.0,
                        "as the CPU suite's writes_W2")])


def _make_batch(name: str, device: str) -> h.Measurement:
  sync = _sync_fn(device)

  def build(config: h.Config):
    w = wl.get(name, config.quick)
    data = wl.rollout(w)
    state = wl.full_state(w, data)
    buf = torch_ref.buffer_from(w.num_envs, w.num_steps, w.shapes, device)
    for k, v in data.items():
      buf.storage[k].copy_(torch.from_numpy(v))

    def jr_make_batch(check: bool):
      def setup():
        def run():
          batch, new_state = jr.make_batch(state, check=check)
          return jax.block_until_ready((batch, new_state))[0]
        return run
      return setup

    def torch_make_dict():
      def run():
        batch = buf.make_dict()
        sync()
        return batch
      return run

    return [h.Impl("jr.make_batch", jr_make_batch(True), "jrollout", c.same),
            h.Impl("jr.make_batch(check=False)", jr_make_batch(False),
                   "jrollout", c.same),
            h.Impl("torch transpose(0,1).reshape", torch_make_dict, "torch",
                   c.same),
            h.Impl("numpy model", lambda: lambda: wl.env_major(data),
                   "numpy", c.same, timed=False)]

  w = wl.get(name, False)
  return h.Measurement(
      name=f"make_batch_{name}",
      description=(f"[T, E, ...] storage to an env-major batch, {w.label()}, "
                   f"{len(w.shapes)} keys"),
      build=build, baseline="torch transpose(0,1).reshape",
      targets=[h.Target("jr.make_batch", "torch transpose(0,1).reshape", 1.0,
                        "as the CPU suite's make_batch_W2")])


def _epoch(name: str, device: str) -> h.Measurement:
  sync = _sync_fn(device)
  jr_name, torch_name = "jr.scan_minibatches (jit)", "torch DictDataset loop"

  def build(config: h.Config):
    w = wl.get(name, config.quick)
    b = wl.batch_size(name, B, config.quick)
    data = wl.rollout(w)
    nbatch = wl.env_major(data)
    jbatch = jax.block_until_ready({k: jnp.asarray(v)
                                    for k, v in nbatch.items()})
    state = wl.full_state(w, data)
    tbatch = {k: torch.from_numpy(v).to(device) for k, v in nbatch.items()}
    key = jax.random.key(0)

    def torch_epoch():
      def run():
        sums = torch_ref.epoch_sums(tbatch, b)
        sync()
        return sums
      return run

    return [h.Impl(jr_name, c.jr_epoch_impl(jbatch, b, key), "jrollout",
                   c.same),
            h.Impl("jr.scan_minibatches on RolloutState",
                   c.jr_epoch_impl(state, b, key), "jrollout", c.same),
            h.Impl(torch_name, torch_epoch, "torch", c.same),
            h.Impl("jax idiom permutation+gather+scan",
                   c.idiom_epoch_impl(jbatch, b, key), "jax-idiom", c.same),
            h.Impl("numpy model", lambda: lambda: wl.sums_of(nbatch),
                   "numpy", c.same, timed=False)]

  w = wl.get(name, False)
  return h.Measurement(
      name=f"epoch_{name}_B{B}",
      description=(f"one shuffled epoch summing every key, {w.label()}, "
                   f"N={w.num_rows}, B={B}"),
      build=build, baseline=torch_name,
      targets=[h.Target(jr_name, torch_name, 0.5,
                        "as the CPU suite's epoch rows")])


def gae_inputs(w: wl.Workload, seed: int = 0) -> dict[str, np.ndarray]:
  """``[T, E]`` rewards, values, flags and final values; ``last_value [E]``.

  About 5% of the steps terminate and 2% are truncated (never both).
  """
  rng = np.random.default_rng(seed)
  shape = (w.num_steps, w.num_envs)
  terminated = rng.random(shape) < 0.05
  return {"reward": rng.standard_normal(shape, np.float32),
          "value": rng.standard_normal(shape, np.float32),
          "final_value": rng.standard_normal(shape, np.float32),
          "last_value": rng.standard_normal(shape[1:], np.float32),
          "terminated": terminated,
          "truncated": (rng.random(shape) < 0.02) & ~terminated}


def _gae(name: str, device: str) -> h.Measurement:
  sync = _sync_fn(device)

  def build(config: h.Config):
    w = wl.get(name, config.quick)
    d = gae_inputs(w)
    j = jax.block_until_ready({k: jnp.asarray(v) for k, v in d.items()})
    t = {k: torch.from_numpy(v).to(device) for k, v in d.items()}

    def jr_gae():
      f = jax.jit(functools.partial(jr.gae, gamma=GAMMA, gae_lambda=LAMBDA))
      return lambda: jax.block_until_ready(f(
          j["reward"], j["value"], j["last_value"], j["terminated"],
          truncations=j["truncated"], final_values=j["final_value"]))

    def idiom_gae():
      zeros = jnp.zeros_like(j["value"])
      traj = ppo_idiom.Transition(zeros, zeros, zeros, j["value"],
                                  j["reward"], j["terminated"],
                                  j["truncated"], None)
      f = jax.jit(functools.partial(ppo_idiom.gae, gamma=GAMMA,
                                    gae_lambda=LAMBDA))
      return lambda: jax.block_until_ready(f(traj, j["last_value"],
                                             j["final_value"]))

    def torch_gae():
      def run():
        out = torch_ref.gae(t["reward"], t["value"], t["last_value"],
                            t["terminated"], t["truncated"],
                            t["final_value"], GAMMA, LAMBDA)
        sync()
        return out
      return run

    return [h.Impl("jr.gae (jit)", jr_gae, "jrollout", c.same),
            h.Impl("jax idiom reverse lax.scan (jit)", idiom_gae,
                   "jax-idiom", c.same),
            h.Impl("torch reverse Python loop", torch_gae, "torch", c.same)]

  w = wl.get(name, False)
  return h.Measurement(
      name=f"gae_{name}",
      description=(f"advantages and targets of a [T, E] rollout with "
                   f"terminations and truncations, {w.label()}"),
      build=build, baseline="torch reverse Python loop",
      rtol=1e-4, atol=1e-4)


def _bridge(direction: str, device: str) -> h.Measurement:
  """Zero-copy by device pointer at every size; a device copy for scale."""
  small, big = BRIDGE_MB
  fn = "from_torch" if direction == "from" else "to_torch"

  def build(config: h.Config):
    from jrollout.torch import from_torch  # noqa: PLC0415 - needs torch.
    from jrollout.torch import to_torch  # noqa: PLC0415
    impls = []
    del config
    for mb in BRIDGE_MB:
      n = mb * (1 << 20) // 4
      if direction == "from":
        src = torch.arange(n, dtype=torch.float32, device=device)

        def zero_copy(src=src):
          arr, copied = from_torch(src, return_copied=True)
          assert not copied and arr.unsafe_buffer_pointer() == src.data_ptr()
          return lambda: from_torch(src).block_until_ready()

        def copy(src=src):
          return lambda: from_torch(src, copy=True).block_until_ready()
      else:
        src = jax.block_until_ready(jnp.arange(n, dtype=jnp.float32))

        def zero_copy(src=src):
          t, copied = to_torch(src, return_copied=True)
          assert not copied and t.data_ptr() == src.unsafe_buffer_pointer()
          del t
          return lambda: to_torch(src)

        def copy(src=src):
          sync = _sync_fn(device)

          def run():
            t = to_torch(src, copy=True)
            sync()
            return t
          return run
      impls.append(h.Impl(f"{fn} {mb} MB", zero_copy, "jrollout"))
      impls.append(h.Impl(f"{fn}(copy=True) {mb} MB", copy, "reference"))
    return impls

  way = "torch -> JAX" if direction == "from" else "JAX -> torch"
  return h.Measurement(
      name=f"bridge_{fn}",
      description=(f"{way} of a {small} MB and a {big} MB float32 array on "
                   f"{device}"),
      build=build, baseline=f"{fn}(copy=True) {small} MB",
      targets=[h.Target(f"{fn} {big} MB", f"{fn} {small} MB", 2.0,
                        "zero-copy: roughly constant in size")])


def ppo_config(seeds: int, updates: int, quick: bool):
  """The example's defaults, ``seeds`` vmapped, ``updates`` long.

  ``quick``: 4 envs x 32 steps, one epoch of 2 minibatches.
  """
  from examples import ppo_cartpole  # noqa: PLC0415 - needs gymnax.
  config = ppo_cartpole.Config(seeds=seeds)
  if quick:
    config = dataclasses.replace(config, num_envs=4, num_steps=32,
                                 num_minibatches=2, num_epochs=1)
  return dataclasses.replace(
      config, total_steps=updates * config.num_envs * config.num_steps)


def env_steps(config) -> int:
  """Env steps of one training run over all seeds."""
  return (config.seeds * config.num_updates * config.num_envs
          * config.num_steps)


def _ppo(seeds: int, updates: int) -> h.Measurement:
  def build(config: h.Config):
    try:
      from benchmarks.scripts import ppo_compare  # noqa: PLC0415 - gymnax.
      from examples import ppo_cartpole  # noqa: PLC0415
    except ImportError as err:
      raise h.Skip(f"the PPO example cannot be imported: {err}") from err
    cfg = ppo_config(seeds, updates, config.quick)
    keys = jax.random.split(jax.random.key(0), cfg.seeds)

    def impl(make_train):
      def setup():
        compiled = ppo_compare.build(make_train, cfg).lower(keys).compile()
        return lambda: jax.block_until_ready(compiled(keys))
      return setup

    impls = [h.Impl(JR_PPO, impl(ppo_cartpole.make_train), "jrollout",
                    reps=1)]
    if not config.quick:   # (the CPU suite's smoke test compiles the idiom)
      impls.append(h.Impl(IDIOM_PPO, impl(ppo_idiom.make_train), "jax-idiom",
                          reps=1))
    return impls

  return h.Measurement(
      name=f"ppo_seeds_{seeds}",
      description=(f"PPO CartPole training run of the example's agent and "
                   f"defaults (8 envs x 128 steps per seed), {seeds} vmapped "
                   f"seeds x {updates} updates, compiled ahead"),
      build=build, baseline=IDIOM_PPO, max_rounds=3)


def measurements(workloads, device: str, ppo_seeds: int,
                 ppo_updates: int) -> list[h.Measurement]:
  out = []
  for name in workloads:
    out += [_writes(name, device), _make_batch(name, device),
            _epoch(name, device), _gae(name, device)]
  out += [_bridge("from", device), _bridge("to", device)]
  if ppo_seeds > 0:
    out.append(_ppo(ppo_seeds, ppo_updates))
  for m in out:
    m.suite = "gpu"
  return out


# ----------------------------------------------------------------- report


def throughput_lines(results, ppo_seeds: int, ppo_updates: int,
                     quick: bool) -> list[str]:
  """RESULTS.md lines: env steps per second of each PPO row."""
  rows = [r for r in results
          if r.measurement.name.startswith("ppo_seeds_") and r.impls]
  if not rows:
    return []
  steps = env_steps(ppo_config(ppo_seeds, ppo_updates, quick))
  lines = ["", "## PPO env steps per second", "",
           f"{steps:,} env steps per training run (all seeds); median run "
           "time over rounds.", "",
           "| implementation | median run | env steps/s |",
           "| --- | --- | --- |"]
  for r in rows:
    for i in r.impls:
      lines.append(f"| {i.name} | {h.fmt_time(i.median)} | "
                   f"{steps / i.median:,.0f} |")
  return lines


def _device_info(device: str) -> dict[str, str]:
  info = {"jax default backend": jax.default_backend(),
          "torch device": device}
  if torch.cuda.is_available():
    info["torch cuda"] = (f"{torch.version.cuda}, "
                          f"{torch.cuda.get_device_name(0)}")
  for var in ("XLA_PYTHON_CLIENT_PREALLOCATE",
              "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
              "JAX_PLATFORMS"):
    info[var] = os.environ.get(var, "(unset)")
  return info


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
  p.add_argument("--workloads", default="W2,GPU",
                 help="comma-separated names from benchmarks/workloads.py")
  p.add_argument("--quick", action="store_true",
                 help="small sizes, numbers not meaningful (the dry run)")
  p.add_argument("--rounds", type=int, default=None,
                 help="interleaved rounds (default 5, --quick 1)")
  p.add_argument("--only", action="append", default=[], metavar="NAME",
                 help="as python -m benchmarks --only")
  p.add_argument("--torch-device", default="auto",
                 help="auto (cuda when JAX runs on a GPU), cpu or cuda")
  p.add_argument("--ppo-seeds", type=int, default=256,
                 help="vmapped seeds of the PPO row (0: no PPO row)")
  p.add_argument("--ppo-updates", type=int, default=20,
                 help="PPO updates per training run")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."),
                 help="where RESULTS.md and results.png go")
  return p.parse_args(argv)


def main(argv=None) -> int:
  raw_argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(raw_argv)
  device = args.torch_device
  if device == "auto":
    device = ("cuda" if jax.default_backend() == "gpu"
              and torch.cuda.is_available() else "cpu")
  torch.set_num_threads(1)   # as the CPU suite: steady torch timings
  workloads = [n for n in args.workloads.split(",") if n]
  chosen = suite.select(measurements(workloads, device, args.ppo_seeds,
                                     args.ppo_updates), args.only)
  rounds = args.rounds if args.rounds is not None else (1 if args.quick
                                                         else 5)
  config = h.Config(rounds=rounds, quick=args.quick,
                    min_sample_s=0.002 if args.quick else 0.02,
                    max_reps=5 if args.quick else 100)
  args.out.mkdir(parents=True, exist_ok=True)
  started = datetime.datetime.now().astimezone()
  info = {**suite.machine(), **_device_info(device)}
  vers = suite.versions()
  print(f"{COMMAND}: {len(chosen)} measurements on JAX "
        f"{jax.default_backend()} / torch {device}, {rounds} rounds"
        f"{' (quick)' if args.quick else ''}", flush=True)
  t0 = time.perf_counter()
  results = []

  def write(chart: bool) -> None:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    path = args.out / "RESULTS.md"
    has_chart = chart and suite.write_chart(
        args.out / "results.png", results,
        f"jrollout on {info.get('torch cuda', device)}, jax "
        f"{vers.get('jax')}, torch {vers.get('torch')}")
    suite.write_markdown(path, results, config, info, vers, started,
                         time.perf_counter() - t0, load,
                         "results.png" if has_chart else None, raw_argv,
                         command=COMMAND)
    extra = throughput_lines(results, args.ppo_seeds, args.ppo_updates,
                             args.quick)
    if len(results) < len(chosen):
      extra += ["", f"**Stopped after {len(results)} of {len(chosen)} "
                "measurements.**"]
    if extra:
      with open(path, "a") as f:
        f.write("\n".join(extra) + "\n")

  try:
    for m in chosen:
      print(f"[gpu] {m.name}: {m.description}", flush=True)
      res = h.run_measurement(m, config, log=lambda s: print(s, flush=True))
      if res.impls:
        print("  " + "; ".join(f"{i.name} {h.fmt_time(i.median)}"
                               for i in res.impls), flush=True)
      results.append(res)
      write(chart=False)
  except KeyboardInterrupt:
    print(f"interrupted after {len(results)} measurements", flush=True)
  impl_rows, target_rows = suite.tables(results)
  print()
  print(h.text_table(h.IMPL_HEADER, impl_rows))
  print()
  print(h.text_table(h.TARGET_HEADER, target_rows))
  print("\n".join(throughput_lines(results, args.ppo_seeds, args.ppo_updates,
                                   args.quick)))
  write(chart=True)
  print(f"wrote {args.out / 'RESULTS.md'}", flush=True)
  failed = [r.measurement.name for r in results if r.error]
  if failed:
    print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0 if len(results) == len(chosen) else 2


if __name__ == "__main__":
  sys.exit(main())
