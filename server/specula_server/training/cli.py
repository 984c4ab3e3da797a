"""`specula-train`: trains speculators for any model the server can load, by self-distillation.

    specula-train medusa --model-id MODEL --prompts prompts.jsonl --output medusa/
    specula-train mlp    --model-id MODEL --prompts prompts.jsonl --output mlp-speculator/
    specula-train eagle3 --model-id MODEL --prompts prompts.jsonl --output eagle3/
    specula-train prompts --model-id MODEL --count 2000 --output prompts.jsonl

The base model (loaded as the server loads it) continues every prompt; the speculator learns those
continuations from the base model's hidden states. A chat model can write its own training prompts (`prompts`:
the user's messages it writes when its chat is opened at the user's turn). The output directory is ready for the
server: a Medusa adapter (`adapter_id` per request, or `--speculator` for all), an MLP speculator or an EAGLE-3
drafter (`--speculator`). It also holds `training.json`: the settings and the held-out top-1 accuracy of each
head before and after training.
Every option also reads an environment variable.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import random
import time
import typing
from collections.abc import Callable
from pathlib import Path

import torch
import typer

from specula_proto.choices import Device, Dtype, listed

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train Medusa heads, an MLP speculator or an EAGLE-3 drafter for a model, by self-distillation.")


def _common(  # the options every command shares (see `_command`)
    model_id: str = typer.Option(..., "--model-id", envvar="MODEL_ID",
                                 help="Base model: a local directory or a Hugging Face Hub id."),
    prompts: Path = typer.Option(..., "--prompts", envvar="PROMPTS", exists=True, dir_okay=False,
                                 help="Prompt file: JSON lines ({\"prompt\": ...} or strings) or one prompt per line."),
    output: Path = typer.Option(..., "--output", envvar="OUTPUT_DIR", file_okay=False,
                                help="Directory the checkpoint is written to."),
    revision: str | None = typer.Option(None, envvar="REVISION", help="Hub revision of the base model."),
    device: str = typer.Option(Device.CUDA.value if torch.cuda.is_available() else Device.CPU.value, envvar="DEVICE",
                               help=f"{listed(Device)}."),
    dtype: str | None = typer.Option(None, envvar="DTYPE",
                                        help="Base model dtype: float32 (CPU default), bfloat16 (CUDA default)."),
    save_dtype: str | None = typer.Option(None, envvar="SAVE_DTYPE",
                                             help="Checkpoint dtype (default: the base model's)."),
    max_prompts: int | None = typer.Option(None, envvar="MAX_PROMPTS", min=1, help="Use the first N prompts."),
    max_input_tokens: int = typer.Option(512, envvar="MAX_INPUT_TOKENS", min=1,
                                         help="Prompts are cut to their last N tokens."),
    max_new_tokens: int = typer.Option(128, envvar="MAX_NEW_TOKENS", min=8,
                                       help="Tokens the base model generates per prompt."),
    temperature: float = typer.Option(0.0, envvar="TEMPERATURE", min=0.0,
                                      help="0: greedy continuations (what greedy verification accepts)."),
    generation_batch_size: int = typer.Option(16, envvar="GENERATION_BATCH_SIZE", min=1,
                                              help="Prompts continued at once."),
    eval_fraction: float = typer.Option(0.1, envvar="EVAL_FRACTION", min=0.01, max=0.5,
                                       help="Share of the prompts held out for evaluation."),
    epochs: int = typer.Option(3, envvar="EPOCHS", min=1, help="Passes over the training samples."),
    batch_size: int = typer.Option(16, envvar="BATCH_SIZE", min=1, help="Samples per training step."),
    lr: float = typer.Option(1e-3, envvar="LR", min=0.0, help="Peak learning rate (AdamW, cosine decay)."),
    seed: int = typer.Option(0, envvar="SEED", help="Seeds the split, the shuffling and the initialisation."),
    states_cache_gb: float = typer.Option(1.0, envvar="STATES_CACHE_GB", min=0.0,
                                          help="Memory (GiB) keeping the base model's hidden states over the "
                                               "training samples between epochs; past it they are recomputed."),
    samples_cache: Path | None = typer.Option(
        None, envvar="SAMPLES_CACHE", dir_okay=False,
        help="File keeping the generated continuations: reused when it was made with the same model and "
             "generation settings, prompt by prompt for greedy ones (a grown prompt file generates only its new "
             "prompts) and for the same prompts when sampled (to train several speculators on one generation)."),
) -> None:
    ...


def _command(func: Callable[..., None]) -> Callable[..., None]:
    """Registers `func(own options..., common)` as a command taking its own options and `_common`'s."""
    def resolved(f: Callable) -> list[inspect.Parameter]:  # annotations are strings here (future import)
        hints = typing.get_type_hints(f)
        return [p.replace(annotation=hints[p.name]) for p in inspect.signature(f).parameters.values()
                if p.name != "common"]

    own, shared = resolved(func), resolved(_common)

    @functools.wraps(func)
    def command(**kwargs) -> None:
        func(**{p.name: kwargs.pop(p.name) for p in own}, common=kwargs)

    command.__signature__ = inspect.Signature(own + shared)  # what typer reads the options from
    command.__annotations__ = {p.name: p.annotation for p in own + shared}
    return app.command()(command)


