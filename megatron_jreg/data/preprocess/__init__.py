"""`megatron-jreg preprocess`: FineWeb-Edu / HF dataset folders / JSONL -> megatron indexed datasets.

Writes `PREFIX_{key}_{document|sentence}.bin/.idx` (Megatron-LM's naming and bytes, through megatron-core's
tokenizers and IndexedDatasetBuilder) plus a manifest per output, accepting every flag of Megatron-LM's
tools/preprocess_data.py. One module per concern:

    config.py    PreprocessConfig: every flag, checked once before any work
    worker.py    one work unit in a worker process: parse, filter, split sentences, tokenize
    progress.py  the progress line and throughput
    shards.py    --output-shards: which files, which names, when a shard is done (resume)
    driver.py    preprocess(): shards, worker pool, datasets and manifests, Ctrl-C
    cli.py       the command line over the above
"""

from megatron_jreg.data.preprocess.cli import build_parser, main
from megatron_jreg.data.preprocess.config import PreprocessConfig
from megatron_jreg.data.preprocess.driver import PreprocessError, preprocess

__all__ = ["PreprocessConfig", "PreprocessError", "build_parser", "main", "preprocess"]
