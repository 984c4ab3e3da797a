"""Trainable speculators and the checkpoint layouts the server loads.

`MedusaTrainee`: Medusa heads, written in the FasterDecoding layout (each head with its own vocabulary
projection) or the LoRAX v2 layout (heads on the base LM head). Residual blocks start at zero, so an untrained
head passes the hidden state through; own vocabulary projections start as copies of the base LM head. Head h,
on the hidden state at position t, learns the token at t + 2 + h.

`MLPSpeculatorTrainee`: IBM's MLP speculator (arXiv 2404.19124), written in its Hugging Face layout
(`model_type: mlp_speculator`). Stage i reads the running state and the token at t + 1 + i (teacher forcing:
the true token, as at inference the accepted draft) and learns the token at t + 2 + i:

    state = GELU(LN_i(proj_i(state) + (emb_weight / state_weight) * emb_i(token)))    logits_i = head_i(state)

with the state starting as the base hidden state at t (RMS-normed and divided by sqrt(2) with `scale_input`).
`tie_weights` shares the embedding, norm and head over the stages and the projection over stages 1 and on.

Both return, from a `TrainingBatch`, the loss and per-head counts of correct top-1 guesses, which estimate
acceptance: with greedy verification, a chain's head h only counts when heads 0..h-1 were right too, so the
trainer also reports the chained rate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from specula_server.training.data import TrainingBatch


@dataclass
class HeadScores:
    """Top-1 guesses per head over a set of positions."""

    correct: torch.Tensor  # [H] positions where head h's top-1 is right
    chained: torch.Tensor  # [H] positions where heads 0..h are all right
    total: torch.Tensor  # [H] positions with a label for head h

    def __add__(self, other: HeadScores) -> HeadScores:
        return HeadScores(self.correct + other.correct, self.chained + other.chained, self.total + other.total)

    def accuracy(self) -> list[float]:
        return (self.correct / self.total.clamp(min=1)).tolist()

    def chained_accuracy(self) -> list[float]:
        return (self.chained / self.total.clamp(min=1)).tolist()

    def mean_accepted(self) -> float:
        """Expected drafts a chain of these heads gets accepted per step (sum of the chained rates)."""
        return sum(self.chained_accuracy())


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    save_file({k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}, str(path))
    path.chmod(0o644)  # readable by the server's user, like the config next to it


def _loss_and_scores(logits: list[torch.Tensor], batch: TrainingBatch, decay: float) -> tuple[torch.Tensor, HeadScores]:
    """`logits[h]`: `[b, n, vocab]` guesses of the token at t + 2 + h."""
    losses, correct, chained, total = [], [], [], []
    all_right = torch.ones_like(batch.valid)
    for h, head_logits in enumerate(logits):
        mask = batch.target_mask(2 + h)
        labels = batch.shifted_tokens(2 + h)
        picked = head_logits[mask]
        if picked.numel():
            losses.append(decay**h * nn.functional.cross_entropy(picked.float(), labels[mask]))
        right = (head_logits.argmax(dim=-1) == labels) & mask
        all_right = all_right & right
        correct.append(right.sum())
        chained.append(all_right.sum())
        total.append(mask.sum())
    loss = torch.stack(losses).sum() if losses else logits[0].sum() * 0
    scores = HeadScores(torch.stack(correct).cpu(), torch.stack(chained).cpu(), torch.stack(total).cpu())
    return loss, scores


class MedusaTrainee(nn.Module):
    def __init__(self, lm_head_weight: torch.Tensor, num_heads: int, num_layers: int, own_lm_heads: bool) -> None:
        super().__init__()
        vocab, hidden = lm_head_weight.shape
        self.num_heads, self.num_layers, self.own_lm_heads = num_heads, num_layers, own_lm_heads
        self.register_buffer("base_lm_head", lm_head_weight.detach().float().clone())
        self.linear_weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden, hidden))
        self.linear_bias = nn.Parameter(torch.zeros(num_heads, num_layers, hidden))
        self.head_weight = (nn.Parameter(self.base_lm_head.unsqueeze(0).repeat(num_heads, 1, 1))
                            if own_lm_heads else None)

    def head_logits(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """`hidden [..., hidden]` -> per head `[..., vocab]`."""
        out = []
        for h in range(self.num_heads):
            x = hidden
            for layer in range(self.num_layers):
                x = x + nn.functional.silu(nn.functional.linear(x, self.linear_weight[h, layer],
                                                                self.linear_bias[h, layer]))
            weight = self.head_weight[h] if self.head_weight is not None else self.base_lm_head
            out.append(nn.functional.linear(x, weight))
        return out

    def loss(self, batch: TrainingBatch, decay: float = 0.8) -> tuple[torch.Tensor, HeadScores]:
        return _loss_and_scores(self.head_logits(batch.hidden), batch, decay)

    def save(self, out_dir: Path, base_model: str, dtype: torch.dtype) -> None:
        """FasterDecoding layout (own LM heads) or LoRAX v2 (`version: 2`, heads on the base LM head)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for h in range(self.num_heads):
            for layer in range(self.num_layers):
                tensors[f"{h}.{layer}.linear.weight"] = self.linear_weight[h, layer]
                tensors[f"{h}.{layer}.linear.bias"] = self.linear_bias[h, layer]
            if self.head_weight is not None:
                tensors[f"{h}.{self.num_layers}.weight"] = self.head_weight[h]
        _save_tensors(tensors, out_dir / "medusa_lm_head.safetensors", dtype)
        config = {"base_model_name_or_path": base_model, "medusa_num_heads": self.num_heads,
                  "medusa_num_layers": self.num_layers}
        if not self.own_lm_heads:
            config["version"] = 2
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class _RMSNormShift(nn.Module):
    """fms-extras' `LayerNormParameterized` as the MLP speculator uses it: RMS norm, learned scale and shift."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight + self.bias


class MLPSpeculatorTrainee(nn.Module):
    def __init__(self, lm_head_weight: torch.Tensor, inner_dim: int, n_predict: int, tie_weights: bool,
                 scale_input: bool, seed: int = 0) -> None:
        super().__init__()
        vocab, emb_dim = lm_head_weight.shape
        self.vocab, self.emb_dim, self.inner_dim, self.n_predict = vocab, emb_dim, inner_dim, n_predict
        self.tie_weights, self.scale_input = tie_weights, scale_input
        stages = 1 if tie_weights else n_predict
        generator = torch.Generator().manual_seed(seed)

        def normal(*shape: int, std: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * std)

        # Unit-variance embeddings (a stage scales them by emb_weight / state_weight); projections and heads
        # scaled by their fan-in, so every stage starts with unit-scale activations.
        self.emb = nn.ParameterList([normal(vocab, inner_dim, std=1.0) for _ in range(stages)])
        self.proj = nn.ParameterList([normal(inner_dim, emb_dim if i == 0 else inner_dim,
                                             std=1 / math.sqrt(emb_dim if i == 0 else inner_dim))
                                      for i in range(2 if tie_weights and n_predict > 1 else stages)])
        self.ln = nn.ModuleList([_RMSNormShift(inner_dim) for _ in range(stages)])
        self.head = nn.ParameterList([normal(vocab, inner_dim, std=1 / math.sqrt(inner_dim)) for _ in range(stages)])
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (inner_dim / 2))

    def _stage(self, i: int) -> tuple[nn.Parameter, nn.Parameter, nn.Module, nn.Parameter]:
        if self.tie_weights:
            return self.emb[0], self.proj[min(i, 1)], self.ln[0], self.head[0]
        return self.emb[i], self.proj[i], self.ln[i], self.head[i]

    def stage_logits(self, state: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """`state [..., emb_dim]`, `tokens [..., n_predict]` (token i feeds stage i) -> per stage `[..., vocab]`."""
        if self.scale_input:
            state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
        out = []
        for i in range(self.n_predict):
            emb, proj, ln, head = self._stage(i)
            state = nn.functional.linear(state, proj)
            state = state + (self.emb_weight / self.state_weight) * nn.functional.embedding(tokens[..., i], emb)
            state = nn.functional.gelu(ln(state))
            out.append(nn.functional.linear(state, head))
        return out

    def loss(self, batch: TrainingBatch, decay: float = 1.0) -> tuple[torch.Tensor, HeadScores]:
        tokens = torch.stack([batch.shifted_tokens(1 + i) for i in range(self.n_predict)], dim=-1)
        return _loss_and_scores(self.stage_logits(batch.hidden, tokens), batch, decay)

    def save(self, out_dir: Path, base_model: str, dtype: torch.dtype, top_k_tokens_per_head: list[int],
             n_candidates: int) -> None:
        """IBM's Hugging Face layout; a tied speculator stores only the tensors its stages share."""
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, params in (("emb", self.emb), ("proj", self.proj), ("head", self.head)):
            for i, p in enumerate(params):
                tensors[f"speculator.{name}.{i}.weight"] = p
        for i, ln in enumerate(self.ln):
            tensors[f"speculator.ln.{i}.weight"] = ln.weight
            tensors[f"speculator.ln.{i}.bias"] = ln.bias
        _save_tensors(tensors, out_dir / "model.safetensors", dtype)
        config = {
            "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
            "base_model_name_or_path": base_model, "emb_dim": self.emb_dim, "inner_dim": self.inner_dim,
            "n_predict": self.n_predict, "vocab_size": self.vocab, "top_k_tokens_per_head": top_k_tokens_per_head,
            "n_candidates": n_candidates, "tie_weights": self.tie_weights, "scale_input": self.scale_input,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
