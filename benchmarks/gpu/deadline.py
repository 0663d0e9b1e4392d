"""A per-test time limit for pytest, for when pytest-timeout is missing.

``python -m pytest -p benchmarks.gpu.deadline --deadline=SECONDS``: a test
(setup, call and teardown each) that runs longer than SECONDS fails with
``DeadlineExceeded`` and the session goes on with the next test. It uses
SIGALRM, so it works on Unix in the main thread only, and like
pytest-timeout's signal method it cannot interrupt a call blocked in C code
until that call returns; ``check.sh`` also bounds each stage with
``timeout``. ``check.sh`` prefers pytest-timeout when it is installed.
"""

from __future__ import annotations

import signal

import pytest


class DeadlineExceeded(Exception):
  """A test phase ran past ``--deadline`` seconds."""


def pytest_addoption(parser):
  parser.addoption("--deadline", type=float, default=0.0, metavar="SECONDS",
                   help="fail a test phase that runs longer than this "
                   "(0: no limit)")


def _limit(item, phase: str):
  seconds = item.config.getoption("deadline")
  if not seconds or not hasattr(signal, "SIGALRM"):
    return None

  def expire(signum, frame):
    del signum, frame
    raise DeadlineExceeded(f"{item.nodeid}: {phase} ran past the "
                           f"--deadline of {seconds:g} s")

  previous = signal.signal(signal.SIGALRM, expire)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  return previous


def _clear(previous) -> None:
  if previous is not None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
  previous = _limit(item, "setup")
  try:
    yield
  finally:
    _clear(previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  previous = _limit(item, "call")
  try:
    yield
  finally:
    _clear(previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
  previous = _limit(item, "teardown")
  try:
    yield
  finally:
    _clear(previous)
