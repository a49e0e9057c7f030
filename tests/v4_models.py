"""Random DeepSeek-V4 models for tests: transformers' DeepseekV4ForCausalLM with every weight re-drawn so that no
path is degenerate (transformers' init zeroes the sinks, the mHC biases, the compressors' ape, the router correction
bias and tid2eid), saved with save_pretrained (release names). The numerical oracle for the runtime."""

from __future__ import annotations

import contextlib
import json
import os
import random

import torch
from safetensors.torch import load_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from moepack.families.deepseek_v4.config import CSA as C
from moepack.families.deepseek_v4.config import HCA as H
from moepack.families.deepseek_v4.config import ModelConfig
from moepack.families.deepseek_v4.config import SLIDING as S
from moepack.families.deepseek_v4.names import from_transformers

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


def wide_indexer(config: dict, heads: int = 16) -> dict:
    """`config` with a wider Lightning Indexer. An indexer score is a weighted sum of ReLUs, so on a tiny model
    with 4 heads every head is zero for some entries and exact ties at the top-k's boundary are common; there the
    chosen entries are whatever the device's top-k makes of the tie (the CPU's and CUDA's differ). With 16 heads
    (the release has 64) such a tie is vanishingly rare, and `indexer_boundary_ties` checks it did not occur."""
    return {**config, "index_n_heads": heads}


def wide_indexer_models(base_dir: str, names=("A", "C"), seed: int = 200) -> dict:
    """name -> (transformers model, container --keep) for CONFIGS[name] made wide_indexer."""
    from moepack.packer.convert import convert_checkpoint

    out = {}
    for i, name in enumerate(names):
        src, container = os.path.join(base_dir, f"{name}-wide"), os.path.join(base_dir, f"{name}-wide.moepack")
        hf_model = saved_model(wide_indexer(CONFIGS[name]), seed + i, src)
        convert_checkpoint(src, container, progress=False)
        out[name] = hf_model, container
    return out


@contextlib.contextmanager
def indexer_boundary_ties():
    """Yields a one-item list counting, while inside, the indexer's queries whose k-th and (k+1)-th best scores
    were exactly equal: the queries whose chosen entries depend on the top-k implementation."""
    from moepack.families.deepseek_v4 import model

    real, ties = model.indexer_scores, [0]

    def counted(cfg, *args, **kwargs):
        scores = real(cfg, *args, **kwargs)
        k = min(cfg.index_topk, scores.shape[-1])
        if scores.shape[-1] > k:
            best = scores.topk(k + 1, dim=-1).values  # (the values, unlike the indices, do not depend on ties)
            ties[0] += int(((best[:, k - 1] == best[:, k]) & torch.isfinite(best[:, k])).sum())
        return scores

    model.indexer_scores = counted
    try:
        yield ties
    finally:
        model.indexer_scores = real


def saved_model(config: dict, seed: int, out_dir: str) -> DeepseekV4ForCausalLM:
    """transformers' model of `config`, every weight re-drawn from `seed`, saved to `out_dir` (release names)."""
    torch.manual_seed(0)
    hf_model = DeepseekV4ForCausalLM(DeepseekV4Config(**config)).eval()
    _randomise(hf_model, seed)
    hf_model.save_pretrained(out_dir)
    return hf_model


def build(name: str, tmp_dir: str):
    """(transformers model, ModelConfig, release-name float32 weights) for CONFIGS[name], built once."""
    key = (name, tmp_dir)
    if key not in _BUILT:
        out = os.path.join(tmp_dir, name)
        hf_model = saved_model(CONFIGS[name], sorted(CONFIGS).index(name) + 1, out)
        weights = {}
        for key, t in load_file(os.path.join(out, "model.safetensors")).items():
            weights[from_transformers(key)] = t.float() if t.is_floating_point() else t
        with open(os.path.join(out, "config.json")) as f:
            cfg = ModelConfig.from_hf(json.load(f))
        _BUILT[key] = hf_model, cfg, weights
    return _BUILT[key]


# --- random configurations: the oracle on shapes no hand-written case names ---------------------------------------

RANDOM_POLICIES = ("keep", "keep", "keep", "fp4", "nvfp4", "q8", "q2", "bf16")  # keep: compared directly


