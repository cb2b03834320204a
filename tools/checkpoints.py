"""Synthetic DeepSeek-V4.1 checkpoints: a directory holding only config.json.

vLLM 0.30.0 builds a ModelConfig from such a directory (no weights, no
tokenizer files): ``DeepseekV41Config`` flattens ``text_config`` onto the top
level and turns ``vision_config`` into ``vision_n_layers`` /
``vision_max_n_token``. The text fields below are the ones vLLM reads while
building the ModelConfig and the V4.1 attention layer
(vllm/transformers_utils/configs/deepseek_v41.py,
vllm/models/deepseek_v41/attention.py); the sizes are small but shaped like
the real model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def v41_config(
    *,
    heads: int = 64,
    vision_layers: int = 2,
    max_image_tokens: int = 1024,
    sliding_window: int = 128,
    index_topk: int = 512,
    compress_ratios: Sequence[int] = (0, 1, 2),
    head_dim: int = 512,
) -> dict[str, Any]:
    """The config.json content of a DeepSeek-V4.1 checkpoint."""
    ratios = [int(r) for r in compress_ratios]
    # One compress_ratios entry per layer; compressed layers need a kv source
    # and an index source at or below them (attention.py); make every
    # compressed layer its own source.
    compressed_layers = [i for i, r in enumerate(ratios) if r]
    text_config = {
        "model_type": "deepseek_v41",
        "vocab_size": 129280,
        "hidden_size": 4096,
        "num_hidden_layers": len(ratios),
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "sliding_window": sliding_window,
        "index_topk": index_topk,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "compress_ratios": ratios,
        "kv_source_layer_ids": compressed_layers,
        "index_source_layer_ids": compressed_layers,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
    }
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "torch_dtype": "bfloat16",
        "text_config": text_config,
        "vision_config": {
            "num_hidden_layers": vision_layers,
            "max_image_tokens": max_image_tokens,
        },
    }


def write_v41_checkpoint(directory: str | Path, **kwargs: Any) -> Path:
    """Write ``config.json`` (only) for a DeepSeek-V4.1 model into ``directory``.

    Keyword arguments are those of :func:`v41_config` (``heads=64``,
    ``vision_layers=2``, ``max_image_tokens=1024``, ``sliding_window=128``,
    ``index_topk=512``, ``compress_ratios=(0, 1, 2)``, ``head_dim=512``).
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(v41_config(**kwargs), indent=2) + "\n", encoding="utf-8")
    return path
