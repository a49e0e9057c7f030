"""The device backends, below the model families: the compiled kernels and the expert backends a model's operations run
on (ops, the dense operations a model calls, each choosing token_kernels' compiled call or torch; token_kernels,
grouped_experts, device_copier; a family's own operations' kernels, such as DeepSeek-V4's mHC and
Lightning Indexer, are in its package and run on token_kernels' shared entries). Layering: runtime -> families ->
backends -> format_spec -> native; nothing here imports a model family (a model names each expert's tensors,
ExpertNaming, and gives the activation)."""
