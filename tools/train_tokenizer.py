"""Train a SentencePiece BPE or Hugging Face byte-level BPE tokenizer from local text.

Thin wrapper over `megatron_jreg.data.train_tokenizer.main` (also `megatron-jreg train-tokenizer`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.data.train_tokenizer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
