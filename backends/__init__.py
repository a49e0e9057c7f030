"""The device backends, below the model families: the compiled kernels and the expert backends a model's operations run
on (token_kernels, mhc_native, grouped_experts, device_copier). Layering: runtime -> families -> backends -> format_spec
-> native; nothing here imports a model family (a model names each expert's tensors, ExpertNaming, and gives the
activation)."""
