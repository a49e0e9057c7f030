"""Writing containers: checkpoint sources, conversion, export, synthetic checkpoints (the architecture adapter and
the tensor schema they follow are moepack.families.deepseek_v4's)."""
