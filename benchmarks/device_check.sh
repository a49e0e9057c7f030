#!/usr/bin/env bash
# The GPU checks for one lease of a device machine, as one command. Everything lands in $OUT (the device tool brings
# it back), a file a step, NAME.txt (its output and errors together: the rows each benchmark prints as it goes, then
# its table); the tool brings back 8 files, so past the 7th the steps' files come back packed in rest.tar.gz. Each
# step has its own time limit, cut to what is left of TOTAL_S, less LATER_S for each step named after it (default 0:
# the steps named first take what they need; LATER_S=60 keeps a minute for each later step); at its limit a step is
# interrupted (pytest then prints its summary, a benchmark the line it was on). STEPS picks the steps and their order
# (default: all, in this order; a step runs only while a minute of TOTAL_S is left, so name the figures that matter
# most first):
#   tests     the CUDA tests (prefill against transformers and the CPU, the release's storage, the quant kernels,
#             the device copier, greedy decode against transformers, seeded sampling, the fused indexer scores)
#   generate  `moepack demo`'s model, then `moepack generate --device cuda` and `--device cpu` on it (--json)
#   capped    benchmarks/capped.py on the GPU: moepack and a CUDA llama.cpp on the same weights, the host memory
#             capped at 0.45 x the container, the experts over a device budget (VRAM_GIB)
#   decode    benchmarks/decode.py on the GPU: tokens/s with cache budgets 0 / 25 % / 100 % of the routed experts
#   prefill   benchmarks/prefill.py on the GPU with a device budget smaller than the model's experts
#             (T_ssd = io-alone, T_compute = compute-alone, wall = streamed)
#   profile   torch's profiler over one GPU generation, its experts cached on the device
#   indexer_scores  benchmarks/indexer_scores.py: one query chunk's Lightning Indexer scores at the release's
#             dimensions (64 heads of 128, 1024 queries; 64K and 128K prompts), torch's blocks against the fused Triton
#             kernel (bf16, with counts, FP8), the errors against float32 and which one the selection keeps
#   gpu_prefill  benchmarks/gpu_prefill.py: three release layers with all 256 experts at full size, N = GPU_TOKENS,
#             in each place the weights can be (disk, page cache, host RAM, device), beside the chip's dense bf16,
#             grouped-GEMM and pinned-H2D ceilings measured in the same run
#   gpu_decode   benchmarks/gpu_decode.py: the same slice (gpu_prefill's container, built here if that step did not
#             run), every expert in the device's expert pool, B = GPU_BATCH: tokens/s, bytes a token reads and their
#             fraction of the copy rate measured in the same run, the pool's path beside the per-expert one
#   triton_aot   benchmarks/triton_aot.py: the Triton kernels (fused scores, stored FP4) compiled for sm_90 at every
#             autotune config and launch specialization the runtime makes, with this Triton; registers, spills,
#             shared memory. Needs no GPU, so not a default step: run it before a lease, on a CPU machine with the
#             image's Triton (`pip install triton==3.6.0` in a venv of its own), or name it here
#
# The goals are an H200's: ask the device tool for that kind (an H100's 78 GiB refuses gpu_prefill's 128K cells in
# one line, the other cells go on).
#
# The device's image has torch (a CUDA build) but an older transformers and no zstandard or gguf (the GGUF export
# `capped` needs), and nothing can be downloaded there. Once, here, in the repository's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl transformers==5.24.0 zstandard==0.25.0 regex==2025.11.3 gguf==0.19.0
# For `capped`, a llama.cpp built with CUDA for the device (sm_90 for an H200) by
# `LLAMA_CUDA=90 bash benchmarks/llama_cpp.sh DIR` where a CUDA toolkit is, carried as LLAMA_CUDA (default
# .llama-cuda, also in .git/info/exclude): its bin/ files, or them packed with
#   tar -C DIR/build-cuda/bin -cf - . | xz -9 > .llama-cuda/llama-cuda.tar.xz
# (libggml-cuda.so alone is 67 MB; the tool carries 64 MiB a call); the cuBLAS it links is the image's. Then run
# `bash benchmarks/device_check.sh` through the device tool with `.whl` (and `.llama-cuda`) carried. On a machine
# without a GPU, DEVICE=cpu runs the same steps (a dry run of this script). The exit status is non-zero if any step
# failed.
# What to read first: the tests (a GPU-vs-CPU mismatch on a tiny model may be the indexer's zero-score ties, which
# CUDA's top-k may break otherwise; the device copier's test prints whether a copy was still in flight when it
# returned); then whether streamed stays near max(io-alone, compute-alone): copies go out on a copy stream ordered
# by events (backends/device_copier.py), the host waits only when a buffer goes back to the read pool.
set -uo pipefail
OUT=${OUT:-/tmp/moepack-device-check}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-tests indexer_scores gpu_prefill gpu_decode generate capped decode prefill profile}
GPU_TOKENS=${GPU_TOKENS:-4096,131072,65536,16384}
GPU_BATCH=${GPU_BATCH:-1,8}
# the release slice gpu_prefill and gpu_decode share (built once, by whichever runs first): fewer experts or layers
# build a smaller one, GPU_DIMS=tiny one of the release's layer kinds at tiny widths (a dry run on a CPU that
# reaches each step's end: GPU_DIMS=tiny GPU_EXPERTS=8 GPU_TOKENS=512,256)
GPU_EXPERTS=${GPU_EXPERTS:-${GPU_DECODE_EXPERTS:-256}}
GPU_LAYERS=${GPU_LAYERS:-1,2,3}
GPU_DIMS=${GPU_DIMS:-release}
GPU_WORKDIR=${GPU_WORKDIR:-/tmp/moepack-gpu-prefill}
# indexer_scores' shapes (a dry run on a CPU: INDEXER_ARGS="--tokens 4096 --heads 4 --chunk 64")
INDEXER_ARGS=${INDEXER_ARGS:---tokens 131072,65536}
PRESET=${PRESET:-medium}
TOKENS=${TOKENS:-1024,4096}
BUDGET_GIB=${BUDGET_GIB:-1}  # below the medium preset's 2.3 GB of experts: they stream, as on a small GPU
VRAM_GIB=${VRAM_GIB:-1}      # capped: below the benchmark model's 3.2 GB of float32 experts
CAPPED_TOKENS=${CAPPED_TOKENS:-1024 4096 8192}
LLAMA_CUDA=${LLAMA_CUDA:-.llama-cuda}
TOTAL_S=${TOTAL_S:-560}      # every step's limit is cut to what is left of this (the tool allows 600 s a command)
LATER_S=${LATER_S:-0}        # ... less this for each step STEPS names after it, so that each of those still runs
END=$(( $(date +%s) + TOTAL_S ))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "== $1 ($(date -u +%T))" | tee -a "$OUT/steps.txt"; }
# a step STEPS names runs if at least a minute of TOTAL_S is left (else it says so, without failing)
wants() {
    (( END - $(date +%s) >= 60 )) && return 0
    echo "== $1: skipped, under a minute of TOTAL_S left" | tee -a "$OUT/steps.txt"
    return 1
}
# a step's limit: its own, cut to what is left of TOTAL_S less LATER_S for each step after it (`later`, set below)
later=0
upto() {
    local left=$(( END - $(date +%s) - later * LATER_S ))
    echo $(( left < $1 ? (left > 1 ? left : 1) : $1 ))
}
# at the limit an interrupt, not a kill: pytest then prints its summary of the tests run, a benchmark the line it was
# on (its rows are already out); killed 15 s later if still running
timeout() { command timeout -s INT -k 15 "$@"; }

