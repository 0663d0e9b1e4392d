"""The examples' persistent compilation cache (``--compile-cache``).

Each run is a fresh process: the cache is JAX's global config, and only a
later process shows what a cache entry does to it. The children report
JAX's cache events (``/jax/compilation_cache/...``, through
``jax.monitoring``) rather than times, which a busy machine makes noisy.

Issue 48: the examples once pickled whole executables beside JAX's cache.
An executable that JAX's cache had handed back lost kernels when pickled
again (XLA:CPU's ``wrapped_copy``), and the next process to load it crashed.
``test_runs_sharing_a_cache_never_crash`` replays that sequence.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

pytest.importorskip("gymnax")
pytest.importorskip("optax")

matplotlib = pytest.importorskip("matplotlib")

from examples import ppo_cartpole  # noqa: E402
from examples.common import checkpoints  # noqa: E402
from examples.common import cli  # noqa: E402
from tests._helpers import child_env  # noqa: E402
from tests._helpers import ROOT  # noqa: E402

# Runs an example's main(argv) and prints JAX's cache events as JSON.
CHILD = """
import collections, importlib, json, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_listener(
    lambda event, **kwargs: events.update([event]))
example = importlib.import_module("examples." + sys.argv[1])
summary = example.main(sys.argv[2:])
print("EVENTS " + json.dumps({
    "hits": events["/jax/compilation_cache/cache_hits"],
    "misses": events["/jax/compilation_cache/cache_misses"],
    "cache_dir": jax.config.jax_compilation_cache_dir,
    "params_sha256": summary["params_sha256"]}))
"""

# 32 updates in 16 chunks: progress lines to kill a run after.
SHORT = ["--total-steps", "8192", "--num-envs", "4", "--num-steps", "64",
         "--num-minibatches", "2", "--seeds", "2", "--chunks", "16"]


def start_child(tmp_path, example, name, *flags):
  """One run of ``example`` in a fresh process, with HOME in tmp_path and
  $JROLLOUT_COMPILE_CACHE unset (so the default cache is in tmp_path)."""
  env = child_env(drop=(cli.COMPILE_CACHE_ENV,))
  env["HOME"] = str(tmp_path / "home")
  if example == "ppo_sharded":   # its 8 devices, before the child's JAX
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  # matplotlib's font cache stays where it is (a new one takes seconds).
  env.setdefault("MPLCONFIGDIR", matplotlib.get_cachedir())
  return subprocess.Popen(
      [sys.executable, "-c", CHILD, example, *flags, "--out",
       str(tmp_path / name)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)


def events(proc):
  """The child's cache events (``CHILD``), once it has exited 0."""
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-4000:]
  line = next(x for x in out.splitlines() if x.startswith("EVENTS "))
  return json.loads(line[len("EVENTS "):])


