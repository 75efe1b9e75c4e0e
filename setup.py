from setuptools import find_packages, setup

setup(
    name="megatron_ulysses",
    version="0.1.0",
    description="Ulysses sequence parallelism for megatron-core GPT pretraining",
    packages=find_packages(include=["megatron_ulysses", "megatron_ulysses.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.20",
        "sentencepiece",
        "numpy",
        "tensorboard",  # --tensorboard-dir
        "matplotlib",  # tools/plot_run.py (the quickstart draws its loss curve)
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "deepspeed": ["deepspeed"],
        "test": ["pytest"],
    },
)
