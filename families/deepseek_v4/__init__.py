"""DeepSeek-V4, the first model family: its config.json (config), the tensors a checkpoint of a config holds (tensors),
their names in the release, in transformers and in GGUF (names), how the converter places them (arch), the KV state
a prefill leaves (kv), its chat encoding and tool calls (chat, tools), the forward (model), its compiled one-token
path (token_layer) and the decode's arithmetic over both (decode: families.base.LayerDecode). Layering: cli -> serve
/ tools -> runtime -> families -> backends -> format_spec -> native; nothing here imports runtime, packer, serve,
tools or cli, nor another family."""

from .family import FAMILY, DeepseekV4Family

__all__ = ["FAMILY", "DeepseekV4Family"]
