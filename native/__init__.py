"""moepack's compiled CPU kernels: the C sources (one .c file per library, shared code in .h headers) and their loader,
which builds each library once per machine into a cache (see loader.py). Imports nothing else of moepack."""

from .loader import (CACHE_ENV, CFLAGS, NATIVE_ENV, SOURCE_DIR, LazyKernel, build, build_key, c_compiler, c_function,
                     cache_dir, cpu_identity, disable, native_builds, native_library, read_source, sources)

__all__ = ["CACHE_ENV", "CFLAGS", "NATIVE_ENV", "SOURCE_DIR", "LazyKernel", "build", "build_key", "c_compiler",
           "c_function", "cache_dir", "cpu_identity", "disable", "native_builds", "native_library", "read_source",
           "sources"]
