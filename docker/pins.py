"""Version pins for the Docker image, run by docker/Dockerfile inside the NGC PyTorch base image.

The base image brings torch, Transformer Engine, apex, numpy and the NVIDIA libraries built for its CUDA;
a PyPI wheel of any of them would replace that build. So the image's own versions of those are pinned
exactly, CI's versions (constraints.txt) pin everything else this package needs, and after the install
`check` proves both held and that every requirement of setup.py is met.

    python docker/pins.py requirements setup.py > /tmp/requirements.txt      # what to install
    python docker/pins.py constraints constraints.txt > /tmp/pins.txt        # at which versions
    pip install -c /tmp/pins.txt -r /tmp/requirements.txt
    python docker/pins.py check setup.py /tmp/pins.txt --pip-check           # after the install
    python docker/pins.py constraints /dev/null --ci-pins 0 --leave-out 'transformer-engine*'  # to replace TE

Standard library and `packaging` only (in every NGC PyTorch image), because it runs before any install.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

# Distributions the base image builds for its CUDA: kept at the image's version, never taken from CI's pins.
IMAGE_OWNED = (
    "torch", "torchvision", "torchaudio", "triton", "pytorch-triton*", "transformer-engine*", "apex",
    "flash-attn*", "numpy", "nvidia-*", "cuda-*", "cupy*", "nvfuser*", "tensorrt*",
)
EXTRAS = ("all",)  # setup.py extras installed in the image: data, HF, evaluation and TensorBoard


def image_owned(name: str) -> bool:
    return any(fnmatch.fnmatch(canonicalize_name(name), pattern) for pattern in IMAGE_OWNED)


def installed_versions() -> dict[str, str]:
    """{canonical distribution name: version} of this Python environment."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[canonicalize_name(name)] = dist.version
    return found


def read_pins(path: str | Path) -> dict[str, str]:
    """{canonical name: version} of the `name==version` lines of a constraints file."""
    pins = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==":
            raise ValueError(f"{path}: {line!r} is not an exact pin (name==version)")
        pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def constraints(ci_pins: dict[str, str], installed: dict[str, str], use_ci_pins: bool = True,
                leave_out: tuple[str, ...] = ()) -> list[str]:
    """Constraint lines: the image's version of each image-owned distribution it has, then CI's pin of every
    other package (none with use_ci_pins=False: setup.py's ranges decide); `leave_out`: name patterns not
    pinned (the distribution about to be replaced, e.g. the image's Transformer Engine)."""
    lines = [f"{name}=={version}" for name, version in sorted(installed.items())
             if image_owned(name) and not any(fnmatch.fnmatch(name, p) for p in leave_out)]
    if use_ci_pins:
        lines += [f"{name}=={version}" for name, version in sorted(ci_pins.items()) if not image_owned(name)]
    return lines


def setup_arguments(setup_py: str | Path) -> dict:
    """The keyword arguments setup.py passes to setuptools.setup (setup.py runs, nothing is built)."""
    setup_py = Path(setup_py).resolve()
    captured: dict = {}
    cwd = os.getcwd()
    os.chdir(setup_py.parent)  # setup.py reads README.md relative to itself
    try:
        with mock.patch("setuptools.setup", lambda **kwargs: captured.update(kwargs)):
            runpy.run_path(str(setup_py), run_name="__main__")
    finally:
        os.chdir(cwd)
    return captured


def requirements(setup: dict, extras: tuple[str, ...] = EXTRAS) -> list[str]:
    """install_requires plus the given extras, in order, without repeats."""
    reqs = list(setup.get("install_requires", []))
    for extra in extras:
        reqs += setup.get("extras_require", {})[extra]
    return list(dict.fromkeys(reqs))


def pip_check_problems(report: str, names: set[str]) -> list[str]:
    """Lines of `pip check` output that involve one of `names` (base-image problems elsewhere are not ours)."""
    problems = []
    for line in report.splitlines():
        words = {canonicalize_name(w) for w in re.findall(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)}
        if words & names:
            problems.append(line)
    return problems


