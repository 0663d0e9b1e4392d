"""Smoke test of the PPO sweep (benchmarks/scripts/ppo_sweep.py).

The quick mode runs end to end (one configuration, 2 updates, one round:
untimed, its numbers mean nothing); the report's arithmetic is checked on
fabricated timings against numpy.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("gymnax")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_ppo_sweep_quick_runs_clean(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # (one device, as users run it; cwd=ROOT finds `benchmarks` and `examples`)
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.scripts.ppo_sweep", "--quick",
       "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  result = json.loads((tmp_path / "results.json").read_text())
  assert result["quick"] and result["rounds"] == 1
  assert len(result["load_start"]) == 3 and len(result["load_end"]) == 3
  (rec,) = result["configs"]
  assert (rec["num_envs"], rec["seeds"], rec["num_updates"]) == (4, 1, 2)
  assert rec["env_steps_per_run"] == 2 * 4 * 128
  for name in ("jrollout", "jax idiom"):
    m = rec["impls"][name]
    assert len(m["run_s"]) == 1 and len(m["compile_s"]) == 1
    assert m["run_s"][0] > 0 and m["compile_s"][0] > 0
    assert len(m["compile_cpu_s"]) == 1 and m["compile_cpu_s"][0] > 0
  text = (tmp_path / "RESULTS.md").read_text()
  assert "Quick mode" in text and result["machine_line"] in text
  assert "load average" in text and "jax idiom" in text
  assert (tmp_path / "ppo_sweep.png").stat().st_size > 10_000
  assert f"E4 {rec['load_start'][0]}" in text
  # --render rewrites the outputs from results.json, adding notes
  from benchmarks.scripts import ppo_sweep  # noqa: PLC0415 - needs gymnax
  ppo_sweep.main(["--render", str(tmp_path / "results.json"), "--out",
                  str(tmp_path / "again"), "--note", "a note"])
  again = json.loads((tmp_path / "again" / "results.json").read_text())
  assert again == {**result, "notes": ["a note"]}
  assert "- a note" in (tmp_path / "again" / "RESULTS.md").read_text()


def _fake_out(rng, rounds):
  return {name: {"compile": list(rng.uniform(5, 10, 2)),
                 "compile_cpu": list(rng.uniform(5, 10, 2)),
                 "run": list(rng.uniform(1, 4, rounds)),
                 "cpu": list(rng.uniform(0.9, 1.6, rounds)),
                 "final": list(rng.uniform(10, 500, 3))}
          for name in ("jrollout", "jax idiom")}


def test_ppo_sweep_report_arithmetic(tmp_path):
  from benchmarks.scripts import ppo_sweep  # noqa: PLC0415 - needs gymnax
  rng = np.random.default_rng(0)
  records, outs = [], []
  for sweep in ppo_sweep.CONFIGS:
    out = _fake_out(rng, rounds=5)
    outs.append(out)
    records.append(ppo_sweep.summarise(sweep, out))
  for sweep, out, rec in zip(ppo_sweep.CONFIGS, outs, records):
    c = sweep.config
    per_update = c.num_envs * c.num_steps
    steps = c.seeds * (c.total_steps // per_update) * per_update
    assert rec["env_steps_per_run"] == steps
    jr = np.array(out["jrollout"]["run"])
    idiom = np.array(out["jax idiom"]["run"])
    np.testing.assert_allclose(rec["run_ratio"], np.median(jr / idiom))
    np.testing.assert_allclose(rec["run_ratio_min_max"],
                               [np.min(jr / idiom), np.max(jr / idiom)])
    np.testing.assert_allclose(
        rec["compile_ratio"],
        np.median(np.array(out["jrollout"]["compile"])
                  / np.array(out["jax idiom"]["compile"])))
    m = rec["impls"]["jrollout"]
    np.testing.assert_allclose(m["env_steps_per_s"], steps / np.median(jr))
    np.testing.assert_allclose(m["env_steps_per_s_min_max"],
                               [steps / jr.max(), steps / jr.min()])
  table = ppo_sweep.summary_table(records)
  rows = table.splitlines()[2:]
  assert len(rows) == len(ppo_sweep.CONFIGS)
  for row, rec in zip(rows, records):
    assert f"**{rec['run_ratio']:.2f}x**" in row
    assert f"{rec['env_steps_per_run']:,}" in row
  result = {"configs": records, "started": "2026-01-01T00:00:00",
            "machine_line": "a CPU, 2 cores, jax 0", "quick": False}
  assert ppo_sweep.write_chart(tmp_path / "c.png", result)
  assert (tmp_path / "c.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv", [["--configs", "E5"], ["--configs", ","],
                                  ["--rounds", "0"], ["--scale", "0"]])
def test_ppo_sweep_rejects_bad_flags(argv, capsys):
  from benchmarks.scripts import ppo_sweep  # noqa: PLC0415 - needs gymnax
  with pytest.raises(SystemExit):
    ppo_sweep.parse_args(argv)
  assert "expected" in capsys.readouterr().err