def _load_generator(args: dict):
    """The base model, loaded as the server loads it (`args["dtype"]` set to the dtype used)."""
    from specula_server.distributed import ShardGroup
    from specula_server.server import DTYPES as SERVER_DTYPES
    from specula_server.server import ServerConfig, load_generator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dtype = args["dtype"] = args["dtype"] or (Dtype.BFLOAT16 if args["device"] == Device.CUDA else Dtype.FLOAT32)
    if dtype not in SERVER_DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(SERVER_DTYPES)}; got {dtype!r}")
    config = ServerConfig(model_id=args["model_id"], uds_path="/tmp/unused", revision=args["revision"], dtype=dtype,
                          device=args["device"])
    return load_generator(config, ShardGroup())[0]


def _prepare(args: dict):
    """Loads the base model, self-distills the prompts and splits them; returns what the trainers need."""
    from specula_server.params import SamplingParams
    from specula_server.training.data import HiddenStates, generate_samples, read_prompts

    texts = read_prompts(args["prompts"])[: args["max_prompts"]]
    if len(texts) < 4:
        raise typer.BadParameter(f"--prompts {args['prompts']}: {len(texts)} prompts; at least 4 are needed")
    generator = _load_generator(args)
    dtype = args["dtype"]
    sampling = SamplingParams(do_sample=True, temperature=args["temperature"], seed=args["seed"]) \
        if args["temperature"] > 0 else SamplingParams()
    key = {k: str(args[k]) for k in ("model_id", "revision", "dtype", "max_input_tokens", "max_new_tokens",
                                     "temperature", "seed")}
    if args["temperature"] > 0:  # a sampled continuation's seed is its prompt's place in the file
        key["prompts"] = texts
    cache: Path | None = args["samples_cache"]
    kept = _cached_samples(cache, key) if cache is not None else {}
    missing = list(dict.fromkeys(t for t in texts if t not in kept))
    if missing:
        started = time.monotonic()
        made = generate_samples(generator, generator.tokenizer, missing, args["max_input_tokens"],
                                args["max_new_tokens"], args["generation_batch_size"], sampling)
        typer.echo(f"generated {sum(s.token_ids.numel() - s.prompt_len for s in made)} tokens for "
                   f"{len(made)} prompts in {time.monotonic() - started:.0f}s")
        kept |= dict(zip(missing, made))
        if cache is not None:
            torch.save({"key": key, "samples": {t: (s.token_ids.tolist(), s.prompt_len) for t, s in kept.items()}},
                       cache)
    if len(missing) < len(set(texts)):
        typer.echo(f"reusing the continuations of {len(set(texts)) - len(missing)} prompts from {cache}")
    samples = [kept[t] for t in texts]
    generator.kv_cache = None  # the training forwards use a scratch cache of their own
    random.Random(args["seed"]).shuffle(samples)
    held_out = max(1, int(len(samples) * args["eval_fraction"]))
    model = generator.model
    longest = max(s.token_ids.numel() for s in samples)
    hidden_states = HiddenStates(model, longest * args["batch_size"], cache_bytes=int(args["states_cache_gb"] * 2**30))
    hidden_size = model.config.hidden_size
    eye = torch.eye(hidden_size, dtype=model.norm.weight.dtype, device=model.norm.weight.device)
    with torch.inference_mode():
        lm_head_weight = model.compute_logits(eye).T.contiguous()  # [vocab, hidden], whatever the head's packing
    return samples[held_out:], samples[:held_out], hidden_states, lm_head_weight.clone(), dtype


