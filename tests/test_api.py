"""The public API: every exported name exists; torch stays optional."""

import subprocess
import sys

import jrollout as jr

EXPECTED = {
    "DonationWarning", "IncompleteRolloutError", "RolloutState",
    "RolloutWriter", "WriteCounts",
    "finish_rollout", "gae", "init", "is_complete", "make_batch",
    "minibatch_indices", "minibatches", "normalize_advantages", "register",
    "scan_minibatches", "scan_minibatches_sharded",
    "scan_sequence_minibatches", "sequence_minibatches", "shard",
    "minibatch_indices_sharded", "shard_rows", "take", "take_sequences",
    "update_all", "update_all_inplace", "update_at", "update_at_inplace",
    "write_counts",
    # checkpoints (jrollout._checkpoint.api, .damage, .errors)
    "CheckpointSaveError", "CorruptCheckpointError",
    "RolloutRestore", "RolloutSave", "restore_rollout", "save_rollout",
    # running statistics (jrollout._running_stats, jrollout._reward_scaling)
    "RewardScaler", "RunningStats", "denormalize", "merge_running_stats",
    "normalize",
    "init_reward_scaler", "init_running_stats", "scale_rewards",
    "scale_rollout_rewards", "update_running_stats",
    # host vector envs' autoreset modes (jrollout._autoreset)
    "autoreset_valid",
    "batch_rows",
    # a torch simulator and JAX on one CPU (jrollout._cores)
    "share_cpu_with_torch",
}


def test_all_lists_the_public_api():
  assert set(jr.__all__) == EXPECTED
  assert list(jr.__all__) == sorted(jr.__all__,
                                    key=lambda s: (s[0].islower(), s))
  for name in jr.__all__:
    obj = getattr(jr, name)
    assert obj.__doc__, f"jrollout.{name} has no docstring"


def test_importing_jrollout_does_not_import_torch():
  code = ("import sys, jrollout, jrollout.compat; "
          "assert 'torch' not in sys.modules, 'torch imported'")
  subprocess.run([sys.executable, "-c", code], check=True)
