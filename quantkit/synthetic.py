"""Synthetic Llama checkpoints written straight to disk, for tests (128-multiple widths) and benchmarks.

Weights are random (seeded) and written one layer per safetensors shard, so even a 1B+ model is created
without holding it in memory. The tokenizer is a self-contained byte-level BPE with no merges (ids 0..255
plus BOS/EOS), so nothing needs downloading.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class SyntheticLlama:
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    attention_bias: bool = False  # q/k/v biases, as Qwen2 has (and o_proj's too for model_type llama)
    dtype: str = "float16"  # or "bfloat16", as Llama 3 and Mistral ship
    head_dim: int | None = None  # None: hidden / heads; else as Mistral Nemo and Small 3 (heads x head_dim != hidden)
    qk_std: float = 0.02  # of q_proj and k_proj: at 0.02 attention is near uniform, larger makes it peak as trained

    @property
    def head_width(self) -> int:
        """The width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def num_parameters(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_width
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
        if self.attention_bias or self.model_type == "qwen2":  # the biases write_synthetic_llama writes
            per_layer += q + 2 * kv + (h if self.attention_bias and self.model_type == "llama" else 0)
        embeds = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeds + h


TINYLLAMA_1B = SyntheticLlama(2048, 5632, 22, 32, 4, 32000, 2048)


def _config(spec: SyntheticLlama) -> dict:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    config = {k: v for k, v in asdict(spec).items() if k not in ("attention_bias", "dtype", "head_dim", "qk_std")}
    if spec.head_dim is not None:
        config["head_dim"] = spec.head_dim
    config.update({
        "architectures": [arch[spec.model_type]], "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": spec.dtype,
        "initializer_range": 0.02,
    })
    if spec.model_type == "llama":
        config["attention_bias"] = spec.attention_bias
    return config


def write_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (every byte is a token; BOS=256, EOS=257) saved in HF fast-tokenizer format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    vocab["<s>"] = 256
    vocab["</s>"] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def write_synthetic_llama(path: Path, spec: SyntheticLlama = SyntheticLlama(), seed: int = 0) -> Path:
    """Write a random Llama-family checkpoint (config, tokenizer, one shard per layer; float16 unless the spec
    says bfloat16) to `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    h, i = spec.hidden_size, spec.intermediate_size
    hd = spec.head_width
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    total = spec.num_hidden_layers + 1
    weight_map = {}
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors = {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": rand(q, h, std=spec.qk_std),
            p + "self_attn.k_proj.weight": rand(kv, h, std=spec.qk_std),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
        if spec.attention_bias or spec.model_type == "qwen2":
            for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                tensors[f"{p}self_attn.{name}.bias"] = rand(width, std=0.1)
        if spec.attention_bias and spec.model_type == "llama":  # Llama's attention_bias covers o_proj too
            tensors[f"{p}self_attn.o_proj.bias"] = rand(h, std=0.1)
        name = f"model-{layer + 1:05d}-of-{total:05d}.safetensors"
        save_file(tensors, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    rest = {"model.embed_tokens.weight": rand(spec.vocab_size, h, std=1.0), "model.norm.weight": norm(h)}
    if not spec.tie_word_embeddings:
        rest["lm_head.weight"] = rand(spec.vocab_size, h)
    name = f"model-{total:05d}-of-{total:05d}.safetensors"
    save_file(rest, path / name, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(rest, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(_config(spec), indent=2))
    write_tokenizer(path)
    return path


CALIBRATION_WORDS = "the a small model reads every layer of weights and tokens while it quantizes them to four bits"


def write_calibration_text(path: Path, lines: int = 40, words_per_line: int = 60, seed: int = 0) -> Path:
    """Seeded English-like calibration text (one sample per line) for synthetic models: needs nothing from shared/."""
    import random

    rng = random.Random(seed)
    words = CALIBRATION_WORDS.split()
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(words_per_line)) for _ in range(lines)))
    return path
