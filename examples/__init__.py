"""jrollout's examples; run one from the repository root with
``python -m examples.<name>`` (e.g. ``python -m examples.ppo_cartpole``).

Kept free of imports: ``examples.ppo_sharded`` sets ``XLA_FLAGS`` before JAX
starts.
"""
