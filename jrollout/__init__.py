"""jrollout: functional rollout buffers and minibatching for on-policy RL in JAX.

Dimension letters used in every docstring: T = num_steps, E = num_envs,
N = rows of a flat batch, B = minibatch size, M = minibatches per epoch.
"""

from jrollout._gae import autoreset_valid as autoreset_valid
from jrollout._ledger import finish_rollout as finish_rollout
from jrollout._ledger import IncompleteRolloutError as IncompleteRolloutError
from jrollout._ledger import is_complete as is_complete
from jrollout._ledger import make_batch as make_batch
from jrollout._ledger import write_counts as write_counts
from jrollout._ledger import WriteCounts as WriteCounts
from jrollout._state import init as init
from jrollout._state import register as register
from jrollout._write import update_all as update_all
from jrollout._write import update_at as update_at
from jrollout._writer import DonationWarning as DonationWarning
from jrollout._checkpoint import restore_rollout as restore_rollout
from jrollout._checkpoint import RolloutRestore as RolloutRestore
from jrollout._checkpoint import RolloutSave as RolloutSave
from jrollout._checkpoint import save_rollout as save_rollout
from jrollout._checkpoint import CorruptCheckpointError as CorruptCheckpointError
from jrollout._checkpoint import CheckpointSaveError as CheckpointSaveError
from jrollout._gae import gae as gae
from jrollout._gae import normalize_advantages as normalize_advantages
from jrollout._minibatch import minibatch_indices as minibatch_indices
from jrollout._minibatch import minibatches as minibatches
from jrollout._minibatch import scan_minibatches as scan_minibatches
from jrollout._minibatch import take as take
from jrollout._reward_scaling import init_reward_scaler as init_reward_scaler
from jrollout._reward_scaling import RewardScaler as RewardScaler
from jrollout._reward_scaling import scale_rewards as scale_rewards
from jrollout._reward_scaling import scale_rollout_rewards as scale_rollout_rewards
from jrollout._rows import batch_rows as batch_rows
from jrollout._running_stats import denormalize as denormalize
from jrollout._running_stats import merge_running_stats as merge_running_stats
from jrollout._running_stats import normalize as normalize
from jrollout._running_stats import init_running_stats as init_running_stats
from jrollout._running_stats import RunningStats as RunningStats
from jrollout._running_stats import update_running_stats as update_running_stats
from jrollout._sharding import shard as shard
from jrollout._sharding import shard_rows as shard_rows
from jrollout._state import RolloutState as RolloutState
from jrollout._writer import RolloutWriter as RolloutWriter

__version__ = "0.2.0"

__all__ = (
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "DonationWarning",
    "IncompleteRolloutError",
    "RewardScaler",
    "RolloutRestore",
    "RolloutSave",
    "RolloutState",
    "RolloutWriter",
    "RunningStats",
    "WriteCounts",
    "autoreset_valid",
    "batch_rows",
    "denormalize",
    "finish_rollout",
    "gae",
    "init",
    "init_reward_scaler",
    "init_running_stats",
    "is_complete",
    "make_batch",
    "merge_running_stats",
    "minibatch_indices",
    "minibatches",
    "normalize",
    "normalize_advantages",
    "register",
    "restore_rollout",
    "save_rollout",
    "scale_rewards",
    "scale_rollout_rewards",
    "scan_minibatches",
    "shard",
    "shard_rows",
    "take",
    "update_all",
    "update_at",
    "update_running_stats",
    "write_counts",
)

# Names of 0.1 and 0.2 that were renamed or removed: using one raises an
# AttributeError that says what to call instead (the CHANGELOG has the map).
_RENAMED = {
    "running_stats": "jrollout.init_running_stats",
    "reward_scaler": "jrollout.init_reward_scaler",
    "shard_minibatch_indices": "jrollout.minibatch_indices",
    "share_cpu_with_torch": "jrollout.torch.share_cpu_with_torch",
    "update_at_inplace": "jrollout.RolloutWriter(state).update_at",
    "update_all_inplace": "jrollout.RolloutWriter(state).update_all",
    "take_sequences": "jrollout.take(..., seq_len=L)",
    "sequence_minibatches": "jrollout.minibatches(..., seq_len=L)",
    "scan_sequence_minibatches": "jrollout.scan_minibatches(..., seq_len=L)",
    "minibatch_indices_sharded": "jrollout.minibatch_indices(..., num_shards=D)",
    "scan_minibatches_sharded": "jrollout.scan_minibatches(..., mesh=mesh)",
}


def __getattr__(name: str):
  if name in _RENAMED:
    raise AttributeError(f"jrollout.{name} was renamed or removed: use "
                         f"{_RENAMED[name]} (see the CHANGELOG)")
  raise AttributeError(f"module 'jrollout' has no attribute {name!r}")
