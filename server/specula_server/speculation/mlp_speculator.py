"""MLP speculators (IBM, arXiv 2404.19124) as a drafter: a small recurrent MLP on the base model's last hidden
state, served for every request with `--speculator PATH_OR_HUB_ID` (its checkpoint: `mlp_speculator_checkpoint.py`).

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

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from specula_server.request import RequestState
from specula_server.speculation.drafters import NO_DRAFT, Draft, Drafter

if TYPE_CHECKING:
    from specula_server.speculation.mlp_speculator_checkpoint import MLPSpeculatorConfig

LN_EPS = 1e-6  # fms-extras' LayerNormParameterized default, for the stage norms and the scale_input norm


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
            order, _, _, rank = _rank_within_owner(cand_score, cand_owner, n)
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
        order, starts, counts, position = _rank_within_owner(all_scores, all_owners, n)
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


def _rank_within_owner(scores: torch.Tensor, owners: torch.Tensor, num_owners: int):
    """Nodes ordered by owner, then score descending (ties in index order): `(order, starts, counts, rank)`, with
    `order` the node indices in that order, `starts`/`counts` each owner's span in it, `rank[i]` node i's place
    within its owner's span."""
    order = torch.sort(-scores, stable=True).indices
    order = order[torch.sort(owners[order], stable=True).indices]
    counts = torch.bincount(owners, minlength=num_owners)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel()) - starts[owners[order]]
    return order, starts, counts, rank
