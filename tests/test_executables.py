"""examples/common/executables.py: compiled programs saved and loaded
between runs, keyed by everything that decides the program."""

import os
import pickle
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.common import executables
from tests._helpers import child_env


def program(scale):
  return jax.jit(lambda x, y: (x * scale + y[None]).sum(axis=0))


def test_a_saved_executable_is_loaded_and_computes_the_same(tmp_path):
  x, y = jnp.arange(12.0).reshape(4, 3), jnp.ones(3)
  fresh, loaded = executables.compile(program(2.0), x, y, tag="p",
                                      settings={"scale": 2.0},
                                      directory=str(tmp_path))
  assert not loaded
  files = list((tmp_path / executables.SUBDIR).iterdir())
  assert [f.suffix for f in files] == [".pkl"]
  again, loaded = executables.compile(program(2.0), x, y, tag="p",
                                      settings={"scale": 2.0},
                                      directory=str(tmp_path))
  assert loaded
  np.testing.assert_array_equal(again(x, y), fresh(x, y))
  np.testing.assert_array_equal(again(x, y), (np.asarray(x) * 2 + 1).sum(0))
  # On new values of the same shapes too.
  np.testing.assert_array_equal(again(x + 1, y), fresh(x + 1, y))


def test_a_save_removes_the_temporary_files_killed_saves_left(tmp_path):
  """A ``*.tmp`` file untouched for ``STALE_S`` seconds was left by a
  killed save: the next save deletes it. A fresh one (another process's
  save in flight) and every other file stay."""
  directory = tmp_path / executables.SUBDIR
  directory.mkdir()
  old, fresh, other = (directory / n for n in ("a.tmp", "b.tmp", "c.pkl"))
  for path in (old, fresh, other):
    path.write_bytes(b"x")
  long_ago = time.time() - executables.STALE_S - 5
  os.utime(old, (long_ago, long_ago))
  os.utime(other, (long_ago, long_ago))
  x, y = jnp.ones((4, 3)), jnp.ones(3)
  executables.compile(program(2.0), x, y, tag="p", settings={},
                      directory=str(tmp_path))
  names = sorted(p.name for p in directory.iterdir())
  assert "a.tmp" not in names and {"b.tmp", "c.pkl"} <= set(names), names
  assert len([n for n in names if n.endswith(".pkl")]) == 2, names


@pytest.mark.parametrize("change", ["settings", "tag", "shape", "dtype",
                                    "structure"])
def test_anything_that_decides_the_program_is_in_the_key(tmp_path, change):
  x, y = jnp.ones((4, 3)), jnp.ones(3)
  base = dict(tag="p", settings={"scale": 2.0})
  key = executables.key(base["tag"], base["settings"], (x, y))
  other = {
      "settings": lambda: executables.key("p", {"scale": 3.0}, (x, y)),
      "tag": lambda: executables.key("q", {"scale": 2.0}, (x, y)),
      "shape": lambda: executables.key("p", {"scale": 2.0},
                                       (jnp.ones((5, 3)), y)),
      "dtype": lambda: executables.key("p", {"scale": 2.0},
                                       (x.astype(jnp.bfloat16), y)),
      "structure": lambda: executables.key("p", {"scale": 2.0},
                                           ((x,), y)),
  }[change]()
  assert other != key
  assert key == executables.key("p", {"scale": 2.0}, (x + 1, y * 5))


def test_a_damaged_file_is_compiled_over(tmp_path):
  x, y = jnp.ones((4, 3)), jnp.ones(3)
  args = dict(tag="p", settings={}, directory=str(tmp_path))
  executables.compile(program(2.0), x, y, **args)
  (path,) = (tmp_path / executables.SUBDIR).iterdir()
  for damage in (b"", path.read_bytes()[:100],
                 pickle.dumps((b"not an executable", None, None))):
    path.write_bytes(damage)
    compiled, loaded = executables.compile(program(2.0), x, y, **args)
    assert not loaded
    np.testing.assert_array_equal(compiled(x, y), np.full(3, 12.0))
    assert executables.compile(program(2.0), x, y, **args)[1]   # saved again


def test_no_directory_or_an_unwritable_one_just_compiles(tmp_path):
  x, y = jnp.ones((4, 3)), jnp.ones(3)
  compiled, loaded = executables.compile(program(2.0), x, y, tag="p",
                                         settings={}, directory=None)
  assert not loaded
  np.testing.assert_array_equal(compiled(x, y), np.full(3, 12.0))
  blocked = tmp_path / "file"
  blocked.write_text("a file where the directory should be")
  compiled, loaded = executables.compile(program(2.0), x, y, tag="p",
                                         settings={}, directory=str(blocked))
  assert not loaded
  np.testing.assert_array_equal(compiled(x, y), np.full(3, 12.0))
  assert blocked.read_text() == "a file where the directory should be"


