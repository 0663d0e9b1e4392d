"""The peers jrollout is measured against: torch, the JAX idiom, PPO's idiom."""
