"""Fingerprints of prefill logits over the test suite's model configurations, for showing that a change of code
leaves the numbers bit-identical: run it before and after, then compare the two JSON files.

    python3 benchmarks/logits_fingerprint.py -o before.json
    python3 benchmarks/logits_fingerprint.py -o after.json --compare before.json

Each case converts one of tests/v4_models.py's configurations (transformers' DeepseekV4 with re-drawn weights,
saved in release names) with a container policy, prefills a prompt with a set of streaming options (sometimes
continued from the KV of its first half) and records the SHA-256 of the last position's float32 logits and of
the written KV files. The release layout (FP8 + FP4 as shipped) comes from `moepack synth`. Decode is
fingerprinted too: for some containers, a greedy generation's tokens and each step's log-probabilities (with the
expert cache off and on), and for tests/test_qwen3_moe.py's configurations (transformers' Qwen3MoeForCausalLM) the
same prefill and decode cases.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import zlib

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.packer.synth import synth_checkpoint  # noqa: E402
from moepack.runtime.engine import PrefillOptions, prefill  # noqa: E402
from moepack.runtime.generate import GenerateOptions, generate  # noqa: E402
from tests.test_qwen3_moe import CONFIGS as QWEN3_CONFIGS  # noqa: E402
from tests.test_qwen3_moe import save_model as save_qwen3  # noqa: E402
from tests.v4_models import CONFIGS, saved_model  # noqa: E402

POLICIES = ("keep", "fp4", "nvfp4", "q8", "q2", "bf16")
DECODED_POLICIES = ("keep", "fp4", "q8")  # the containers whose greedy generation is fingerprinted too
DECODE_OPTIONS = {"uncached": {"cache_gib": 0}, "cached": {},
                  "bf16": {"prefill": PrefillOptions(compute_dtype="bfloat16")}}
OPTIONS = {
    "default": {},
    "bf16": {"compute_dtype": "bfloat16"},
    "direct-1": {"io_mode": "direct", "bundle_experts": 1, "queue_depth": 1, "expert_selection": "routed"},
    "mmap-chunk16": {"io_mode": "mmap", "query_chunk": 16, "expert_selection": "all"},
}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def kv_digest(kv_dir: str) -> str:
    """The KV's tensors (the files' metadata name the container, whose index records when it was written)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(kv_dir)):
        if name.endswith(".safetensors"):
            for key, t in sorted(load_file(os.path.join(kv_dir, name)).items()):
                h.update(key.encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _seed(name: str) -> int:
    """A configuration's seeds come from its name: one added to a test's configurations changes no other's prints."""
    return zlib.crc32(name.encode()) % 1000


def cases(work: str):
    for name in sorted(CONFIGS):
        src = os.path.join(work, name)
        saved_model(CONFIGS[name], _seed(name) + 1, src)
        vocab = CONFIGS[name]["vocab_size"]
        n = 300 if name == "long" else 70
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(_seed(name)))
        for policy in POLICIES:
            yield f"{name}/{policy}", src, policy, ids
    for preset_seed in (0, 1):
        src = os.path.join(work, f"release{preset_seed}")
        synth_checkpoint(src, preset="tiny", layout="release", seed=preset_seed)
        ids = torch.randint(0, 200, (90,), generator=torch.Generator().manual_seed(preset_seed))
        for policy in ("keep", "fp4"):
            yield f"release{preset_seed}/{policy}", src, policy, ids
    for name in sorted(QWEN3_CONFIGS):
        src = os.path.join(work, f"qwen3-{name}")
        save_qwen3(src, QWEN3_CONFIGS[name], torch.float32)
        ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(_seed(f"qwen3-{name}")))
        for policy in ("keep", "q8", "bf16"):
            yield f"qwen3-{name}/{policy}", src, policy, ids


def decode_digest(container: str, ids: torch.Tensor, **options) -> str:
    """A greedy generation's tokens and each step's log-probabilities (the chosen token's and the top 3)."""
    got = generate(container, ids, GenerateOptions(max_new_tokens=8, stop_at_eos=False, logprobs=3, **options))
    steps = [[p.token, p.logprob, list(p.top)] for p in got.logprobs]
    return hashlib.sha256(json.dumps([got.generated_ids, steps]).encode()).hexdigest()[:16]


def run(work: str) -> dict:
    out = {}
    for label, src, policy, ids in cases(work):
        container = os.path.join(work, label.replace("/", "-") + ".moepack")
        convert_checkpoint(src, container, policy=policy, progress=False)
        for opt_name, opts in OPTIONS.items():
            options = PrefillOptions(**opts)
            out[f"{label}/{opt_name}"] = digest(prefill(container, ids, options).logits)
        kv = os.path.join(work, label.replace("/", "-") + ".kv")
        split = len(ids) // 2
        prefill(container, ids[:split], PrefillOptions(), kv_out=kv)
        got = prefill(container, ids[split:], PrefillOptions(), continue_from=kv, kv_out=kv + "2")
        out[f"{label}/continued"] = digest(got.logits)
        out[f"{label}/continued-kv"] = kv_digest(kv + "2")
        if policy in DECODED_POLICIES:
            for opt_name, opts in DECODE_OPTIONS.items():
                out[f"{label}/decode-{opt_name}"] = decode_digest(container, ids, **opts)
        os.remove(container)
        print(label, file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--compare", help="an earlier run's JSON: print the cases whose fingerprints differ")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="moepack-fingerprint-") as work:
        result = run(work)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"{len(result)} fingerprints -> {args.out}")
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        differ = sorted(k for k in before.keys() | result.keys() if before.get(k) != result.get(k))
        print(f"{len(before)} before, {len(result)} after, {len(differ)} differ")
        for k in differ:
            print(f"  {k}: {before.get(k)} -> {result.get(k)}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
