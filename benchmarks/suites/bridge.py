"""DLPack bridges: jrollout.torch.from_torch / to_torch vs copies.

Zero-copy should cost the same at 1 MB and 64 MB; the targets check
``64 MB / 1 MB <= 2`` (our reading of "roughly constant"). The copies
(``copy=True``, and on the host the copies through numpy) scale with the
size and are shown for scale. Tensors live on the torch device
(``Config.torch_device``: the GPU in the GPU run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks import harness as h
from benchmarks.suites import _common as c

SIZES_MB = (1, 64)  # also in --quick: a 64 MB copy takes milliseconds


def _from_build(config: h.Config):
  from jrollout.torch import from_torch  # noqa: PLC0415 - needs torch.
  from jrollout.torch import from_torch_copied  # noqa: PLC0415
  device = config.torch_device
  impls = []
  for mb in SIZES_MB:
    t = torch.arange(mb * (1 << 20) // 4, dtype=torch.float32, device=device)

    def zero_copy(t=t):
      arr, copied = from_torch_copied(t)
      assert not copied and arr.unsafe_buffer_pointer() == t.data_ptr()
      np.testing.assert_array_equal(np.asarray(arr), t.cpu().numpy())
      return lambda: from_torch(t).block_until_ready()

    def copy(t=t):
      return lambda: from_torch(t, copy=True).block_until_ready()

    def numpy_copy(t=t):
      arr = jnp.array(t.numpy())
      assert arr.unsafe_buffer_pointer() != t.data_ptr()
      np.testing.assert_array_equal(np.asarray(arr), t.numpy())
      return lambda: jnp.array(t.numpy()).block_until_ready()

    impls.append(h.Impl(f"from_torch {mb} MB", zero_copy, "jrollout"))
    impls.append(h.Impl(f"from_torch(copy=True) {mb} MB", copy, "reference"))
    if config.on_host:
      impls.append(h.Impl(f"jnp.array(t.numpy()) copy {mb} MB", numpy_copy,
                          "numpy"))
  return impls


def _to_build(config: h.Config):
  from jrollout.torch import to_torch  # noqa: PLC0415 - needs torch.
  from jrollout.torch import to_torch_copied  # noqa: PLC0415
  sync = c.torch_sync(config.torch_device)
  impls = []
  for mb in SIZES_MB:
    x = jax.block_until_ready(jnp.arange(mb * (1 << 20) // 4,
                                         dtype=jnp.float32))

    def zero_copy(x=x):
      t, copied = to_torch_copied(x)
      assert not copied and t.data_ptr() == x.unsafe_buffer_pointer()
      np.testing.assert_array_equal(t.cpu().numpy(), np.asarray(x))
      del t
      return lambda: to_torch(x)

    def copy(x=x):
      def run():
        t = to_torch(x, copy=True)
        sync()
        return t
      return run

    def numpy_copy(x=x):
      t = torch.from_numpy(np.array(x))
      assert t.data_ptr() != x.unsafe_buffer_pointer()
      np.testing.assert_array_equal(t.numpy(), np.asarray(jnp.copy(x)))
      return lambda: torch.from_numpy(np.array(x))

    impls.append(h.Impl(f"to_torch {mb} MB", zero_copy, "jrollout"))
    impls.append(h.Impl(f"to_torch(copy=True) {mb} MB", copy, "reference"))
    if config.on_host:
      impls.append(h.Impl(f"torch.from_numpy(np.array(x)) copy {mb} MB",
                          numpy_copy, "numpy"))
  return impls


def _measurement(name, build, fn, what):
  small, big = SIZES_MB
  return h.Measurement(
      name=name,
      description=f"{what} of a {small} MB and a {big} MB float32 array",
      build=build,
      baseline=f"{fn}(copy=True) {big} MB",
      targets=[h.Target(f"{fn} {big} MB", f"{fn} {small} MB", 2.0,
                        "zero-copy: roughly constant in size")],
  )


MEASUREMENTS = [
    _measurement("bridge_from_torch", _from_build, "from_torch",
                 "torch -> JAX"),
    _measurement("bridge_to_torch", _to_build, "to_torch", "JAX -> torch"),
]
