"""DeepSeek-V4, the model: its config.json (config), the tensors a checkpoint of a config holds (tensors), their
names in the release, in transformers and in GGUF (names), how the converter places them (arch), and the KV state
a prefill leaves (kv). Layering: cli -> packer / runtime -> v4 -> format_spec; nothing here imports packer,
runtime or cli."""
