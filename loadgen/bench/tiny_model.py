"""A small random-weight MHA model for engine benchmarks on a host too busy for the default one.

`tiny_mha_opt()` saves (once per machine, under the tandem cache) an OPT with random weights,
hidden size 256, 4 layers of 8 heads (multi-head attention: a hidden row is half a token's
K+V, the memory shape Apt-Serve needs) and the default model's tokenizer, so prompts are built
the same way as for the default model. The weights are drawn from a fixed seed, so every
machine builds the same model. Why OPT: learned positions, the family the paper measures.
What it is for: comparing schedules on a pool that binds at a fraction of the default model's
step time; its outputs mean nothing.
"""

from __future__ import annotations

from pathlib import Path

CONFIG = dict(
    vocab_size=49152,  # the default model's tokenizer
    hidden_size=256,
    ffn_dim=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    max_position_embeddings=2048,
    word_embed_proj_dim=256,
)
SEED = 17


def tiny_mha_opt(root: Path | None = None) -> Path:
    """The model's directory (built on first use)."""
    import hashlib
    import json

    root = root or Path.home() / ".cache" / "tandem" / "bench-models"
    key = hashlib.sha256(json.dumps([CONFIG, SEED], sort_keys=True).encode()).hexdigest()[:12]
    path = root / f"tiny-mha-opt-{key}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, OPTConfig

    from engine.loader import load_tokenizer, resolve_model

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(OPTConfig(**CONFIG), dtype=torch.float32)
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(resolve_model("default")).save_pretrained(tmp)
    tmp.rename(path)  # whole or absent: a run killed half-way leaves no half model behind
    return path
