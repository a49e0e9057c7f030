"""Does a higher-precision prefill node help a low-precision decode node? (the design note's open question)

One synthetic DeepSeek-V4 checkpoint in the release layout is converted four ways (bf16 = the release's values
exactly, q8, fp4 = lossless MXFP4 experts + Q8_0 dense, q2). Each container prefills the same prompts with
`moepack prefill --kv-out`; then ONE decode model -- transformers on `moepack export` of the q2 container, the
decode node's weights -- continues greedily from each KV (`moepack.kv.load_transformers_cache`). Reported per
prefill precision, against the bf16 prefill:
  kv_rel_error    relative L2 error of the KV (window K=V and compressed entries, all layers)
  next_token_kl   KL(decode | bf16-prefill KV  ||  decode | this KV) of the first decoded token's distribution
  greedy_agree    fraction of the greedy continuation equal to the one from the bf16 prefill's KV
Usage: python benchmarks/asymmetric_precision.py [--preset tiny] [--prompts 4] [--tokens 96] [--decode 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from moepack.families.deepseek_v4.kv import read_kv
from moepack.kv import continuation_input_ids, load_transformers_cache
from moepack.packer.convert import convert_checkpoint
from moepack.packer.export import export_container
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.engine import PrefillOptions, prefill

POLICIES = ("bf16", "q8", "fp4", "q2")


def kv_tensors(kv_dir: str) -> list[torch.Tensor]:
    out = []
    for state in read_kv(kv_dir).layers:
        out.append(state.window_kv.float())
        for comp in (state.compressor, state.indexer):
            if comp is not None:
                out.append(comp.compressed_kv.float())
    return out


def decode(model, kv_dir: str, steps: int) -> tuple[torch.Tensor, list[int]]:
    """First decode step's log-probabilities and the greedy continuation, from a KV."""
    cache = load_transformers_cache(kv_dir, model)
    ids = continuation_input_ids(kv_dir)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return torch.log_softmax(out.scores[0][0].float(), -1), out.sequences[0, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="bench-work/asymmetric")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, "src")
    if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        synth_checkpoint(src, preset=args.preset, layout="release", seed=0, progress=False)
    containers = {}
    for policy in POLICIES:
        containers[policy] = os.path.join(args.workdir, f"{policy}.moepack")
        if not os.path.exists(containers[policy]):
            convert_checkpoint(src, containers[policy], policy=policy, progress=False, drop_mtp=True)
    decode_dir = os.path.join(args.workdir, "q2-export")
    if not os.path.exists(os.path.join(decode_dir, "config.json")):
        export_container(containers["q2"], decode_dir, dtype="f32", progress=False)
    model = AutoModelForCausalLM.from_pretrained(decode_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size

    sums = {p: {"kv_rel_error": 0.0, "next_token_kl": 0.0, "greedy_agree": 0.0} for p in POLICIES}
    for k in range(args.prompts):
        ids = torch.randint(3, vocab, (args.tokens,), generator=torch.Generator().manual_seed(k)).tolist()
        kv_dirs = {}
        for policy, path in containers.items():
            kv_dirs[policy] = os.path.join(args.workdir, f"kv-{policy}-{k}")
            if os.path.exists(kv_dirs[policy]):
                import shutil

                shutil.rmtree(kv_dirs[policy])
            prefill(path, ids, PrefillOptions(), kv_out=kv_dirs[policy])
        ref_kv = kv_tensors(kv_dirs["bf16"])
        ref_logp, ref_tokens = decode(model, kv_dirs["bf16"], args.decode)
        for policy in POLICIES:
            kv = kv_tensors(kv_dirs[policy])
            num = sum(float((a - b).pow(2).sum()) for a, b in zip(kv, ref_kv))
            den = sum(float(b.pow(2).sum()) for b in ref_kv)
            logp, tokens = decode(model, kv_dirs[policy], args.decode)
            kl = float((ref_logp.exp() * (ref_logp - logp)).sum())
            agree = sum(a == b for a, b in zip(tokens, ref_tokens)) / len(ref_tokens)
            s = sums[policy]
            s["kv_rel_error"] += (num / den) ** 0.5 / args.prompts
            s["next_token_kl"] += kl / args.prompts
            s["greedy_agree"] += agree / args.prompts
    result = {"preset": args.preset, "prompts": args.prompts, "prompt_tokens": args.tokens,
              "decode_tokens": args.decode, "decode_weights": "q2 (transformers on moepack export)",
              "by_prefill_policy": {p: {k: round(v, 5) for k, v in s.items()} for p, s in sums.items()}}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.preset}: {args.prompts} prompts x {args.tokens} tokens, decode {args.decode} tokens with q2 weights")
    print("prefill policy | KV rel. error vs bf16 | next-token KL vs bf16 prefill | greedy agreement")
    for p, s in result["by_prefill_policy"].items():
        print(f"{p} | {s['kv_rel_error']:.4f} | {s['next_token_kl']:.5f} | {s['greedy_agree']:.3f}")


if __name__ == "__main__":
    main()
