"""Random DeepSeek-V4 models for tests: transformers' DeepseekV4ForCausalLM with every weight re-drawn so that no
path is degenerate (transformers' init zeroes the sinks, the mHC biases, the compressors' ape, the router correction
bias and tid2eid), saved with save_pretrained (release names). The numerical oracle for the runtime."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from moepack.runtime import model as M

S, C, H = M.SLIDING, M.CSA, M.HCA

CONFIGS = {
    # 5 layers of every kind, 2 hash layers, 4 streams, YaRN compress rope, clamping SwiGLU.
    "A": dict(vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
              head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8,
              layer_types=[S, C, H, C, H], compress_rates={C: 4, H: 16}, mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 3,
              hc_mult=4, sliding_window=16, o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16,
              index_topk=6, swiglu_limit=1.5, max_position_embeddings=256,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    # Odd sizes: 6 heads in 3 output groups, 3 streams, CSA rate 3, 16 experts top-4, one hash layer, plain RoPE.
    "B": dict(vocab_size=61, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=6,
              head_dim=16, q_lora_rank=20, partial_rotary_factor=0.5, num_experts_per_tok=4, n_routed_experts=16,
              layer_types=[H, C, S, C], compress_rates={C: 3, H: 8}, mlp_layer_types=["hash_moe"] + ["moe"] * 3,
              hc_mult=3, hc_sinkhorn_iters=7, sliding_window=8, o_groups=3, o_lora_rank=8, index_n_heads=4,
              index_head_dim=8, index_topk=5, routed_scaling_factor=2.5),
    # V4-Flash-like proportions (rope 1/8 of a 64-dim head), no hash layers, sigmoid router, top-1, window 64,
    # one output group, strong YaRN.
    "C": dict(vocab_size=50, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=6, num_attention_heads=2,
              head_dim=64, q_lora_rank=16, partial_rotary_factor=0.125, num_experts_per_tok=1, n_routed_experts=4,
              layer_types=[S, H, S, C, H, C], compress_rates={C: 4, H: 32}, mlp_layer_types=["moe"] * 6,
              scoring_func="sigmoid", hc_mult=2, sliding_window=64, o_groups=1, o_lora_rank=16, index_n_heads=6,
              index_head_dim=16, index_topk=10, swiglu_limit=3.0, max_position_embeddings=512,
              rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32}),
    # Tiny, for the long prompt (index heads 8: fewer exact zero-score ties in the indexer's top-k).
    "long": dict(vocab_size=40, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                 head_dim=32, q_lora_rank=16, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=4,
                 layer_types=[S, C, H], compress_rates={C: 4, H: 64}, mlp_layer_types=["hash_moe"] + ["moe"] * 2,
                 hc_mult=2, sliding_window=32, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16,
                 index_topk=16),
}


def _randomise(model: DeepseekV4ForCausalLM, seed: int) -> None:
    """Re-draw every parameter and buffer so every path carries signal: matrices ~ N(0, 1/fan_in), norms around 1,
    sinks / ape / mHC biases / router bias non-zero, tid2eid a random distinct choice per token."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config

    def normal(shape, std=1.0):
        return torch.randn(shape, generator=g) * std

    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                        for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows))
            elif name.endswith(("sinks", "position_bias")):
                t.copy_(normal(t.shape))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(normal(t.shape, 0.3))
            elif name.endswith((".base", "hc_base")):
                t.copy_(normal(t.shape, 0.5))
            elif name.endswith((".scale", "hc_scale")):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            elif t.dim() == 1:  # norm weights
                t.copy_(1 + normal(t.shape, 0.2))
            elif "embed_tokens" in name:
                t.copy_(normal(t.shape))
            else:
                t.copy_(normal(t.shape, t.shape[-1] ** -0.5))


_BUILT: dict[str, tuple] = {}


def build(name: str, tmp_dir: str):
    """(transformers model, ModelConfig, release-name float32 weights) for CONFIGS[name], built once."""
    key = (name, tmp_dir)
    if key not in _BUILT:
        torch.manual_seed(0)
        hf_model = DeepseekV4ForCausalLM(DeepseekV4Config(**CONFIGS[name])).eval()
        _randomise(hf_model, seed=sorted(CONFIGS).index(name) + 1)
        out = os.path.join(tmp_dir, name)
        hf_model.save_pretrained(out)
        weights = {}
        for key, t in load_file(os.path.join(out, "model.safetensors")).items():
            key = key.removeprefix("model.").replace("hc_head.hc_", "hc_head_")
            key = "embed.weight" if key == "embed_tokens.weight" else key
            weights[key] = t.float() if t.is_floating_point() else t
        with open(os.path.join(out, "config.json")) as f:
            cfg = M.ModelConfig.from_hf(json.load(f))
        _BUILT[key] = hf_model, cfg, weights
    return _BUILT[key]
