"""Self-distillation data: the base model's own continuations of a prompt file, and its hidden states over them.

A speculator is only as good as its agreement with the model it drafts for, so it learns from that model's
own outputs: the base model (loaded exactly as the server loads it) continues every prompt, and the heads
learn to predict those continuations from the base model's final-normed hidden states. Greedy continuations
(the default) teach exactly what greedy verification accepts.

Only the generated part is learned from. At position t the server's drafter sees the hidden state the token
at t + 1 was chosen from; it must guess the tokens at t + 2, t + 3, ... as the base model would continue.
Inside the prompt those tokens are the prompt's, not the model's choices, so positions count from the last
prompt position on (`Sample.first_position`).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import tokenizers
import torch
from tqdm.auto import tqdm

from specula_server.batch import build_step
from specula_server.generator import TextGenerator
from specula_server.kv_cache import KVCache
from specula_server.models.llama import LlamaForCausalLM
from specula_server.params import SamplingParams, StoppingParams
from specula_server.request import RequestSpec, StepPlan

logger = logging.getLogger("specula.training")


def read_prompts(path: Path) -> list[str]:
    """Prompts from a file: JSON lines (a string, or an object with `prompt`, `inputs` or `text`) when the
    file ends in `.jsonl`, else one prompt per non-empty line."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix != ".jsonl":
        return [line for line in text.splitlines() if line.strip()]
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        if isinstance(item, dict):
            item = next((item[k] for k in ("prompt", "inputs", "text") if k in item), None)
        if not isinstance(item, str) or not item:
            raise ValueError(f"{path}:{number}: expected a string or an object with a 'prompt', 'inputs' or "
                             "'text' string")
        prompts.append(item)
    return prompts


@dataclass(frozen=True)
class Sample:
    """One prompt and the base model's continuation of it."""

    token_ids: torch.Tensor  # [length] long: prompt then generated tokens
    prompt_len: int

    @property
    def first_position(self) -> int:
        """First position whose hidden state a drafter reads (the last prompt token's)."""
        return self.prompt_len - 1


