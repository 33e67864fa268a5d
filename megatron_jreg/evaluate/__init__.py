"""Evaluation: LAMBADA top-1 (built in), the paper's lm-eval tasks, and the baseline-vs-JREG test, all on one
model interface (`models.CausalLM`) so a Hugging Face folder and a checkpoint are scored by the same code."""
