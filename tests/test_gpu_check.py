"""The one-command GPU check (benchmarks/gpu): its CPU dry run (every stage
at small sizes, so the script cannot rot between GPU sessions) and parts."""

import subprocess
import sys
import textwrap

import pytest

from benchmarks.gpu import summary
from tests._helpers import child_env
from tests._helpers import ROOT


def test_summary_reports_stages_and_failed_tests(tmp_path):
  (tmp_path / "tests.xml").write_text(textwrap.dedent("""\
      <?xml version="1.0" encoding="utf-8"?>
      <testsuites><testsuite name="pytest" errors="1" failures="1"
          skipped="1" tests="5">
        <testcase classname="tests.test_a" name="test_ok"/>
        <testcase classname="tests.test_a" name="test_ok2"/>
        <testcase classname="tests.test_a" name="test_bad">
          <failure message="AssertionError: 1 != 2&#10;more">tb</failure>
        </testcase>
        <testcase classname="tests.test_b" name="test_err">
          <error message="failed on setup">tb</error>
        </testcase>
        <testcase classname="tests.test_b" name="test_skip">
          <skipped message="no GPU"/>
        </testcase>
      </testsuite></testsuites>
  """))
  stages = tmp_path / "stages.tsv"
  stages.write_text("install\t0\t3\t-\tjrollout\n"
                    "tests\t1\t40\t270\tpytest tests\n"
                    "bench\t124\t180\t180\tbench\n"
                    "total\t1\t230\t480\tGPU run\n")
  text = summary.render(tmp_path, stages)
  assert "| tests | failures | 40 | 270 | pytest tests |" in text
  assert "| bench | time limit | 180 | 180 | bench |" in text
  assert "5 tests: 2 passed, 1 failed, 1 errors, 1 skipped" in text
  assert "- `tests.test_a::test_bad`: AssertionError: 1 != 2" in text
  assert "- `tests.test_b::test_err`: failed on setup" in text
  assert "No junit report" in summary.render(tmp_path / "missing", stages)


@pytest.mark.slow
def test_check_sh_dry_run_writes_every_report(tmp_path):
  """The whole script on the CPU (about 100 s on 2 busy cores)."""
  pytest.importorskip("torch")
  pytest.importorskip("gymnax")
  out = tmp_path / "out"
  env = child_env(PYTHONUNBUFFERED="1", OUT=str(out), PYTHON=sys.executable)
  proc = subprocess.run(["bash", "benchmarks/gpu/check.sh", "--dry-run"],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  names = {p.name for p in out.iterdir()}
  assert names == {"SUMMARY.md", "check.log", "env.txt", "tests.xml",
                   "tests.txt", "RESULTS.md", "results.png"}, names
  text = (out / "SUMMARY.md").read_text()
  for stage in ("install", "env", "tests", "bench"):
    assert f"| {stage} | ok |" in text, text
  assert "| total | ok |" in text and "dry run (CPU)" in text, text
  counts = summary.junit_counts(out / "tests.xml")
  assert counts["tests"] >= 6 and counts["failures"] == counts["errors"] == 0
  env_txt = (out / "env.txt").read_text()
  assert "jax default backend: cpu" in env_txt
  assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in env_txt
  assert "values ok" in env_txt
  results = (out / "RESULTS.md").read_text()
  assert "Quick mode" in results
  for name in ("writes_W2", "writes_GPU", "make_batch_GPU",
               "epoch_GPU_B4096", "gae_GPU", "bridge_from_torch",
               "bridge_to_torch", "ppo_seeds_2"):
    assert f"`{name}`" in results, name
  assert "FAILED" not in results and "## Throughput" in results
  assert "env steps/s" in results
