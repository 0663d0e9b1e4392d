"""Sharing a CPU between torch and JAX in one process.

A torch simulator stepping on the CPU and a jitted JAX policy take turns in
one process. By default torch's OpenMP worker threads keep spinning for a
few milliseconds after each torch op, on the cores the JAX call that comes
next needs: measured on 2 cores at 16,384 envs, the example's step took
1.6-1.7x the sum of its parts, each timed alone
(``benchmarks/results/torch_jax_cores/``). With ``OMP_WAIT_POLICY=PASSIVE``
the workers sleep as soon as an op ends, and the step took 1.2-1.4x.
OpenMP reads the setting once, when torch loads it, so it has to be in the
environment before the first ``import torch``.

This module never imports torch.
"""

from __future__ import annotations

import os
import sys

_VAR = "OMP_WAIT_POLICY"


def share_cpu_with_torch() -> str:
  """Lets torch's CPU threads yield the cores to JAX between torch ops.

  Call it before the first ``import torch`` in a process where a torch
  simulator on the CPU and a JAX learner take turns (the shape of
  ``examples/torch_simulator.py``): it sets ``OMP_WAIT_POLICY=PASSIVE``
  in this process's environment, so torch's OpenMP threads sleep as soon
  as each parallel op ends instead of spinning on the cores the next JAX
  call needs. Measured on 2 cores at 16,384 envs: the example's step went
  from 1.6-1.7x the sum of its parts (simulator, bridge, policy, write,
  each timed alone) to 1.2-1.4x (medians of runs at different hours of the
  same shared machine); at 1,024 envs torch's ops are too small to use its
  thread pool.

  Do not call it where torch does heavy CPU work op after op on its own
  (a torch learner on the CPU): there the sleeping threads must be woken
  for every op, and an all-torch PPO learner ran 1.46x slower per update.
  It changes nothing for JAX (XLA does not use OpenMP) nor for torch ops
  on a GPU.

  A value already in the environment is the user's choice and is kept.

  Returns:
    The ``OMP_WAIT_POLICY`` in effect for torch in this process (upper
    case): ``"PASSIVE"``, or the value the environment already held.

  Raises:
    RuntimeError: torch is already imported and ``OMP_WAIT_POLICY`` is not
      ``PASSIVE``: OpenMP has read the setting and it can no longer change
      in this process. Call this before importing torch, or start the
      process with ``OMP_WAIT_POLICY=PASSIVE``.

  Example:
    Call it first, before ``import torch``. A value already in the
    environment (patched in here for the example only, as a launcher would
    set it) is kept, in upper case:

    >>> import os, unittest.mock, jrollout as jr
    >>> launcher = {"OMP_WAIT_POLICY": "passive"}
    >>> with unittest.mock.patch.dict(os.environ, launcher):
    ...   jr.share_cpu_with_torch()
    'PASSIVE'
  """
  current = os.environ.get(_VAR, "").strip()
  if current:
    return current.upper()     # the user's choice
  if "torch" in sys.modules:
    raise RuntimeError(
        "share_cpu_with_torch: torch is already imported, and its OpenMP "
        f"threads read {_VAR} (not set: spin after each op) when it "
        "loaded; expected a call before the first `import torch`, or a "
        f"process started with {_VAR}=PASSIVE")
  os.environ[_VAR] = "PASSIVE"
  return "PASSIVE"
