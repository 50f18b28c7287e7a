"""quantkit: offline, recipe-driven post-training quantization for Llama-family LLMs."""

__version__ = "0.1.0"
