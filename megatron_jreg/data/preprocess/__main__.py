"""`python -m megatron_jreg.data.preprocess`: the same as `megatron-jreg preprocess`."""

import sys

from megatron_jreg.data.preprocess.cli import main

sys.exit(main())