step "install"
# the carried wheels, where this python lacks what they bring (here, a dry run, it has them already); the checks
# find modules without importing them: each torch import costs seconds of the lease, the versions below take one
if ! python3 -c "import importlib.metadata as m, importlib.util as u, sys
need = ('zstandard', 'regex', 'gguf', 'transformers')
sys.exit(any(u.find_spec(n) is None for n in need)
         or tuple(map(int, m.version('transformers').split('.')[:2])) < (5, 24))
" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
# no dependencies: the image's torch is the one to use (the project pins a CPU build for fresh machines)
# (skipped where this python imports moepack from this tree already: a dry run in the repository's own venv)
python3 -c "import importlib.util as u, os, sys
sys.exit(not os.path.realpath(u.find_spec('moepack.runtime.engine').origin).startswith(os.path.realpath('.') + os.sep))" \
    2> /dev/null \
    || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import os, torch, transformers
print("torch", torch.__version__, "built for CUDA", torch.version.cuda, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "cpus", os.cpu_count())
print("transformers", transformers.__version__)
if torch.cuda.is_available():  # what the CUDA paths depend on: the arch, the memory, torch's grouped GEMM here
    from moepack.backends.grouped_experts import grouped_mm_refusal
    probe = torch.zeros(8, 64, dtype=torch.bfloat16, device="cuda")
    print("capability", torch.cuda.get_device_capability(0), "free / total GiB",
          [round(v / 2**30, 1) for v in torch.cuda.mem_get_info(0)],
          "grouped GEMM:", grouped_mm_refusal(probe, probe.new_zeros(2, 64, 64)) or "torch's CUDA kernel")
assert hasattr(transformers, "DeepseekV4ForCausalLM"), "this transformers has no DeepseekV4ForCausalLM"
EOF
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
failed=""

