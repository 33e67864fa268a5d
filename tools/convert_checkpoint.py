"""Convert checkpoints between megatron-jreg and Hugging Face Llama, checked by logits.

Thin wrapper over `megatron_jreg.convert.cli.main` (also `megatron-jreg convert`):

    python tools/convert_checkpoint.py mcore-to-hf --load CKPT_DIR --output HF_DIR [--dtype bfloat16]
    python tools/convert_checkpoint.py hf-to-mcore --hf HF_DIR --output CKPT_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.convert.cli import main  # noqa: E402

if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    sys.exit(main())
