"""The examples' compile time with an empty cache and with a filled one.

Each repeat makes a fresh cache directory and runs the example twice in
fresh processes, one after the other: the first run compiles and fills the
cache, the second loads from it (JAX's persistent compilation cache).
Reported per run
(from ``summary.json``): ``compile_s`` (the host loop's compile of its
chunk), ``init_s`` (the jitted init, compile included), the eval's compile
where the example has one, and the whole process's wall time; the ratios
second / first are of the medians over the repeats. One JSON line per run
goes to ``--out``.

    python -m benchmarks.scripts.compile_cache --examples ppo_cartpole \\
        ppo_brax --repeats 3 --out benchmarks/results/compile_cache/runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Each example's flags for the measurement: its defaults, shortened where a
# full run takes minutes (the compiled program is the same for any number
# of updates of the same size).
ARGS = {
    "ppo_cartpole": [],
    "ppo_brax": ["--total-steps", "163840", "--seeds", "1"],
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def run_once(example: str, cache: str, out: str) -> dict:
  """One run of ``example`` in a fresh process with ``--compile-cache
  cache``; its times."""
  cmd = [sys.executable, "-m", f"examples.{example}", *ARGS[example],
         "--compile-cache", cache, "--out", out]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
  with open(os.path.join(out, "summary.json")) as f:
    summary = json.load(f)
  return {"compile_s": summary["compile_s"], "init_s": summary.get("init_s"),
          "eval_compile_s": summary.get("eval_compile_s"),
          "process_s": wall, "params_sha256": summary["params_sha256"],
          "command": " ".join(cmd[1:])}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--examples", nargs="+", default=list(ARGS),
                      choices=list(ARGS))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=None, help="JSON lines, appended")
  parser.add_argument("--note", default="")
  args = parser.parse_args(argv)
  for example in args.examples:
    runs: dict[str, list[dict]] = {"first": [], "second": []}
    for repeat in range(args.repeats):
      with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "cache")
        for which in ("first", "second"):
          record = run_once(example, cache, os.path.join(tmp, which))
          record.update(example=example, run=which, repeat=repeat,
                        note=args.note)
          runs[which].append(record)
          print(json.dumps(record), flush=True)
          if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "a") as f:
              f.write(json.dumps(record) + "\n")
    same = {r["params_sha256"] for rs in runs.values() for r in rs}
    print(f"\n{example}: medians over {args.repeats} repeats "
          f"({'same' if len(same) == 1 else 'DIFFERENT'} params_sha256)")
    for field in ("compile_s", "init_s", "eval_compile_s", "process_s"):
      if any(r[field] is None for rs in runs.values() for r in rs):
        continue
      first = statistics.median(r[field] for r in runs["first"])
      second = statistics.median(r[field] for r in runs["second"])
      print(f"  {field:15s} first {first:7.2f} s  second {second:7.2f} s  "
            f"ratio {second / first:5.3f}")


if __name__ == "__main__":
  main()
