"""megatron-jreg: the Jump-Suppressing Regularizer (JREG) for megatron-core pretraining."""

__version__ = "0.1.0"
