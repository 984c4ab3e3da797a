"""Draft-model speculation: a small causal LM with the target's tokenizer drafts the next tokens.

The draft model keeps its own paged KV cache in the worker: as many blocks of the same size as the target's,
addressed by the same slots (`RequestState.slots`), so the router's block allocation covers both and nothing
is allocated per request. `RequestState.draft_cached` counts the request's tokens (from the first) whose
draft KV is written. A decode step that verifies `k` drafts of a request:

    catch up   one forward over the tokens the draft has not seen (after prefill: the whole prompt and the
               first token; after a step: the accepted drafts it did not run over and the target's own
               token), all requests together; its last row gives q_1
    draft      x_j ~ q_j (argmax for greedy requests), then a forward over x_j at position n + j - 1 gives
               q_(j+1): k - 1 one-token forwards, requests batched, each dropping out once it has its k
    commit     after verification the draft's KV is valid up to the last accepted draft it ran over:
               `draft_cached = min(n + k - 1, num_tokens - 1)`; the target's own token (correction or bonus)
               is always run over by the next step's catch-up before anything is drafted from it

KV written at positions past the committed tokens (drafts the target rejected) is never read: the valid count
stops before it and the next catch-up overwrites it, as for the target's cache.

q_j is the draft's distribution after the request's own sampling processing (logit bias, penalties with the
draft prefix in the history, temperature, top-k/p, typical-p: `Sampler.process`), and x_j is drawn from it with the
request's own generator; verification accepts x_j with probability min(1, p_j(x_j) / q_j(x_j)) and otherwise
samples from norm(max(0, p_j - q_j)) (`verify.py`), so the output distribution is exactly the target's.
Greedy requests take the draft's argmax (of its biased logits, when the request has a bias: the drafts then
avoid what the target is biased against) and are verified by the plain greedy rule.

Tensor parallelism: the draft model is sharded like the target, so every rank computes the same logits (the LM
head gathers them) and consumes every request's generator the same way: ranks draft the same tokens.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import tokenizers
import torch

from specula_server.batch import build_step
from specula_server.distributed import ShardGroup
from specula_server.kv_cache import KVCache
from specula_server.models.config import ModelConfig
from specula_server.models.llama import LlamaForCausalLM
from specula_server.request import RequestState
from specula_server.sampling import DRAFT_STREAM, Sampler, SamplingRow
from specula_server.speculation.drafters import Draft

logger = logging.getLogger("specula.speculation")

# model_type values of the causal LMs the server loads (the Llama family, see models/).
DRAFT_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


def is_causal_lm_dir(path: Path) -> bool:
    """Whether `path` holds a causal LM (a `config.json` whose architecture ends in ForCausalLM, or whose
    model_type is one the server loads) rather than Medusa heads, a LoRA adapter (which may carry its base
    model's config.json) or another speculator."""
    config = Path(path) / "config.json"
    if not config.is_file() or (Path(path) / "adapter_config.json").is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict) or "medusa_num_heads" in raw:
        return False
    architectures = raw.get("architectures") or []
    return (bool(architectures) and str(architectures[0]).endswith("ForCausalLM")) \
        or raw.get("model_type") in DRAFT_MODEL_TYPES


def find_draft_model(speculator_id: str, cache_dir: Path | None = None, revision: str | None = None) -> Path | None:
    """The local directory of `speculator_id` (a directory or a Hub id) when it is a causal LM, else None.

    For a Hub id only `config.json` is fetched first; the model's files only when it names a causal LM. A Hub id
    that cannot be fetched gives None, so the caller's other loaders report the error.
    """
    local = Path(speculator_id).expanduser()
    if local.is_dir():
        return local if is_causal_lm_dir(local) else None
    from specula_server.hub import ModelNotFoundError, is_offline_from_env, resolve_model_dir, snapshot

    token, offline = os.environ.get("HF_TOKEN") or None, is_offline_from_env()
    try:
        config_dir = snapshot(speculator_id, revision, cache_dir, token, ("config.json",), offline)
    except ModelNotFoundError as error:
        logger.debug("--speculator %s: no config.json from the Hub (%s)", speculator_id, error.reason)
        return None
    if not is_causal_lm_dir(config_dir):
        return None
    logger.info("fetching draft model %s", speculator_id)
    return resolve_model_dir(speculator_id, revision, cache_dir)