def killed_after(proc, progress_lines):
  """SIGKILLs the child after ``progress_lines`` progress lines."""
  seen, lines = 0, []
  for line in proc.stdout:
    lines.append(line)
    seen += line.startswith("update ")
    if seen == progress_lines:
      break
  os.kill(proc.pid, signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL, "".join(lines[-30:])


def entries(path):
  return sorted(p.name for p in path.iterdir()) if path.exists() else []


@pytest.mark.slow
def test_runs_sharing_a_cache_never_crash(tmp_path):
  """Issue 48's sequence, in fresh processes sharing the default cache: a
  run, its checkpointed twin killed and resumed, then a run with other
  settings that compiles the same programs (found in the cache), and its
  checkpointed twin. Each exits 0; each twin ends with its plain run's
  parameters, bit for bit, and so does a last run without the cache."""
  def run(name, *flags):
    return events(start_child(tmp_path, "ppo_cartpole", name, *SHORT,
                              *flags))

  first = run("a", "--seed", "4242")
  cache = tmp_path / "home" / ".cache" / "jrollout" / "jax"
  assert first["cache_dir"] == str(cache)
  assert first["misses"] >= 2 and first["hits"] == 0  # the init, a chunk
  written = entries(cache)
  twin = ["--seed", "4242", "--checkpoint-dir", str(tmp_path / "ck1")]
  killed_after(start_child(tmp_path, "ppo_cartpole", "b", *SHORT, *twin), 5)
  resumed = run("b", *twin)
  assert resumed["misses"] == 0
  assert resumed["params_sha256"] == first["params_sha256"]
  # Another seed and checkpoint interval: the same programs, all of them
  # from the cache, which the old executable layer saved again, broken.
  other = ["--seed", "5151", "--checkpoint-every", "12"]
  plain = run("c", *other)
  assert plain["misses"] == 0 and plain["hits"] > 0
  checkpointed = run("d", *other, "--checkpoint-dir", str(tmp_path / "ck2"))
  assert checkpointed["params_sha256"] == plain["params_sha256"]
  assert entries(cache) == written, "a run with the same programs compiled"
  # Without the cache: nothing read or written, the same parameters.
  off = run("e", *other, "--no-compile-cache")
  assert off["cache_dir"] is None and (off["hits"], off["misses"]) == (0, 0)
  assert off["params_sha256"] == plain["params_sha256"]
  assert entries(cache) == written
  saved = json.loads((tmp_path / "d" / "summary.json").read_text())
  assert saved["params_sha256"] == plain["params_sha256"]


# The sharded example (several devices) and Brax's physics, 4 updates in 2
# chunks, a checkpoint at each chunk's end (no eval: its compile is the
# same cache path as training's, and 20-40 s per run).
OTHERS = {
    "ppo_sharded": ["--total-steps", "2048", "--num-envs", "16",
                    "--num-steps", "32", "--num-minibatches", "2",
                    "--num-epochs", "1", "--chunks", "2"],
    "ppo_brax": ["--env", "inverted_pendulum", "--num-envs", "16",
                 "--num-steps", "16", "--num-minibatches", "2",
                 "--num-epochs", "1", "--total-steps", "1024", "--seeds",
                 "1", "--chunks", "2", "--eval-envs", "0"],
}


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(OTHERS))
def test_other_examples_sharing_a_cache_never_crash(tmp_path, example):
  """A checkpointed run, then the same command once its last checkpoint is
  gone: it resumes at update 2, its training programs from the cache the
  first filled (the restore compiles a few of its own), and ends with the
  first run's parameters and returns, bit for bit (the examples' exact
  resume)."""
  if example == "ppo_brax":
    pytest.importorskip("brax.envs")
  ckpt = tmp_path / "ckpt"
  args = [*OTHERS[example], "--seed", "1", "--checkpoint-dir", str(ckpt),
          "--checkpoint-every", "1"]
  first = events(start_child(tmp_path, example, "a", *args))
  assert first["misses"] > 0
  shutil.rmtree(ckpt / "4")
  again = events(start_child(tmp_path, example, "b", *args))
  assert again["hits"] > 0 and again["misses"] < first["misses"]
  assert again["params_sha256"] == first["params_sha256"]
  a, b = (json.loads((tmp_path / x / "summary.json").read_text())
          for x in "ab")
  assert b["params_sha256"] == first["params_sha256"]
  for key in {"final_returns", "returns"} & set(a):   # brax / sharded
    assert b[key] == a[key], key


def test_compile_cache_flags(monkeypatch):
  monkeypatch.setenv("HOME", "/home/someone")
  monkeypatch.delenv(cli.COMPILE_CACHE_ENV, raising=False)
  assert ppo_cartpole.parse_config([]).compile_cache == (
      "/home/someone/.cache/jrollout/jax")
  monkeypatch.setenv(cli.COMPILE_CACHE_ENV, "/tmp/elsewhere")
  assert ppo_cartpole.parse_config([]).compile_cache == "/tmp/elsewhere"
  assert ppo_cartpole.parse_config(
      ["--compile-cache", "d"]).compile_cache == "d"
  config = ppo_cartpole.parse_config(["--no-compile-cache"])
  assert config.compile_cache == ""
  assert cli.use_compile_cache(config) is None   # sets nothing
  monkeypatch.setenv(cli.COMPILE_CACHE_ENV, "")   # empty: off
  assert ppo_cartpole.parse_config([]).compile_cache == ""


def test_the_test_suite_runs_the_examples_without_a_cache():
  # conftest.py: examples run by tests (main() in this process, or a child
  # process) write nothing to ~/.cache and share no compiled programs.
  assert os.environ[cli.COMPILE_CACHE_ENV] == ""
  assert ppo_cartpole.Config().compile_cache == ""


def test_a_resumed_run_may_use_another_cache(tmp_path):
  # compile_cache is not one of the settings a checkpoint must match.
  settings = []
  for cache in ("a", ""):
    checkpoint = checkpoints.RunCheckpoint(ppo_cartpole.Config(
        checkpoint_dir=str(tmp_path / "ckpt"), compile_cache=cache))
    settings.append(checkpoint._settings)
    checkpoint.close()
  assert settings[0] == settings[1]
  assert "compile_cache" not in settings[0]