def encode_prompt(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    """A prompt's ids as a request's would be: with the tokenizer's special tokens (a BOS), unless the text already
    begins with them, as a prompt rendered by a chat template that writes its own BOS does (the router encodes
    those without adding another: a second BOS would train on a context no request has)."""
    ids = tokenizer.encode(text, add_special_tokens=True).ids
    plain = tokenizer.encode(text, add_special_tokens=False).ids
    added = len(ids) - len(plain)
    return plain if added > 0 and plain[:added] == ids[:added] else ids


def generate_samples(
    generator: TextGenerator,
    tokenizer: tokenizers.Tokenizer,
    prompts: Sequence[str],
    max_input_tokens: int,
    max_new_tokens: int,
    batch_size: int,
    sampling: SamplingParams | None = None,
    progress: bool = True,
) -> list[Sample]:
    """The base model continues every prompt (kept to its last `max_input_tokens` tokens, `encode_prompt`),
    `batch_size` at a time, through the worker's own steps."""
    block_size = generator.block_size
    per_request = -(-(max_input_tokens + max_new_tokens) // block_size)
    generator.allocate_kv_cache(per_request * batch_size)
    encoded = [encode_prompt(tokenizer, p)[-max_input_tokens:] for p in prompts]
    samples: list[Sample] = []
    bar = tqdm(total=len(encoded), desc="generating", unit="prompt", disable=not progress)
    for first in range(0, len(encoded), batch_size):
        chunk = [ids for ids in encoded[first : first + batch_size] if ids]
        specs = [
            RequestSpec(
                id=i,
                input_ids=tuple(ids),
                # A seed per prompt, so sampled data is reproducible whatever the batch size.
                sampling=replace(sampling or SamplingParams(), seed=(sampling or SamplingParams()).seed + first + i),
                stopping=StoppingParams(max_new_tokens),
                blocks=tuple(range(i * per_request, (i + 1) * per_request)),
            )
            for i, ids in enumerate(chunk)
        ]
        generated: dict[int, list[int]] = {s.id: [] for s in specs}
        plan = StepPlan(new=specs)
        while True:  # the requests join in the first step and leave on their own when they finish
            for out in generator.step(plan).outputs:
                if out.error:
                    raise RuntimeError(f"generating training data failed: {out.error}")
                generated[out.request_id].extend(t.id for t in out.tokens)
            if not generator.requests:
                break
            plan = StepPlan()
        for spec in specs:
            ids = list(spec.input_ids) + generated[spec.id]
            samples.append(Sample(torch.tensor(ids, dtype=torch.long), len(spec.input_ids)))
        bar.update(len(chunk))
    bar.close()
    generator.reset()
    return samples


USER_MARK = "\x00"  # stands for the user's message when the chat template renders a conversation's start


def user_turn_prefix(render: Callable[[list[dict]], str]) -> str:
    """The text a chat opens with up to where the user's first message goes (the system prompt the template adds
    by default, the user turn's header): `render(messages)` is the model's chat template, without a generation
    prompt."""
    text = render([{"role": "user", "content": USER_MARK}])
    if USER_MARK not in text:
        raise ValueError("the chat template does not write the user's message; no prompts can be synthesized")
    return text[: text.index(USER_MARK)]


def synthesize_prompts(
    generator: TextGenerator,
    tokenizer: tokenizers.Tokenizer,
    prefix: str,
    count: int,
    max_new_tokens: int,
    batch_size: int,
    sampling: SamplingParams,
    progress: bool = True,
    max_tries: int = 6,
) -> list[str]:
    """`count` distinct user messages the model writes itself when its chat stops at the user turn (`prefix`,
    `user_turn_prefix`), sampled with `sampling`, a seed each (`sampling.seed`, the next, ...): an
    instruction-tuned model continues there with the kind of request it was tuned on (the Magpie method). Kept:
    messages the model ended itself (an end-of-sequence token within `max_new_tokens`), at least 8 characters,
    each once. Sampled `batch_size` at a time until `count` are kept; raises after `max_tries * count` samples (a
    model without a chat tuning rarely ends a turn)."""
    kept: dict[str, None] = {}
    tried = 0
    bar = tqdm(total=count, desc="synthesizing prompts", unit="prompt", disable=not progress)
    while len(kept) < count:
        if tried >= max_tries * count:
            raise RuntimeError(f"the model ended {len(kept)} distinct user messages of {count} asked for in {tried} "
                               f"samples; is it a chat model, and is max_new_tokens ({max_new_tokens}) enough?")
        samples = generate_samples(generator, tokenizer, [prefix] * batch_size, max_input_tokens=len(prefix) + 1,
                                   max_new_tokens=max_new_tokens, batch_size=batch_size,
                                   sampling=replace(sampling, seed=sampling.seed + tried), progress=False)
        tried += batch_size
        for sample in samples:
            generated = sample.token_ids[sample.prompt_len :].tolist()
            if not generated or generated[-1] not in generator.eos_token_ids:
                continue
            text = tokenizer.decode(generated[:-1], skip_special_tokens=True).strip()
            if len(text) >= 8 and text not in kept and len(kept) < count:
                kept[text] = None
                bar.update(1)
    bar.close()
    return list(kept)


class HiddenStates:
    """Final-normed hidden states of the base model over whole samples, in one forward per batch.

    Uses the model's own paged-attention forward with a scratch KV cache large enough for one batch. States are
    kept (on the model's device) for later epochs until they take `cache_bytes`; past that they are recomputed.
    """

    def __init__(self, model: LlamaForCausalLM, max_tokens: int, block_size: int = 16,
                 cache_bytes: int = 2**30) -> None:
        self.model = model
        self.block_size = block_size
        self.cache_bytes = cache_bytes
        self._cache: dict[int, tuple[Sample, torch.Tensor]] = {}  # id(sample) -> (the sample, kept alive; its states)
        self._cached_bytes = 0
        num_blocks = -(-max_tokens // block_size)
        cfg = model.config
        device = model.norm.weight.device
        self.kv_cache = KVCache.allocate(num_blocks, block_size, cfg.num_layers, model.num_kv_heads, cfg.head_dim,
                                         model.norm.weight.dtype, device)
        self.device = device

    def __call__(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Per sample, `[length, hidden]` float32 (a plain tensor, usable as a training input)."""
        if all(id(s) in self._cache for s in samples):
            return [self._cache[id(s)][1] for s in samples]
        states = self._forward(samples)
        for sample, state in zip(samples, states):
            size = state.numel() * state.element_size()
            if id(sample) not in self._cache and self._cached_bytes + size <= self.cache_bytes:
                self._cache[id(sample)] = (sample, state)
                self._cached_bytes += size
        return states

    @torch.no_grad()  # not inference mode: the states are inputs of a trained module
    def _forward(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        lengths = [s.token_ids.numel() for s in samples]
        if sum(lengths) > self.kv_cache.num_slots:
            raise ValueError(f"{sum(lengths)} tokens do not fit the {self.kv_cache.num_slots}-token scratch cache")
        offsets = torch.tensor([0] + lengths).cumsum(0).tolist()
        requests = [
            SimpleNamespace(token_ids=s.token_ids, slots=torch.arange(offsets[i], offsets[i + 1], device=self.device))
            for i, s in enumerate(samples)
        ]
        step = build_step(requests, [0] * len(samples), lengths, self.device)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache.layers, step.attn).float()
        return [hidden[offsets[i] : offsets[i + 1]].clone() for i in range(len(samples))]


@dataclass
class TrainingBatch:
    """Samples padded to one length: what a speculator trainer consumes."""

    hidden: torch.Tensor  # [b, n, hidden] float32: base hidden state at each position
    tokens: torch.Tensor  # [b, n] long: the token at each position (0 past a sample's end)
    valid: torch.Tensor  # [b, n] bool: positions whose hidden state a drafter reads (see the module docstring)
    lengths: torch.Tensor  # [b] long

    def target_mask(self, ahead: int) -> torch.Tensor:
        """`[b, n]`: positions t whose token t + ahead exists (the label of a guess `ahead` tokens on)."""
        n = self.tokens.shape[1]
        positions = torch.arange(n, device=self.tokens.device).unsqueeze(0)
        return self.valid & (positions + ahead < self.lengths.unsqueeze(1))

    def shifted_tokens(self, ahead: int) -> torch.Tensor:
        """`[b, n]`: the token at t + ahead (0 where there is none)."""
        shifted = torch.zeros_like(self.tokens)
        if ahead < self.tokens.shape[1]:
            shifted[:, : self.tokens.shape[1] - ahead] = self.tokens[:, ahead:]
        return shifted


def batches(samples: Sequence[Sample], hidden_states: HiddenStates, batch_size: int, shuffle: bool,
            seed: int = 0) -> Iterator[TrainingBatch]:
    order = list(range(len(samples)))
    if shuffle:
        random.Random(seed).shuffle(order)
    for first in range(0, len(order), batch_size):
        chosen = [samples[i] for i in order[first : first + batch_size]]
        states = hidden_states(chosen)
        n = max(s.token_ids.numel() for s in chosen)
        b = len(chosen)
        hidden = torch.zeros(b, n, states[0].shape[-1], device=states[0].device)
        tokens = torch.zeros(b, n, dtype=torch.long, device=states[0].device)
        valid = torch.zeros(b, n, dtype=torch.bool, device=states[0].device)
        for i, (sample, state) in enumerate(zip(chosen, states)):
            length = sample.token_ids.numel()
            hidden[i, :length] = state
            tokens[i, :length] = sample.token_ids.to(tokens.device)
            valid[i, sample.first_position : length] = True
        lengths = torch.tensor([s.token_ids.numel() for s in chosen], device=tokens.device)
        yield TrainingBatch(hidden, tokens, valid, lengths)
