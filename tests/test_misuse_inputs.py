"""Misuse of the inputs (issue 40, item 5), without torch: each case raises
an error naming the function, the argument (and the key) and what was
given, at trace time where it is static, and leaves its inputs unchanged.

- unparsable device strings in ``compat.ExperienceBuffer``.

Flags of ``gae`` and ``autoreset_valid`` are in ``tests/test_gae.py``;
running statistics fed samples too large to square in
``tests/test_running_stats.py``; bad batches and step functions of the minibatch
functions in ``tests/test_minibatch.py``.
"""

import re

import jax
import pytest

from jrollout.compat import ExperienceBuffer

N, B, T, E = 8, 4, 3, 4


# --- Device strings of the compat classes. ---


@pytest.mark.parametrize("device", ["cpu:abc", "cpu:", "cpu:-1", "cpu:01",
                                    "cpu:1:2", "", " cpu", "CPU", "cpu:\u0663",
                                    "cpu 0"])
def test_unparsable_device_strings_are_refused(device):
  with pytest.raises(ValueError, match=(
      rf"^ExperienceBuffer: `device` {re.escape(repr(device))} is not a "
      r"device name; expected 'platform' or 'platform:index', e\.g\. 'cpu' "
      r"or 'cuda:1'$")):
    ExperienceBuffer(2, 3, device=device)


def test_device_strings_that_parse_still_work():
  assert ExperienceBuffer(2, 3, device="cpu").device == jax.devices("cpu")[0]
  assert ExperienceBuffer(2, 3, device="cpu:0").device == jax.devices(
      "cpu")[0]
  with pytest.raises(ValueError, match=(
      r"^ExperienceBuffer: device 'cpu:99' is not available to JAX")):
    ExperienceBuffer(2, 3, device="cpu:99")
