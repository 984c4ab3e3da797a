"""The training loop shared by every speculator: AdamW with warmup and cosine decay over self-distilled batches,
evaluated on held-out samples before and after."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm.auto import tqdm

from specula_server.training.data import HiddenStates, Sample, TrainingBatch, batches
from specula_server.training.speculators import HeadScores

logger = logging.getLogger("specula.training")


class Trainee(Protocol):
    def loss(self, batch: TrainingBatch) -> tuple[torch.Tensor, HeadScores]: ...

    def parameters(self): ...

    def train(self, mode: bool = True): ...


@dataclass(frozen=True)
class TrainingSettings:
    epochs: int = 3
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class TrainingReport:
    before: HeadScores  # held-out scores of the untrained speculator
    after: HeadScores
    steps: int
    final_loss: float


def evaluate(trainee: Trainee, samples: Sequence[Sample], hidden_states: HiddenStates, batch_size: int) -> HeadScores:
    trainee.train(False)
    total: HeadScores | None = None
    with torch.no_grad():
        for batch in batches(samples, hidden_states, batch_size, shuffle=False):
            _, scores = trainee.loss(batch)
            total = scores if total is None else total + scores
    trainee.train(True)
    assert total is not None, "no evaluation samples"
    return total


def train(trainee: Trainee, train_samples: Sequence[Sample], eval_samples: Sequence[Sample],
          hidden_states: HiddenStates, settings: TrainingSettings, progress: bool = True) -> TrainingReport:
    torch.manual_seed(settings.seed)
    before = evaluate(trainee, eval_samples, hidden_states, settings.batch_size)
    params = [p for p in trainee.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    steps_per_epoch = -(-len(train_samples) // settings.batch_size)
    total_steps = max(1, settings.epochs * steps_per_epoch)

    def schedule(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress_ = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    bar = tqdm(total=total_steps, desc="training", unit="step", disable=not progress)
    step, loss_value = 0, math.nan
    for epoch in range(settings.epochs):
        for batch in batches(train_samples, hidden_states, settings.batch_size, shuffle=True,
                             seed=settings.seed + epoch):
            loss, scores = trainee.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            loss_value = float(loss.detach())
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss_value:.3f}",
                            top1=" ".join(f"{a:.2f}" for a in scores.accuracy()))
            bar.update(1)
    bar.close()
    after = evaluate(trainee, eval_samples, hidden_states, settings.batch_size)
    return TrainingReport(before, after, step, loss_value)
