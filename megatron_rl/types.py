"""Typed records passed between the parts of a run. Shapes are written in the field docstrings.

Per-token tensors in a `TrainBatch` are *token-aligned*: entry [b, t] refers to token t of row b
(its log-probability given tokens [0, t), its advantage, ...). Position 0 never carries a loss.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch


@dataclasses.dataclass
class Completion:
    """One sampled response to one prompt, as a rollout engine returns it."""

    request_id: str
    """Id of the request (unique per sample; `n > 1` requests get `<id>-<k>`)."""
    prompt_ids: list[int]
    """Prompt token ids, length P."""
    output_ids: list[int]
    """Generated token ids, length R (includes the stop token when one ended the response)."""
    output_logprobs: list[float]
    """log mu(y_t | x, y_<t) of each generated token under the engine's raw policy (temperature 1,
    no top-p/top-k truncation), length R: the behaviour log-probs for importance weighting."""
    weight_versions: list[int]
    """Weight version that produced each generated token, length R (one value unless the weights were
    updated while this response was in flight)."""
    finish_reason: str
    """'stop' (stop token or string), 'length' (max_new_tokens or context), or 'abort'."""
    group_id: str = ""
    """Samples of the same prompt share a group id (advantage baselines are per group)."""
    output_mask: list[int] | None = None
    """Multi-turn episodes (recipes/agent/): 1 on output tokens the policy sampled, 0 on tokens the
    environment wrote between turns (tool results, the chat template's turn markers), length R; their
    log-probs are 0 and they carry no loss. None: every output token was sampled."""
    routed_experts: torch.Tensor | None = None
    """MoE routing record: int16 [P + R - 1, num_layers, top_k], the expert ids the engine chose at every
    position that was an input of an engine forward (every prompt token and every generated token but the
    last), top-k in descending router probability. None for dense models or when recording is off."""

    @property
    def weight_version(self) -> int:
        """The oldest version that contributed to this response (what staleness is measured against)."""
        return min(self.weight_versions) if self.weight_versions else -1


@dataclasses.dataclass
class TrainBatch:
    """Rows of (prompt + response) tokens for the trainer, right-padded to one length S."""

    tokens: torch.Tensor
    """[B, S] int64 token ids, right-padded with any id (padding is masked out)."""
    loss_mask: torch.Tensor
    """[B, S] float: 1 on tokens whose log-prob enters the loss (response tokens), 0 elsewhere; [:, 0] is 0."""
    advantages: torch.Tensor | None = None
    """[B, S] float advantage of each token (usually the sequence advantage broadcast over its tokens)."""
    behaviour_logprobs: torch.Tensor | None = None
    """[B, S] float log mu of each token under the policy that sampled it (0 where loss_mask is 0)."""
    reference_logprobs: torch.Tensor | None = None
    """[B, S] float log pi_ref of each token, when a KL penalty to a reference model is used."""
    values: torch.Tensor | None = None
    """[B, S] float: PPO's critic, V of the state before each token when the step's advantages were
    computed (the value loss's clip centre); None without a critic."""
    returns: torch.Tensor | None = None
    """[B, S] float: GAE's returns, the critic's regression targets; None without a critic."""
    token_multiple: int = 1
    """Keep S (here and in every trimmed micro-batch) a multiple of this, padding columns with token 0
    and no loss: Transformer Engine's FP8 GEMMs need the token count of a micro-batch aligned
    (controller/batching.py FP8_TOKEN_MULTIPLE). 1: no constraint."""
    routed_experts: torch.Tensor | None = None
    """MoE routing record [B, S', L, k] int64: the experts the rollout engine chose for token t of row b at
    each of the L layers (-1: no record; the trainer routes those positions itself). S' may differ from S
    (trimming and alignment leave it alone; the trainer crops or pads it). docs/moe.md."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"TrainBatch.tokens must be [B, S], got shape {tuple(self.tokens.shape)}")
        if self.routed_experts is not None and (self.routed_experts.dim() != 4
                                                or self.routed_experts.shape[0] != self.tokens.shape[0]):
            raise ValueError(f"TrainBatch.routed_experts must be [B={self.tokens.shape[0]}, S, layers, top_k], "
                             f"got shape {tuple(self.routed_experts.shape)}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "routed_experts":
                continue
            if isinstance(value, torch.Tensor) and value.shape != self.tokens.shape:
                raise ValueError(f"TrainBatch.{field.name} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(self.tokens.shape)} like tokens")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    def select(self, rows: slice | torch.Tensor) -> "TrainBatch":
        """These rows, as the same batch type (subclasses may add row-indexed tensors and plain fields)."""
        def take(value):
            return value[rows] if isinstance(value, torch.Tensor) else value

        return type(self)(**{f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def loss_positions(self) -> torch.Tensor:
        """[B, S] bool: the positions whose log-probs a loss reads; the trainer computes only these.
        A batch type whose loss also reads other positions (e.g. a scored reference answer) extends it."""
        return self.loss_mask != 0

    def trimmed(self) -> "TrainBatch":
        """The columns up to the last loss position (later tokens cannot affect earlier log-probs in a
        causal model); at least 2 columns. Keeps the batch's type and its non-tensor fields."""
        carrying = self.loss_positions().any(dim=0).nonzero()
        width = max(int(carrying[-1]) + 1 if carrying.numel() else 0, 2)
        width = -(-width // self.token_multiple) * self.token_multiple
        if width >= self.seq_length:
            return self.token_aligned()
        def take(value):  # per-token [B, S] tensors lose their tail; per-row and plain fields stay
            per_token = isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == self.seq_length
            return value[:, :width] if per_token else value
        return type(self)(**{f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def token_aligned(self) -> "TrainBatch":
        """Columns of padding (token 0, no loss) appended up to a multiple of `token_multiple` columns:
        a causal model's log-probs at earlier positions do not see them, and the loss masks them out."""
        extra = -self.seq_length % self.token_multiple
        if not extra:
            return self
        width = self.seq_length

        def pad(value):
            if not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == width):
                return value
            return torch.cat([value, value.new_zeros((value.shape[0], extra))], dim=1)

        return type(self)(**{f.name: pad(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def padded_rows(self, multiple: int) -> "TrainBatch":
        """Rows of zeros (token 0, no loss anywhere) appended up to a multiple of `multiple` rows."""
        extra = -self.batch_size % multiple
        if not extra:
            return self

        def pad(value):
            if not isinstance(value, torch.Tensor) or value.shape[:1] != self.tokens.shape[:1]:
                return value
            fill = -1 if value is self.routed_experts else 0  # padding rows have no routing record
            return torch.cat([value, value.new_full((extra, *value.shape[1:]), fill)])

        return type(self)(**{f.name: pad(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def data_parallel_share(self, dp_rank: int, dp_size: int, micro_batch_size: int) -> "TrainBatch":
        """Data-parallel rank `dp_rank`'s rows of a global batch of a multiple of `micro_batch_size` x
        `dp_size` rows: micro-batch i goes to rank i mod dp_size. Batches are built longest row first,
        so every rank gets rows of similar lengths (no straggler rank), and rows a micro-batch keeps
        together (e.g. a JEPO group) stay together."""
        if self.batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"a global batch of {self.batch_size} rows does not split into micro-batches of "
                             f"{micro_batch_size} rows over {dp_size} data-parallel ranks")
        if dp_size == 1:
            return self
        micro = torch.arange(self.batch_size) // micro_batch_size
        return self.select((micro % dp_size == dp_rank).nonzero().flatten())

    def micro_batches(self, micro_batch_size: int) -> Iterator["TrainBatch"]:
        for start in range(0, self.batch_size, micro_batch_size):
            yield self.select(slice(start, start + micro_batch_size))
