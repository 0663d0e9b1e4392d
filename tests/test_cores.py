"""``jrollout.torch.share_cpu_with_torch``: torch's threads yield the cores,
set in time.

OpenMP reads ``OMP_WAIT_POLICY`` when torch loads, so every case runs in a
fresh interpreter. The effect itself is observed, not only the variable:
after a parallel torch op, a spinning OpenMP worker burns CPU time while
the main thread sleeps; a passive one does not.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests._helpers import ROOT

pytest.importorskip("torch")

# CPU seconds the process burns while its main thread sleeps 0.5 s right
# after a parallel torch op (two threads, an add over 2**22 elements).
_SPIN = """
import time
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 22)
for _ in range(3):
  (x + x).sum()
  c0 = time.process_time()
  time.sleep(0.5)
  burnt = time.process_time() - c0
print("BURNT", burnt)
"""


def _run(code: str, **env: str) -> str:
  """The stdout of ``code`` run in a fresh interpreter, which must succeed."""
  environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
  environ.update(env)
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                        env=environ, capture_output=True, text=True,
                        timeout=120, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout


def _burnt(out: str) -> float:
  return float(out.split("BURNT")[-1].split()[0])


needs_two_cores = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="torch needs two threads to spin one")


def test_sets_passive_before_torch_and_leaves_torch_unloaded():
  out = _run("""
      import os, sys
      from jrollout.torch import share_cpu_with_torch
      assert "torch" not in sys.modules
      print("POLICY", share_cpu_with_torch(), os.environ["OMP_WAIT_POLICY"])
      print("TORCH", "torch" in sys.modules)
      """)
  assert "POLICY PASSIVE PASSIVE" in out
  assert "TORCH False" in out


@needs_two_cores
@pytest.mark.parametrize("passive", [True, False], ids=["passive", "active"])
def test_passive_workers_sleep_where_active_ones_spin(passive):
  """A passive worker sleeps at once: almost nothing burnt while sleeping.
  ACTIVE, the contrast that lets that bound fail, spins through the sleep
  (0.5 s on a quiet machine; the bound leaves room for a busy one)."""
  if passive:
    out = _run("from jrollout.torch import share_cpu_with_torch\n"
               "share_cpu_with_torch()\n" + _SPIN)
  else:
    out = _run(_SPIN, OMP_WAIT_POLICY="ACTIVE")
  burnt = _burnt(out)
  assert (burnt < 0.01) if passive else (burnt > 0.02), out


def test_keeps_a_value_the_user_set():
  out = _run("""
      import os
      from jrollout.torch import share_cpu_with_torch
      print("POLICY", share_cpu_with_torch(),
            os.environ["OMP_WAIT_POLICY"])
      import torch
      print("POLICY", share_cpu_with_torch())
      """, OMP_WAIT_POLICY="active")
  assert "POLICY ACTIVE active" in out
  assert out.count("POLICY ACTIVE") == 2


def test_too_late_is_an_error_and_changes_nothing():
  out = _run("""
      import os
      import torch
      from jrollout.torch import share_cpu_with_torch
      try:
        share_cpu_with_torch()
      except RuntimeError as e:
        print("ERROR", e)
      print("ENV", os.environ.get("OMP_WAIT_POLICY"))
      """)
  message = out.split("ERROR ")[1].split("\nENV")[0]
  assert message.startswith("share_cpu_with_torch: torch is already "
                            "imported")
  assert "before the first `import torch`" in message
  assert "OMP_WAIT_POLICY=PASSIVE" in message
  assert "ENV None" in out


def test_the_torch_simulator_example_shares_the_cpu_by_default():
  code = """
      import os, sys
      import examples.torch_simulator
      print("POLICY", os.environ.get("OMP_WAIT_POLICY"))
      """
  out = _run(code)
  assert "POLICY PASSIVE" in out
  out = _run(code, OMP_WAIT_POLICY="ACTIVE")     # the user's choice wins
  assert "POLICY ACTIVE" in out
