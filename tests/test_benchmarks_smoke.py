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
