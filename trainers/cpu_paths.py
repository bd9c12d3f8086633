"""The CPU switches of the trainer's forwards and memory (docs/methods/grpo.md D12, D14, D15), each one context manager
or call the base trainer makes at a named point:

- `ScoredLabels`: a log-prob forward projects only the positions a loss mask scores through the LM head (D12);
- `CausalWithoutMask`: a batch padded only on the right runs as plain causal attention, without a mask (D15);
- `keep_freed_memory`: glibc keeps freed activations for the next step instead of faulting them in again (D14).

The switches inside transformers and TRL (their fused head and grouped key/value attention on CPU) are
`trainers.trl_api.cpu_fast_paths`, since they reach private names.

Decision ids (`Dn`) without a page are docs/methods/grpo.md's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch


def keep_freed_memory() -> bool:
    """Ask glibc's allocator to keep freed memory for reuse instead of handing it back to the system
    (docs/methods/grpo.md D14).

    A training step on CPU allocates and frees many tensors of a few to a few tens of MB (activations of a 64-episode
    batch). glibc unmaps the blocks it mapped on their own (above its adaptive `M_MMAP_THRESHOLD`) when they are freed,
    and gives a free region at the top of its heap back to the system once it passes `M_TRIM_THRESHOLD`, so the next
    step page-faults that memory in again, zeroed. With no trim and a fixed 32 MB `M_MMAP_THRESHOLD` (its largest
    value), freed blocks under 32 MB stay in the heap and are reused. The process keeps its peak heap size; blocks of
    32 MB or more are still mapped and unmapped as before. Returns False (and changes nothing) where the C library is
    not glibc. The trainer calls it when its policy is on CPU; calling it again changes nothing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # musl, macOS: other allocators
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20))


class ScoredLabels(AbstractContextManager):
    """While open, each fused-head call of `model` (TRL's `model(..., labels=labels, fused_lm_head=True)`) gets label
    -100 on the completion positions where `scored` (B, T) is 0, so the head projects only the model's own tokens and
    returns log-prob 0 elsewhere (docs/methods/grpo.md D12). TRL's forward may split the B rows into chunks; they come
    in order, and the rows consumed so far are counted so each chunk gets its own rows."""

    def __init__(self, model: torch.nn.Module, scored: torch.Tensor):
        self.model, self.scored, self.row = model, scored, 0

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self._relabel, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def _relabel(self, module, args, kwargs):
        labels = kwargs.get("labels")
        if labels is None or not kwargs.get("fused_lm_head"):
            return None
        rows = self.scored[self.row : self.row + labels.size(0)]  # (b, T)
        if rows.size(0) != labels.size(0):
            raise RuntimeError(f"the forward scored more rows than the {self.scored.size(0)} the loss mask covers")
        self.row += labels.size(0)
        T = rows.size(1)
        completion = labels[:, -T:].masked_fill(rows.to(labels.device) == 0, -100)
        kwargs["labels"] = torch.cat([labels[:, :-T], completion], dim=1)
        return args, kwargs


def pads_right_only(mask: torch.Tensor) -> bool:
    """True when every row of the (B, S) 0/1 attention `mask` is ones followed by zeros: padding only on the right."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


class CausalWithoutMask(AbstractContextManager):
    """While open, each call of `model` whose `attention_mask` pads only on the right gets `attention_mask=None`, so
    attention runs as plain causal attention (docs/methods/grpo.md D15). A causal model's position reads only itself
    and the positions before it, so padding on the right never reaches a real token; the mask changed only what the
    padding positions themselves compute, and nothing reads their outputs. Without it no (B, 1, S, S) mask is built,
    and PyTorch's attention skips the blocks above the diagonal. Position ids are what the mask gave: no row is
    shifted. TRL builds its labels from the mask before the call, so padding is still not scored."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self._drop_right_padding_mask, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    @staticmethod
    def _drop_right_padding_mask(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None or mask.dim() != 2 or not pads_right_only(mask):
            return None
        kwargs["attention_mask"] = None
        return args, kwargs