def test_the_device_is_kept_and_multi_device_programs_are_not_saved(
    tmp_path):
  devices = jax.devices()
  assert len(devices) >= 2   # conftest's fake CPU devices
  x = jax.device_put(jnp.ones((4, 3)), devices[-1])
  y = jax.device_put(jnp.ones(3), devices[-1])
  args = dict(tag="p", settings={}, directory=str(tmp_path))
  executables.compile(program(2.0), x, y, **args)
  compiled, loaded = executables.compile(program(2.0), x, y, **args)
  assert loaded
  assert compiled(x, y).devices() == {devices[-1]}
  mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))
  spread = jax.device_put(jnp.ones((4, 3)), jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("d")))
  replicated = jax.device_put(y, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  before = sorted((tmp_path / executables.SUBDIR).iterdir())
  for _ in range(2):
    compiled, loaded = executables.compile(program(2.0), spread, replicated,
                                           **args)
    assert not loaded
  assert sorted((tmp_path / executables.SUBDIR).iterdir()) == before
  np.testing.assert_array_equal(compiled(spread, replicated),
                                np.full(3, 12.0))


@pytest.mark.usefixtures("standard_promotion")   # optax's own arithmetic
def test_static_data_of_the_arguments_is_taken_from_the_next_run(tmp_path):
  """A TrainState's apply_fn and optimiser are static pytree data that
  cannot be pickled (optax's closures): they are stored as references to
  the same objects in the arguments of the run that loads the file."""
  optax = pytest.importorskip("optax")
  from flax.training.train_state import TrainState  # noqa: PLC0415

  def make_state():   # what each run builds anew: new closures
    return TrainState.create(apply_fn=lambda p, x: x @ p["w"],
                             params={"w": jnp.ones((3, 2))},
                             tx=optax.adam(0.1))

  def step(state, x):
    grads = jax.grad(lambda p: state.apply_fn(p, x).sum())(state.params)
    return state.apply_gradients(grads=grads)

  x = jnp.arange(12.0).reshape(4, 3)
  args = dict(tag="step", settings={}, directory=str(tmp_path))
  state0 = make_state()
  first, loaded = executables.compile(jax.jit(step), state0, x, **args)
  assert not loaded
  state = make_state()
  again, loaded = executables.compile(jax.jit(step), state, x, **args)
  assert loaded
  out = again(state, x)
  assert out.tx is state.tx and out.apply_fn is state.apply_fn
  np.testing.assert_array_equal(out.params["w"],
                                first(state0, x).params["w"])
  assert int(out.step) == 1

  # Static data made inside the program (a new optimiser in the outputs)
  # cannot refer to the arguments: compiled every time, nothing saved.
  def restart(state):
    return TrainState.create(apply_fn=state.apply_fn, params=state.params,
                             tx=optax.sgd(0.1))

  before = sorted((tmp_path / executables.SUBDIR).iterdir())
  for _ in range(2):
    assert not executables.compile(jax.jit(restart), state, tag="restart",
                                   settings={}, directory=str(tmp_path))[1]
  assert sorted((tmp_path / executables.SUBDIR).iterdir()) == before


_SAVER = """
import resource, sys
import jax, jax.numpy as jnp
import numpy as np
from examples.common import executables
limit, directory = int(sys.argv[1]), sys.argv[2]
x = jnp.ones((4, 3))
for i in map(int, sys.argv[3].split(",")):   # a program (and file) each
  fn = jax.jit(lambda x, i=i: (x * i).sum(axis=0))
  if limit:   # set once JAX has started: a disk that fills up now
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
  compiled, loaded = executables.compile(fn, x, tag=f"p{i}", settings={},
                                         directory=directory)
  np.testing.assert_array_equal(compiled(x), np.full(3, 4.0 * i))
  print(i, loaded, flush=True)
"""


def _saved(directory):
  """The saved executables' files (not temporary ones), by name."""
  path = directory / executables.SUBDIR
  return {p.name: p.read_bytes() for p in path.glob("*.pkl")}


def test_a_full_disk_or_a_kill_while_saving_loses_nothing_saved(tmp_path):
  """A file-size limit (a full disk) while saving: the run goes on
  compiling, leaves no temporary file, and the executables saved before
  are unchanged. SIGKILL at several moments of saving: every executable
  file present afterwards is whole (it loads and computes); a killed write
  leaves at most its temporary file, which is never read."""

  def saver(limit, numbers):
    return subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(limit), str(tmp_path),
         ",".join(map(str, numbers))], env=child_env(),
        stdout=subprocess.PIPE, text=True)

  def outputs(proc):
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out.split()

  assert outputs(saver(0, [1, 2])) == ["1", "False", "2", "False"]
  before = _saved(tmp_path)
  assert len(before) == 2
  # Each file is larger than 1 KiB: no save completes, the run goes on.
  assert outputs(saver(1024, [3, 4])) == ["3", "False", "4", "False"]
  assert _saved(tmp_path) == before   # nothing new, nothing lost
  assert sorted(p.name for p in (tmp_path / executables.SUBDIR).iterdir()
                ) == sorted(before)   # no temporary file left
  # Each kill comes after the child has saved n + 1 programs (read off its
  # output, so a slow machine changes nothing), then a moment into the
  # next save.
  for n, delay in enumerate((0.0, 0.002, 0.005, 0.01, 0.03)):
    proc = saver(0, range(100 * (n + 1), 100 * (n + 1) + 50))
    assert proc.stdout is not None
    for _ in range(n + 1):
      assert proc.stdout.readline().split()[1] == "False"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
  # A kill while a temporary file is written leaves it (never read:
  # only *.pkl names are); every *.pkl is whole: it loads and computes.
  names = [p.name for p in (tmp_path / executables.SUBDIR).iterdir()]
  assert all(n.endswith((".pkl", ".tmp")) for n in names), names
  saved = _saved(tmp_path)
  assert len(saved) >= len(before) + 15   # 1 + 2 + 3 + 4 + 5 before the kills
  for name, data in before.items():
    assert saved[name] == data
  numbers = sorted(int(name.split("-")[0][1:]) for name in saved)
  got = outputs(saver(0, numbers))
  assert got == [w for i in numbers for w in (str(i), "True")], got
