"""What the examples share, one topic a module; nothing here calls jrollout's
rollout functions (``jr.update_at``, ``jr.gae``, the minibatch scans): the
examples make those calls themselves.

- ``cli``: ``Config`` (the PPO hyperparameters, every field a flag),
  ``parse_config`` and ``use_compile_cache``;
- ``agent``: the feed-forward ``ActorCritic``, its ``Categorical`` and
  ``Gaussian`` policies, ``make_optimizer`` and ``rollout_fields`` (what a
  PPO rollout stores);
- ``loss``: the clipped PPO objective and one gradient step;
- ``gymnax_envs``: stepping and resetting gymnax envs, counting episodes;
- ``training``: the host loop over jitted, seed-vmapped chunks of updates;
- ``host_learner``: the jitted policy of a loop whose env steps on the host;
- ``reporting``: returns, learning curves, ``summary.json``;
- ``checkpoints``: a whole run saved with orbax and resumed.

None of them imports gymnax at import time (``examples.ppo_sharded`` needs
JAX's backend to start after ``jax.distributed.initialize``).
"""
