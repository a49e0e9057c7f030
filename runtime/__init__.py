"""The prefill runtime (layer-major, experts streamed from the container)."""