def python_error(setup: dict, version: tuple[int, ...] = tuple(sys.version_info[:3])) -> str | None:
    """Why this Python cannot run megatron-jreg (None when it can)."""
    python = ".".join(map(str, version))
    if SpecifierSet(setup.get("python_requires", "")).contains(python):
        return None
    return (f"Python {python} does not meet setup.py's python_requires {setup['python_requires']} (megatron-core "
            "0.19 needs 3.12): use an NGC PyTorch base image from 25.01-py3 on (--build-arg BASE_IMAGE=...)")


def te_error(installed: dict[str, str], revision: str) -> str | None:
    """Why the installed Transformer Engine is not the build of git `revision` (its version's local part is the
    commit's first 8 hex digits, e.g. 2.17.1+4329ff84), or None when it is."""
    have = installed.get("transformer-engine")
    local = have.partition("+")[2] if have else ""
    if have is not None and len(local) >= 7 and revision.startswith(local):
        return None
    return (f"transformer-engine is {have or 'not installed'}, not the build of revision {revision[:8]} that "
            "Megatron-LM core_v0.19.0's CI uses (build with --build-arg TE_REVISION=...)")


def check(setup: dict, pins: dict[str, str], installed: dict[str, str], pip_report: str | None = None,
          te_revision: str = "") -> list[str]:
    """Everything wrong with this environment for megatron-jreg (empty = fine); with `te_revision`, also a
    Transformer Engine that is not that revision's build."""
    errors = [e for e in [python_error(setup), te_error(installed, te_revision) if te_revision else None] if e]
    reqs = [Requirement(r) for r in requirements(setup)]
    for req in reqs:
        have = installed.get(canonicalize_name(req.name))
        if have is None:
            errors.append(f"{req.name} is not installed (setup.py needs {req})")
        elif not req.specifier.contains(Version(have), prereleases=True):  # NGC's torch is e.g. 2.9.0a0+nv
            errors.append(f"{req.name} {have} does not satisfy setup.py's {req}")
    for name, version in pins.items():
        have = installed.get(name)
        if have is not None and have != version:
            errors.append(f"{name} is {have}, pinned to {version}")
    if pip_report is not None:
        ours = {canonicalize_name(r.name) for r in reqs} | {"megatron-jreg"}
        errors += [f"pip check: {line}" for line in pip_check_problems(pip_report, ours)]
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("requirements", help="print setup.py's requirements (with the image's extras)")
    p.add_argument("setup_py")
    p = sub.add_parser("constraints", help="print the constraints for pip install")
    p.add_argument("constraints_txt")
    p.add_argument("--ci-pins", choices=["0", "1"], default="1", help="1: CI's pins for what the image lacks")
    p.add_argument("--leave-out", action="append", default=[], metavar="PATTERN",
                   help="a distribution (fnmatch pattern) not to pin: the one about to be replaced")
    p = sub.add_parser("check", help="verify the installed environment")
    p.add_argument("setup_py")
    p.add_argument("pins_txt")
    p.add_argument("--pip-check", action="store_true", help="also fail on `pip check` lines about our packages")
    p.add_argument("--te-revision", default="", help="also fail unless Transformer Engine is this git revision's build")
    args = parser.parse_args(argv)

    if args.command == "requirements":  # the first step of the build: stop early on a too old Python
        setup = setup_arguments(args.setup_py)
        if error := python_error(setup):
            print(f"pins.py: {error}", file=sys.stderr)
            return 1
        print("\n".join(requirements(setup)))
        return 0
    if args.command == "constraints":
        print("\n".join(constraints(read_pins(args.constraints_txt), installed_versions(), args.ci_pins == "1",
                                     tuple(args.leave_out))))
        return 0
    report = None
    if args.pip_check:
        report = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
    installed = installed_versions()
    errors = check(setup_arguments(args.setup_py), read_pins(args.pins_txt), installed, report, args.te_revision)
    for error in errors:
        print(f"pins.py check: {error}", file=sys.stderr)
    if not errors:
        stack = ", ".join(f"{n} {installed[n]}" for n in ("torch", "megatron-core", "transformer-engine", "apex")
                          if n in installed)
        print(f"pins.py check: all requirements of setup.py met ({stack})")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
