"""`megatron-jreg train` / `python -m megatron_jreg.train`: parse flags, train, exit.

Launch with torchrun for several ranks (`torchrun --nproc-per-node 8 -m megatron_jreg.train ...`) or run
as a plain single process. See README "Training" for the flags.
"""

from __future__ import annotations

import sys

from megatron_jreg.config import ConfigError
from megatron_jreg.training.args import config_from_args


def main(argv: list[str] | None = None) -> int:
    from megatron_jreg.training.distributed import shutdown
    from megatron_jreg.training.trainer import TrainingDiverged, run

    try:
        cfg = config_from_args(argv)
        return run(cfg)
    except ConfigError as e:
        print(f"megatron-jreg train: error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"megatron-jreg train: {e}", file=sys.stderr)
        return 3
    finally:
        shutdown()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    sys.exit(main())
