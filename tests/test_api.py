"""The public API: every exported name exists; torch stays optional."""

import importlib.util
import inspect
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

import jrollout as jr
import jrollout.compat
import jrollout.torch
from tests._helpers import ROOT

EXPECTED = {
    "DonationWarning", "IncompleteRolloutError", "RolloutState",
    "RolloutWriter", "WriteCounts",
    "finish_rollout", "gae", "init", "is_complete", "make_batch",
    "minibatch_indices", "minibatches", "normalize_advantages", "register",
    "scan_minibatches", "shard", "shard_rows", "take",
    "update_all", "update_at", "write_counts",
    # checkpoints (jrollout._checkpoint.api, .damage, .errors)
    "CheckpointSaveError", "CorruptCheckpointError",
    "RolloutRestore", "RolloutSave", "restore_rollout", "save_rollout",
    # running statistics (jrollout._running_stats, jrollout._reward_scaling)
    "RewardScaler", "RunningStats", "denormalize", "merge_running_stats",
    "normalize",
    "init_reward_scaler", "init_running_stats", "scale_rewards",
    "scale_rollout_rewards", "update_running_stats",
    # host vector envs' autoreset modes (jrollout._gae)
    "autoreset_valid",
    "batch_rows",
}


def test_all_lists_the_public_api():
  assert set(jr.__all__) == EXPECTED
  assert list(jr.__all__) == sorted(jr.__all__,
                                    key=lambda s: (s[0].islower(), s))
  for name in jr.__all__:
    obj = getattr(jr, name)
    assert obj.__doc__, f"jrollout.{name} has no docstring"


def test_the_submodules_list_their_public_api():
  """``jrollout.torch`` and ``jrollout.compat`` say what is public with
  ``__all__``: every name there exists with a docstring, every public
  function or class defined there is listed, and the docs' reference page
  documents each."""
  for module, page in ((jrollout.torch, "torch.md"),
                       (jrollout.compat, "compat.md")):
    text = (ROOT / "docs" / "api" / page).read_text()
    defined = {name for name, obj in vars(module).items()
               if not name.startswith("_") and callable(obj)
               and getattr(obj, "__module__", None) == module.__name__}
    assert set(module.__all__) == defined, module.__name__
    for name in module.__all__:
      assert getattr(module, name).__doc__, f"{module.__name__}.{name}"
      assert f"{module.__name__}.{name}" in text, (page, name)


def test_importing_jrollout_does_not_import_torch():
  """Neither jrollout, its compat classes nor the bridge module import torch
  (the bridge loads it at its first call, so that share_cpu_with_torch can
  run first)."""
  code = ("import sys, jrollout, jrollout.compat, jrollout.torch; "
          "assert 'torch' not in sys.modules, 'torch imported'")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_without_torch_the_first_bridge_call_names_the_extra(monkeypatch):
  """Without torch (hidden here, whether it is installed or not),
  ``jrollout.torch`` imports and its first bridge call says what to
  install."""
  monkeypatch.setitem(sys.modules, "torch", None)
  origin = importlib.util.find_spec("jrollout.torch").origin
  spec = importlib.util.spec_from_file_location("_jt_no_torch", origin)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for call in (lambda: module.to_torch({"x": jnp.zeros(2)}),
               lambda: module.from_torch_copied({})):
    with pytest.raises(ImportError, match=r'pip install "jrollout\[torch\]"'):
      call()


@pytest.mark.parametrize("old, new", [
    ("running_stats", "jrollout.init_running_stats"),
    ("update_at_inplace", "jrollout.RolloutWriter(state).update_at"),
    ("scan_sequence_minibatches", "jrollout.scan_minibatches(..., seq_len=L)"),
])
def test_an_old_name_says_where_it_went(old, new):
  with pytest.raises(AttributeError, match=rf"^jrollout\.{old} was renamed or "
                     rf"removed: use {re.escape(new)} \(see the CHANGELOG\)$"):
    getattr(jr, old)


def _public_signatures():
  """``{qualified name: inspect.Signature}`` of every public function and
  method of ``jrollout`` and ``jrollout.torch`` (``jrollout.compat`` keeps
  the original torch API's words on purpose)."""
  out = {}
  for module in (jr, jrollout.torch):
    for name in module.__all__:
      obj = getattr(module, name)
      members = [(name, obj)]
      if isinstance(obj, type):
        if issubclass(obj, BaseException):
          continue
        members = [(f"{name}.{m}", v) for m, v in vars(obj).items()
                   if not m.startswith("_") and callable(v)
                   and getattr(v, "__module__", "").startswith("jrollout")]
      for qualname, fn in members:
        out[f"{module.__name__}.{qualname}"] = inspect.signature(fn)
  return out


# Words the glossary (docs/glossary.md) retired: each concept has one name.
RETIRED = {"dones", "done", "mask", "axis", "envs_per_batch", "env_idx",
           "return_copied", "target", "index", "keys"}
# Where the glossary allows a word that means one thing only.
ONLY_IN = {
    "values": {"jrollout.gae"},
    "data": {"jrollout.update_at", "jrollout.update_all",
             "jrollout.batch_rows", "jrollout.RolloutWriter.update_at",
             "jrollout.RolloutWriter.update_all"},
    "tree": {"jrollout.shard_rows", "jrollout.torch.to_torch",
             "jrollout.torch.from_torch", "jrollout.torch.to_torch_copied",
             "jrollout.torch.from_torch_copied"},
}


def test_the_public_signatures_follow_the_glossary():
  """One word per concept in every public signature: no retired word;
  ``values``, ``data`` and ``tree`` only where the glossary puts them;
  ``key`` always a PRNG key, right before the batch it shuffles; every
  mode argument a ``Literal`` type; options after the data keyword-only,
  in one order (num_epochs, shuffle, remainder)."""
  sigs = _public_signatures()
  assert len(sigs) > 30
  for name, sig in sigs.items():
    params = list(sig.parameters)
    assert not RETIRED & set(params), (name, RETIRED & set(params))
    for word, allowed in ONLY_IN.items():
      if word in params:
        assert name in allowed, (name, word)
    if "key" in params:
      p = sig.parameters["key"]
      assert "PRNGKey" in str(p.annotation), (name, p.annotation)
      after = params[params.index("key") + 1]
      assert after in ("batch", "num_rows"), (name, after)
    for mode in ("check", "mode", "remainder"):
      if mode in params:
        annotation = str(sig.parameters[mode].annotation)
        assert annotation in ("Check", "Remainder", "ShardMode",
                              "AutoresetMode") or annotation.startswith(
                                  "Literal"), (name, mode, annotation)
        assert sig.parameters[mode].kind is inspect.Parameter.KEYWORD_ONLY
    order = [p for p in ("num_epochs", "shuffle", "remainder") if p in params]
    assert order == sorted(order, key=params.index), (name, order)
    for p in order:
      assert sig.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY, (
          name, p)
