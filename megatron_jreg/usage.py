"""What every command's parser shares: a help that ends with an example, usage errors on one line."""

from __future__ import annotations

import argparse


def example(command: str) -> dict:
    """argparse keyword arguments for a parser whose help ends with `command` as an example, printed as written."""
    return {"epilog": f"example:\n  {command}", "formatter_class": argparse.RawDescriptionHelpFormatter}


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors on one line (`prog: error: ... (see --help)`), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
