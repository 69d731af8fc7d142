"""A Bradley-Terry reward model as the reward (`reward.name: reward_model`): an HF `*ForSequenceClassification`
checkpoint with one output (Llama, Qwen2/3, Mistral, Gemma families: transformers' own classes) scores the
conversation [user: question, assistant: response] rendered with the reward model's own chat template.

    reward:
      name: reward_model
      kwargs: {path: /models/Skywork-Reward-V2-Llama-3.1-8B, batch_size: 8, scale: sigmoid}

The model runs forward-only in the driver process through transformers (bf16 on a GPU, fp32 on CPU),
batched with the step's responses, each batch right-padded (the classification head reads each row's last
real token). `scale`: `raw` (the logit, the usual Bradley-Terry score), `sigmoid` (in (0, 1), e.g. for a
correctness threshold) or `standardize` (the logit minus the batch mean over the batch std: group-free
whitening for estimators that do not normalise). Responses longer than `max_length` tokens keep their
start and lose their end, and are counted in the log; an empty response is scored like any other.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import torch
import transformers

from megatron_rl.rewards.registry import RewardResult

logger = logging.getLogger(__name__)

_MODELS: dict[tuple, "RewardModel"] = {}
_LOCK = threading.Lock()


def render_conversation(tokenizer, messages: Sequence[dict[str, Any]]) -> str:
    """A conversation as a reward model reads it: its tokenizer's default chat template, the whole
    conversation, no generation prompt (reward-model training renders its pairs with this too)."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False)


def conversation_ids(tokenizer, messages: Sequence[dict[str, Any]]) -> list[int]:
    """The token ids `RewardModel.score` gives the rendered conversation (no special tokens added)."""
    return tokenizer(render_conversation(tokenizer, messages), add_special_tokens=False)["input_ids"]


class RewardModel:
    """One loaded `*ForSequenceClassification` checkpoint and its tokenizer."""

    def __init__(self, path: str, *, dtype: str = "auto", device: str = "auto"):
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        torch_dtype = {"auto": torch.bfloat16 if self.device.type == "cuda" else torch.float32,
                       "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch_dtype)
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path}: {self.model.config.num_labels} outputs; a reward model has one")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.model.to(self.device).eval()
        if self.tokenizer.chat_template is None:
            raise ValueError(f"reward model {path}: its tokenizer has no chat template to render conversations with")

    def render(self, question: str, response: str) -> str:
        return render_conversation(self.tokenizer, [{"role": "user", "content": question},
                                                    {"role": "assistant", "content": response}])

    @torch.no_grad()
    def score(self, texts: Sequence[str], *, batch_size: int, max_length: int) -> tuple[list[float], int]:
        """The logit of each rendered conversation, and how many were cut at max_length."""
        logits, truncated = [], 0
        for start in range(0, len(texts), batch_size):
            chunk = list(texts[start:start + batch_size])
            full = self.tokenizer(chunk, add_special_tokens=False)["input_ids"]
            truncated += sum(len(ids) > max_length for ids in full)
            batch = self.tokenizer(chunk, add_special_tokens=False, padding=True, truncation=True,
                                   max_length=max_length, return_tensors="pt").to(self.device)
            logits.extend(self.model(**batch).logits[:, 0].float().cpu().tolist())
        return logits, truncated


def reward_model(path: str, **options: Any) -> RewardModel:
    """The process's loaded reward model for `path` and these options (loaded once)."""
    key = (path, tuple(sorted(options.items())))
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = RewardModel(path, **options)
        return _MODELS[key]


def _scaled(logits: list[float], scale: str) -> list[float]:
    if scale == "raw":
        return logits
    values = torch.tensor(logits, dtype=torch.float64)
    if scale == "sigmoid":
        return torch.sigmoid(values).tolist()
    if scale == "standardize":
        if len(logits) < 2:
            return [0.0] * len(logits)
        return ((values - values.mean()) / (values.std() + 1e-6)).tolist()
    raise ValueError(f"reward_model: scale must be raw, sigmoid or standardize, got {scale!r}")


def reward_model_batch(responses: Sequence[str], prompts: Sequence[Any], *, path: str = "", batch_size: int = 8,
                       max_length: int = 4096, scale: str = "raw", dtype: str = "auto", device: str = "auto",
                       extract: Any = None) -> list[RewardResult]:
    """The step's responses scored in batches (module docstring)."""
    if not path:
        raise ValueError("reward reward_model needs reward.kwargs.path (an HF *ForSequenceClassification checkpoint)")
    if batch_size < 1 or max_length < 2:
        raise ValueError("reward reward_model: batch_size >= 1 and max_length >= 2")
    model = reward_model(path, dtype=dtype, device=device)
    texts = [model.render(getattr(p, "question", ""), r) for r, p in zip(responses, prompts)]
    logits, truncated = model.score(texts, batch_size=batch_size, max_length=max_length)
    if truncated:
        logger.info("reward_model: %d of %d conversations cut at max_length=%d tokens", truncated, len(texts),
                    max_length)
    return [RewardResult(reward=value) for value in _scaled(logits, scale)]


def reward_model_reward(response: str, prompt: Any, **kwargs: Any) -> RewardResult:
    """One response scored alone (`standardize` needs a batch: use `score_batch`)."""
    return reward_model_batch([response], [prompt], **kwargs)[0]


reward_model_reward.score_batch = reward_model_batch  # type: ignore[attr-defined]
