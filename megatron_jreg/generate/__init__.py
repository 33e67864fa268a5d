"""`megatron-jreg generate`: chat answers of a model to a question file, ready for FastChat's MT-bench judge.

config.py     GenerateConfig: every flag checked before any model is loaded
questions.py  FastChat question files in, answer files out (atomic rewrite, resume by question id)
runner.py     model + chat tokenizer (--hf or --load), multi-turn answering (evaluate/decoding.py), progress
cli.py        the command line
"""
