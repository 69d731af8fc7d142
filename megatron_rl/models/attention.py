"""Attention math the trainer and the native engine share (like `rope.py`): the softmax with learned sinks."""
from __future__ import annotations

import torch


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """GPT-OSS's attention weights, as transformers computes them: the softmax over each row of `scores`
    [..., heads, rows, keys] (masked keys at -inf) and its head's sink logit, one more column broadcast from
    `sinks` (shaped to broadcast against scores[..., :1]), whose share is dropped, so a row sums to less than 1.
    `dtype`: the softmax's (None: the scores')."""
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=dtype)[..., :-1]