def load_draft_model(
    path: Path,
    speculator_id: str,
    target_id: str,
    target_config: ModelConfig,
    target_tokenizer: tokenizers.Tokenizer | None,
    target_eos: frozenset[int],
    dtype: torch.dtype,
    device: torch.device,
    group: ShardGroup,
) -> DraftModelDrafter:
    """Checks the draft model's tokenizer against the target's (before reading any weight), then loads it
    sharded like the target."""
    from specula_server.hub import weight_files
    from specula_server.models import build_model
    from specula_server.tokens import eos_token_ids, load_tokenizer
    from specula_server.weights import Weights

    if target_tokenizer is None:
        raise ValueError(f"--speculator {speculator_id}: checking a draft model needs the target's tokenizer")
    draft_config = ModelConfig.from_dir(path)
    draft_tokenizer = load_tokenizer(path)
    draft_eos = eos_token_ids(path, {"eos_token_id": list(draft_config.eos_token_ids)})
    check_same_tokenizer(target_id, target_tokenizer, target_config.vocab_size, target_eos,
                         speculator_id, draft_tokenizer, draft_config.vocab_size, draft_eos)
    if draft_config.max_position_embeddings < target_config.max_position_embeddings:
        logger.warning("draft model %s has %d positions, the target %d: requests past them are not drafted",
                       speculator_id, draft_config.max_position_embeddings, target_config.max_position_embeddings)
    weights = Weights(weight_files(path), device, dtype, rank=group.rank, world_size=group.world_size)
    try:
        model = build_model(draft_config, weights, group)
    except ValueError as error:
        raise ValueError(f"--speculator {speculator_id}: cannot load the draft model: {error}") from error
    logger.info("draft model %s (%s, %d layers) loaded on %s, shard %d/%d", speculator_id,
                draft_config.architecture, draft_config.num_layers, device, group.rank, group.world_size)
    return DraftModelDrafter(model, device, speculator_id)


