"""moepack prefill against transformers at the release's own dimensions: DeepSeek-V4-Flash's config.json
(tests/data/deepseek-v4-flash.config.json: hidden 4096, 64 heads of 512, q/o LoRA 1024 in 8 output groups, the
indexer's 64 heads of 128 and top-512, window 128, CSA 4 / HCA 128, 4 streams, YaRN compress rope, vocab 129,280)
cut to a few of its layers and routed experts, so that transformers' float32 model fits in host memory.

The default takes release layers 1, 2 and 3 (sliding + hash, CSA + hash, HCA + routed) with 8 experts, and a prompt
of 2,100 tokens: CSA then has 525 compressed entries, more than index_topk = 512, so the Lightning Indexer really
selects; HCA has 16. The random weights are transformers' model re-drawn (tests/v4_models.py), saved with
save_pretrained, converted with --keep (float32) and streamed with O_DIRECT; the logits of the last position are
compared with transformers' forward, as the tests do for small configurations.
Usage: python benchmarks/release_dims.py [--layers 1,2,3] [--experts 8] [--tokens 2100] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import moepack  # noqa: F401  (before torch: moepack sets OpenMP's spin limit)
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.runtime.engine import PrefillOptions, prefill  # noqa: E402

RELEASE_CONFIG = os.path.join(HERE, "..", "tests", "data", "deepseek-v4-flash.config.json")
PER_LAYER = ("layer_types", "mlp_layer_types")
# --dims tiny: the release's layer kinds, compress rates, window, top-k, mHC streams and rope with the widths cut
# to the tiny preset's (a dry run on a CPU reaches every step's end, through the same code paths); index_topk
# cut too, so that a prompt of a few hundred tokens has the indexer really select
DIMS = {"release": {},
        "tiny": dict(hidden_size=256, moe_intermediate_size=256, num_attention_heads=4, head_dim=128,
                     qk_rope_head_dim=16, q_lora_rank=256, o_groups=2, o_lora_rank=128, index_n_heads=8,
                     index_head_dim=32, index_topk=64)}


def release_cut(layers: list[int], experts: int, dims: str = "release") -> dict:
    """The release's config with only `layers` (release indexes) and `experts` routed experts, its widths those
    of DIMS[dims]."""
    with open(RELEASE_CONFIG) as f:
        config = json.load(f)
    for key in ("quantization_config", "architectures", "dtype", "_name_or_path", "transformers_version"):
        config.pop(key, None)  # a float32 model, saved as such
    for key in PER_LAYER:
        config[key] = [config[key][i] for i in layers]
    config.update(num_hidden_layers=len(layers), n_routed_experts=experts, num_nextn_predict_layers=0, **DIMS[dims])
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="1,2,3", help="release layer indexes to keep (default 1,2,3)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per layer (default 8)")
    parser.add_argument("--tokens", type=int, default=2100, help="prompt length (default 2100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the checkpoint and container here (default: a temporary folder)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from v4_models import logit_error, saved_model  # transformers: here, not for release_cut's importers

    layers = [int(v) for v in args.layers.split(",")]
    config = release_cut(layers, args.experts)
    with tempfile.TemporaryDirectory(prefix="moepack-release-dims-", dir=args.workdir) as work:
        src, container = os.path.join(work, "src"), os.path.join(work, "model.moepack")
        started = time.perf_counter()
        hf_model = saved_model(config, args.seed, src)
        built_s = time.perf_counter() - started
        convert_checkpoint(src, container, progress=False)
        ids = torch.randint(0, config["vocab_size"], (args.tokens,), generator=torch.Generator().manual_seed(args.seed))
        rows = []
        for compute in ("float32", "bfloat16"):
            result = prefill(container, ids, PrefillOptions(io_mode="direct", compute_dtype=compute))
            rows.append({"compute_dtype": compute, "seconds": result.stats["seconds"],
                         "bytes_read": result.stats["bytes_read"], "logits": result.logits})
        started = time.perf_counter()
        with torch.no_grad():
            ref = hf_model(ids[None]).logits[0, -1].float()
        ref_s = time.perf_counter() - started
        container_bytes = os.path.getsize(container)
    report = {"layers": layers, "layer_types": config["layer_types"], "mlp_layer_types": config["mlp_layer_types"],
              "experts": args.experts, "tokens": args.tokens, "container_bytes": container_bytes,
              "model_build_s": round(built_s, 1), "transformers_s": round(ref_s, 2),
              "runs": [{**{k: v for k, v in r.items() if k != "logits"}, **logit_error(r["logits"], ref)}
                       for r in rows]}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"release dimensions, layers {layers} ({', '.join(config['layer_types'])}; "
          f"{', '.join(config['mlp_layer_types'])}), {args.experts} experts, {args.tokens} tokens; container "
          f"{container_bytes / 1e9:.2f} GB; transformers {report['transformers_s']} s")
    for r in report["runs"]:
        print(f"  {r['compute_dtype']:>8}: {r['seconds']:.2f} s, read {r['bytes_read'] / 1e9:.2f} GB, max abs error "
              f"{r['max_abs_error']:.3g} of logit scale {r['logit_scale']:.3g} ({r['relative']:.2e}), "
              f"same next token: {r['same_token']}")


if __name__ == "__main__":
    main()
