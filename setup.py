"""relf_jax: a JAX/TPU-first model zoo for low-latency chatbots."""

import re

from setuptools import find_packages, setup

# the version is defined once, in relf_jax/__init__.py (`relf_jax.__version__`)
with open("relf_jax/__init__.py", encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

CORE = [
    "jax>=0.10.2",
    "flax>=0.12",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "grain>=0.2.12",
    "tensorflow-datasets>=4.9.9",
    "importlib_resources",
    "sentencepiece>=0.2",
    "numpy>=1.26",
    "scipy",  # sparse co-occurrence counts for the Hellinger-SVD embeddings (also a jax dependency)
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "tensorboardX>=2.6",
    "chatterbot-corpus>=1.2",
    "PyYAML>=6",
    "safetensors>=0.4",  # relf-jax export --format safetensors / hf
    "flatbuffers",  # jax.export serialization (relf-jax export --format jax-export)
    "tokenizers>=0.20",  # tokenizer.json of models imported from HuggingFace
    # relf-jax serve: the OpenAI-compatible HTTP server
    "fastapi>=0.110",
    "uvicorn>=0.29",
    # uvicorn's C HTTP parser and event loop (else it falls back to pure-Python h11, slower per
    # request: server overhead at batch 1 is one of `relf-jax bench serve`'s targets)
    "httptools>=0.6",
    "uvloop>=0.19; sys_platform != 'win32'",
    "httpx>=0.27",  # relf-jax bench serve's load generator
    "Jinja2>=3.1",  # chat templates given as Jinja2 files
]

# HuggingFace interop (import/export checks, `relf-jax bench hf`): torch is pinned to the
# CPU wheel on purpose (an unpinned torch pulls a multi-GB CUDA build).
HF = ["torch==2.13.0", "transformers>=4.45"]
EXTRAS = {
    "hf": HF,
    # the tests run the HF parity checks and execute examples/quickstart.ipynb
    "dev": ["pytest>=8", "pytest-xdist>=3.5", "ruff>=0.6", "nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6.29",
            "openai>=1.40", "schemathesis>=4.0", *HF],
}

setup(
    name="relf_jax",
    version=VERSION,
    description="JAX/TPU-first model zoo for low-latency chatbots: ReLF, NSD, RCSD, DWS.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["relf_jax*", "kernels_pallas*", "kernels_cpu*", "experiments*"]),
    package_data={"experiments": ["configs/*.json"], "kernels_cpu": ["*.cc"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["relf-jax=experiments.launch:main"]},
)
