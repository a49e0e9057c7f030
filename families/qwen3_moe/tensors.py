"""Qwen3-MoE's tensors: every name and shape a config implies (transformers' names, which the Hugging Face
releases use, and llama.cpp's `qwen3moe` GGUF names from gguf-py's constants), and a checkpoint directory loaded
through that schema: every tensor present with its shape, nothing unknown, the FP8 releases dequantized.

The official `-FP8` releases store each quantized linear as `P.weight` (F8_E4M3 [out, in]) with
`P.weight_scale_inv` (BF16 or F32 [ceil(out/128), ceil(in/128)]): the value is weight x scale_inv of its 128x128
block (config.json `quantization_config`: quant_method "fp8", weight_block_size [128, 128]). Embeddings, the head,
the norms and the routers stay BF16. They are dequantized by format_spec's F8_E4M3 codec.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moepack.format_spec import decode
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.source_blocks import FP8_BLOCK, fp8_block_scale_shape
from moepack.format_spec.untrusted import UntrustedInputError, load_file

from ..base import (ROLE_ATTENTION, ROLE_DENSE_FFN, ROLE_EMBED, ROLE_EXPERT, ROLE_HEAD, ROLE_NORM, ROLE_ROUTER,
                    ExpertNaming, TensorSpec)
from .config import Qwen3MoeConfig

EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
_GLOBAL_GGUF = {EMBED: "token_embd.weight", FINAL_NORM: "output_norm.weight", HEAD: "output.weight"}


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


EXPERT_NAMING = ExpertNaming(prefix=lambda layer, expert: f"{layer_prefix(layer)}mlp.experts.{expert}.",
                             gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")
# a layer's stacked expert tensor in a GGUF, per matrix of EXPERT_NAMING
EXPERT_GGUF = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"}

# Inside a layer: name (after layer_prefix) -> (role, llama.cpp qwen3moe name after `blk.N.`, or None: its
# architecture has no dense-MLP layer)
ATTENTION = {
    "input_layernorm.weight": (ROLE_NORM, "attn_norm.weight"),
    "self_attn.q_proj.weight": (ROLE_ATTENTION, "attn_q.weight"),
    "self_attn.k_proj.weight": (ROLE_ATTENTION, "attn_k.weight"),
    "self_attn.v_proj.weight": (ROLE_ATTENTION, "attn_v.weight"),
    "self_attn.o_proj.weight": (ROLE_ATTENTION, "attn_output.weight"),
    "self_attn.q_norm.weight": (ROLE_NORM, "attn_q_norm.weight"),
    "self_attn.k_norm.weight": (ROLE_NORM, "attn_k_norm.weight"),
    "post_attention_layernorm.weight": (ROLE_NORM, "ffn_norm.weight"),
}
ROUTER = "mlp.gate.weight"
ROUTER_GGUF = "ffn_gate_inp.weight"
DENSE_MLP = {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}


def _layer_shapes(c: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    h, d = c.hidden_size, c.head_dim
    return {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (c.num_heads * d, h), "self_attn.k_proj.weight": (c.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (c.num_kv_heads * d, h), "self_attn.o_proj.weight": (h, c.num_heads * d),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
    }


def ffn_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """A SwiGLU FFN's matrices [out, in]: gate and up [I, H], down [H, I]."""
    return {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}


def tensor_specs(c: Qwen3MoeConfig) -> list[TensorSpec]:
    """Every tensor of a Qwen3-MoE checkpoint of config `c`, in the order a forward reads them."""
    specs = [TensorSpec(EMBED, (c.vocab_size, c.hidden_size), ROLE_EMBED, _GLOBAL_GGUF[EMBED])]
    for layer in range(c.num_layers):
        prefix, blk = layer_prefix(layer), f"blk.{layer}."
        for rest, shape in _layer_shapes(c).items():
            role, gguf = ATTENTION[rest]
            specs.append(TensorSpec(prefix + rest, shape, role, blk + gguf, layer))
        if not c.is_moe_layer(layer):
            for matrix, shape in ffn_shapes(c.hidden_size, c.intermediate_size).items():
                specs.append(TensorSpec(prefix + DENSE_MLP[matrix], shape, ROLE_DENSE_FFN, None, layer))
            continue
        specs.append(TensorSpec(prefix + ROUTER, (c.num_experts, c.hidden_size), ROLE_ROUTER, blk + ROUTER_GGUF,
                                layer))
        expert_shapes = ffn_shapes(c.hidden_size, c.moe_intermediate_size)
        for expert in range(c.num_experts):
            for matrix, name in EXPERT_NAMING.names(layer, expert).items():
                specs.append(TensorSpec(name, expert_shapes[matrix], ROLE_EXPERT, blk + EXPERT_GGUF[matrix], layer,
                                        expert))
    specs.append(TensorSpec(FINAL_NORM, (c.hidden_size,), ROLE_NORM, _GLOBAL_GGUF[FINAL_NORM]))
    if not c.tie_word_embeddings:
        specs.append(TensorSpec(HEAD, (c.vocab_size, c.hidden_size), ROLE_HEAD, _GLOBAL_GGUF[HEAD]))
    return specs


# ------------------------------------------------------------------------------------------ the checkpoint's FP8

FP8_SCALE_SUFFIX = "_scale_inv"  # `P.weight` -> `P.weight_scale_inv`


