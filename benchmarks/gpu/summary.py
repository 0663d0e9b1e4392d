"""SUMMARY.md of a GPU check: what ran, how long, what failed.

``python -m benchmarks.gpu.summary OUT STAGES`` reads ``STAGES`` (one line
per stage, written by ``check.sh``: name, exit status, seconds, budget,
what it ran) and ``OUT/tests.xml`` (pytest's junit report) and writes
``OUT/SUMMARY.md``. Only the standard library: it must run even where the
environment is broken.
"""

from __future__ import annotations

import pathlib
import sys
import xml.etree.ElementTree as ET

EXIT = {0: "ok", 1: "failures", 2: "interrupted", 5: "no tests ran",
        124: "time limit", 137: "killed"}


def junit_counts(path: pathlib.Path) -> dict:
  """Counts and failed tests of a junit XML report (empty if missing).

  Returns:
    ``{"tests", "failures", "errors", "skipped", "passed": int,
    "failed": [(test id, first line of the message)]}``.
  """
  if not path.exists():
    return {}
  root = ET.parse(path).getroot()
  suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
  out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
  for suite in suites:
    for key in ("tests", "failures", "errors", "skipped"):
      out[key] += int(suite.get(key, 0))
    for case in suite.iter("testcase"):
      for bad in list(case.iter("failure")) + list(case.iter("error")):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        message = (bad.get("message") or "").strip().splitlines()
        out["failed"].append((test_id, message[0][:160] if message else ""))
  out["passed"] = (out["tests"] - out["failures"] - out["errors"]
                   - out["skipped"])
  return out


def read_stages(path: pathlib.Path) -> list[list[str]]:
  if not path.exists():
    return []
  return [line.split("\t") for line in path.read_text().splitlines()
          if line.strip()]


def render(out: pathlib.Path, stages_path: pathlib.Path) -> str:
  stages = read_stages(stages_path)
  lines = ["# GPU check summary", "",
           "| stage | result | seconds | budget s | ran |",
           "| --- | --- | --- | --- | --- |"]
  for name, rc, seconds, budget, what in ((s + [""] * 5)[:5] for s in stages):
    status = EXIT.get(int(rc), f"exit {rc}") if rc.lstrip("-").isdigit() \
        else rc
    lines.append(f"| {name} | {status} | {seconds} | {budget} | {what} |")
  counts = junit_counts(out / "tests.xml")
  lines += ["", "## Tests", ""]
  if not counts:
    lines.append("No junit report (tests.xml): the test stage did not "
                 "finish writing it; see tests.txt and check.log.")
  else:
    lines.append(f"{counts['tests']} tests: {counts['passed']} passed, "
                 f"{counts['failures']} failed, {counts['errors']} errors, "
                 f"{counts['skipped']} skipped (details: tests.xml, "
                 "tests.txt).")
    if counts["failed"]:
      lines += ["", "Failed:", ""]
      lines += [f"- `{test_id}`: {message}"
                for test_id, message in counts["failed"]]
  lines += ["", "Benchmarks: RESULTS.md (and results.png); versions and "
            "devices: env.txt; everything printed: check.log.", ""]
  return "\n".join(lines)


def main(argv=None) -> int:
  args = sys.argv[1:] if argv is None else argv
  out = pathlib.Path(args[0])
  (out / "SUMMARY.md").write_text(render(out, pathlib.Path(args[1])))
  print((out / "SUMMARY.md").read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
