"""TensorDicts through the torch bridge, and leaves the bridge refuses.

IsaacLab hands rsl_rl observation groups as a TensorDict
(``{"policy": [E, 48], "critic": [E, 60]}``); ``from_torch`` must convert it
(not pass it through), sharing memory as for plain tensors, and
``to_tensordict`` must build one from JAX arrays.
"""

import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

from jrollout.torch import from_torch, to_tensordict, to_torch  # noqa: E402
from jrollout.torch import from_torch_copied  # noqa: E402

E = 4


def _groups():
  gen = torch.Generator().manual_seed(0)
  return tensordict.TensorDict(
      {"policy": torch.randn(E, 48, generator=gen),
       "critic": torch.randn(E, 60, generator=gen),
       "extras": {"time_outs": torch.tensor([0, 1, 0, 0], dtype=torch.bool)}},
      batch_size=(E,))


def _shares(array, tensor):
  return np.shares_memory(np.asarray(array), tensor.numpy())


@pytest.mark.parametrize("where", ["bare", "nested"])
def test_from_torch_converts_a_tensordict_sharing_memory(where):
  td = _groups()
  tree = td if where == "bare" else {"obs": td, "reward": torch.ones(E)}
  out, copied = from_torch_copied(tree, batch_size=(E,))
  groups = out if where == "bare" else out["obs"]
  assert isinstance(groups, dict) and set(groups) == {
      "policy", "critic", "extras"}
  for name in ("policy", "critic"):
    assert isinstance(groups[name], jax.Array)
    np.testing.assert_array_equal(groups[name], td[name].numpy())
    assert _shares(groups[name], td[name])
  np.testing.assert_array_equal(groups["extras"]["time_outs"],
                                [False, True, False, False])
  assert not any(jax.tree_util.tree_leaves(copied))
  if where == "nested":
    np.testing.assert_array_equal(out["reward"], np.ones(E, np.float32))


def test_from_torch_copy_true_gives_memory_of_its_own():
  td = _groups()
  out, copied = from_torch_copied(td, copy=True)
  assert all(jax.tree_util.tree_leaves(copied))
  assert not _shares(out["policy"], td["policy"])
  np.testing.assert_array_equal(out["critic"], td["critic"].numpy())


def test_a_wrong_batch_size_is_an_error_and_changes_nothing():
  td = _groups()
  before = td.clone()
  with pytest.raises(ValueError, match=r"^from_torch: TensorDict \['obs'\] "
                     r"has batch size \(4,\); expected batch_size=\(8,\)$"):
    from_torch({"obs": td}, batch_size=(8,))
  assert (td == before).all()
  with pytest.raises(TypeError, match="from_torch: `batch_size` must be"):
    from_torch(td, batch_size=4)


def test_a_lazy_stack_is_refused_with_the_fix():
  td = _groups()
  lazy = tensordict.LazyStackedTensorDict.lazy_stack([td[0], td[1]])
  with pytest.raises(TypeError, match=r"LazyStackedTensorDict.*"
                     r"call `\.contiguous\(\)` first"):
    from_torch({"obs": lazy})


class _Opaque:
  pass


@pytest.mark.parametrize("leaf, name", [
    (_Opaque(), "_Opaque"), ({1, 2}, "builtins.set"),
    (range(3), "builtins.range")])
def test_unknown_leaves_are_refused_both_ways(leaf, name):
  with pytest.raises(TypeError, match=rf"^from_torch: leaf \['x'\] is a "
                     rf".*{name}, which the bridge does not know"):
    from_torch({"x": leaf, "t": torch.ones(2)})
  with pytest.raises(TypeError, match=rf"^to_torch: leaf \['x'\] is a "
                     rf".*{name}, which the bridge does not know"):
    to_torch({"x": leaf, "a": jnp.ones(2)})


class Transition(NamedTuple):
  obs: jax.Array
  reward: jax.Array


def test_to_tensordict_builds_groups_and_round_trips():
  tree = {"policy": jnp.arange(E * 3, dtype=jnp.float32).reshape(E, 3),
          "critic": {"priv": jnp.ones((E, 2), jnp.int32)},
          "step": Transition(jnp.zeros((E, 5)),
                             jnp.arange(E, dtype=jnp.float32))}
  td = to_tensordict(tree, batch_size=(E,))
  assert isinstance(td, tensordict.TensorDict)
  assert tuple(td.batch_size) == (E,)
  assert isinstance(td["critic"], tensordict.TensorDict)
  assert set(td["step"].keys()) == {"obs", "reward"}   # fields by name
  np.testing.assert_array_equal(td["policy"].numpy(), np.asarray(
      tree["policy"]))
  assert _shares(tree["policy"], td["policy"])           # as to_torch shares
  back = from_torch(td)
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(
      {"policy": 0, "critic": {"priv": 0}, "step": {"obs": 0, "reward": 0}})
  for got, want in zip(jax.tree_util.tree_leaves(back),
                       jax.tree_util.tree_leaves(
                           {"critic": tree["critic"], "policy":
                            tree["policy"], "step": tree["step"]._asdict()})):
    np.testing.assert_array_equal(got, want)


def test_to_tensordict_checks_the_leading_dimensions():
  with pytest.raises(ValueError, match=r"^to_tensordict: leaf \['b'\] has "
                     r"shape \(3, 2\); expected leading dimensions "
                     r"batch_size=\(4,\)$"):
    to_tensordict({"a": jnp.ones((4, 2)), "b": jnp.ones((3, 2))},
                  batch_size=(4,))


def test_the_bridge_never_imports_tensordict():
  code = ("import sys, torch, numpy as np\n"
          "from jrollout.torch import from_torch, to_torch\n"
          "x = from_torch({'a': torch.ones(2)})\n"
          "to_torch(x)\n"
          "assert 'tensordict' not in sys.modules, 'imported'\n")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_to_tensordict_refuses_leaves_that_are_not_arrays(monkeypatch):
  with pytest.raises(TypeError, match=r"^to_tensordict: leaf \['n'\] is a "
                     r"int; expected a jax.Array$"):
    to_tensordict({"a": jnp.ones((E, 2)), "n": 3}, batch_size=(E,))
  monkeypatch.setitem(sys.modules, "tensordict", None)   # not installed
  with pytest.raises(ImportError, match=r"to_tensordict needs tensordict, "
                     r"an optional extra: install it with `pip install "
                     r'"jrollout\[tensordict\]"`'):
    to_tensordict({"a": jnp.ones((E, 2))}, batch_size=(E,))
