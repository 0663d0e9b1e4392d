"""The suites' hot-path rows on an accelerator, torch on the same device.

``python -m benchmarks.gpu.bench`` runs measurements of the suites
(``benchmarks/suites``) with the harness and reports of ``python -m
benchmarks``, on the device JAX uses, with torch's tensors on the same
device (``--torch-device auto``: CUDA when JAX's default backend is a GPU
and torch sees one): for each workload (default W2 and GPU = 4096 envs x 64
steps x 512-dim obs, ``benchmarks/workloads.py``) ``writes_<W>``,
``make_batch_<W>``, ``epoch_<W>_B4096`` and ``gae_<W>``; then
``bridge_from_torch`` / ``bridge_to_torch`` and ``ppo_seeds_<S>`` (the PPO
example's agent with S vmapped seeds, env steps per second). Host-only rows
(numpy bounds and copies, the CPU write path's diagnoses) are left out when
torch is not on the CPU.
RESULTS.md is rewritten after every measurement, so a run stopped by a
time limit keeps what it measured. On a CPU (``JAX_PLATFORMS=cpu``) with
``--quick`` it is the dry run of ``benchmarks/gpu/check.sh``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

COMMAND = "python -m benchmarks.gpu.bench"
B = 4096   # minibatch rows of the epochs (shrunk in --quick)


def measurements(workloads, ppo_seeds: int, ppo_updates: int):
  """The suites' measurements this run makes, in order."""
  from benchmarks.suites import batch  # noqa: PLC0415 - imports torch.
  from benchmarks.suites import bridge  # noqa: PLC0415
  from benchmarks.suites import epoch  # noqa: PLC0415
  from benchmarks.suites import gae  # noqa: PLC0415
  from benchmarks.suites import ppo  # noqa: PLC0415
  from benchmarks.suites import writes  # noqa: PLC0415
  out = []
  for name in workloads:
    out += [(writes, writes.writes(name)), (batch, batch.make_batch(name)),
            (epoch, epoch.epoch(name, B)), (gae, gae.gae(name))]
  out += [(bridge, m) for m in bridge.MEASUREMENTS]
  if ppo_seeds > 0:
    out.append((ppo, ppo.seeds(ppo_seeds, ppo_updates)))
  for module, m in out:
    m.suite = module.__name__.rpartition(".")[2]
  return [m for _, m in out]


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
  import jax  # noqa: PLC0415 - after --help
  import torch  # noqa: PLC0415

  from benchmarks import harness as h  # noqa: PLC0415
  from benchmarks import run  # noqa: PLC0415
  device = args.torch_device
  if device == "auto":
    device = ("cuda" if jax.default_backend() == "gpu"
              and torch.cuda.is_available() else "cpu")
  torch.set_num_threads(1)   # as the CPU suite: steady torch timings
  workloads = [n for n in args.workloads.split(",") if n]
  chosen = run.select(measurements(workloads, args.ppo_seeds,
                                   args.ppo_updates), args.only)
  rounds = args.rounds if args.rounds is not None else (1 if args.quick
                                                         else 5)
  config = h.Config(rounds=rounds, quick=args.quick,
                    min_sample_s=0.002 if args.quick else 0.02,
                    max_reps=5 if args.quick else 100, torch_device=device)
  info = {"jax default backend": jax.default_backend(),
          "torch device": device}
  if torch.cuda.is_available():
    info["torch cuda"] = (f"{torch.version.cuda}, "
                          f"{torch.cuda.get_device_name(0)}")
  for var in ("XLA_PYTHON_CLIENT_PREALLOCATE",
              "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
              "JAX_PLATFORMS"):
    info[var] = os.environ.get(var, "(unset)")
  return run.run(chosen, config, args.out, argv=raw_argv, command=COMMAND,
                 label=f"JAX {jax.default_backend()} / torch {device}",
                 info_extra=info)


if __name__ == "__main__":
  sys.exit(main())
