"""The KVAE decoder's fast forms: the same function as diffusers' modules, with fewer passes over memory.

`fuse_decoder(decoder)` gives two kinds of the decoder's modules another `forward` (on the instances; the encoder and
other copies keep theirs):

- **Spatial norms** (`Kandinsky6SRSpatialNorm3D`, 31 of them): the latent `zq` modulates every resnet norm through
  two 1x1x1 convolutions of `zq` nearest-upsampled to the feature grid. A 1x1x1 convolution is the same arithmetic
  at every position and nearest upsampling only repeats positions, so the two commute: the convolutions run on
  `zq`'s own grid (1/256 of the positions at full resolution) and their results are upsampled. Compiled, the
  upsampling is index arithmetic inside the norm's one fused kernel, so neither the upsampled `zq` nor the two
  full-resolution modulation tensors are ever written.
- **Causal convolutions of stride 1**: diffusers pads height and width with `F.pad` (a copy of the input), convolves
  the first frames and the rest in two calls and copies both into a preallocated output. Here the carried frames are
  joined to the input once and one convolution pads height and width itself. The carried frames (`cache`) are kept
  unpadded, which only this forward reads.

- **Channels-last layout** (`channels_last=True`, what the compiled GPU path uses): cuDNN's convolutions on Hopper are
  implicit GEMMs on channels-last (NDHWC) data; given diffusers' channels-first tensors, cuDNN transposed every
  input and output around each convolution (18 % of a compiled tile decode on an H200, bench/RESULTS.md). The
  decoder's convolution weights are kept channels-last, its input is made channels-last once, every convolution's
  input is asked for in that layout (inside a compiled decoder, the kernel that produces it writes it so), and the
  output is handed back channels-first.

Every output element is the same sum of the same products; a convolution library may order a sum differently for
another input size or layout, so the last bits may differ from diffusers' forms (bench/network_profile.py measures
it against the eager reference).
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import (
    CONV_CHUNK_ELEMENTS,
    Kandinsky6SRCausalConv3d,
    Kandinsky6SRSpatialNorm3D,
)

from k6vsr_core import settings

CHANNELS_LAST = torch.channels_last_3d
# `channels_first` keeps diffusers' layout (with the other fast forms): only to measure what the layout brings.
LAYOUT_ENV = settings.env_name("decoder_layout")


def channels_last_wanted() -> bool:
    return settings.read(settings.Compute).decoder_layout == "channels_last"


def _conv_input(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` in the layout of `like` (channels-last where the decoder runs so)."""
    if like.dim() == 5 and like.is_contiguous(memory_format=CHANNELS_LAST) and not like.is_contiguous():
        return tensor.contiguous(memory_format=CHANNELS_LAST)
    return tensor


def _nearest_like(values: torch.Tensor, target: torch.Tensor, first_segment: bool) -> torch.Tensor:
    """`values` nearest-upsampled to `target`'s grid, as diffusers upsamples `zq` (the first frame alone at first)."""
    if not first_segment:
        return F.interpolate(values, size=target.shape[-3:], mode="nearest")
    head = F.interpolate(values[:, :, :1], size=target[:, :, :1].shape[-3:], mode="nearest")
    if values.size(2) == 1:
        return head
    rest = F.interpolate(values[:, :, 1:], size=target[:, :, 1:].shape[-3:], mode="nearest")
    return torch.cat([head, rest], dim=2)


def spatial_norm_forward(self: Any, hidden_states: torch.Tensor, zq: torch.Tensor, cache: dict) -> torch.Tensor:
    """`Kandinsky6SRSpatialNorm3D.forward` with the modulation computed on `zq`'s grid (see the module's text)."""
    first = cache["is_first_segment"]
    scale = _nearest_like(self.conv_y(zq), hidden_states, first)
    shift = _nearest_like(self.conv_b(zq), hidden_states, first)
    cache["is_first_segment"] = False
    return self.norm_layer(hidden_states) * scale + shift


def causal_conv_forward(self: Any, hidden_states: torch.Tensor, cache: dict) -> torch.Tensor:
    """`Kandinsky6SRCausalConv3d.forward` for stride 1: one join, one convolution that pads height and width."""
    padding = cache["padding"]
    if padding is None:
        padding = hidden_states[:, :, :1].expand(-1, -1, self.time_pad, -1, -1)
    joined = torch.cat([padding, hidden_states], dim=2) if self.time_pad else hidden_states
    joined = _conv_input(joined, self.conv.weight)
    if joined.numel() > CONV_CHUNK_ELEMENTS:
        # diffusers' time-chunked convolution bounds the memory of very large inputs; it wants the padded input.
        spatial = (self.width_pad, self.width_pad, self.height_pad, self.height_pad)
        output = self.conv(F.pad(joined, spatial))
    else:
        weight, bias = self.conv.weight, self.conv.bias
        output = F.conv3d(joined, weight, bias, padding=(0, self.height_pad, self.width_pad))
    cache["padding"] = joined[:, :, joined.size(2) - self.time_pad :].clone()
    return output


def channels_last_forward(self: Any, latents: torch.Tensor, cache: dict) -> torch.Tensor:
    """The decoder's own forward on a channels-last input; its output channels-first, as diffusers gives it."""
    decoded = type(self).forward(self, latents.contiguous(memory_format=CHANNELS_LAST), cache)
    return decoded.contiguous()


# The modules already changed, so that a second call changes none of them again.
_CHANNELS_LAST: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_FUSED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _own_forward(module: torch.nn.Module, forward: Any) -> None:
    """Give this one module `forward` ahead of its class's: an instance attribute, which nn.Module keeps in its
    `__dict__` as it does any attribute that is not a parameter, buffer or submodule."""
    vars(module)["forward"] = types.MethodType(forward, module)


def fuse_decoder(decoder: torch.nn.Module, channels_last: bool | None = None) -> int:
    """Give `decoder`'s spatial norms and stride-1 causal convolutions their fast forms, and with `channels_last` its
    layout; returns how many modules changed.

    Idempotent. Call it before the decoder first runs: a decode in progress keeps its cache in diffusers' form.
    `channels_last` None: as `K6VSR_DECODER_LAYOUT` says (channels-last unless it says `channels_first`).
    """
    if channels_last is None:
        channels_last = channels_last_wanted()
    if channels_last and decoder not in _CHANNELS_LAST:
        for conv in decoder.modules():
            if isinstance(conv, torch.nn.Conv3d):
                conv.weight.data = conv.weight.data.contiguous(memory_format=CHANNELS_LAST)
        _own_forward(decoder, channels_last_forward)
        _CHANNELS_LAST.add(decoder)
    changed = 0
    for module in decoder.modules():
        if module in _FUSED:
            continue
        if isinstance(module, Kandinsky6SRSpatialNorm3D):
            _own_forward(module, spatial_norm_forward)
        elif isinstance(module, Kandinsky6SRCausalConv3d) and module.time_stride == 1:
            _own_forward(module, causal_conv_forward)
        else:
            continue
        _FUSED.add(module)
        changed += 1
    return changed