def check_same_tokenizer(
    target_name: str, target_tokenizer: tokenizers.Tokenizer, target_vocab_size: int, target_eos: frozenset[int],
    draft_name: str, draft_tokenizer: tokenizers.Tokenizer, draft_vocab_size: int, draft_eos: frozenset[int],
) -> None:
    """Refuses a draft model whose token ids do not mean what the target's mean; the message names both models
    and what differs. Token ids are all the two models exchange, so the vocabularies (with added and special
    tokens) and the logits' width must be equal; normalisers and pre-tokenisers do not matter."""
    problems = []
    if target_vocab_size != draft_vocab_size:
        problems.append(f"vocab_size {target_vocab_size} (target) vs {draft_vocab_size} (draft)")
    target_vocab = target_tokenizer.get_vocab(with_added_tokens=True)
    draft_vocab = draft_tokenizer.get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        only_target = sorted(set(target_vocab.items()) - set(draft_vocab.items()), key=lambda kv: kv[1])
        only_draft = sorted(set(draft_vocab.items()) - set(target_vocab.items()), key=lambda kv: kv[1])
        problems.append(
            f"tokenizer vocabularies differ ({len(target_vocab)} vs {len(draft_vocab)} entries; "
            f"{len(only_target)} token/id pairs only in the target's, e.g. {only_target[:3]}, "
            f"{len(only_draft)} only in the draft's, e.g. {only_draft[:3]})"
        )

    def specials(tokenizer: tokenizers.Tokenizer) -> dict[int, str]:
        return {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    if specials(target_tokenizer) != specials(draft_tokenizer):
        problems.append(f"special tokens {specials(target_tokenizer)} (target) vs {specials(draft_tokenizer)} "
                        "(draft)")
    if target_eos and draft_eos and not target_eos & draft_eos:
        problems.append(f"eos token ids {sorted(target_eos)} (target) vs {sorted(draft_eos)} (draft)")
    elif target_eos != draft_eos:
        logger.warning("draft model %s lists eos token ids %s, the target %s lists %s; the target's decide when "
                       "a request stops", draft_name, sorted(draft_eos), target_name, sorted(target_eos))
    if problems:
        raise ValueError(f"--speculator {draft_name} cannot draft for {target_name}: a draft model needs the "
                         f"target's tokenizer, but: " + "; ".join(problems))


class DraftModelDrafter:
    """Drafts with a small causal LM over its own paged KV cache (see the module docstring).

    `propose` only says how many tokens each request could draft (`Draft.pending`); once the controller has
    chosen, the generator calls `draft` with exactly those counts.
    """

    name = "draft_model"

    def __init__(self, model: LlamaForCausalLM, device: torch.device, model_name: str = "draft model") -> None:
        self.model = model
        self.device = device
        self.model_name = model_name
        self.dtype = model.norm.weight.dtype
        self.sampler = Sampler()
        self.kv_cache: KVCache | None = None

    # --- KV cache (sized and allocated by the generator, beside the target's) -----------------------------

    def bytes_per_block(self, block_size: int) -> int:
        cfg = self.model.config
        return KVCache.bytes_per_block(cfg.num_layers, self.model.num_kv_heads, cfg.head_dim, block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = None  # release the old cache before allocating the new one
        cfg = self.model.config
        self.kv_cache = KVCache.allocate(num_blocks, block_size, cfg.num_layers, self.model.num_kv_heads,
                                         cfg.head_dim, self.dtype, self.device)

    def release_kv_cache(self) -> None:
        self.kv_cache = None

    # --- the Drafter interface ------------------------------------------------------------------------------

    def method_for(self, request: RequestState) -> str:
        return self.name

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[Draft]:
        """Pending drafts: up to the cap, within the draft model's own positions (the catch-up runs over
        positions up to n - 1, the drafts' forwards over n .. n + k - 2)."""
        limit = self.model.config.max_position_embeddings
        empty = torch.empty(0, dtype=torch.long)
        return [Draft(empty, pending=max(0, min(k, limit - r.num_tokens + 1))) for r, k in zip(requests, max_tokens)]

    @torch.inference_mode()
    def draft(self, requests: Sequence[RequestState], lengths: Sequence[int]) -> list[Draft]:
        """Exactly `lengths[i] >= 1` draft tokens for request i, with q for sampling requests.

        Writes the drafts into each request's token buffer past its tokens (where verification reads them) and
        advances `draft_cached` to the KV the draft has now written; the generator cuts it back to the accepted
        tokens after verification.
        """
        assert self.kv_cache is not None, "the draft model's KV cache is not allocated"
        assert all(k >= 1 for k in lengths)
        kv = self.kv_cache.layers
        lengths = list(lengths)
        n0 = [r.num_tokens for r in requests]
        for r, n in zip(requests, n0):  # the target's last token at least is always new to the draft
            r.draft_cached = min(r.draft_cached, n - 1)
        step = build_step(requests, [r.draft_cached for r in requests],
                          [n - r.draft_cached for r, n in zip(requests, n0)], self.device)
        hidden = self.model(step.input_ids, step.positions, kv, step.attn)
        logits = self.model.compute_logits(hidden[step.last_rows])  # [B, vocab]: q_1 of every request

        tokens: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))  # requests whose next draft `logits` rows (in order) give
        for j in range(max(lengths)):
            rows = [SamplingRow(requests[i].spec.sampling, requests[i].token_ids[: n0[i] + j], requests[i].generator,
                                DRAFT_STREAM) for i in active]
            if all(row.params.is_plain_greedy for row in rows):
                logprobs, chosen = None, logits.argmax(dim=-1)
            else:
                logprobs = self.sampler.process(logits, rows)
                chosen = self.sampler.choose(logprobs, rows)
            for a, (i, token) in enumerate(zip(active, chosen.tolist())):
                r = requests[i]
                r.token_ids[n0[i] + j] = token  # the buffer tail past num_tokens is free: drafts go there
                tokens[i].append(token)
                if logprobs is not None and not r.spec.sampling.is_greedy:
                    qs[i].append(logprobs[a].exp())
            active = [i for i in active if lengths[i] > j + 1]
            if not active:
                break
            members = [requests[i] for i in active]
            step = build_step(members, [n0[i] + j for i in active], [1] * len(active), self.device)
            hidden = self.model(step.input_ids, step.positions, kv, step.attn)
            logits = self.model.compute_logits(hidden)

        drafts = []
        for i, r in enumerate(requests):
            r.draft_cached = n0[i] + lengths[i] - 1  # x_1 .. x_(k-1) were run over; x_k was not
            q = torch.stack(qs[i]) if qs[i] else None
            drafts.append(Draft(torch.tensor(tokens[i], dtype=torch.long), q=q))
        return drafts
