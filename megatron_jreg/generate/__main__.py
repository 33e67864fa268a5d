"""`python -m megatron_jreg.generate` = `megatron-jreg generate`."""

import sys

from megatron_jreg.generate.cli import main

if __name__ == "__main__":
    sys.exit(main())
