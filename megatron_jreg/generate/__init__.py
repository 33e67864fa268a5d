"""`megatron-jreg generate`: chat answers of a model to a question file, ready for FastChat's MT-bench judge."""