def fp8_block(raw_config: Mapping[str, Any]) -> int | None:
    """The FP8 block of a config.json's quantization_config (None: not quantized). Only the releases' 128x128
    e4m3 blocks are read."""
    quant = raw_config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise UntrustedInputError(f"config.json quantization_config: quant_method {str(method)[:40]!r} is not "
                                  "supported (qwen3-moe reads the releases' fp8)")
    if quant.get("weight_block_size") != [FP8_BLOCK, FP8_BLOCK] or quant.get("fmt", "e4m3") != "e4m3":
        raise UntrustedInputError(f"config.json quantization_config: only e4m3 in {FP8_BLOCK}x{FP8_BLOCK} blocks "
                                  f"is supported, got {str(quant.get('weight_block_size'))[:40]} "
                                  f"{str(quant.get('fmt'))[:20]}")
    return FP8_BLOCK


FP8_ROLES = (ROLE_ATTENTION, ROLE_DENSE_FFN, ROLE_EXPERT)  # the `-FP8` releases' F8_E4M3 linears


def release_tensors(spec: TensorSpec, fp8: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of what a release stores for `spec`: BF16, or with `fp8` (an `-FP8`
    release) a linear as F8_E4M3 with its BF16 128x128 block scales."""
    if fp8 and spec.role in FP8_ROLES:
        return [(spec.name, "F8_E4M3", spec.shape),
                (spec.name + FP8_SCALE_SUFFIX, "BF16", fp8_block_scale_shape(*spec.shape))]
    return [(spec.name, "BF16", spec.shape)]


def dequantize_fp8(name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """An F8_E4M3 weight and its 128x128 block scales -> float32, through format_spec's F8_E4M3 codec."""
    raw = decode.as_uint8(weight.contiguous().view(torch.uint8))
    try:
        return decode.decode_float("F8_E4M3", tuple(weight.shape), raw, scale_inv)
    except MoepackError as e:
        raise MoepackError(f"{name}: {e}") from None


# ------------------------------------------------------------------------------------------ loading a directory


@dataclass
class Checkpoint:
    """A loaded Qwen3-MoE checkpoint: its config and every tensor of the schema, float (`dtype`)."""

    config: Qwen3MoeConfig
    raw_config: dict
    tensors: dict[str, torch.Tensor]

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s non-expert tensors, by their name inside the layer."""
        prefix = layer_prefix(layer)
        return {n[len(prefix):]: t for n, t in self.tensors.items()
                if n.startswith(prefix) and ".mlp.experts." not in n}

    def experts(self, layer: int) -> list[dict[str, torch.Tensor]]:
        """Layer `layer`'s routed experts, each {"gate", "up", "down"} (empty for a dense-MLP layer)."""
        if not self.config.is_moe_layer(layer):
            return []
        return [{m: self.tensors[n] for m, n in EXPERT_NAMING.names(layer, e).items()}
                for e in range(self.config.num_experts)]

    @property
    def globals(self) -> dict[str, torch.Tensor]:
        head = self.tensors[EMBED if self.config.tie_word_embeddings else HEAD]
        return {"embed": self.tensors[EMBED], "norm": self.tensors[FINAL_NORM], "head": head}


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = load_file(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise MoepackError(f"{index}: no weight_map object")
        names = sorted({v for v in weight_map.values() if isinstance(v, str)})
        for name in names:
            if os.path.basename(name) != name:
                raise MoepackError(f"{index}: shard {name[:80]!r} is not a file name in the directory")
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    if not single.is_file():
        raise MoepackError(f"{directory}: neither model.safetensors nor model.safetensors.index.json")
    return [single]


def load_checkpoint(directory: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Read a Qwen3-MoE checkpoint directory (config.json and safetensors) into `dtype` tensors, checked against
    the schema its config implies: a missing, misshapen or unknown tensor is refused by name. The whole model is
    held in memory: this is the reference's loader (tests, small models), not a streaming converter."""
    from safetensors import safe_open

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise MoepackError(f"{directory}: no config.json (not a checkpoint directory)")
    raw = load_file(directory / "config.json")
    config = Qwen3MoeConfig.from_hf(raw)
    block = fp8_block(raw)
    specs = {s.name: s for s in tensor_specs(config)}
    stored: dict[str, torch.Tensor] = {}
    for shard in _shard_files(directory):
        if not shard.is_file():
            raise MoepackError(f"{directory}: the index lists shard {shard.name}, which is not in the directory")
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    stored[name] = f.get_tensor(name)
        except Exception as e:  # the safetensors library raises its own types for a damaged file
            raise MoepackError(f"{shard}: not a safetensors file the safetensors library reads "
                               f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    tensors = {}
    for name, spec in specs.items():
        if name not in stored:
            raise MoepackError(f"{directory}: tensor {name} is missing (the config implies {list(spec.shape)})")
        value = stored.pop(name)
        if tuple(value.shape) != spec.shape:
            raise MoepackError(f"{directory}: tensor {name} has shape {list(value.shape)}, the config implies "
                               f"{list(spec.shape)}")
        if value.dtype == torch.float8_e4m3fn:
            scale = stored.pop(name + FP8_SCALE_SUFFIX, None)
            if block is None or scale is None:
                raise MoepackError(f"{directory}: tensor {name} is FP8 without "
                                   f"{'a quantization_config' if block is None else name + FP8_SCALE_SUFFIX}")
            value = dequantize_fp8(name, value, scale)
        elif not value.is_floating_point():
            raise MoepackError(f"{directory}: tensor {name} is {value.dtype}, not a float type")
        tensors[name] = value.to(dtype)
    if stored:
        extra = sorted(stored)
        raise MoepackError(f"{directory}: tensor {extra[0]} is not one a qwen3-moe config implies"
                           + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return Checkpoint(config, raw, tensors)
