"""Time one training step (loss, backward) of `specula-train eagle3`'s trainee at a model's shapes.

Random weights at SmolLM2-135M-Instruct's shapes by default (hidden 576, 9 heads over 3 KV heads, MLP 1536,
vocabulary 49152, draft vocabulary 8192); a batch of `--batch` samples of `--length // 3` to `--length` tokens,
the last `--learned` of each learned from (a prompt, then the model's continuation). Prints each round's seconds
and the median:

    python benchmark/eagle3_training.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_load  # noqa: E402, F401  (puts the repo's packages on the path)

from specula_server.training.data import TrainingBatch  # noqa: E402
from specula_server.training.eagle3 import Eagle3Trainee  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=640)
    parser.add_argument("--learned", type=int, default=130)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="training-time test depth")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cfg = SimpleNamespace(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                          rms_norm_eps=1e-5, vocab_size=49152, rope_theta=100000.0, rope_scaling=None)
    torch.manual_seed(0)
    model = SimpleNamespace(config=cfg, embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size))
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    draft_ids = torch.randperm(cfg.vocab_size)[: args.draft_vocab].sort().values
    b, n = args.batch, args.length
    lengths = torch.randint(n // 3, n + 1, (b,))
    lengths[0] = n
    tokens = torch.randint(0, cfg.vocab_size, (b, n))
    valid = torch.zeros(b, n, dtype=torch.bool)
    for i, length in enumerate(lengths.tolist()):
        tokens[i, length:] = 0
        valid[i, max(0, length - args.learned) : length] = True
    batch = TrainingBatch(torch.randn(b, n, 3 * cfg.hidden_size), tokens, valid, lengths)
    trainee = Eagle3Trainee(model, lm_head, draft_ids, (2, 15, 27), steps=args.steps)
    times = []
    for r in range(args.rounds):
        begin = time.perf_counter()
        loss, _ = trainee.loss(batch)
        loss.backward()
        times.append(time.perf_counter() - begin)
        print(f"round {r}: {times[-1]:.2f} s (loss {loss.item():.3f})", flush=True)
    print(f"median {statistics.median(times):.2f} s a step: {b} samples of {n // 3}-{n} tokens, "
          f"{args.learned} learned each, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
