"""What a tiled call's backward replays, as torch's checkpoint does: the RNG states at the call's
start (so each tile draws in backward what it drew in forward) and the autocast state."""

from __future__ import annotations

import contextlib

import torch


def _device_type(tensors) -> str:
    for t in tensors:
        if t.device.type != "cpu":
            return t.device.type
    return "cpu"


def _autocast_state(device_type: str):
    state = {}
    for dev in {device_type, "cpu"}:
        if torch.amp.is_autocast_available(dev):
            state[dev] = {
                "enabled": torch.is_autocast_enabled(dev),
                "dtype": torch.get_autocast_dtype(dev),
                "cache_enabled": torch.is_autocast_cache_enabled(),
            }
    return state


def _autocast(state: dict):
    stack = contextlib.ExitStack()
    for dev, kwargs in state.items():
        stack.enter_context(torch.amp.autocast(dev, **kwargs))
    return stack


class _RngState:
    """The RNG states at a tiled call's start (CPU, and the devices its tensors are on), replayed
    in backward: the tiles then run in forward order and draw what they drew in forward."""

    def __init__(self, tensors, device_type):
        from torch.utils.checkpoint import get_device_states

        self.device_type = device_type
        self.cpu = torch.get_rng_state()
        self.devices, self.states = [], []
        module = getattr(torch, device_type, None) if device_type != "cpu" else None
        if module is not None and getattr(module, "_initialized", False):
            self.devices, self.states = get_device_states(*tensors)

    @contextlib.contextmanager
    def replay(self):
        from torch.utils.checkpoint import set_device_states

        kwargs = {} if self.device_type == "cpu" else {"device_type": self.device_type}
        with torch.random.fork_rng(devices=self.devices, enabled=True, **kwargs):
            torch.set_rng_state(self.cpu)
            if self.devices:
                set_device_states(self.devices, self.states, device_type=self.device_type)
            yield