def _cached_samples(cache: Path, key: dict) -> dict:
    """The continuations `cache` keeps by prompt, when it was made with the same settings (`key`); {} otherwise.
    Greedy continuations are reused prompt by prompt, so a prompt file that grew generates only its new prompts."""
    from specula_server.training.data import Sample

    if not cache.is_file():
        return {}
    saved = torch.load(cache)
    saved_key, samples = dict(saved["key"]), saved["samples"]
    if isinstance(samples, list):  # the earlier layout: one list in the order of the key's prompts
        samples = dict(zip(saved_key["prompts"], samples))
        if "prompts" not in key:
            del saved_key["prompts"]
    if saved_key != key:
        return {}
    return {text: Sample(torch.tensor(ids), prompt_len) for text, (ids, prompt_len) in samples.items()}


def _finish(args: dict, kind: str, trainee, report, dtype: str, extra: dict, save) -> None:
    from specula_server.server import DTYPES as SERVER_DTYPES

    save_dtype = args["save_dtype"] or dtype
    if save_dtype not in SERVER_DTYPES:
        raise typer.BadParameter(f"--save-dtype must be one of {', '.join(SERVER_DTYPES)}; got {save_dtype!r}")
    output: Path = args["output"]
    save(output, SERVER_DTYPES[save_dtype])
    summary = {
        "kind": kind, "base_model": args["model_id"], "steps": report.steps, "final_loss": report.final_loss,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in args.items()} | extra,
        "held_out": {
            "top1_before": report.before.accuracy(), "top1_after": report.after.accuracy(),
            "chained_before": report.before.chained_accuracy(), "chained_after": report.after.chained_accuracy(),
            "mean_accepted_before": report.before.mean_accepted(),
            "mean_accepted_after": report.after.mean_accepted(),
        },
    }
    (output / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    held = summary["held_out"]
    typer.echo("held-out top-1 per head: " + " ".join(f"{a:.3f}" for a in held["top1_before"]) + " untrained -> "
               + " ".join(f"{a:.3f}" for a in held["top1_after"]) + " trained")
    typer.echo(f"expected accepted drafts per step (chain): {held['mean_accepted_before']:.2f} -> "
               f"{held['mean_accepted_after']:.2f}")
    typer.echo(f"wrote {output}")


@_command
def medusa(
    num_heads: int = typer.Option(3, "--num-heads", envvar="MEDUSA_NUM_HEADS", min=1, max=10,
                                  help="Heads: head h guesses the token h + 2 places ahead."),
    num_layers: int = typer.Option(1, "--num-layers", envvar="MEDUSA_NUM_LAYERS", min=1,
                                   help="Residual blocks per head."),
    layout: str = typer.Option("fasterdecoding", envvar="MEDUSA_LAYOUT",
                               help="fasterdecoding: each head has its own LM head; lorax-v2: heads reuse the "
                                    "base LM head (far smaller)."),
    common: dict | None = None,
) -> None:
    """Medusa heads (FasterDecoding or LoRAX v2 layout)."""
    from specula_server.training.speculators import MedusaTrainee
    from specula_server.training.trainer import train

    if layout not in ("fasterdecoding", "lorax-v2"):
        raise typer.BadParameter(f"--layout must be fasterdecoding or lorax-v2; got {layout!r}")
    train_samples, eval_samples, hidden_states, lm_head, dtype = _prepare(common)
    trainee = MedusaTrainee(lm_head, num_heads, num_layers, own_lm_heads=layout == "fasterdecoding").to(lm_head.device)
    report = train(trainee, train_samples, eval_samples, hidden_states, _settings(common))
    _finish(common, "medusa", trainee, report, dtype, dict(num_heads=num_heads, num_layers=num_layers, layout=layout),
            lambda out, save_dtype: trainee.save(out, common["model_id"], save_dtype))


@_command
def mlp(
    n_predict: int = typer.Option(3, "--n-predict", envvar="MLP_N_PREDICT", min=1, max=10,
                                  help="Stages: stage i guesses the token i + 1 places after the last one."),
    inner_dim: int | None = typer.Option(None, "--inner-dim", envvar="MLP_INNER_DIM", min=8,
                                            help="Width of the speculator's state (default: the model's hidden size)."),
    tie_weights: bool = typer.Option(False, "--tie-weights/--no-tie-weights", envvar="MLP_TIE_WEIGHTS",
                                     help="Share embedding, norm and head over the stages (a much smaller file)."),
    scale_input: bool = typer.Option(True, "--scale-input/--no-scale-input", envvar="MLP_SCALE_INPUT",
                                     help="RMS-normalise the base hidden state first."),
    top_k_tokens_per_head: str = typer.Option("4,3,2", envvar="MLP_TOP_K_TOKENS_PER_HEAD",
                                              help="Candidates per stage for tree drafting (written to config.json)."),
    n_candidates: int = typer.Option(5, envvar="MLP_N_CANDIDATES", min=1,
                                     help="Candidate paths kept (written to config.json)."),
    common: dict | None = None,
) -> None:
    """An MLP speculator (IBM layout, `model_type: mlp_speculator`)."""
    from specula_server.training.speculators import MLPSpeculatorTrainee
    from specula_server.training.trainer import train

    try:
        top_k = [int(k) for k in top_k_tokens_per_head.split(",")]
    except ValueError:
        raise typer.BadParameter(f"--top-k-tokens-per-head must be comma-separated integers; got "
                                 f"{top_k_tokens_per_head!r}") from None
    if len(top_k) < n_predict:
        top_k += [top_k[-1]] * (n_predict - len(top_k))
    train_samples, eval_samples, hidden_states, lm_head, dtype = _prepare(common)
    trainee = MLPSpeculatorTrainee(lm_head, inner_dim or lm_head.shape[1], n_predict, tie_weights, scale_input,
                                   seed=common["seed"]).to(lm_head.device)
    report = train(trainee, train_samples, eval_samples, hidden_states, _settings(common))
    extra = dict(n_predict=n_predict, inner_dim=trainee.inner_dim, tie_weights=tie_weights, scale_input=scale_input)
    _finish(common, "mlp_speculator", trainee, report, dtype, extra,
            lambda out, save_dtype: trainee.save(out, common["model_id"], save_dtype, top_k[:n_predict],
                                                 n_candidates))


@_command
def eagle3(
    draft_vocab_size: int = typer.Option(32000, "--draft-vocab-size", envvar="EAGLE3_DRAFT_VOCAB_SIZE", min=2,
                                         help="Draft vocabulary: the tokens most frequent in the continuations "
                                              "(at most the model's vocabulary)."),
    layer_ids: str | None = typer.Option(None, "--layer-ids", envvar="EAGLE3_LAYER_IDS",
                                            help="Target layers whose outputs the drafter reads, comma-separated "
                                                 "(default: 2, L // 2, L - 3 of an L-layer model, or its last "
                                                 "three for a shallow one)."),
    steps: int = typer.Option(3, "--steps", envvar="EAGLE3_STEPS", min=1, max=10,
                              help="Training-time test depth: step s learns the token s + 2 places ahead."),
    norm_before_residual: bool = typer.Option(False, "--norm-before-residual/--no-norm-before-residual",
                                              envvar="EAGLE3_NORM_BEFORE_RESIDUAL",
                                              help="The draft layer's residual is the normed input state."),
    common: dict | None = None,
) -> None:
    """An EAGLE-3 drafter (the `speculators` layout, `speculators_model_type: eagle3`)."""
    from specula_server.hub import resolve_model_dir
    from specula_server.training import eagle3 as training
    from specula_server.training.trainer import train

    train_samples, eval_samples, hidden_states, lm_head, dtype = _prepare(common)
    model = hidden_states.model
    num_layers = model.config.num_layers
    try:
        ids = tuple(int(i) for i in layer_ids.split(",")) if layer_ids else training.default_layer_ids(num_layers)
    except ValueError:
        raise typer.BadParameter(f"--layer-ids must be comma-separated integers; got {layer_ids!r}") from None
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
        raise typer.BadParameter(f"--layer-ids {list(ids)}: distinct layer ids in [0, {num_layers}] are needed")
    draft_ids = training.choose_draft_vocabulary(train_samples, model.config.vocab_size,
                                                 min(draft_vocab_size, model.config.vocab_size)).to(lm_head.device)
    trainee = training.Eagle3Trainee(model, lm_head, draft_ids, ids, steps, norm_before_residual,
                                     seed=common["seed"]).to(lm_head.device)
    aux_states = training.Eagle3HiddenStates(hidden_states, ids)
    report = train(trainee, train_samples, eval_samples, aux_states, _settings(common))
    verifier_dir = resolve_model_dir(common["model_id"], common["revision"], None)
    extra = dict(draft_vocab_size=int(draft_ids.numel()), layer_ids=list(ids), steps=steps,
                 norm_before_residual=norm_before_residual)
    _finish(common, "eagle3", trainee, report, dtype, extra,
            lambda out, save_dtype: trainee.save(out, verifier_dir, common["model_id"], save_dtype))


@app.command()
def prompts(
    model_id: str = typer.Option(..., "--model-id", envvar="MODEL_ID",
                                 help="A chat model: a local directory or a Hugging Face Hub id."),
    output: Path = typer.Option(..., "--output", envvar="OUTPUT", dir_okay=False,
                                help="JSON-lines file written: one {\"prompt\", \"message\"} per line, the prompt "
                                     "the message rendered by the chat template (for --prompts)."),
    count: int = typer.Option(1000, "--count", envvar="PROMPT_COUNT", min=1, help="Distinct messages to write."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", envvar="MAX_NEW_TOKENS", min=8,
                                       help="A message the model has not ended within this many tokens is dropped."),
    temperature: float = typer.Option(1.0, "--temperature", envvar="TEMPERATURE", min=0.01,
                                      help="Sampling temperature of the messages."),
    top_p: float = typer.Option(0.95, "--top-p", envvar="TOP_P", min=0.01, max=1.0,
                                help="Nucleus sampling of the messages."),
    chat_template: str | None = typer.Option(None, "--chat-template", envvar="CHAT_TEMPLATE",
                                             help="A template file or text replacing the model's chat template."),
    revision: str | None = typer.Option(None, envvar="REVISION", help="Hub revision of the model."),
    device: str = typer.Option(Device.CUDA.value if torch.cuda.is_available() else Device.CPU.value, envvar="DEVICE",
                               help=f"{listed(Device)}."),
    dtype: str | None = typer.Option(None, envvar="DTYPE",
                                     help="Model dtype: float32 (CPU default), bfloat16 (CUDA default)."),
    generation_batch_size: int = typer.Option(48, envvar="GENERATION_BATCH_SIZE", min=1,
                                              help="Messages sampled at once."),
    seed: int = typer.Option(0, envvar="SEED", help="Seeds the sampling (one seed per message from it)."),
) -> None:
    """Training prompts written by the model itself: its chat opened at the user's turn, it writes the user's
    message (the Magpie method), so a drafter can be trained for a chat model without a dataset. Messages it does
    not end itself are dropped, each kept once."""
    from specula_router.chat_template import load_chat_template
    from specula_server.hub import resolve_model_dir
    from specula_server.params import SamplingParams
    from specula_server.training.data import synthesize_prompts, user_turn_prefix

    template = load_chat_template(resolve_model_dir(model_id, revision, None), chat_template)
    if template is None:
        raise typer.BadParameter(f"--model-id {model_id}: the model has no chat template; give --chat-template")
    prefix = user_turn_prefix(lambda messages: template.render(messages, add_generation_prompt=False))
    generator = _load_generator(dict(model_id=model_id, revision=revision, device=device, dtype=dtype))
    started = time.monotonic()
    messages = synthesize_prompts(generator, generator.tokenizer, prefix, count, max_new_tokens,
                                  generation_batch_size,
                                  SamplingParams(do_sample=True, temperature=temperature, top_p=top_p, seed=seed))
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as f:
        for message in messages:
            prompt = template.render([{"role": "user", "content": message}], add_generation_prompt=True)
            f.write(json.dumps({"prompt": prompt, "message": message}) + "\n")
    typer.echo(f"wrote {len(messages)} prompts to {output} in {time.monotonic() - started:.0f}s")


def _settings(common: dict):
    from specula_server.training.trainer import TrainingSettings

    return TrainingSettings(epochs=common["epochs"], batch_size=common["batch_size"], lr=common["lr"],
                            seed=common["seed"])
