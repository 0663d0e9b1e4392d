"""Helpers shared by several test modules (fixtures are in conftest.py).

The ``jax.distributed`` workers import this module before JAX starts, so it
imports JAX only inside functions, after ``start_worker`` sets ``XLA_FLAGS``.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

# The subprocesses' working directory (``python -m benchmarks`` finds it).
ROOT = pathlib.Path(__file__).resolve().parent.parent


def child_env(*, drop=(), **extra):
  """This environment for a child process, without ``XLA_FLAGS`` (it sets
  up its own devices) or the names in ``drop``, with ``extra`` set."""
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and k not in drop}
  env.update(extra)
  return env


def assert_same_leaves(got, want, *, shardings=True):
  """Same structure; leaf by leaf the same type and Python scalar, or array
  dtype, shape, values (a PRNG key's data) and, with ``shardings``,
  equivalent shardings."""
  import jax  # noqa: PLC0415 - see the module docstring
  assert jax.tree_util.tree_structure(got) == \
      jax.tree_util.tree_structure(want)
  for x, y in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    assert type(x) is type(y)
    if isinstance(x, (bool, int, float)):
      assert x == y
      continue
    assert x.dtype == y.dtype and x.shape == y.shape
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if shardings and isinstance(x, jax.Array):
      assert x.sharding.is_equivalent_to(y.sharding, x.ndim)


def envs_mesh(num_devices=None):
  """A 1-D auto mesh, axis "envs", over the first ``num_devices`` (all)."""
  import jax  # noqa: PLC0415 - see the module docstring
  from jax.sharding import AxisType  # noqa: PLC0415 - as jax above
  return jax.make_mesh((num_devices or jax.device_count(),), ("envs",),
                       axis_types=(AxisType.Auto,))


def random_batch(lengths, seed=0):
  """``{"k{i}": float32 [n, 2]}`` for each ``n`` in lengths, normal draws."""
  rng = np.random.default_rng(seed)
  return {f"k{i}": rng.standard_normal((n, 2)).astype(np.float32)
          for i, n in enumerate(lengths)}


# ------------------------------------------------- several processes (tests)


def free_port() -> int:
  """A localhost TCP port no one listens on now (bound to 0, released)."""
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def run_workers(command, args_of, *, num_processes=2, timeout, log_dir,
                skip_if=None):
  """Runs ``python -m *command PROCESS_ID NUM_PROCESSES PORT *args_of(i)``
  for each process i and returns their outputs (also in
  ``log_dir/worker{i}.log``).

  Fails the test, stopping the others (a peer of a dead process would wait
  in a collective), if one fails or they are not all done in ``timeout`` s;
  skips instead when ``skip_if(logs)`` returns a reason.
  """
  port = str(free_port())
  env = child_env()
  paths = [pathlib.Path(log_dir) / f"worker{i}.log"
           for i in range(num_processes)]
  procs = []
  for i, path in enumerate(paths):
    with open(path, "w") as log:
      procs.append(subprocess.Popen(
          [sys.executable, "-m", *command, str(i), str(num_processes), port,
           *args_of(i)], cwd=ROOT, env=env, stdout=log,
          stderr=subprocess.STDOUT, text=True))
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    codes = [p.poll() for p in procs]
    if None not in codes or any(codes):
      break
    time.sleep(0.1)
  codes = [p.poll() for p in procs]
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
  logs = [path.read_text() for path in paths]
  failed = [i for i, code in enumerate(codes) if code]
  if failed and skip_if is not None:
    reason = skip_if("".join(logs))
    if reason:
      pytest.skip(reason)
  if failed or None in codes:
    why = (f"worker(s) {failed} failed" if failed else
           f"the {num_processes} processes did not finish in {timeout} s "
           "(a hang?)")
    pytest.fail(why + ":\n" + "\n".join(
        f"--- worker {i}:\n{log[-3000:]}" for i, log in enumerate(logs)))
  return logs


# ----------------------------------------------- several processes (workers)


def start_worker(argv, local_devices=4):
  """``argv`` = PROCESS_ID NUM_PROCESSES PORT ...: starts JAX on
  ``local_devices`` fake CPU devices with gloo collectives, joins the other
  processes and returns ``(jax, jr, envs_mesh(), argv[3:])``. Call
  ``jax.distributed.shutdown()`` at the end.
  """
  process_id, num_processes, port = int(argv[0]), int(argv[1]), argv[2]
  os.environ["XLA_FLAGS"] = (
      f"--xla_force_host_platform_device_count={local_devices}")
  import jax  # noqa: PLC0415 - only after XLA_FLAGS is set
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes,
                             process_id=process_id)

  import jrollout as jr  # noqa: PLC0415 - after jax.distributed.initialize
  return jax, jr, envs_mesh(), argv[3:]
