"""Training an EAGLE-3 drafter by self-distillation, written in the `speculators` layout the server loads.

The data are the trainer's (`data.py`), with the target's auxiliary hidden states in place of its final ones
(`Eagle3HiddenStates`: the residual stream after the chosen layers, as the worker hands them to the drafter).
Position t pairs the target's state at t with the token at t + 1 (`speculators`' alignment) and guesses the
token at t + 2. Training runs the draft layer `steps` times, as `speculators` does ("training-time test"):

    step 0    every position t, causal attention over the step-0 entries j <= t, state fc(aux_t), token t + 1
    step s    position t again, state the draft layer's output of step s - 1 at t, token t + 1 + s (the true
              token: at inference, the accepted draft), attending to the step-0 entries j <= t and to its own
              entries of steps 1 .. s at t (the chain's own KV at inference); it guesses the token at t + 2 + s

Only positions from the last prompt token on are learned from (`Sample.first_position`), and only there do step
0's queries, the later steps and the head run (`Eagle3Trainee.step_states`). The draft vocabulary is
the `draft_vocab_size` tokens most frequent in the continuations (`choose_draft_vocabulary`); a label outside it
counts as a miss and takes no part in the loss. The embedding and the LM head rows are the target's, frozen (as
`speculators` trains, and saved with the drafter as it saves them); fc, the draft layer and its norms are trained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch import nn

from specula_server.batch import build_step
from specula_server.models.config import ModelConfig
from specula_server.models.llama import LlamaForCausalLM
from specula_server.training.data import HiddenStates, Sample, TrainingBatch
from specula_server.training.speculators import HeadScores


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's and `speculators`' choice (2, L // 2, L - 3) where those are three distinct layers, else the
    last three layer ids of a shallow model."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    return tuple(range(num_layers + 1))[-3:]


class Eagle3HiddenStates(HiddenStates):
    """`HiddenStates` giving the target's auxiliary states `[length, A * hidden]` after `layer_ids` layers."""

    def __init__(self, states: HiddenStates, layer_ids: Sequence[int]) -> None:  # reuses its scratch cache
        self.__dict__.update(states.__dict__)
        self._cache, self._cached_bytes = {}, 0
        self.layer_ids = tuple(layer_ids)

    @torch.no_grad()
    def _forward(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        lengths = [s.token_ids.numel() for s in samples]
        offsets = torch.tensor([0] + lengths).cumsum(0).tolist()
        requests = [SimpleNamespace(token_ids=s.token_ids, slots=torch.arange(offsets[i], offsets[i + 1],
                                                                               device=self.device))
                    for i, s in enumerate(samples)]
        step = build_step(requests, [0] * len(samples), lengths, self.device)
        _, aux = self.model.forward_with_aux(step.input_ids, step.positions, self.kv_cache.layers, step.attn,
                                             None, self.layer_ids)
        return [aux[offsets[i] : offsets[i + 1]].float().clone() for i in range(len(samples))]


def choose_draft_vocabulary(samples: Sequence[Sample], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` target tokens most frequent in the continuations (ties to the lower id), topped
    up with the lowest unused ids, ascending (as `speculators` builds d2t)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.token_ids[s.prompt_len :], minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Eagle3Trainee(nn.Module):
    """One EAGLE-3 draft layer for `model` (its shapes, the verifier's as `speculators` makes them), trained
    `steps` deep; `loss` gives the loss and each step's top-1 guesses against the labels."""

    def __init__(self, model: LlamaForCausalLM, lm_head_weight: torch.Tensor, draft_ids: torch.Tensor,
                 layer_ids: Sequence[int], steps: int = 3, norm_before_residual: bool = False,
                 init_std: float = 0.02, seed: int = 0) -> None:
        super().__init__()
        cfg: ModelConfig = model.config
        self.config, self.layer_ids, self.steps = cfg, tuple(layer_ids), steps
        self.norm_before_residual = norm_before_residual
        self._embed = [model.embed_tokens]  # the target's, frozen (a list: not a submodule)
        h, heads, kv, d, inner = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        generator = torch.Generator().manual_seed(seed)

        def normal(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * init_std)

        self.fc = normal(h, len(self.layer_ids) * h)
        self.q, self.k, self.v = normal(heads * d, 2 * h), normal(kv * d, 2 * h), normal(kv * d, 2 * h)
        self.o = normal(h, heads * d)
        self.gate, self.up, self.down = normal(inner, h), normal(inner, h), normal(h, inner)
        self.norms = nn.ParameterDict({name: nn.Parameter(torch.ones(h)) for name in (
            "input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")})
        self.register_buffer("draft_ids", draft_ids.clone())  # [draft_vocab] target ids, ascending
        self.register_buffer("lm_head", lm_head_weight.detach().float()[draft_ids].clone())  # frozen
        to_draft = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
        to_draft[draft_ids] = torch.arange(draft_ids.numel())
        self.register_buffer("to_draft", to_draft)
        from specula_server.layers.rotary import inverse_frequencies  # here: rotary imports the models package

        self.register_buffer("inv_freq", inverse_frequencies(d, cfg.rope_theta, cfg.rope_scaling).float())

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of `x [b, n, heads, d]` at `positions` (`[n]`, or `[b, n]` per sample)."""
        freqs = positions.float()[..., None] * self.inv_freq
        cos, sin = torch.cat([freqs, freqs], -1).cos()[..., None, :], torch.cat([freqs, freqs], -1).sin()[..., None, :]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def step_states(self, aux: torch.Tensor, batch: TrainingBatch
                    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The draft layer's final-normed output of each step (see the module docstring) at the positions learned
        from only: a window of `m` positions per sample from its first learned one (`batch.valid`'s first), the
        longest sample's continuation wide. Returns the window's positions `[b, m]`, whether each is inside its
        sample `[b, m]`, and per step s `[b, m, hidden]`.

        Only step 0's keys and values cover the whole sample (every step attends to them); its queries, the later
        steps and the LM head run over the window alone, so a long prompt costs one key/value projection per
        position, not the whole layer and a vocabulary-wide head three times."""
        cfg, eps = self.config, self.config.rms_norm_eps
        b, n = batch.tokens.shape
        heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rep = heads // kv
        positions = torch.arange(n, device=aux.device)
        first = torch.where(batch.valid.any(1), batch.valid.int().argmax(1), batch.lengths)  # [b]
        m = max(1, int((batch.lengths - first).max()))
        window = first[:, None] + torch.arange(m, device=aux.device)[None]  # [b, m]
        inside = window < batch.lengths[:, None]
        window = window.clamp(max=n - 1)

        def at_window(x: torch.Tensor) -> torch.Tensor:  # [b, n, ...] -> [b, m, ...]
            return x.gather(1, window.view(b, m, *([1] * (x.dim() - 2))).expand(b, m, *x.shape[2:]))

        def embed(ahead: int) -> torch.Tensor:  # the (frozen) embedding of the token at window + ahead
            with torch.no_grad():
                ids = at_window(batch.shifted_tokens(ahead))
                return self._embed[0](ids.flatten()).view(b, m, -1).float()

        # Step 0's keys and values over every position of the sample.
        state = nn.functional.linear(aux, self.fc)  # [b, n, hidden]
        with torch.no_grad():
            embeds = self._embed[0](batch.shifted_tokens(1).flatten()).view(b, n, -1).float()
        normed = _rms(state, self.norms["hidden_norm"], eps)
        x = torch.cat([_rms(embeds, self.norms["input_layernorm"], eps), normed], -1)
        k0 = self._rotate(nn.functional.linear(x, self.k).view(b, n, kv, d), positions).repeat_interleave(rep, 2)
        v0 = nn.functional.linear(x, self.v).view(b, n, kv, d).repeat_interleave(rep, 2)
        seen = positions[None, None, :] <= window[:, :, None]  # [b, query, key]: causal over step 0's entries
        x, residual = at_window(x), at_window(normed if self.norm_before_residual else state)
        own: list[tuple[torch.Tensor, torch.Tensor]] = []  # steps 1.. keys and values at the window [b, m, heads, d]
        out = []
        for s in range(self.steps):
            if s > 0:
                normed = _rms(state, self.norms["hidden_norm"], eps)
                residual = normed if self.norm_before_residual else state
                x = torch.cat([_rms(embed(1 + s), self.norms["input_layernorm"], eps), normed], -1)
                own.append((self._rotate(nn.functional.linear(x, self.k).view(b, m, kv, d), window + s)
                            .repeat_interleave(rep, 2),
                            nn.functional.linear(x, self.v).view(b, m, kv, d).repeat_interleave(rep, 2)))
            q = self._rotate(nn.functional.linear(x, self.q).view(b, m, heads, d), window + s)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k0) / d**0.5
            scores = scores.masked_fill(~seen[:, None], float("-inf"))
            diagonal = [torch.einsum("bqhd,bqhd->bhq", q, k).unsqueeze(-1) / d**0.5 for k, _ in own]
            weights = torch.cat([scores] + diagonal, -1).softmax(-1)
            attended = torch.einsum("bhqk,bkhd->bqhd", weights[..., :n], v0)
            for j, (_, v) in enumerate(own):
                attended = attended + weights[..., n + j].permute(0, 2, 1).unsqueeze(-1) * v
            hidden = residual + nn.functional.linear(attended.reshape(b, m, heads * d), self.o)
            mlp_in = _rms(hidden, self.norms["post_attention_layernorm"], eps)
            hidden = hidden + nn.functional.linear(
                nn.functional.silu(nn.functional.linear(mlp_in, self.gate)) * nn.functional.linear(mlp_in, self.up),
                self.down)
            out.append(_rms(hidden, self.norms["norm"], eps))
            state = hidden
        return window, inside, out

    def step_logits(self, aux: torch.Tensor, batch: TrainingBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The window's positions `[b, m]` (`step_states`) and per step s `[b, m, draft_vocab]` guesses of the
        token at window + 2 + s."""
        window, _, states = self.step_states(aux, batch)
        return window, [nn.functional.linear(h, self.lm_head) for h in states]

    def loss(self, batch: TrainingBatch, decay: float = 1.0) -> tuple[torch.Tensor, HeadScores]:
        window, inside, states = self.step_states(batch.hidden, batch)
        losses, correct, chained, total = [], [], [], []
        all_right = inside.clone()
        for s, hidden in enumerate(states):
            mask = batch.target_mask(2 + s).gather(1, window) & inside
            labels = self.to_draft[batch.shifted_tokens(2 + s).gather(1, window)]
            learnable = mask & (labels >= 0)
            right = torch.zeros_like(mask)
            if learnable.any():  # the head over the rows learned from only
                logits = nn.functional.linear(hidden[learnable], self.lm_head)
                losses.append(decay**s * nn.functional.cross_entropy(logits, labels[learnable]))
                right[learnable] = logits.argmax(-1) == labels[learnable]
            all_right = all_right & right
            correct.append(right.sum())
            chained.append(all_right.sum())
            total.append(mask.sum())
        loss = torch.stack(losses).sum() if losses else states[0].sum() * 0
        return loss, HeadScores(torch.stack(correct).cpu(), torch.stack(chained).cpu(), torch.stack(total).cpu())

    def save(self, out_dir: Path, verifier_dir: Path | None, base_model: str, dtype: torch.dtype) -> None:
        """The `speculators` layout (`config.json`, `model.safetensors` with the verifier's embedding, as the
        package saves it: its own loader does not fall back to the verifier's)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        cfg, p = self.config, "layers.0."
        tensors = {
            "fc.weight": self.fc, "lm_head.weight": self.lm_head, "norm.weight": self.norms["norm"],
            p + "hidden_norm.weight": self.norms["hidden_norm"],
            p + "input_layernorm.weight": self.norms["input_layernorm"],
            p + "post_attention_layernorm.weight": self.norms["post_attention_layernorm"],
            p + "self_attn.q_proj.weight": self.q, p + "self_attn.k_proj.weight": self.k,
            p + "self_attn.v_proj.weight": self.v, p + "self_attn.o_proj.weight": self.o,
            p + "mlp.gate_proj.weight": self.gate, p + "mlp.up_proj.weight": self.up,
            p + "mlp.down_proj.weight": self.down,
        }
        tensors["embed_tokens.weight"] = self._embed[0](torch.arange(cfg.vocab_size, device=self.fc.device))
        tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in tensors.items()}
        tensors["d2t"] = (self.draft_ids - torch.arange(self.draft_ids.numel(), device=self.draft_ids.device)).cpu()
        tensors["t2d"] = (self.to_draft >= 0).cpu()
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "model.safetensors").chmod(0o644)  # readable by the server's user, like the config next to it
        verifier = json.loads((verifier_dir / "config.json").read_text()) if verifier_dir is not None else {}
        layer = {k: v for k, v in verifier.items() if k != "transformers_version"} or {
            "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta}
        config = eagle3_config(layer, cfg.architecture, base_model, int(self.draft_ids.numel()), self.layer_ids,
                               self.steps, norm_before_residual=self.norm_before_residual)
        config["dtype"] = str(dtype).removeprefix("torch.")
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# Fields of a whole LlamaConfig that a minimal verifier config (one written from a GGUF file's metadata, say) may lack:
# the `speculators` package writes the layer's whole config, and vLLM's EAGLE-3 layer reads them (`hidden_act`, ...).
LLAMA_LAYER_DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
                        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
                        "tie_word_embeddings": False}


def eagle3_config(layer: dict, architecture: str, verifier_name: str, draft_vocab_size: int,
                  layer_ids: Sequence[int] | None, speculative_tokens: int = 3, num_layers: int = 1,
                  norm_before_residual: bool = False, norm_before_fc: bool = False, fc_norm: bool = False,
                  norm_output: bool = False) -> dict:
    """`config.json` of an EAGLE-3 checkpoint as `speculators` 0.9 writes it (`layer`: the verifier's config,
    used as the draft layer's)."""
    return {
        "architectures": ["Eagle3DraftModel"],
        "draft_vocab_size": draft_vocab_size,
        "dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": list(layer_ids) if layer_ids is not None else None,
        "embed_requires_grad": False,
        "fc_norm": fc_norm,
        "norm_before_fc": norm_before_fc,
        "norm_before_residual": norm_before_residual,
        "norm_output": norm_output,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens, "verifier_accept_k": 1}],
            "verifier": {"architectures": [architecture], "name_or_path": verifier_name},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": {**LLAMA_LAYER_DEFAULTS, **layer, "num_hidden_layers": num_layers},
    }
