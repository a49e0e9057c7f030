#!/usr/bin/env bash
# The GPU checks for one lease of a device machine, as one command: the CUDA tests, then benchmarks/prefill.py on
# the GPU with a device budget smaller than the model's experts (T_ssd = io-alone, T_compute = compute-alone,
# wall = streamed). Everything lands in $OUT (the device tool brings it back).
#
# The device's image has torch (a CUDA build) but an older transformers and no zstandard, and nothing can be
# downloaded there. Once, here, in the repository's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl transformers==5.24.0 zstandard==0.25.0 regex==2025.11.3
# then run `bash benchmarks/device_check.sh` through the device tool with `.whl` carried. On a machine without a
# GPU, DEVICE=cpu runs the same steps (a dry run of this script). The steps' limits add up to under the tool's 600 s
# for one command; the exit status is non-zero if any step failed.
# What to read in its output first (the CUDA path has only been checked by reading it): the tests (a GPU-vs-CPU
# mismatch on a tiny model may be the indexer's zero-score ties, which CUDA's top-k may break otherwise; the
# device copier's test prints whether a copy was still in flight when it returned); then whether streamed stays
# near max(io-alone, compute-alone): copies go out on a copy stream ordered by events (runtime/device_copier.py),
# the host waits only when a buffer goes back to the read pool.
set -uo pipefail
OUT=${OUT:-/tmp/moepack-device-check}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-medium}
TOKENS=${TOKENS:-256,1024,4096}
BUDGET_GIB=${BUDGET_GIB:-1}  # below the medium preset's 2.3 GB of experts: they stream, as on a small GPU
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "== $1 ($(date -u +%T))" | tee -a "$OUT/steps.txt"; }

step "install"
# the carried wheels, where this python lacks what they bring (here, a dry run, it has them already)
if ! python3 -c "import zstandard, regex, transformers; transformers.DeepseekV4ForCausalLM" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
# no dependencies: the image's torch is the one to use (the project pins a CPU build for fresh machines)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("transformers", transformers.__version__)
assert hasattr(transformers, "DeepseekV4ForCausalLM"), "this transformers has no DeepseekV4ForCausalLM"
EOF
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
failed=""

step "tests"
timeout 200 python3 -m pytest -q -rs tests/test_prefill.py tests/test_quants.py tests/test_bench.py tests/test_pipeline_stages.py \
    tests/test_generate.py -k cuda 2>&1 \
    | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || failed="$failed tests"

step "prefill benchmark"
timeout 320 python3 benchmarks/prefill.py --workdir /tmp/moepack-bench --preset "$PRESET" --tokens "$TOKENS" \
    --compute-dtype bfloat16 --repeat 2 --device "$DEVICE" --device-budget-gib "$BUDGET_GIB" \
    2> "$OUT/prefill_stderr.txt" | tee "$OUT/prefill.txt"
[ "${PIPESTATUS[0]}" = 0 ] || failed="$failed benchmark"

step "done${failed:+: FAILED:$failed}"
[ -z "$failed" ]