run_tests() {
    step "tests"
    # first the files no GPU has run yet (CUDA graphs, the Triton kernels, the compiled mHC weights, torch's grouped
    # GEMM), then those an H200 passed on 2026-12-04: a run cut at its limit has the new ones
    timeout "$(upto 240)" python3 -m pytest -rs --durations=8 tests/test_device_decode.py tests/test_stored_pool.py \
        tests/test_device_kv.py tests/test_stored_gemv_cuda.py tests/test_fused_scores_cuda.py \
        tests/test_fused_norm.py tests/test_mhc_native.py tests/test_grouped_experts.py tests/test_resident.py \
        tests/test_prefill.py \
        tests/test_quants.py tests/test_pipeline_stages.py tests/test_generate.py tests/test_sampling.py \
        -k cuda 2>&1 | tee "$OUT/tests.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed tests"
}

run_generate() {
    step "generate"
    {
        timeout "$(upto 60)" moepack demo --workdir /tmp/moepack-demo --json > /tmp/demo.json &&
        for dev in "$DEVICE" cpu; do
            timeout "$(upto 60)" moepack generate /tmp/moepack-demo/small-fp4.moepack \
                --chat "Why does layer-major order matter?" --max-new-tokens 64 --device "$dev" --json \
                > "/tmp/generate-$dev.json" || exit 1
            python3 -c "import json, sys; d = json.load(open(sys.argv[1])); s = d['stats']['decode']
keys = ('tokens_per_s', 'expert_cache_hit_rate', 'peak_rss_bytes')
print(sys.argv[2], d['finish_reason'], d['generated_ids'], {k: s[k] for k in keys})" "/tmp/generate-$dev.json" "$dev"
        done
    } 2>&1 | tee "$OUT/generate.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed generate"
}

