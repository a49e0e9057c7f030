"""Every test runs with a bench cache of its own (empty unless the test measures): what `moepack bench` recorded on
this machine (read defaults, the fused kernel's crossover) must not change what a test sees. The same directory holds
the compiled kernels (moepack.native builds them into its native/ folder): compiled once per session, never into the
user's ~/.cache."""

from __future__ import annotations

import pytest

from moepack.runtime.tuning import CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def own_bench_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("bench-cache")))
        yield


@pytest.fixture
def prefill_room(monkeypatch):
    """room(n): the prefill's memory check (StreamingPrefill.check_memory) refuses a prompt, or prompts together, of
    more than n tokens ("a prompt of N tokens needs more than there is"), and checks the others as it does."""
    from moepack.format_spec.errors import MoepackError
    from moepack.runtime import engine as engine_module

    real = engine_module.StreamingPrefill.check_memory

    def room(limit: int) -> None:
        def check_memory(self, n_tokens, scored_tokens=0, freeable_bytes=0):
            if n_tokens > limit:
                raise MoepackError(f"a prompt of {n_tokens} tokens needs more than there is")
            return real(self, n_tokens, scored_tokens, freeable_bytes)
        monkeypatch.setattr(engine_module.StreamingPrefill, "check_memory", check_memory)
    return room
