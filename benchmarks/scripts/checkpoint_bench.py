"""Save and restore throughput of a W2-size rollout, next to plain NumPy.

``jr.save_rollout`` / ``jr.restore_rollout`` (orbax, with jrollout's record
and checks) against ``np.save`` / ``np.load`` of the same arrays, one file
per key, in the same directory. Each row is the median of ``--rounds``
runs; every save writes a new directory (deleted afterwards), so the
figures include creating files, not fsync (neither side syncs). The orbax
figures include the device-to-host copy (cheap on CPU), NumPy's start
from host arrays. The first (warm-up) round of each is not counted.

    python -m benchmarks.scripts.checkpoint_bench [--rounds 5] [--dir /tmp]

``--ppo N`` instead runs the PPO example with its defaults N times with
checkpoints (``--checkpoint-dir``, default ``--checkpoint-every``) and N
times without, interleaved in ABBA order, each in its own process, and
compares the run time (``wall_s - compile_s`` of its summary: the chunks,
the host loop and the saves, without compilation), the whole process's
time, and its CPU time (user + system: less sensitive than wall time to
other jobs on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

import jrollout as jr
from benchmarks import harness
from benchmarks import workloads


def _timed(fn, rounds: int) -> float:
  """The median seconds of ``rounds`` calls after one warm-up."""
  fn()
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def ppo_overhead(runs: int, directory: str | None) -> None:
  """The PPO example with and without checkpoints, interleaved."""
  root = tempfile.mkdtemp(dir=directory)
  times: dict[str, list[tuple[float, ...]]] = {"off": [], "on": []}
  try:
    for i in range(runs):
      # ABBA order: neither mode always runs first.
      for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
        out = os.path.join(root, f"{mode}{i}")
        flags = (["--checkpoint-dir", os.path.join(out, "ckpt")]
                 if mode == "on" else [])
        cpu0 = harness.cpu_seconds(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "examples.ppo_cartpole",
                        "--out", out, *flags], check=True,
                       stdout=subprocess.DEVNULL)
        process_s = time.perf_counter() - t0
        cpu_s = harness.cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0
        with open(os.path.join(out, "summary.json")) as f:
          summary = json.load(f)
        times[mode].append((summary["wall_s"] - summary["compile_s"],
                            process_s, cpu_s))
        print(f"run {i} checkpoints {mode:3s}: run {times[mode][-1][0]:6.2f} "
              f"s, process {process_s:6.2f} s, CPU {cpu_s:6.2f} s",
              flush=True)
  finally:
    shutil.rmtree(root)
  med = {m: [statistics.median(t[j] for t in v) for j in (0, 1, 2)]
         for m, v in times.items()}
  for j, name in enumerate(("run", "process", "process CPU")):
    print(f"medians of {runs}, {name}: {med['off'][j]:.2f} s without, "
          f"{med['on'][j]:.2f} s with checkpoints "
          f"({med['on'][j] / med['off'][j]:.3f}x)")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--dir", default=None,
                      help="where to write (default: the system temp dir)")
  parser.add_argument("--ppo", type=int, default=0, metavar="N",
                      help="time the PPO example N times with and without "
                      "checkpoints instead")
  args = parser.parse_args(argv)
  if args.ppo:
    ppo_overhead(args.ppo, args.dir)
    return
  w = workloads.W2
  state = workloads.full_state(w, workloads.rollout(w))
  arrays = {k: np.asarray(v) for k, v in
            jax.tree_util.tree_leaves_with_path(state)}
  host = {str(i): a for i, a in enumerate(arrays.values())}
  nbytes = sum(a.nbytes for a in host.values())
  root = tempfile.mkdtemp(dir=args.dir)
  counter = iter(range(10**6))

  def fresh() -> str:
    return os.path.join(root, str(next(counter)))

  def orbax_save():
    path = fresh()
    jr.save_rollout(path, state)
    shutil.rmtree(path)

  def numpy_save():
    path = fresh()
    os.mkdir(path)
    for name, a in host.items():
      np.save(os.path.join(path, name + ".npy"), a)
    shutil.rmtree(path)

  saved = os.path.join(root, "orbax")
  jr.save_rollout(saved, state)
  npy = os.path.join(root, "npy")
  os.mkdir(npy)
  for name, a in host.items():
    np.save(os.path.join(npy, name + ".npy"), a)

  def orbax_restore():
    jax.block_until_ready(jr.restore_rollout(saved, state))

  def numpy_load():
    for name in host:
      np.load(os.path.join(npy, name + ".npy"))

  try:
    rows = [("save", "np.save", _timed(numpy_save, args.rounds)),
            ("save", "jr.save_rollout", _timed(orbax_save, args.rounds)),
            ("restore", "np.load", _timed(numpy_load, args.rounds)),
            ("restore", "jr.restore_rollout", _timed(orbax_restore,
                                                     args.rounds))]
  finally:
    shutil.rmtree(root)
  print(f"{w.label()}: {nbytes / 1e6:.1f} MB in {len(host)} arrays; "
        f"medians of {args.rounds} rounds (jax {jax.__version__}, "
        f"{jax.devices()[0].platform})")
  base = {}
  for op, name, sec in rows:
    base.setdefault(op, sec)
    print(f"{op:8s} {name:20s} {sec * 1e3:8.1f} ms  {nbytes / sec / 1e9:6.2f} "
          f"GB/s  ({sec / base[op]:.2f}x NumPy's time)")


if __name__ == "__main__":
  main()