def random_config(rng: random.Random) -> dict:
    """A DeepSeek-V4 configuration drawn within what transformers' model accepts: any mix of attention kinds and
    hash layers, 1-8 heads in any divisor of output groups, rope on 4 to all channels (the indexer's head at least
    as wide), windows of 1 to 128 tokens, compression rates 2-8 / 4-128, top-1 to top-6 of 2-16 experts,
    1-4 streams, YaRN or plain, tied or separate LM head."""
    heads = rng.choice([1, 2, 3, 4, 6, 8])
    head_dim = rng.choice([16, 32, 48, 64])
    rope_dim = rng.choice([d for d in (4, 8, 16, 32, 64) if d <= head_dim])
    n_layers = rng.randint(1, 6)
    n_hash = rng.randint(0, n_layers)
    n_experts = rng.choice([2, 3, 4, 8, 16])
    config = dict(
        vocab_size=rng.randint(20, 130), hidden_size=rng.choice([32, 48, 64, 96]),
        moe_intermediate_size=rng.choice([16, 32, 48]), num_hidden_layers=n_layers, num_attention_heads=heads,
        head_dim=head_dim, q_lora_rank=rng.choice([8, 16, 24]), partial_rotary_factor=rope_dim / head_dim,
        num_experts_per_tok=rng.randint(1, min(n_experts, 6)), n_routed_experts=n_experts,
        layer_types=[rng.choice([S, C, H]) for _ in range(n_layers)],
        compress_rates={C: rng.choice([2, 3, 4, 8]), H: rng.choice([4, 8, 16, 32, 128])},
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash), hc_mult=rng.randint(1, 4),
        hc_sinkhorn_iters=rng.choice([1, 3, 20]), sliding_window=rng.choice([1, 4, 16, 64, 128]),
        o_groups=rng.choice([g for g in range(1, heads + 1) if heads % g == 0]), o_lora_rank=rng.choice([8, 16]),
        index_n_heads=rng.choice([1, 2, 4, 8]),
        index_head_dim=rng.choice([d for d in (8, 16, 32, 64) if d >= rope_dim]),
        index_topk=rng.choice([1, 2, 5, 16, 64]), scoring_func=rng.choice(["sqrtsoftplus", "sigmoid"]),
        routed_scaling_factor=rng.choice([1.0, 1.5, 2.5]), swiglu_limit=rng.choice([0.5, 3.0, 10.0]),
        rms_norm_eps=rng.choice([1e-6, 1e-5]), hc_eps=rng.choice([1e-6, 1e-3]), rope_theta=rng.choice([1e4, 500.0]),
        compress_rope_theta=rng.choice([160000.0, 40000.0]), max_position_embeddings=4096,
        tie_word_embeddings=rng.random() < 0.2)
    if rng.random() < 0.5:
        config["rope_parameters"] = {"rope_type": "yarn", "factor": rng.choice([2.0, 4.0, 16.0]),
                                     "original_max_position_embeddings": rng.choice([32, 64, 256])}
        if rng.random() < 0.5:
            config["rope_parameters"].update(beta_fast=rng.choice([8, 32]), beta_slow=rng.choice([1, 2]))
    return config


def random_case(seed: int) -> dict:
    """A random configuration, prompt length, container policy, streaming options and (sometimes) a split point:
    the first `split` tokens prefilled, the rest continued from their KV."""
    rng = random.Random(seed)
    config = random_config(rng)
    n = rng.choice([1, 2, 7, 33, 129, 300, 700])
    options = dict(query_chunk=rng.choice([None, 16, 64, 512]), bundle_experts=rng.choice([1, 2, 3, 4, 8]),
                   queue_depth=rng.choice([1, 2, 4]), io_mode=rng.choice(["auto", "direct", "mmap"]),
                   expert_selection=rng.choice(["auto", "all", "routed"]))
    split = rng.randint(1, n - 1) if n > 1 and rng.random() < 0.3 else 0
    return dict(seed=seed, config=config, tokens=n, policy=rng.choice(RANDOM_POLICIES), options=options, split=split)


def run_random_case(case: dict, work_dir: str) -> dict:
    """Convert the case's model (transformers, re-drawn, save_pretrained) with its policy, prefill it, and measure
    the last position's logits against transformers: on the same checkpoint for `keep`, on `moepack export` of the
    container otherwise. A prompt continued from its KV is compared with transformers' whole-prompt forward."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.export import export_container
    from moepack.runtime.engine import PrefillOptions, prefill

    seed, split = case["seed"], case["split"]
    src, container = os.path.join(work_dir, "src"), os.path.join(work_dir, "model.moepack")
    hf_model = saved_model(case["config"], seed, src)
    convert_checkpoint(src, container, policy=case["policy"], progress=False)
    if case["policy"] != "keep":
        export_container(container, os.path.join(work_dir, "export"), dtype="f32", progress=False)
        hf_model = DeepseekV4ForCausalLM.from_pretrained(os.path.join(work_dir, "export"), dtype=torch.float32).eval()
    ids = torch.randint(0, case["config"]["vocab_size"], (case["tokens"],),
                        generator=torch.Generator().manual_seed(seed))
    options = PrefillOptions(**case["options"])
    if split:
        kv = os.path.join(work_dir, "kv")
        prefill(container, ids[:split], options, kv_out=kv)
        got = prefill(container, ids[split:], options, continue_from=kv).logits
    else:
        got = prefill(container, ids, options).logits
    with torch.no_grad():
        whole = hf_model(ids[None]).logits[0].float()
    row, reference = logit_error(got, whole[-1]), "whole prompt"
    if split and row["relative"] > 1e-3:
        # transformers' continuation from its cache is not always its whole forward: in some configurations it
        # fails or gives other logits, and exact zero-score ties in the indexer's top-k may resolve differently
        # by length (then ours follows its continuation). Matching either is matching transformers.
        with torch.no_grad():
            try:
                cache = hf_model(ids[None, :split], use_cache=True).cache
                cont = logit_error(got, hf_model(ids[None, split:], cache=cache, use_cache=True).logits[0, -1].float())
            except Exception:  # noqa: BLE001  (transformers' own cache path failing: no continuation to compare)
                cont = None
        if cont is not None and cont["max_abs_error"] < row["max_abs_error"]:
            row, reference = cont, "continuation"
        if row["relative"] > 1e-3:
            with torch.no_grad():  # does transformers' own forward give the first tokens other logits by length?
                prefix = hf_model(ids[None, :split]).logits[0]
            if (whole[:split] - prefix).abs().max().item() > 1e-3 * whole[:split].abs().max().item():
                reference = "none: transformers' logits for the first tokens depend on the prompt's length here"
    return {"seed": seed, "tokens": case["tokens"], "policy": case["policy"], "split": split, "reference": reference,
            **row}


def logit_error(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Last-position logits against the reference's: max abs error, the logit scale, their ratio, same argmax."""
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    return {"max_abs_error": err, "logit_scale": scale, "relative": err / scale,
            "same_token": int(got.argmax()) == int(ref.argmax())}
