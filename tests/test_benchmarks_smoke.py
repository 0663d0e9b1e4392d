"""CI smoke test of the benchmark suite: every code path and result check runs.

Untimed: `--quick` shrinks the workloads and its numbers mean nothing; the
suite exits non-zero only if a measurement raised or implementations
disagreed on a result.
"""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("gymnax")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_benchmarks_quick_runs_clean(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # (the suite runs on one device, as users do; cwd=ROOT finds `benchmarks`)
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  results = (tmp_path / "RESULTS.md").read_text()
  assert "writes_W2" in results and "epoch_W2_B4096" in results
  assert "ppo_run_reference" in results
  assert (tmp_path / "results.png").stat().st_size > 1000


def test_ppo_compare_report_shows_cpu_over_wall():
  from benchmarks.scripts import ppo_compare  # noqa: PLC0415 - needs gymnax
  names = list(ppo_compare.IMPLS)
  out = {name: {"compile": [2.0, 2.0], "run": [run, run],
                "cpu": [cpu, cpu + 0.1], "final": [500.0]}
         for name, run, cpu in zip(names, [3.0, 2.0, 1.5], [1.5, 1.0, 1.0])}
  text = ppo_compare.report("t", ppo_compare.REFERENCE, out)
  assert "| CPU time / wall time |" in text
  rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
          for line in text.splitlines() if line.startswith("| ")}
  assert rows[names[0]][3] == "1.55"   # median of [1.5, 1.6]
  assert rows[names[1]][3] == "1.05"
  assert "run 1.50x" in text and "MISS" in text   # 3.0 / 2.0
  assert "run 2.00x" in text                      # against the reference
