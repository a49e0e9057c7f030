"""generation_config.json, the side file (embedded in a container with the tokenizer's) in which a model's maker
recommends how to sample it: the temperature, top_p, top_k, min_p and repetition_penalty a generation takes where
its request names none (`moepack serve --sampling-defaults model`), as vLLM reads them (whatever its do_sample
says), and the GGUF keys of those llama.cpp's GGUF converter writes (general.sampling.*: `export --format gguf` writes
them, a GGUF's conversion reads them back; llama.cpp's penalty_repeat counts only the last 64 tokens, unlike
transformers' repetition_penalty, so that one has no key)."""

from __future__ import annotations

import math

GENERATION_CONFIG = "generation_config.json"
# the largest values the GGUF keys' types hold (a larger one had failed the export's write in a traceback)
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = (1 << 31) - 1
MAX_REPETITION_PENALTY = 100.0  # far past any use (2 already all but bans a repeat); a bound keeps it a number
# each field: what a value must be, the test, its GGUF key and type (gguf-py's add_sampling_*)
SAMPLING_FIELDS = {
    "temperature": ("a number in [0, 3.4e38]", lambda v: 0 <= v <= FLOAT32_MAX, "general.sampling.temp", "float32"),
    "top_p": ("a number in (0, 1]", lambda v: 0 < v <= 1, "general.sampling.top_p", "float32"),
    "top_k": (f"an integer in [0, {INT32_MAX}]", lambda v: isinstance(v, int) and 0 <= v <= INT32_MAX,
              "general.sampling.top_k", "int32"),
    "min_p": ("a number in [0, 1]", lambda v: 0 <= v <= 1, "general.sampling.min_p", "float32"),
    "repetition_penalty": (f"a number in (0, {MAX_REPETITION_PENALTY:g}]", lambda v: 0 < v <= MAX_REPETITION_PENALTY,
                           None, None),
}


def recommended_sampling(config: dict) -> tuple[dict, list[str]]:
    """The recommended sampling of a generation_config.json ({field: value} of SAMPLING_FIELDS it sets) and a note
    for each value left out (not a finite number in its range)."""
    defaults, notes = {}, []
    for name, (expected, valid, _, _) in SAMPLING_FIELDS.items():
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                not valid(value)):
            notes.append(f"{GENERATION_CONFIG}'s {name} {str(value)[:40]!r} is left out: expected {expected}")
            continue
        defaults[name] = value
    return defaults, notes


def gguf_sampling_keys(config: dict) -> list[tuple[str, str, float | int]]:
    """(key, gguf type, value) of a generation_config.json's recommended sampling, as GGUF metadata."""
    defaults, _ = recommended_sampling(config)
    return [(SAMPLING_FIELDS[name][2], SAMPLING_FIELDS[name][3], value) for name, value in defaults.items()
            if SAMPLING_FIELDS[name][2] is not None]


def from_gguf_sampling(meta: dict) -> dict:
    """The generation_config.json fields of a GGUF's general.sampling.* keys ({} where it has none; a float32 read
    back at the 7 digits it holds: 0.6, not 0.6000000238)."""
    fields = {}
    for name, (_, _, key, kind) in SAMPLING_FIELDS.items():
        value = meta.get(key) if key is not None else None
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        fields[name] = int(value) if kind == "int32" else float(f"{value:.7g}")
    return recommended_sampling(fields)[0]
