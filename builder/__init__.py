"""vllm-overlay: apply downstream vLLM fixes onto a pinned tree, key and bake them."""

__version__ = "0.1.0"
