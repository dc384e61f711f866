"""erpo-jax: RL from verifiable rewards with ERPO, in JAX/Flax."""

__version__ = "0.1.0"
