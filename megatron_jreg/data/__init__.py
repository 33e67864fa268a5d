"""Data pipeline: FineWeb-Edu / JSONL / parquet -> megatron-core indexed datasets (see docs/data.md).

sources.py          inputs (files, directories, globs, HF dataset folders) -> ordered work units
compressed.py       .gz/.zst reading that keeps everything before a damaged or truncated tail
tokenizers.py       megatron-core's tokenizers by --tokenizer-type, with a manifest identity and a fast path
indexed.py          megatron-core's IndexedDatasetBuilder written atomically; verify_dataset
manifest.py         per-output manifests and resume fingerprints
preprocess/         `megatron-jreg preprocess` (config, worker, progress, shards, driver, cli)
train_tokenizer.py  `megatron-jreg train-tokenizer`
merge.py            `megatron-jreg merge-datasets`
checks.py           one-line errors and up-front checks shared by the commands
text.py             plain readers for the demo, analysis and evaluation corpora
"""
