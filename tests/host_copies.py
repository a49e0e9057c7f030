"""Counting host-to-device copies on a machine without a GPU: the "meta" device stands in for it (a tensor made
there from host data is an aten._to_copy or copy_ out of a CPU tensor, as on CUDA, or a torch.tensor / as_tensor
of host data given a device, which torch makes below the dispatcher)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_MAKERS = ("tensor", "as_tensor")


class HostToDevice(TorchDispatchMode):
    """Records each copy of host data to another device run under it (.to(device), copy_, torch.tensor(list,
    device=...)), as (what, shape)."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple] = []
        self._makers: dict = {}

    def __enter__(self):
        for name in _MAKERS:
            self._makers[name] = made = getattr(torch, name)
            setattr(torch, name, self._recording(name, made))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, made in self._makers.items():
            setattr(torch, name, made)
        return super().__exit__(*exc)

    def _recording(self, name, make):
        def made_from_host_data(data, *args, **kwargs):
            out = make(data, *args, **kwargs)
            if out.device.type != "cpu" and not (isinstance(data, torch.Tensor) and data.device == out.device):
                self.copies.append((f"torch.{name}", tuple(out.shape)))
            return out
        return made_from_host_data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _COPIES:
            source = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            if source.device.type == "cpu" and out.device.type != "cpu":
                self.copies.append((str(func), tuple(source.shape)))
        return out
