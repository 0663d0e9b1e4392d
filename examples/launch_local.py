"""Runs P processes of a multi-process example on this machine, as one job.

For trying a ``--distributed`` example on one machine (and for the tests):

    python -m examples.launch_local --num-processes 2 examples.ppo_sharded \\
        --mode global

starts ``python -m examples.ppo_sharded --mode global --distributed
--coordinator localhost:PORT --num-processes 2 --process-id I`` for I = 0
and 1, with PORT a free port, and waits for them. Every process inherits
this one's output (the examples print from process 0 only). If one fails,
the others are stopped (a process whose peer died would otherwise wait in a
collective until JAX's heartbeat timeout) and its exit status is returned;
SIGINT or SIGTERM to the launcher is passed on to them. The processes are
in the launcher's process group: ``kill -- -PGID`` stops all of them.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
  """A TCP port no one listens on now (bound to port 0, then released)."""
  with socket.socket() as sock:
    sock.bind(("", 0))
    return sock.getsockname()[1]


def commands(module: str, args: list[str], num_processes: int,
             coordinator: str) -> list[list[str]]:
  """The command line of each process, ``python -m module args`` and the
  four process flags."""
  return [[sys.executable, "-m", module, *args, "--distributed",
           "--coordinator", coordinator, "--num-processes", str(num_processes),
           "--process-id", str(i)] for i in range(num_processes)]


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
  """SIGTERM to every process still running, then SIGKILL after grace_s."""
  for proc in procs:
    if proc.poll() is None:
      proc.terminate()
  deadline = time.monotonic() + grace_s
  for proc in procs:
    try:
      proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def run(module: str, args: list[str], num_processes: int = 2,
        host: str = "localhost", port: int = 0) -> int:
  """Starts the processes and waits; the first failure's status, else 0."""
  if num_processes < 1:
    raise ValueError(f"launch_local: --num-processes must be at least 1, got "
                     f"{num_processes}")
  coordinator = f"{host}:{port or free_port()}"
  procs = [subprocess.Popen(cmd) for cmd in commands(
      module, args, num_processes, coordinator)]

  def forward(signum, frame):
    del frame
    _stop(procs)
    sys.exit(128 + signum)

  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)
  while True:
    codes = [proc.poll() for proc in procs]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      i, code = failed[0]
      print(f"launch_local: process {i} exited with status {code}; stopping "
            "the others", file=sys.stderr, flush=True)
      _stop(procs)
      return code if code > 0 else 128 - code
    if all(c == 0 for c in codes):
      return 0
    time.sleep(0.1)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      usage="python -m examples.launch_local [--num-processes P] [--port N] "
            "MODULE [ARGS...]")
  parser.add_argument("--num-processes", type=int, default=2,
                      help="P, the processes to start (default 2)")
  parser.add_argument("--host", default="localhost",
                      help="the coordinator's host (default localhost)")
  parser.add_argument("--port", type=int, default=0,
                      help="the coordinator's port (default: a free one)")
  parser.add_argument("module", help="e.g. examples.ppo_sharded")
  parser.add_argument("args", nargs=argparse.REMAINDER,
                      help="the module's own flags")
  opts = parser.parse_args(argv)
  return run(opts.module, opts.args, opts.num_processes, opts.host, opts.port)


if __name__ == "__main__":
  sys.exit(main())
