"""The examples' persistent compilation cache (``--compile-cache``).

Each run is a fresh process: the cache is JAX's global config, and only a
second process shows that compiled executables were loaded from disk. The
children report JAX's cache events (``/jax/compilation_cache/...``, through
``jax.monitoring``) rather than times, which a busy machine makes noisy.
"""

import json
import os
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

# Runs ppo_cartpole.main(argv) and prints JAX's cache events as JSON.
CHILD = """
import collections, json, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_listener(
    lambda event, **kwargs: events.update([event]))
from examples import ppo_cartpole
from examples.common import executables
summary = ppo_cartpole.main(sys.argv[1:])
print("EVENTS " + json.dumps({
    "hits": events["/jax/compilation_cache/cache_hits"],
    "loaded": events[executables.LOADED],
    "saved": events[executables.SAVED],
    "cache_dir": jax.config.jax_compilation_cache_dir,
    "params_sha256": summary["params_sha256"]}))
"""

TINY = ["--total-steps", "256", "--num-envs", "4", "--num-steps", "32",
        "--num-minibatches", "2", "--num-epochs", "1", "--seeds", "1",
        "--chunks", "1"]


def start_child(tmp_path, name, *flags):
  """One tiny ppo_cartpole run in a fresh process, with HOME in tmp_path
  and $JROLLOUT_COMPILE_CACHE unset (so the default is in tmp_path)."""
  env = child_env(drop=(cli.COMPILE_CACHE_ENV,))
  env["HOME"] = str(tmp_path / "home")
  # matplotlib's font cache stays where it is (a new one takes seconds).
  env.setdefault("MPLCONFIGDIR", matplotlib.get_cachedir())
  return subprocess.Popen(
      [sys.executable, "-c", CHILD, *TINY, "--out", str(tmp_path / name),
       *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)


def events(proc):
  """The child's cache events (``CHILD``), once it has exited."""
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out
  line = next(x for x in out.splitlines() if x.startswith("EVENTS "))
  return json.loads(line[len("EVENTS "):])


def entries(path):
  return sorted(p.name for p in path.iterdir()) if path.exists() else []


# Slow: three example runs in fresh processes (about 50 s on 2 cores).
@pytest.mark.slow
def test_a_second_process_loads_the_compiled_programs(tmp_path):
  cache = tmp_path / "cache"
  # The first run with the cache and one without it, side by side.
  cold = start_child(tmp_path, "cold", "--compile-cache", str(cache))
  off = start_child(tmp_path, "off", "--no-compile-cache")
  cold, off = events(cold), events(off)
  written = entries(cache)
  assert written, "the first run wrote no cache entry"
  assert cold["cache_dir"] == str(cache)
  assert "executables" in written
  assert (cold["hits"], cold["loaded"], cold["saved"]) == (0, 0, 1)
  assert off["cache_dir"] is None
  assert (off["hits"], off["loaded"], off["saved"]) == (0, 0, 0)

  # The second run loads the chunk's executable whole
  # (examples/common/executables.py: no tracing, no lowering) and the
  # others (the init's, whose outputs hold the optimiser, is not saved
  # whole) from JAX's cache.
  warm = events(start_child(tmp_path, "warm", "--compile-cache", str(cache)))
  assert (warm["loaded"], warm["saved"]) == (1, 0)
  assert warm["hits"] >= 1
  assert entries(cache) == written, "the second run compiled anew"
  assert len(entries(cache / "executables")) == 1

  # --no-compile-cache wrote nothing, not even in the default directory
  # (~/.cache/jrollout/jax: HOME is tmp_path/home).
  assert entries(tmp_path) == ["cache", "cold", "off", "warm"]
  # The same executables: the same results, bit for bit.
  assert cold["params_sha256"] == warm["params_sha256"] == off[
      "params_sha256"]
  saved = json.loads((tmp_path / "warm" / "summary.json").read_text())
  assert saved["params_sha256"] == warm["params_sha256"]
  assert saved["config"]["compile_cache"] == str(cache)


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
  # process) write nothing to ~/.cache and share no executables.
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
