"""The benchmark harness and suites: every suite runs, the method's arithmetic.

Untimed: ``--smoke`` and ``--quick`` shrink the workloads (their numbers mean
nothing); a run fails only if a measurement raised or implementations
disagreed on a result."""

import dataclasses
import importlib
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import harness as h
from tests._helpers import child_env
from tests._helpers import ROOT


def _run(args, out):
  """``python -m benchmarks ARGS --out OUT`` on one device, as users run it."""
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks", *args, "--out", str(out)],
      cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  return proc


def test_every_suite_runs_its_smoke_case(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("gymnax")
  from benchmarks import suites  # noqa: PLC0415 - imports torch
  _run(["--smoke"], tmp_path)
  results = (tmp_path / "RESULTS.md").read_text()
  cases = suites.smoke_cases(suites.load(suites.SUITES + suites.EXTRA))
  assert {m.suite for m in cases} == set(suites.SUITES), (
      "a default suite has no smoke case")
  for m in cases:
    assert f"`{m.name}` ({m.suite})" in results, m.name
  assert "FAILED" not in results and "Quick mode" in results
  assert "## Throughput" in results and "env steps/s" in results
  assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


ONE_ROUND = h.Config(rounds=1, quick=True, min_sample_s=0.0, max_reps=1)


def _measurement(times, targets=(), check=None, **kw):
  """A measurement of pure-Python impls that sleep nothing: ``times`` maps
  an impl name to the value its run returns."""
  def build(config):
    del config
    return [h.Impl(name, lambda v=v: (lambda: v), "reference", check)
            for name, v in times.items()]
  return h.Measurement("m", "test", build, baseline=next(iter(times)),
                       targets=targets, **kw)


def test_harness_reports_medians_targets_and_cpu_over_wall():
  r = h.ImplResult("a", "jrollout", 0.1, [3.0, 1.0, 2.0], 1,
                   [1.5, 1.5, 3.0])
  assert (r.median, r.min, r.max) == (2.0, 1.0, 3.0)
  assert r.cpu_per_wall == pytest.approx(6.0 / 6.0)
  res = h.run_measurement(
      _measurement({"base": 1, "subj": 1},
                   targets=[h.Target("subj", "base", 1e9),
                            h.Target("subj", None, 1e9, "absolute"),
                            h.Target("subj", "numpy", 1.0, optional=True)]),
      dataclasses.replace(ONE_ROUND, rounds=3))
  assert res.error is None and res.rounds == 3
  assert [t.target.baseline for t in res.targets] == ["base", None]
  ratios = [a / b for a, b in zip(res.impl("subj").samples,
                                  res.impl("base").samples)]
  np.testing.assert_allclose(res.targets[0].round_ratios, ratios)
  np.testing.assert_allclose(res.targets[0].value,
                             np.median(res.impl("subj").samples)
                             / np.median(res.impl("base").samples))
  assert all(row[-1] == "PASS" for row in h.target_rows(res))


def test_harness_refuses_disagreeing_results_and_unknown_targets():
  res = h.run_measurement(_measurement({"a": 1, "b": 2}, check=lambda x: x),
                          ONE_ROUND, log=lambda s: None)
  assert res.error is not None and "b vs a" in res.error
  res = h.run_measurement(
      _measurement({"a": 1}, targets=[h.Target("a", "typo", 1.0)]), ONE_ROUND,
      log=lambda s: None)
  assert res.error is not None and "unknown impl 'typo'" in res.error


def test_throughput_rows_divide_work_by_the_median():
  m = _measurement({"a": 1}, work=lambda c: 1000.0, work_unit="env steps")
  res = h.MeasurementResult(m, impls=[h.ImplResult("a", "jrollout", 1.0,
                                                   [0.5, 0.25, 1.0], 1)])
  assert h.work_rows(res, ONE_ROUND) == [
      ["m", "a", "1,000 env steps", "500 ms", "2,000 env steps/s"]]


def test_only_selects_a_suite_by_name_and_extra_suites_when_named():
  from benchmarks import run  # noqa: PLC0415
  ms = [h.Measurement(n, "", lambda c: [], suite=s) for n, s in
        (("ppo_run", "ppo"), ("ppo_sweep_E4", "ppo_sweep"),
         ("epoch_W1", "epoch"))]
  names = lambda sel: [m.name for m in sel]  # noqa: E731
  assert names(run.select(ms, [], ["ppo", "epoch"])) == ["ppo_run",
                                                          "epoch_W1"]
  assert names(run.select(ms, ["ppo"], ["ppo", "epoch"])) == ["ppo_run"]
  assert names(run.select(ms, ["ppo_sweep"])) == ["ppo_sweep_E4"]
  assert names(run.select(ms, ["ppo_*,epoch"])) == ["ppo_run",
                                                     "ppo_sweep_E4",
                                                     "epoch_W1"]
  assert names(run.select(ms, ["epoch_W"])) == ["epoch_W1"]


def test_ppo_sweep_runs_the_configurations_of_its_saved_results():
  """4, 64 and 256 envs and 16 seeds (results/ppo_sweep/RESULTS.md)."""
  pytest.importorskip("gymnax")
  sweep = importlib.import_module("benchmarks.suites.ppo_sweep")
  steps = {m.name: m.work(h.Config()) for m in sweep.MEASUREMENTS}
  assert steps == {"ppo_sweep_E4": 262_144, "ppo_sweep_E64": 524_288,
                   "ppo_sweep_E256": 524_288, "ppo_sweep_S16": 524_288}


def test_baseline_switch_against_head_times_every_hot_path_row(tmp_path):
  """``--baseline HEAD --quick``: the checkout against its own commit."""
  pytest.importorskip("torch")
  proc = _run(["--baseline", "HEAD", "--quick", "--rounds", "2"], tmp_path)
  result = json.loads((tmp_path / "baseline.json").read_text())
  rows = ["writer_W1_rollout", "scan_update_at_W2",
          "compile_scan_update_at_W2", "make_batch_W2", "epoch_W2_B4096",
          "compile_epoch_W2_B4096", "from_torch_step", "to_torch_step"]
  assert list(result["rows"]) == rows
  assert result["rev"] == "HEAD" and result["rounds"] == 2
  for name, row in result["rows"].items():
    assert len(row["round_ratios"]) == 2, name
    assert math.isfinite(row["ratio"]) and row["ratio"] > 0, name
    assert row["ratio"] == pytest.approx(
        row["HEAD"]["median_s"] / row["REV"]["median_s"]), name
    assert name in proc.stdout
  assert "HEAD / REV" in proc.stdout


def test_baseline_switch_names_an_unknown_revision():
  from benchmarks import baseline  # noqa: PLC0415
  with pytest.raises(ValueError, match="--baseline: 'no-such-rev' is not a "
                     "commit"):
    baseline.resolve("no-such-rev")


def test_gpu_run_measures_the_suites_rows():
  pytest.importorskip("torch")
  pytest.importorskip("gymnax")
  from benchmarks.gpu import bench  # noqa: PLC0415
  ms = bench.measurements(["W2", "GPU"], ppo_seeds=256, ppo_updates=20)
  assert [m.name for m in ms] == [
      "writes_W2", "make_batch_W2", "epoch_W2_B4096", "gae_W2",
      "writes_GPU", "make_batch_GPU", "epoch_GPU_B4096", "gae_GPU",
      "bridge_from_torch", "bridge_to_torch", "ppo_seeds_256"]
  assert [m.suite for m in ms[:4]] == ["writes", "batch", "epoch", "gae"]
  assert ms[-1].work(h.Config()) == 256 * 20 * 8 * 128
