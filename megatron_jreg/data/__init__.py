"""Data pipeline: FineWeb-Edu / JSONL / parquet -> megatron-core indexed datasets (see docs/data.md).

sources.py          inputs (files, directories, globs, HF dataset folders) -> ordered work units
compressed.py       .gz/.zst reading that keeps everything before a damaged or truncated tail
tokenizers.py       Megatron-LM --tokenizer-type tokenizers with Megatron-LM's conventions
sentences.py        nltk Punkt sentence splitting without downloads
indexed.py          the .bin/.idx format, written atomically
manifest.py         per-output manifests and resume fingerprints
preprocess/         `megatron-jreg preprocess` (config, worker, progress, shards, partitions, driver, cli)
train_tokenizer.py  `megatron-jreg train-tokenizer`
merge.py            `megatron-jreg merge-datasets`
checks.py           one-line errors and up-front checks shared by the three commands
text.py             plain readers for the demo, analysis and evaluation corpora
"""
