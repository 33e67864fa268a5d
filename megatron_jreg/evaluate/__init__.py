"""Evaluation: LAMBADA top-1 (built in), the paper's lm-eval tasks, and the baseline-vs-JREG test.

Everything scores a `models.CausalLM`; a backend is one class implementing it (`HFCausalLM` for a
Hugging Face folder, `load_megatron_lm` for a megatron-jreg checkpoint). `lm_eval_model.py` registers
the same with lm-eval as `--model megatron-jreg`.
"""
