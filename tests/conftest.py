"""Shared test setup: strict JAX numerics, 8 fake CPU devices, fixtures."""

import importlib
import os

# Must be set before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The examples run by tests use no persistent compilation cache (their
# --compile-cache default is $JROLLOUT_COMPILE_CACHE, "" turns it off): the
# suite writes nothing to ~/.cache, a test's main() does not change JAX's
# global config for the tests after it, and no test loads another's
# executables. Child processes inherit it. tests/test_compile_cache.py
# passes --compile-cache into tmp_path.
os.environ["JROLLOUT_COMPILE_CACHE"] = ""

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile("jrollout", deadline=None, max_examples=25,
                          print_blob=True)
settings.load_profile("jrollout")

def pytest_report_header(config):
  """The machine at the top of the log: the learning tests' returns depend
  on the CPU's XLA code (instruction set, threads), so a failure elsewhere is
  read with it (benchmarks/results/learning_margins/)."""
  del config
  import jaxlib  # noqa: PLC0415  (its version only)
  import platform  # noqa: PLC0415
  cpu = platform.processor() or "unknown CPU"
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f
                 if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return (f"jrollout machine: {cpu}, {os.cpu_count()} cores, "
          f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
          f"{jax.default_backend()} x {jax.device_count()}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '').strip()!r}")


TRANSFORMS = [pytest.param(lambda f: f, id="nojit"),
              pytest.param(jax.jit, id="jit")]


@pytest.fixture
def rng_key():
  return jax.random.key(0)


@pytest.fixture
def transition_spec():
  """A fake transition with mixed dtypes and ranks: {key: (shape, dtype)}."""
  return {
      "obs": ((3,), jnp.float32),
      "image": ((2, 2), jnp.uint8),
      "action": ((), jnp.int32),
      "reward": ((), jnp.float32),
      "done": ((), jnp.bool_),
  }


class CompileCounter:
  """Counts XLA backend compilations inside a ``with`` block."""

  def __init__(self):
    self.count = 0
    self._active = False
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event, duration, **kwargs):
    del duration, kwargs
    if self._active and event == "/jax/core/compile/backend_compile_duration":
      self.count += 1

  def __enter__(self):
    self.count = 0
    self._active = True
    return self

  def __exit__(self, *exc):
    self._active = False


_COUNTER = None


@pytest.fixture
def count_compiles():
  """``with count_compiles() as c: ...; assert c.count == 0``."""
  global _COUNTER
  if _COUNTER is None:
    _COUNTER = CompileCounter()
  return lambda: _COUNTER


@pytest.fixture
def strict_numpy():
  """Strict rank and dtype promotion inside the test, whatever the global
  config (a module opts in: ``pytestmark = pytest.mark.usefixtures(
  "strict_numpy")``)."""
  with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
    yield


@pytest.fixture
def standard_promotion():
  """JAX's default promotion rules, for tests that run third-party code.

  This conftest makes jrollout's own tests strict; gymnax and the examples
  built on it are not strict-clean.
  """
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    yield


def load_example(name):
  """``examples.<name>``; tests may also ``from examples import <name>``."""
  return importlib.import_module(f"examples.{name}")
