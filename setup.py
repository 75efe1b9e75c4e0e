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
        "tokenizers",  # --tokenizer-type GPT2BPETokenizer (GPT-2's byte-level BPE)
        "numpy",
        "psutil",  # megatron-core's dist_checkpointing imports it when it saves
        "tensorboard",  # --tensorboard-dir
        "matplotlib",  # tools/plot_run.py (the quickstart draws its loss curve)
        # megatron-core >= 0.17 (what pip picks on Python >= 3.12) imports triton from
        # `import megatron.core` on; CUDA builds of torch bring it, CPU-only builds do not.
        "triton; python_version >= '3.12' and platform_system == 'Linux'"
        " and platform_machine == 'x86_64'",
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        # --ulysses-attention-backend flash (FlashAttention-4, Hopper / Blackwell); with a CUDA 13
        # torch, pip install 'flash-attn-4[cu13]==4.0.0b36' for the CuTe DSL's CUDA 13 libraries
        "flash": ["flash-attn-4==4.0.0b36"],
        "deepspeed": ["deepspeed"],
        "hf": ["transformers>=4.45", "safetensors"],  # Hugging Face import / export
        "tiktoken": ["tiktoken"],  # --tokenizer-type TikTokenizer
        "wandb": ["wandb"],  # --wandb-project
        # regex: the GPT-2 and tiktoken reference encoders in the tests (\p{L}, \p{N})
        "test": ["pytest", "transformers>=4.45", "safetensors", "regex", "tiktoken",
                 "wandb"],
    },
)
