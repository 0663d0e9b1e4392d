"""Versions, devices and memory settings, as the GPU check saw them.

``python -m benchmarks.gpu.env [--expect-gpu]`` prints the Python and
package versions, JAX's backend and devices, torch's CUDA view, the memory
variables and one small JAX <-> torch round trip on the default device.
With ``--expect-gpu`` it exits with status 3 when JAX or torch has no GPU
(the check goes on, and SUMMARY.md shows the status).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt",
            "jax-cuda12-plugin", "jax-cuda12-pjrt", "torch", "numpy", "flax",
            "optax", "chex", "orbax-checkpoint", "hypothesis", "pytest",
            "pytest-timeout", "pytest-xdist", "gymnax", "gymnasium",
            "jrollout")
VARIABLES = ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE",
             "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
             "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS",
             "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "PYTHONPATH")


def report() -> tuple[list[str], bool]:
  """The lines to print, and whether both JAX and torch see a GPU."""
  lines = [f"python {sys.version.split()[0]} ({sys.executable})",
           f"platform {platform.platform()}, {os.cpu_count()} CPUs"]
  for name in PACKAGES:
    try:
      lines.append(f"{name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
      pass
  lines += [f"{v}={os.environ[v]}" for v in VARIABLES if v in os.environ]
  import jax  # noqa: PLC0415 - after the variables are printed.
  import jax.numpy as jnp  # noqa: PLC0415
  import jrollout  # noqa: PLC0415
  lines.append(f"jrollout imported from {os.path.dirname(jrollout.__file__)}")
  lines.append(f"jax default backend: {jax.default_backend()}; devices: "
               f"{jax.devices()}")
  jax_gpu = jax.default_backend() == "gpu"
  if jax_gpu:
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit:
      lines.append(f"jax device memory limit: {limit / 2**30:.1f} GiB")
  torch_gpu = False
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    lines.append("torch: not importable")
  else:
    torch_gpu = torch.cuda.is_available()
    lines.append(f"torch cuda available: {torch_gpu}"
                 + (f", cuda {torch.version.cuda}, "
                    f"{torch.cuda.get_device_name(0)}" if torch_gpu else ""))
    from jrollout.torch import from_torch_copied  # noqa: PLC0415
    from jrollout.torch import to_torch  # noqa: PLC0415
    device = "cuda" if torch_gpu and jax_gpu else "cpu"
    t = torch.arange(8, dtype=torch.float32, device=device)
    a, copied = from_torch_copied(t)
    back = to_torch(jnp.sin(a))
    ok = bool(torch.allclose(back, torch.sin(t)))
    lines.append(f"round trip on {device}: from_torch copied={copied}, "
                 f"on {a.devices()}, to_torch -> {back.device}, "
                 f"values {'ok' if ok else 'WRONG'}")
  return lines, jax_gpu and torch_gpu


def main(argv=None) -> int:
  args = sys.argv[1:] if argv is None else argv
  lines, gpu = report()
  print("\n".join(lines), flush=True)
  if "--expect-gpu" in args and not gpu:
    print("expected a GPU for both JAX and torch: not found", flush=True)
    return 3
  return 0


if __name__ == "__main__":
  sys.exit(main())
