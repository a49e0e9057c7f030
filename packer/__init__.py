"""Writing containers: checkpoint sources, conversion, export, synthetic checkpoints (the architecture adapter and
the tensor schema they follow are moepack.v4's)."""
