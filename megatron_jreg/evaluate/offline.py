"""Keep every Hugging Face library on local files for the rest of the process.

Evaluation must never download: models come from a local folder or a checkpoint, datasets from the
`datasets` cache or a local path. The libraries read their offline switches from the environment when
they are imported, so `force_offline` sets the variables and also the flags of modules already imported
(a test run or an embedding program may have imported them first).
"""

from __future__ import annotations

import os
import sys

_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def force_offline() -> None:
    for name in _VARIABLES:
        os.environ[name] = "1"
    if (hub := sys.modules.get("huggingface_hub.constants")) is not None:
        hub.HF_HUB_OFFLINE = True
    if (datasets_config := sys.modules.get("datasets.config")) is not None:
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True
