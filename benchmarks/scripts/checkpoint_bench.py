"""Save and restore throughput of a W2-size rollout, next to plain NumPy.

``jr.save_rollout`` / ``jr.restore_rollout`` (orbax, with jrollout's record
and checks) against ``np.save`` / ``np.load`` of the same arrays, one file
per key, in the same directory. Each row is the median of ``--rounds``
runs; every save writes a new directory (deleted afterwards), so the
figures include creating files, not fsync (neither side syncs). The orbax
figures include the device-to-host copy (cheap on CPU), NumPy's start
from host arrays. The first (warm-up) round of each is not counted.

    python -m benchmarks.scripts.checkpoint_bench [--rounds 5] [--dir /tmp]
        [--baseline REV]

Since jrollout verifies checkpoints (CRC-32 of every shard, file sizes),
``jr.restore_rollout(verify=False)`` is timed too, and ``--baseline REV``
adds the save and restore of ``jrollout/_checkpoint.py`` as it was at git
revision REV (loaded from ``git show``, run in this process on the same
data), e.g. the commit before checksums: the rounds of all rows are
interleaved, so that a slower or faster spell of the machine affects each
row alike. The first call of each row (compilation, caches) is shown apart
and not counted.

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
import types
from typing import Any

import jax
import numpy as np

import jrollout as jr
from benchmarks import harness
from benchmarks import workloads


def _timed(fns: dict[str, Any], rounds: int
           ) -> dict[str, tuple[float, float, float]]:
  """``{name: (first call, median wall, median CPU)}`` seconds of each
  function, the rounds interleaved (the order rotates each round). CPU is
  the process's user + system time over all its threads (TensorStore's
  and the CRC-32 threads included): less sensitive than wall time to other
  jobs on the machine."""
  first: dict[str, float] = {}
  wall: dict[str, list[float]] = {name: [] for name in fns}
  cpu: dict[str, list[float]] = {name: [] for name in fns}
  for name, fn in fns.items():
    t0 = time.perf_counter()
    fn()
    first[name] = time.perf_counter() - t0
  names = list(fns)
  for i in range(rounds):
    for name in names[i % len(names):] + names[:i % len(names)]:
      c0, t0 = time.process_time(), time.perf_counter()
      fns[name]()
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  return {name: (first[name], statistics.median(wall[name]),
                 statistics.median(cpu[name])) for name in fns}


def load_baseline(rev: str, path: str = "jrollout/_checkpoint.py"
                  ) -> types.ModuleType:
  """The module at ``path`` as it was at git revision ``rev``."""
  repo = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  source = subprocess.run(["git", "show", f"{rev}:{path}"],
                          cwd=repo, check=True, capture_output=True,
                          text=True).stdout
  stem = path.removesuffix(".py").replace("/", ".")
  name = f"{stem}_at_{rev.replace('~', '_').replace('^', '_')}"
  module = types.ModuleType(name)
  module.__file__ = f"{rev}:{path}"
  sys.modules[name] = module   # dataclasses look their module up
  exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102
  return module


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
  parser.add_argument("--baseline", default=None, metavar="REV",
                      help="also time jrollout/_checkpoint.py of this git "
                      "revision (e.g. the commit before checksums)")
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
  base = load_baseline(args.baseline) if args.baseline else None
  root = tempfile.mkdtemp(dir=args.dir)
  counter = iter(range(10**6))

  def fresh() -> str:
    return os.path.join(root, str(next(counter)))

  def saver(save):
    def run():
      path = fresh()
      save(path, state)
      shutil.rmtree(path)
    return run

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

  def restorer(restore, path, **kwargs):
    return lambda: jax.block_until_ready(restore(path, state, **kwargs))

  def numpy_load():
    for name in host:
      np.load(os.path.join(npy, name + ".npy"))

  saves = {"np.save": numpy_save, "jr.save_rollout": saver(jr.save_rollout)}
  restores = {"np.load": numpy_load,
              "jr.restore_rollout": restorer(jr.restore_rollout, saved),
              "  verify=False": restorer(jr.restore_rollout, saved,
                                         verify=False)}
  if base is not None:
    old = os.path.join(root, "baseline")
    base.save_rollout(old, state)
    saves[f"at {args.baseline}"] = saver(base.save_rollout)
    restores[f"at {args.baseline}"] = restorer(base.restore_rollout, old)
  try:
    rows = [("save", name, *t) for name, t in
            _timed(saves, args.rounds).items()]
    rows += [("restore", name, *t) for name, t in
             _timed(restores, args.rounds).items()]
  finally:
    shutil.rmtree(root)
  print(f"{w.label()}: {nbytes / 1e6:.1f} MB in {len(host)} arrays; "
        f"medians of {args.rounds} interleaved rounds (jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f})")
  print(f"{'':8s} {'':20s} {'wall':>9s} {'':>9s} {'CPU':>9s} "
        f"{'first call':>11s}  wall vs NumPy, vs jr;  CPU vs jr")
  numpy = {op: sec for op, _, _, sec, _ in reversed(rows)}   # each op's first
  ours = {op: (sec, cpu) for op, name, _, sec, cpu in rows
          if name.startswith("jr.")}
  for op, name, first, sec, cpu in rows:
    print(f"{op:8s} {name:20s} {sec * 1e3:7.1f} ms {nbytes / sec / 1e9:5.2f} "
          f"GB/s {cpu * 1e3:7.1f} ms {first * 1e3:8.1f} ms  "
          f"{sec / numpy[op]:6.2f}x {sec / ours[op][0]:5.2f}x   "
          f"{cpu / ours[op][1]:5.2f}x")


if __name__ == "__main__":
  main()
