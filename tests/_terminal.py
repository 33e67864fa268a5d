"""Start a child with SIGINT at its default disposition, as a terminal starts a command.

A shell that runs the suite in the background (`nohup ... &`, some CI runners) starts it with SIGINT ignored, and
children inherit that: Python then never raises KeyboardInterrupt, and a Ctrl-C test would see its signal dropped
rather than the code under test at work. Pass `preexec_fn=sigint_default` to `subprocess.Popen`.
"""

from __future__ import annotations

import signal


def sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
