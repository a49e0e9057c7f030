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
