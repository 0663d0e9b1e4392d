"""Per env step of a host loop: env step | bridge | policy | buffer write.

EnvPool CartPole-v1 with the jitted policy of ``examples/ppo_envpool.py``,
at E = 1024 and 4096 envs (``--envs``), two loops doing the same work,
interleaved rollout by rollout (``--rounds`` rollouts of ``--steps`` steps
each, after one warm-up rollout each):

- ``jrollout``: the example's ``collect`` (one ``jax.device_put`` per step,
  a ``jr.RolloutWriter`` writing 16 steps per jitted call, in place);
- ``numpy``: ``benchmarks.suites.hostloop.numpy_collect`` (numpy ``[T, E]``
  arrays, the policy's outputs copied to numpy every step, one
  ``jax.device_put`` of the rollout at the end).

Every part is waited for (``block_until_ready``) before the next starts,
so each is charged its own work; the loops' totals without that
instrumentation are the suite's ``hostloop_envpool_E*`` measurements.
Reported: milliseconds per step of all E envs, per part, as the median
over rollouts; env steps per second of the instrumented loop; and the
share of the loop taken by the bridge and the buffer writes (jrollout's
own part: for the writer loop, its checks, queueing and flushes).

``--torch`` adds the torch simulator (``examples/torch_simulator.py``: its
own breakdown, sim | bridge | policy | buffer, for the same E, from its
``train`` with ``--updates 3``, medians of ``--torch-rounds`` runs), with
``--bridge numpy`` (numpy views into the policy call and the writer, the
CPU default), ``--bridge view`` (zero-copy ``from_torch``) and ``--bridge
copy`` (``from_torch(copy=True)``).

    python -m benchmarks.scripts.hostloop_bench [--envs 1024,4096] \\
        [--rounds 12] [--steps 32] [--torch]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.suites import hostloop

KINDS = ("jrollout", "numpy")
PARTS = ("env", "bridge", "policy", "buffer")


def measure(num_envs: int, num_steps: int, rounds: int) -> dict:
  """``{kind: {part: [ms per step, one per rollout]}}``."""
  loop = hostloop.HostLoop(num_envs, num_steps)
  per_round = {k: {p: [] for p in (*PARTS, "total")} for k in KINDS}
  for kind in KINDS:   # warm-up: compilation, first flushes
    loop.run(kind)
  for r in range(rounds):
    for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
      before = dict(loop.timings[kind])
      loop.run(kind)
      ms = {p: 1e3 * (loop.timings[kind][p] - before[p]) / num_steps
            for p in PARTS}
      ms["total"] = sum(ms.values())
      for p, v in ms.items():
        per_round[kind][p].append(v)
  loop.close()
  return per_round


def report(num_envs: int, per_round: dict) -> None:
  med = {k: {p: statistics.median(v) for p, v in parts.items()}
         for k, parts in per_round.items()}
  print(f"\nE = {num_envs}: ms per step of all envs (median of "
        f"{len(per_round['numpy']['total'])} rollouts)")
  print("| loop | env step | bridge | policy | buffer write | total | env "
        "steps/s | bridge + buffer |")
  print("|---|---|---|---|---|---|---|---|")
  for kind in KINDS:
    m = med[kind]
    share = (m["bridge"] + m["buffer"]) / m["total"]
    print(f"| {kind} | {m['env']:.3f} | {m['bridge']:.3f} | "
          f"{m['policy']:.3f} | {m['buffer']:.3f} | {m['total']:.3f} | "
          f"{num_envs / m['total'] * 1e3:,.0f} | {100 * share:.1f}% |")
  ratios = [a / b for a, b in zip(per_round["jrollout"]["total"],
                                  per_round["numpy"]["total"])]
  print(f"jrollout / numpy total per rollout: median "
        f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}x-"
        f"{max(ratios):.3f}x]")


def torch_sim(num_envs: int, rounds: int = 3) -> None:
  """The torch simulator's own breakdown with each ``--bridge`` (numpy
  views, the CPU default; DLPack views; ``from_torch(copy=True)``),
  ``rounds`` runs of each, interleaved."""
  import dataclasses  # noqa: PLC0415
  from examples import torch_simulator as ts  # noqa: PLC0415 (torch extra)
  config = ts.Config(num_envs=num_envs, num_steps=32, updates=3)
  variants = ("numpy", "view", "copy")
  runs = {name: [] for name in variants}
  for _ in range(rounds):
    for name in variants:
      result = ts.train(dataclasses.replace(config, bridge=name),
                        verbose=False)
      runs[name].append(result["per_step_ms"])
  for name, results in runs.items():
    ms = {k: statistics.median(r[k] for r in results) for k in results[0]}
    share = (ms["bridge"] + ms["buffer"]) / ms["total"]
    print(f"| torch simulator, --bridge {name} | {ms['sim']:.3f} | "
          f"{ms['bridge']:.3f} | {ms['policy']:.3f} | {ms['buffer']:.3f} | "
          f"{ms['total']:.3f} | {num_envs / ms['total'] * 1e3:,.0f} | "
          f"{100 * share:.1f}% |")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--envs", default="1024,4096")
  p.add_argument("--rounds", type=int, default=12)
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--torch", action="store_true")
  p.add_argument("--torch-rounds", type=int, default=3,
                 help="runs of the torch simulator per --bridge (each a "
                 "whole training run: compile, 3 updates)")
  args = p.parse_args(argv)
  for num_envs in (int(e) for e in args.envs.split(",")):
    report(num_envs, measure(num_envs, args.steps, args.rounds))
    if args.torch:
      torch_sim(num_envs, args.torch_rounds)


if __name__ == "__main__":
  main()
