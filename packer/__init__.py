"""Writing containers: checkpoint sources, architecture adapters, conversion, synthetic checkpoints."""