run_capped() {
    step "capped benchmark"
    {
        mkdir -p /tmp/llama-cuda/bin && cp -a "$LLAMA_CUDA"/. /tmp/llama-cuda/bin/
        for packed in /tmp/llama-cuda/bin/*.tar.xz; do
            [ -e "$packed" ] && tar -xJf "$packed" -C /tmp/llama-cuda/bin
        done
        # the CUDA runtime and cuBLAS it links: the image's (its toolkit, or the nvidia wheels under /opt), found
        # for llama-bench alone (a wrapper sets the path; torch keeps loading its own)
        libs=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublas.so.*' -o -name 'libcudart.so.*' 2> /dev/null \
               | xargs -r -n1 dirname | sort -u | paste -sd: -)
        bin=/tmp/llama-cuda/bin
        [ -e $bin/llama-bench.real ] || mv $bin/llama-bench $bin/llama-bench.real
        path=$bin${libs:+:$libs}
        printf '#!/bin/sh\nexport LD_LIBRARY_PATH=%s\nexec %s/llama-bench.real "$@"\n' "$path" "$bin" > $bin/llama-bench
        chmod +x $bin/llama-bench
        LD_LIBRARY_PATH=$path ldd $bin/llama-bench.real | grep "not found"
        # a memory cgroup needs the controller mounted (v2 where nothing is)
        [ -e /sys/fs/cgroup/cgroup.controllers ] || [ -d /sys/fs/cgroup/memory ] \
            || mount -t cgroup2 none /sys/fs/cgroup || true
        timeout "$(upto 330)" python3 benchmarks/capped.py --llama-cpp /tmp/llama-cuda --device "$DEVICE" \
            --vram-gib "$VRAM_GIB" --tokens $CAPPED_TOKENS --threads 8 --workdir /tmp/moepack-vs-llama
    } 2>&1 | tee "$OUT/capped.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed capped"
}

run_decode() {
    step "decode benchmark"
    timeout "$(upto 200)" python3 benchmarks/decode.py --preset "$PRESET" --device "$DEVICE" --no-transformers \
        --workdir /tmp/moepack-decode 2>&1 | tee "$OUT/decode.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed decode"
}

run_indexer_scores() {
    step "indexer scores: torch's blocks against the fused kernel"
    timeout "$(upto 90)" python3 benchmarks/indexer_scores.py --device "$DEVICE" $INDEXER_ARGS 2>&1 \
        | tee "$OUT/indexer_scores.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed indexer_scores"
}

run_triton_aot() {
    step "triton_aot: the Triton kernels compiled for sm_90"
    timeout "$(upto 120)" python3 benchmarks/triton_aot.py --arch 90 2>&1 | tee "$OUT/triton_aot.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed triton_aot"
}

run_gpu_prefill() {
    step "gpu prefill, the release slice at $GPU_DIMS widths"
    timeout "$(upto 300)" python3 benchmarks/gpu_prefill.py --device "$DEVICE" --tokens "$GPU_TOKENS" \
        --experts "$GPU_EXPERTS" --layers "$GPU_LAYERS" --dims "$GPU_DIMS" --workdir "$GPU_WORKDIR" 2>&1 \
        | tee "$OUT/gpu_prefill.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed gpu_prefill"
}

run_gpu_decode() {
    step "gpu decode, the release slice at $GPU_DIMS widths"
    timeout "$(upto 300)" python3 benchmarks/gpu_decode.py --device "$DEVICE" --batch "$GPU_BATCH" \
        --experts "$GPU_EXPERTS" --layers "$GPU_LAYERS" --dims "$GPU_DIMS" --workdir "$GPU_WORKDIR" 2>&1 \
        | tee "$OUT/gpu_decode.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed gpu_decode"
}

run_prefill() {
    step "prefill benchmark"
    # the decode step's model, where it made one (the same synthetic medium preset, converted with --keep)
    mkdir -p /tmp/moepack-bench
    [ -e "/tmp/moepack-decode/$PRESET.moepack" ] && ln -sfn "/tmp/moepack-decode/$PRESET-src" \
        "/tmp/moepack-bench/$PRESET-release" && ln -sfn "/tmp/moepack-decode/$PRESET.moepack" \
        "/tmp/moepack-bench/$PRESET-keep.moepack"
    timeout "$(upto 240)" python3 benchmarks/prefill.py --workdir /tmp/moepack-bench --preset "$PRESET" \
        --tokens "$TOKENS" --compute-dtype bfloat16 --repeat 1 --device "$DEVICE" --device-budget-gib "$BUDGET_GIB" \
        2>&1 | tee "$OUT/prefill.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed prefill"
}

run_profile() {
    step "decode profile"
    # where a GPU token's time goes: torch's profiler over a short generation (16-token prompt, 8 new tokens) after
    # a warm-up that cached every expert on the device; the decode benchmark's medium model where that step made it
    MODEL=/tmp/moepack-decode/$PRESET.moepack
    [ -e "$MODEL" ] || MODEL=/tmp/moepack-demo/small-fp4.moepack
    timeout "$(upto 120)" python3 - "$MODEL" "$DEVICE" <<'EOF' 2>&1 | tee "$OUT/profile.txt"
import sys
import torch
from torch.profiler import ProfilerActivity, profile
from moepack.runtime.engine import PrefillOptions
from moepack.runtime.generate import GenerateOptions, Generator
path, device = sys.argv[1], sys.argv[2]
options = GenerateOptions(max_new_tokens=32, stop_at_eos=False, cache_gib=8.0,
                          prefill=PrefillOptions(device=device, compute_dtype="bfloat16"))
with Generator(path, cache_gib=8.0, prefill=options.prefill) as g:
    ids = [3 + (7919 * i) % 200 for i in range(64)]
    print("warm-up", g.generate(ids, options).stats["decode"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    short = GenerateOptions(max_new_tokens=8, stop_at_eos=False, cache_gib=8.0, prefill=options.prefill)
    with profile(activities=activities) as prof:  # (few tokens: the table of a long run took minutes to build)
        decode = g.generate(ids[:16], short).stats["decode"]
    print("profiled", decode)
table = prof.key_averages()
print(table.table(sort_by="self_cpu_time_total", row_limit=30))
if device == "cuda":
    print(table.table(sort_by="self_cuda_time_total", row_limit=15))
EOF
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed profile"
}

# in the order STEPS names them: the figures that matter most first, so a run cut short still has them
steps=($STEPS)
for i in "${!steps[@]}"; do
    name=${steps[i]} later=$(( ${#steps[@]} - 1 - i ))
    if ! declare -F "run_$name" > /dev/null; then
        echo "== $name: no such step" | tee -a "$OUT/steps.txt"
        failed="$failed $name"
        continue
    fi
    wants "$name" && "run_$name"
done

# the device tool brings back 8 files of $OUT at most: the steps' own after the 7th go back packed in one
names=(steps.txt versions.txt)
for name in "${steps[@]/%/.txt}" $(ls "$OUT"); do  # (each step writes NAME.txt)
    [ -f "$OUT/$name" ] && [[ " ${names[*]} " != *" $name "* ]] && names+=("$name")
done
if (( ${#names[@]} > 8 )); then
    echo "== packed in rest.tar.gz (the device tool brings back 8 files): ${names[*]:7}" | tee -a "$OUT/steps.txt"
    tar -C "$OUT" -czf "$OUT/rest.tar.gz" "${names[@]:7}" && (cd "$OUT" && rm -f "${names[@]:7}")
fi
step "done${failed:+: FAILED:$failed}"
[ -z "$failed" ]
