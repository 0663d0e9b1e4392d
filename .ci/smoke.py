"""Smoke test of an installed (not editable) jrollout wheel.

Run by .ci/run from outside the repository, in a fresh virtual environment
that has only the wheel and its dependencies installed.
"""

import importlib.metadata
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr

here = pathlib.Path(jr.__file__).resolve().parent
assert "site-packages" in here.parts, f"not an installed package: {here}"
assert (here / "py.typed").is_file(), "py.typed is missing from the wheel"
assert jr.__version__ == importlib.metadata.version("jrollout")
assert "torch" not in sys.modules

E, T = 3, 4
state = jr.register(jr.init(num_envs=E, num_steps=T), "x", dtype=jnp.int32)
steps = np.arange(T * E, dtype=np.int32).reshape(T, E)
state = jax.jit(lambda s: jax.lax.scan(
    lambda s, t: (jr.update_at(s, t, {"x": jnp.asarray(steps)[t]}), None),
    s, jnp.arange(T))[0])(state)
batch, state = jr.make_batch(state)
assert batch["x"].tolist() == steps.T.reshape(-1).tolist()
idx = jr.minibatch_indices(jax.random.key(0), T * E, 4)
assert sorted(np.asarray(idx).reshape(-1).tolist()) == list(range(T * E))
print(f"smoke test passed: jrollout {jr.__version__} from {here}")
