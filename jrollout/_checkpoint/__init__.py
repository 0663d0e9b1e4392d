"""Checkpoints of rollouts and whole training runs, through orbax.

One module per part, each importing only those listed above it:

- ``errors``: ``CheckpointSaveError``, the one-line cause of a failed
  write, and the processes agreeing on it.
- ``record``: what a checkpoint records of a pytree (leaves, RolloutStates)
  and the checks of a restore target against it.
- ``damage``: ``CorruptCheckpointError`` and the file checks that find a
  damaged checkpoint before anything is read.
- ``checksums``: the CRC-32 of every shard and file, recorded by a save
  and verified by a restore.
- ``paths``: which directories a save may write or replace and a restore
  may read.
- ``swap``: the lock, sync and atomic exchange that replace a checkpoint
  without losing it.
- ``api``: ``save_rollout``, ``restore_rollout``, ``RolloutSave``,
  ``RolloutRestore`` and orbax's ``RolloutCheckpointHandler``.

The public names are re-exported by ``jrollout``; how checkpoints behave is
in docs/guides/checkpoints.md.
"""
