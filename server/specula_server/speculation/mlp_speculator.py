"""MLP speculators (IBM, arXiv 2404.19124) as a drafter: a small recurrent MLP on the base model's last hidden
state, served for every request with `--speculator PATH_OR_HUB_ID`.

Checkpoint layout (IBM's Hugging Face layout, e.g. `ibm-ai-platform/llama3-8b-accelerator`):
  - `config.json`: `{"model_type": "mlp_speculator", "architectures": ["MLPSpeculatorPreTrainedModel"],
    emb_dim, inner_dim, n_predict, vocab_size, top_k_tokens_per_head, n_candidates, tie_weights, scale_input}`;
    `inner_dim` 0 means `emb_dim` (as fms-extras and vLLM read it).
  - weights in `model.safetensors` (or shards named by `model.safetensors.index.json`, or any `*.safetensors`):
    `speculator.emb.{i}.weight [vocab, inner]`, `speculator.proj.{i}.weight [inner, emb_dim if i == 0 else
    inner]`, `speculator.ln.{i}.weight|bias [inner]`, `speculator.head.{i}.weight [vocab, inner]` for stages
    i < n_predict; the `speculator.` prefix may be missing. A `tie_weights` checkpoint stores only `emb.0`,
    `ln.0`, `head.0` (shared by every stage), `proj.0` and `proj.1` (stage 1 and on).

Stage i (fms-extras `MLPSpeculator.generate_suffixes`, vLLM `MLPSpeculator.generate_proposals`):

    state = proj_i(state) * state_weight + emb_i(token_i) * emb_weight
    state = GELU(LN_i(state))              LN: RMS norm (eps 1e-6) with learned weight and bias, no centring
    logits_i = head_i(state)

with `state_weight = 0.5 ** (0.5 / n_predict)` and `emb_weight = sqrt((1 - state_weight**2) * inner_dim / 2)`.
The state starts as the base model's final-normed hidden state at the position the request's last token was
chosen from (`RequestState.last_hidden`; with `scale_input` first RMS-normed without weights, eps 1e-6, and
divided by sqrt(2)), and token_0 is that last token: the base LM head on that state gave token_0, and stage 0
guesses the token after it. Token_i for i >= 1 is the draft stage i - 1 chose, so stage i guesses the token
i + 1 places after the last committed one.

Drafts (`MLPSpeculatorDrafter`): `--draft-tree-width 1` takes each stage's top-1 token, a chain (as vLLM and
TGI do). Width K > 1 grows a tree: stage i offers its top `k_i` tokens for every node it expands, `k_i` =
min(K, `top_k_tokens_per_head[i]`) (K when the checkpoint has no list), a node's score is the sum of the
log-probs along its path, and the request's `max_tokens` best nodes are kept (parents before children, in order
of preference, as `medusa.best_first_tree`). fms-extras instead keeps the `n_candidates` best full-length paths;
here the verification budget counts nodes, so `n_candidates` is read but not used. Because the MLP is
autoregressive over the chosen tokens, every node carries its own state: the tree is evaluated level by level,
all nodes of a level of all requests in one call per stage, and a level keeps at most `budget - level` nodes
per request (no more of them can be among the best `budget` nodes, which also need an ancestor at each level
above). Drafts are deterministic functions of the context, so verification stays exact (`verify.py`).

Tensor parallelism: the speculator is small and loaded whole on every rank; the hidden state it reads is the
full (all-reduced) one on every rank, so every rank proposes the same drafts.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specula_server.request import RequestState
from specula_server.speculation.drafters import NO_DRAFT, Draft, Drafter

if TYPE_CHECKING:
    from specula_server.models.config import ModelConfig

logger = logging.getLogger("specula.speculation")

MODEL_TYPE = "mlp_speculator"
CONFIG_FILE = "config.json"
# What a Hub download of an MLP speculator fetches (pickles stay excluded by the hub module).
HUB_ALLOW_PATTERNS = (CONFIG_FILE, "*.safetensors", "*.safetensors.index.json")
LN_EPS = 1e-6  # fms-extras' LayerNormParameterized default, for the stage norms and the scale_input norm
_REQUIRED = ("emb_dim", "n_predict", "vocab_size")


class MLPSpeculatorError(ValueError):
    """An MLP speculator that cannot be used with this model; the message names it and says why."""


def _error(name: str, reason: str) -> MLPSpeculatorError:
    return MLPSpeculatorError(f"MLP speculator `{name}`: {reason}")


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    emb_dim: int
    inner_dim: int
    n_predict: int
    vocab_size: int
    tie_weights: bool = False
    scale_input: bool = False
    top_k_tokens_per_head: tuple[int, ...] | None = None
    n_candidates: int | None = None

    @classmethod
    def from_dict(cls, raw: object, name: str) -> MLPSpeculatorConfig:
        if not isinstance(raw, dict):
            raise _error(name, f"{CONFIG_FILE} is not a JSON object")
        if raw.get("model_type") != MODEL_TYPE:
            raise _error(name, f"{CONFIG_FILE} has model_type {raw.get('model_type')!r}, not {MODEL_TYPE!r}")
        missing = [key for key in _REQUIRED if key not in raw]
        if missing:
            raise _error(name, f"{CONFIG_FILE} lacks {', '.join(missing)}")
        try:
            emb_dim, n_predict, vocab = (_int(raw[k]) for k in _REQUIRED)
            inner_dim = _int(raw.get("inner_dim") or 0) or emb_dim  # 0 or absent: emb_dim
            top_k = raw.get("top_k_tokens_per_head")
            top_k = None if top_k is None else tuple(_int(k) for k in top_k)
            n_candidates = raw.get("n_candidates")
            n_candidates = None if n_candidates is None else _int(n_candidates)
        except (TypeError, ValueError) as error:
            raise _error(name, f"{CONFIG_FILE} has a non-integer emb_dim / inner_dim / n_predict / vocab_size / "
                               f"top_k_tokens_per_head / n_candidates ({error})") from None
        if min(emb_dim, inner_dim, n_predict, vocab) < 1:
            raise _error(name, f"{CONFIG_FILE} needs positive emb_dim ({emb_dim}), inner_dim ({inner_dim}), "
                               f"n_predict ({n_predict}) and vocab_size ({vocab})")
        if top_k is not None and (len(top_k) != n_predict or min(top_k) < 1):
            raise _error(name, f"top_k_tokens_per_head {list(top_k)} must give a positive count for each of the "
                               f"{n_predict} stages")
        return cls(emb_dim, inner_dim, n_predict, vocab, bool(raw.get("tie_weights", False)),
                   bool(raw.get("scale_input", False)), top_k, n_candidates)

    @property
    def state_weight(self) -> float:
        return 0.5 ** (0.5 / self.n_predict)

    @property
    def emb_weight(self) -> float:
        return math.sqrt((1 - self.state_weight**2) * self.inner_dim / 2)

    def head_widths(self, tree_width: int) -> list[int]:
        """Tokens each stage offers per expanded node: 1 (a chain) for width 1, else min(width, the
        checkpoint's `top_k_tokens_per_head[i]`), or the width for every stage when it has no list."""
        if tree_width <= 1:
            return [1] * self.n_predict
        top_k = self.top_k_tokens_per_head or (tree_width,) * self.n_predict
        return [max(1, min(tree_width, k, self.vocab_size)) for k in top_k]


def _int(value: object) -> int:
    if isinstance(value, bool) or not float(value).is_integer():  # type: ignore[arg-type]
        raise ValueError(f"{value!r} is not an integer")
    return int(value)  # type: ignore[arg-type]


class MLPSpeculator(nn.Module):
    """The speculator's stages. Weights as stored (`[out, in]`), one entry per distinct tensor: a tied
    checkpoint has one embedding, norm and head and two projections, and every stage indexes its own.

    `forward(hidden [n, emb_dim], tokens [n, n_predict]) -> logits [n_predict, n, vocab]` runs every stage on
    given tokens (token i feeds stage i); the drafter runs `initial_state` then `stage` level by level.
    Logits are float32; the rest runs in the weights' dtype (the norms in float32).
    """

    def __init__(self, config: MLPSpeculatorConfig, emb: torch.Tensor, proj0: torch.Tensor, proj: torch.Tensor,
                 ln_weight: torch.Tensor, ln_bias: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("emb", emb)  # [E, vocab, inner], E = 1 (tied) or n_predict
        self.register_buffer("proj0", proj0)  # [inner, emb_dim]
        self.register_buffer("proj", proj)  # [P, inner, inner], stages 1.. (P = 1 tied, n_predict - 1 untied)
        self.register_buffer("ln_weight", ln_weight)  # [E, inner]
        self.register_buffer("ln_bias", ln_bias)  # [E, inner]
        self.register_buffer("head", head)  # [E, vocab, inner]

    @property
    def n_predict(self) -> int:
        return self.config.n_predict

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor:
        state = hidden.to(self.proj0.dtype)
        if self.config.scale_input:
            state = _rms_norm(state) / math.sqrt(2)
        return state

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage i on `state [n, emb_dim or inner]` and `tokens [n]`: the new state and logits `[n, vocab]`."""
        if not 0 <= i < self.config.n_predict:
            raise IndexError(f"stage {i} of a {self.config.n_predict}-stage MLP speculator")
        e = min(i, self.emb.shape[0] - 1)
        proj = self.proj0 if i == 0 else self.proj[min(i - 1, self.proj.shape[0] - 1)]
        z = nn.functional.embedding(tokens, self.emb[e])
        state = nn.functional.linear(state, proj) * self.config.state_weight + z * self.config.emb_weight
        state = _rms_norm(state) * self.ln_weight[e] + self.ln_bias[e]
        state = nn.functional.gelu(state)
        return state, nn.functional.linear(state, self.head[e]).float()

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        state = self.initial_state(hidden)
        logits = []
        for i in range(self.config.n_predict):
            state, stage_logits = self.stage(i, state, tokens[:, i])
            logits.append(stage_logits)
        return torch.stack(logits)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + LN_EPS)).to(x.dtype)


# --- finding and loading ------------------------------------------------------------------------------------


def read_config(path: Path) -> object | None:
    """`path/config.json` parsed, or None when there is none or it is not JSON."""
    try:
        return json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def is_mlp_speculator_dir(path: Path) -> bool:
    """Whether `path` is a directory whose `config.json` says `model_type: mlp_speculator`."""
    raw = read_config(path) if Path(path).is_dir() else None
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


def find_mlp_speculator(speculator_id: str, cache_dir: Path | None = None, revision: str | None = None) -> Path | None:
    """The local directory of `speculator_id` (a directory or a Hub id) when it is an MLP speculator, else None.

    For a Hub id only `config.json` is fetched first; the weights are fetched only when it names an MLP
    speculator. A Hub id that cannot be fetched gives None, so the caller's other loaders report the error.
    """
    local = Path(speculator_id).expanduser()
    if local.is_dir():
        return local if is_mlp_speculator_dir(local) else None
    from specula_server.hub import ModelNotFoundError, is_offline_from_env, snapshot

    token, offline = os.environ.get("HF_TOKEN") or None, is_offline_from_env()
    try:
        config_dir = snapshot(speculator_id, revision, cache_dir, token, (CONFIG_FILE,), offline)
    except ModelNotFoundError as error:
        logger.debug("--speculator %s: no config.json from the Hub (%s)", speculator_id, error.reason)
        return None
    if not is_mlp_speculator_dir(config_dir):
        return None
    logger.info("fetching MLP speculator %s from the Hugging Face Hub%s", speculator_id,
                " cache only (offline)" if offline else "")
    try:
        return snapshot(speculator_id, revision, cache_dir, token, HUB_ALLOW_PATTERNS, offline)
    except ModelNotFoundError as error:
        raise _error(speculator_id, f"cannot fetch its weights from the Hub: {error.reason}") from None


def load_mlp_speculator(
    path: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    speculator_id: str | None = None,
) -> MLPSpeculator:
    """Reads the MLP speculator in `path` (tied or not, with or without the `speculator.` prefix) whole, in
    `dtype` on `device`, and checks it against the base model.

    Raises:
        MLPSpeculatorError: no or bad config, emb_dim or vocab_size not the model's hidden size and vocabulary,
            no safetensors weights, a tensor missing or of the wrong shape.
    """
    from specula_server.hub import weight_files
    from specula_server.weights import Weights

    path = Path(path)
    name = speculator_id if speculator_id is not None else str(path)
    raw = read_config(path)
    if raw is None:
        raise _error(name, f"no readable {CONFIG_FILE} in {path}")
    spec = MLPSpeculatorConfig.from_dict(raw, name)
    if spec.emb_dim != config.hidden_size:
        raise _error(name, f"emb_dim {spec.emb_dim} is not the model's hidden size {config.hidden_size} "
                           "(it was trained for another model)")
    if spec.vocab_size != config.vocab_size:
        raise _error(name, f"vocab_size {spec.vocab_size} is not the model's vocabulary size {config.vocab_size} "
                           "(it was trained for another model)")
    try:
        reader = Weights(weight_files(path), torch.device("cpu"), dtype)
    except Exception as error:  # no files, a damaged file, a tensor in two shards
        raise _error(name, f"cannot read its weights: {error}") from error
    names = set(reader.names())
    prefix = "speculator." if any(n.startswith("speculator.") for n in names) else ""
    inner, vocab, stages = spec.inner_dim, spec.vocab_size, spec.n_predict

    def read(tensor: str, shape: list[int]) -> torch.Tensor:
        if prefix + tensor not in names:
            raise _error(name, f"tensor {prefix}{tensor} is missing"
                               + (" (a tie_weights checkpoint stores emb.0, ln.0, head.0, proj.0 and proj.1)"
                                  if spec.tie_weights else ""))
        found = reader.shape(prefix + tensor)
        if found != shape:
            raise _error(name, f"tensor {prefix}{tensor} has shape {found}, expected {shape} (emb_dim "
                               f"{spec.emb_dim}, inner_dim {inner}, vocab_size {vocab})")
        return reader.get_tensor(prefix + tensor).to(device=device, dtype=dtype)

    shared = range(1 if spec.tie_weights else stages)
    emb = torch.stack([read(f"emb.{i}.weight", [vocab, inner]) for i in shared])
    ln_weight = torch.stack([read(f"ln.{i}.weight", [inner]) for i in shared])
    ln_bias = torch.stack([read(f"ln.{i}.bias", [inner]) for i in shared])
    head = torch.stack([read(f"head.{i}.weight", [vocab, inner]) for i in shared])
    proj0 = read("proj.0.weight", [inner, spec.emb_dim])
    later = range(1, min(2, stages) if spec.tie_weights else stages)
    proj = (torch.stack([read(f"proj.{i}.weight", [inner, inner]) for i in later]) if len(later)
            else torch.empty(0, inner, inner, device=device, dtype=dtype))
    logger.info("read MLP speculator %s: %d stages, inner dim %d%s%s", name, stages, inner,
                ", tied weights" if spec.tie_weights else "", ", scaled input" if spec.scale_input else "")
    return MLPSpeculator(spec, emb, proj0, proj, ln_weight, ln_bias, head).eval()


# --- drafting -----------------------------------------------------------------------------------------------


class MLPSpeculatorDrafter:
    """Drafts with an MLP speculator for every request with a last hidden state; `fallback` (prompt lookup) for
    the others. See the module docstring for chains and trees."""

    def __init__(self, speculator: MLPSpeculator, fallback: Drafter | None, tree_width: int = 1,
                 name: str = "mlp") -> None:
        if tree_width < 1:
            raise ValueError(f"the draft tree width must be at least 1, got {tree_width}")
        self.speculator = speculator
        self.fallback = fallback
        self.tree_width = tree_width
        self.widths = speculator.config.head_widths(tree_width)
        self.name = name

    def method_for(self, request: RequestState) -> str:
        if request.last_hidden is not None:
            return "mlp"
        return self.fallback.method_for(request) if self.fallback is not None else "none"

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[Draft]:
        drafts: list[Draft] = [NO_DRAFT] * len(requests)
        members = [i for i, r in enumerate(requests) if r.last_hidden is not None and max_tokens[i] > 0]
        others = [i for i, r in enumerate(requests) if r.last_hidden is None]
        if members:
            proposed = self.draft([requests[i] for i in members], [max_tokens[i] for i in members])
            for i, draft in zip(members, proposed):
                drafts[i] = draft
        if others and self.fallback is not None:
            proposed = self.fallback.propose([requests[i] for i in others], [max_tokens[i] for i in others])
            for i, draft in zip(others, proposed):
                drafts[i] = draft
        return drafts

    @torch.inference_mode()
    def draft(self, requests: Sequence[RequestState], budgets: Sequence[int]) -> list[Draft]:
        """Drafts for requests that all have `last_hidden` and a budget >= 1, all evaluated together."""
        model = self.speculator
        device = model.proj0.device
        n = len(requests)
        budget = torch.tensor(budgets, dtype=torch.long)
        # The frontier: the nodes the next stage expands (first the roots), with their state, token, owner
        # (request), score and id (-1 for a root).
        state = model.initial_state(torch.stack([r.last_hidden for r in requests]).to(device))
        tokens = torch.tensor([int(r.token_ids[r.num_tokens - 1]) for r in requests], dtype=torch.long)
        owner = torch.arange(n)
        score = torch.zeros(n)
        node_id = torch.full((n,), -1, dtype=torch.long)
        # Every kept node, level by level: token, parent id, owner, score.
        kept_tokens, kept_parents, kept_owners, kept_scores = [], [], [], []
        num_nodes = 0
        for level in range(min(model.n_predict, max(budgets))):
            state, logits = model.stage(level, state, tokens.to(device))
            top = torch.log_softmax(logits, dim=-1).topk(self.widths[level], dim=-1)
            width = self.widths[level]
            values, indices = top.values.cpu().clamp(max=0.0), top.indices.cpu()  # [rows, width]
            # Candidates, in (row, rank) order: score desc within each owner, ties in that order.
            cand_score = (score.unsqueeze(1) + values).flatten()
            cand_owner = owner.repeat_interleave(width)
            order = torch.sort(-cand_score, stable=True).indices
            order = order[torch.sort(cand_owner[order], stable=True).indices]
            rank = torch.empty_like(order)
            counts = torch.bincount(cand_owner, minlength=n)
            starts = torch.cumsum(counts, 0) - counts
            rank[order] = torch.arange(order.numel()) - starts[cand_owner[order]]
            # No more than budget - level nodes of this level can be among the budget best (see the docstring).
            keep = order[rank[order] < (budget - level)[cand_owner[order]]]
            if keep.numel() == 0:
                break
            rows = torch.div(keep, width, rounding_mode="floor")
            tokens = indices.flatten()[keep]
            owner, score = cand_owner[keep], cand_score[keep]
            parents = node_id[rows]
            node_id = torch.arange(num_nodes, num_nodes + keep.numel())
            num_nodes += keep.numel()
            kept_tokens.append(tokens)
            kept_parents.append(parents)
            kept_owners.append(owner)
            kept_scores.append(score)
            state = state.index_select(0, rows.to(device))
        if not kept_tokens:
            return [NO_DRAFT] * len(requests)
        all_tokens, all_parents = torch.cat(kept_tokens), torch.cat(kept_parents)
        all_owners, all_scores = torch.cat(kept_owners), torch.cat(kept_scores)
        # The budget best nodes of each request: score desc, ties to the shallower (earlier) node, so parents
        # come before their children and the first k nodes always form a tree.
        order = torch.sort(-all_scores, stable=True).indices
        order = order[torch.sort(all_owners[order], stable=True).indices]
        counts = torch.bincount(all_owners, minlength=n)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel()) - starts[all_owners[order]]
        parent_position = torch.where(all_parents >= 0, position[all_parents.clamp(min=0)], -1)
        drafts = []
        for j in range(n):
            nodes = order[starts[j] : starts[j] + min(int(counts[j]), budgets[j])]
            node_tokens, node_parents = all_tokens[nodes], parent_position[nodes]
            if torch.equal(node_parents, torch.arange(-1, nodes.numel() - 1)):
                drafts.append(Draft(node_tokens))  # a chain
            else:
                drafts.append(Draft(node_tokens, node_parents))
        return drafts
