"""Bounds on the tuning knobs (the commands' flags check them before any work; the runtime again, for API callers).
No imports: the CLI reads these without loading torch."""

MAX_QUEUE_DEPTH = 256  # reads in flight: each holds a buffer of the largest read, and a thread waits on it
MAX_BUNDLE_EXPERTS = 1024  # experts per read (V4-Flash has 256 per layer; a read is at most one layer's)
MAX_THREADS_PER_CPU = 8  # --threads beyond this many per CPU the machine has only adds switching
MAX_CACHE_GIB = 1 << 20  # an expert cache of a PiB is a typo, not a budget (memory is checked too)
# `serve --prompt-cache-gib` (runtime/prompt_cache.py): llama-server keeps 8 GiB of prompts (--cache-ram); 4 GiB is
# Qwen3-30B-A3B's float32 KV of ~21k tokens, DeepSeek-V4-Flash's compressed one of far more
DEFAULT_PROMPT_CACHE_GIB = 4.0
MIN_CACHED_TOKENS = 32  # a shorter prefix costs its copies and a lookup for about nothing a pass saves
MAX_BATCH = 256  # sequences decoding together (`serve --max-batch`): each holds its KV, a step computes all
DEFAULT_MAX_BATCH = 8  # a decode step is bound by reading the weights: 8 sequences cost about what one does
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per prefill run while others decode: each run reads the model again
MAX_BENCH_REPEAT = 100  # runs a bench keeps the best of: more measure nothing new, and 10^8 never end
MAX_CHUNK_TOKENS = 1 << 31  # a token chunk flag's bound: past any prompt it is the whole prompt (2^63 overflows)
MAX_PROMPTS = 10_000  # prompts of one `generate` run: all are tokenized and queued up front
