"""Specula against vLLM's CPU build and llama.cpp's `llama-server` on a real model, SmolLM2-135M-Instruct, over
OpenAI's chat completions route, side by side.

The model is the Q4_1 GGUF of `specula_testing.real_model`. Each server serves the same weights:

    specula*     the GGUF itself (dequantized to float32 at load; `--quantize` where a setting asks for it:
                 `specula-gguf` serves the file's own Q4_1 layers and Q8_0 embedding, as `llamacpp-q4_1` does)
    vllm*        a float32 safetensors directory written from the same dequantized tensors, with the tokenizer,
                 chat template and config Specula derives from the file
    llamacpp-*   the GGUF: `q4_1` the file as it is, `f32` and `q8_0` made from it by `llama-quantize
                 --allow-requantize` (f32 holds exactly the file's values; q8_0 requantizes them)

Three kinds of greedy chat requests (temperature 0, `--max-tokens`, ending at EOS as chats do), written from real
text: rewriting a standard-library function with a renamed parameter (the answer copies most of the prompt),
summarizing a standard-library docstring, and open questions (nothing to copy). Each concurrency level sends
distinct prompts (nothing cached from an earlier level): `--requests-per-stream` per stream, `c` streams.

Scheme (2 cores: one server at a time). A round starts each setting in turn, warms it up on unmeasured prompts,
runs every kind at every level, and stops it; the order of the settings is reversed every other round. Reported:
completion tokens/s per (setting, kind, level), the median over rounds; ratios of Specula's settings to each peer
setting as the median of per-round ratios (paired); and beside every ratio the share of prompts whose answer is
identical to the answer of the baseline (`specula`, speculation off, float32). With `--stream` the answers are
streamed, and each cell also records its median time to first token and decode rate after it (a prompt's prefill
apart from the decode).

    python benchmark/real_model.py --settings specula specula-ngram specula-suffix vllm vllm-ngram \\
        llamacpp-f32 llamacpp-f32-ngram --rounds 2 --json benchmark/results/real_model.json

EAGLE-3 (`specula-eagle3`, and vLLM serving the same drafter, `vllm-eagle3`; `--eagle3 DIR`) needs a drafter
trained for this model; `--write-training-prompts FILE` writes chat prompts of the same three kinds from other
sources (other modules' functions and docstrings, other questions: none is a benchmark prompt), rendered with the
model's chat template, for `specula-train eagle3`:

    python benchmark/real_model.py --write-training-prompts work/eagle3-prompts.jsonl --training-prompts 160
    specula-train eagle3 --model-id ~/.cache/specula/real-model/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts work/eagle3-prompts.jsonl --output work/eagle3 --draft-vocab-size 8192
    python benchmark/real_model.py --settings specula specula-ngram specula-suffix specula-eagle3 \\
        --eagle3 work/eagle3 --rounds 2

Peers are set up as `benchmark/peers.py --help` describes (vLLM in `/work/peers/vllm-venv`, llama.cpp's server
built from the `llama-cpp-python` source package).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load import free_port, start_launcher  # noqa: E402  (puts the repo's packages on the path)
from peers import LLAMA_SERVER, Server, start_llamacpp, start_vllm, stop, wait_healthy  # noqa: E402

KINDS = ("rewrite", "summary", "question")
DRAFTS = 4
# Each setting: which server, and its flags. Specula's speculation: prompt lookup (`ngram`) or suffix trees with
# prompt lookup behind them; vLLM's n-gram proposer; llama.cpp's simple n-gram drafting.
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "specula": ("specula", []),
    "specula-ngram": ("specula", ["--speculative-tokens", str(DRAFTS)]),
    "specula-suffix": ("specula", ["--speculative-tokens", str(DRAFTS), "--speculator", "suffix"]),
    "specula-eagle3": ("specula", ["--speculative-tokens", str(DRAFTS), "--speculator", "{eagle3}"]),
    # EAGLE-3 with its draft layer, fc and head in int8 (a third of the bytes a draft).
    "specula-eagle3-int8": ("specula", ["--speculative-tokens", str(DRAFTS), "--speculator", "{eagle3}",
                                        "--speculator-quantize", "int8"]),
    # The same, every request drafting 3 tokens at every step (no adaptive controller): what the drafter can give.
    "specula-eagle3-int8-fixed": ("specula", ["--speculative-tokens", "3", "--speculator", "{eagle3}",
                                              "--speculator-quantize", "int8", "--speculation-mode", "fixed"]),
    # EAGLE-3 drafting trees (top-3 expansion), the best 6 nodes verified.
    "specula-eagle3-tree": ("specula", ["--speculative-tokens", "6", "--speculator", "{eagle3}",
                                        "--draft-tree-width", "3"]),
    "specula-int8": ("specula", ["--quantize", "int8"]),
    # int8 weights by int8 activations: the arithmetic of llama.cpp's q8_0 products.
    "specula-w8a8": ("specula", ["--quantize", "w8a8"]),
    "specula-w8a8-ngram": ("specula", ["--quantize", "w8a8", "--speculative-tokens", str(DRAFTS)]),
    "specula-int4": ("specula", ["--quantize", "int4", "--quantize-group-size", "32"]),
    "specula-gguf": ("specula", ["--quantize", "gguf"]),
    # One setting above with one decode step per Step call (--num-scheduler-steps; the default runs up to 4).
    "specula-steps1": ("specula", ["--num-scheduler-steps", "1"]),
    "specula-gguf-steps1": ("specula", ["--quantize", "gguf", "--num-scheduler-steps", "1"]),
    "vllm": ("vllm", []),
    "vllm-ngram": ("vllm", ["--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_max": 4, "prompt_lookup_min": 1})]),
    "vllm-eagle3": ("vllm", ["--speculative-config", json.dumps(
        {"method": "eagle3", "model": "{eagle3}", "num_speculative_tokens": DRAFTS})]),
    "llamacpp-f32": ("llamacpp:f32", []),
    "llamacpp-f32-ngram": ("llamacpp:f32", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                            "--spec-ngram-simple-size-m", str(DRAFTS)]),
    "llamacpp-q8_0": ("llamacpp:q8_0", []),
    "llamacpp-q8_0-ngram": ("llamacpp:q8_0", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                              "--spec-ngram-simple-size-m", str(DRAFTS)]),
    "llamacpp-q4_1": ("llamacpp:q4_1", []),
}
QUESTIONS = [
    "Why do leaves change colour in autumn?", "How does a refrigerator keep food cold?",
    "What causes the tides?", "Why is the sea salty?", "How do bees make honey?", "What is a black hole?",
    "Why do we have seasons?", "How does a vaccine work?", "What makes a rainbow appear?",
    "How do airplanes stay in the air?", "Why do cats purr?", "What is the difference between weather and climate?",
    "How does the internet send a message from one computer to another?", "Why do onions make people cry?",
    "What is photosynthesis?", "How do volcanoes form?", "Why is the sky dark at night?",
    "What does a central bank do?", "How do magnets work?", "Why do we dream?", "What is inflation?",
    "How does a compass find north?", "Why does ice float on water?", "What is the water cycle?",
    "How do plants know which way is up?", "What is an atom made of?", "Why do stars twinkle?",
    "How does a battery store energy?", "What is the greenhouse effect?", "Why do birds migrate?",
    "How does a microwave oven heat food?", "What causes earthquakes?", "Why is exercise good for the heart?",
    "How do noise-cancelling headphones work?", "What is a prime number?", "Why does bread rise?",
    "How do fish breathe under water?", "What is the speed of light, and why does it matter?",
    "Why do we yawn?", "How is glass made?", "What is machine learning?", "Why do apples turn brown?",
    "How do submarines dive and surface?", "What is a democracy?",
]


# -- the prompts ------------------------------------------------------------------------------------------------


REWRITE_MODULES = ("textwrap", "string", "shlex", "csv", "difflib", "json.decoder", "json.encoder", "inspect",
                   "posixpath", "fnmatch", "base64", "calendar", "heapq", "glob")
SUMMARY_MODULES = ("argparse", "asyncio", "collections", "dataclasses", "functools", "logging", "pathlib",
                   "subprocess", "threading", "typing", "inspect", "json")
# EAGLE-3 training prompts: other modules than the benchmark's.
TRAINING_REWRITE_MODULES = ("shutil", "tokenize", "pprint", "random", "ntpath", "zipfile", "tarfile", "email.utils",
                            "urllib.parse", "html", "ast", "locale", "gettext", "configparser", "bisect", "statistics",
                            "fractions", "ipaddress", "uuid", "tempfile", "filecmp", "mimetypes", "quopri",
                            "sysconfig", "platform", "copy", "dis", "pydoc", "traceback", "warnings", "os",
                            "genericpath", "linecache", "codecs", "operator", "keyword", "colorsys", "wave")
TRAINING_SUMMARY_MODULES = ("email", "http.client", "urllib.request", "unittest", "shutil", "tarfile", "zipfile",
                            "enum", "contextlib", "os", "socket", "tempfile", "configparser", "xml.etree.ElementTree",
                            "random", "statistics", "heapq", "queue", "sched", "selectors", "smtplib", "ftplib",
                            "imaplib", "pickle", "shelve", "sqlite3", "string", "textwrap", "traceback", "weakref")
TRAINING_SUBJECTS = [
    "a rainbow", "the moon's phases", "a thunderstorm", "a hurricane", "coral reefs", "the human eye", "a telescope",
    "a bicycle gear", "a steam engine", "an electric motor", "a solar panel", "a wind turbine", "a nuclear reactor",
    "the immune system", "sleep", "memory", "a glacier", "a desert", "the ozone layer", "a lighthouse",
    "a printing press", "paper money", "a stock market", "a library", "a spider's web", "a snowflake", "a geyser",
    "the northern lights", "a thermometer", "a barometer", "a camera lens", "a hearing aid", "a pacemaker",
    "a satellite", "GPS", "a 3D printer", "a refrigerator's compressor", "an elevator", "a suspension bridge",
    "a dam", "a canal lock", "a sailboat", "a hot-air balloon", "a helicopter", "a rocket", "a jet engine",
    "a compass", "an hourglass", "a pendulum clock", "a piano", "a violin", "the human voice", "an echo",
    "a rain forest", "a tide pool", "an octopus", "a chameleon", "a bat's sonar", "a beehive", "an ant colony",
    "a tree's roots", "a seed", "yeast", "cheese", "chocolate", "coffee", "tea", "salt", "sugar", "a kidney",
    "the liver", "the lungs", "blood", "a bone", "a muscle", "a tooth", "hair", "skin", "a fingerprint",
    "a river delta", "a cave", "a sand dune", "a mountain range", "a coral atoll", "quicksand", "a waterfall",
    "fog", "hail", "lightning", "a tornado", "a monsoon", "the jet stream", "a comet", "an asteroid", "Mars",
    "Jupiter", "Saturn's rings", "the sun", "a solar eclipse", "a meteor shower", "the Milky Way", "a neutron star",
    "a microscope", "an X-ray machine", "an MRI scanner", "a stethoscope", "an antibiotic", "a virus",
    "a bacterium", "DNA", "a cell membrane", "the heart's valves", "the brain", "a nerve", "the stomach",
    "the skeleton", "an allergy", "a fever", "a scab", "a spider", "a shark", "a whale", "a penguin",
    "an owl", "a bat", "a snake", "a frog", "a butterfly", "a firefly", "a jellyfish", "a starfish", "a mushroom",
    "moss", "a cactus", "a sunflower", "a Venus flytrap", "bamboo", "a lichen", "a pearl", "a diamond",
    "gold", "iron", "copper wire", "rubber", "plastic", "concrete", "steel", "a brick", "paper", "soap",
    "a candle", "a match", "fireworks", "a light bulb", "an LED", "a transistor", "a computer chip",
    "a hard drive", "a keyboard", "a touch screen", "a QR code", "a barcode scanner", "Wi-Fi", "Bluetooth",
    "a search engine", "email", "a password", "encryption", "a spreadsheet", "a database", "a web browser",
    "a radio", "a television", "a telephone", "a loudspeaker", "a microphone", "a typewriter", "a sewing machine",
    "a washing machine", "a dishwasher", "a toaster", "a kettle", "a pressure cooker", "an oven thermostat",
    "a lock and key", "a zipper", "a parachute", "a seatbelt", "an airbag", "a traffic light", "a roundabout",
    "a train signal", "a tunnel", "a skyscraper", "an escalator", "a windmill", "a water wheel", "a well",
    "a water tower", "a sewer", "a recycling plant", "compost", "a greenhouse", "a beekeeper's smoker",
    "a farm tractor", "irrigation", "crop rotation", "bread yeast", "pasteurization", "a vaccine trial",
    "a census", "a tax", "a loan", "interest on savings", "an insurance policy", "a budget", "a market price",
    "a trade union", "an election", "a court trial", "a constitution", "a map", "a time zone", "a calendar",
    "a leap year", "the metric system", "a museum", "a newspaper", "a dictionary", "an orchestra",
    "a choir", "a drum", "a guitar", "a painting", "a sculpture", "a photograph", "a film camera", "animation",
    "a board game", "chess", "a marathon", "swimming", "a bicycle helmet", "a yoga class", "meditation",
]
TRAINING_FORMS = ["How does {} work?", "Explain {} to a beginner.", "What is special about {}?",
                  "Describe {} in a few sentences.", "What would happen without {}?", "Why does {} matter?",
                  "What is {} made of?", "What are the main parts of {}?", "How did people first come up with {}?",
                  "What are some common misconceptions about {}?"]


def _modules(names):
    import importlib

    return [importlib.import_module(name) for name in names]


def rewrite_prompts(count: int, modules=REWRITE_MODULES) -> list[str]:
    """Standard-library functions of 200-1200 characters with a parameter to rename, as chat requests."""
    found = []
    for module in _modules(modules):
        for _name, function in sorted(vars(module).items()):
            if not inspect.isfunction(function) or function.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(function)
            except OSError:  # made at run time (namedtuple methods, ...)
                continue
            parameters = [p for p in inspect.signature(function).parameters if p not in ("self", "cls")]
            if 200 <= len(source) <= 1200 and parameters and len(parameters[0]) > 1:
                old = parameters[0]
                found.append(f"Rewrite this Python function so that its parameter `{old}` is called `{old}_value`"
                             f" everywhere. Reply with the code only.\n\n```python\n{source}```")
    if len(found) < count:
        raise SystemExit(f"only {len(found)} rewrite prompts; asked for {count}")
    return found[:count]


def docstring_paragraphs(modules, exclude: frozenset[str] = frozenset()) -> list[str]:
    """The paragraphs of 200-1000 characters of the modules' docstrings and their members', whitespace joined."""
    paragraphs = []
    for module in _modules(modules):
        for _, member in sorted(vars(module).items()):
            doc = inspect.getdoc(member) if callable(member) or inspect.ismodule(member) else None
            for paragraph in (doc or "").split("\n\n"):
                text = " ".join(paragraph.split())
                if 200 <= len(text) <= 1000 and text not in paragraphs and text not in exclude:
                    paragraphs.append(text)
    return paragraphs


def summary_prompts(count: int, modules=SUMMARY_MODULES, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Paragraphs of standard-library docstrings, each to summarize, spread over what `modules` hold."""
    paragraphs = docstring_paragraphs(modules, exclude)
    if len(paragraphs) < count:
        raise SystemExit(f"only {len(paragraphs)} summary prompts; asked for {count}")
    step = len(paragraphs) // count
    return [f"Summarize this in two sentences:\n\n{paragraphs[i * step]}" for i in range(count)]


def training_prompts(count: int, gguf: Path, questions: int | None = None) -> list[str]:
    """`count` chat prompts of each kind (`questions` open questions, if given) from sources the benchmark does
    not use, rendered as the server renders chats (the model's chat template, the generation prompt added),
    the kinds taking turns."""
    from transformers import AutoTokenizer

    from specula_server.hub import resolve_model_dir

    questions = count if questions is None else questions
    asked = [form.format(subject) for subject in TRAINING_SUBJECTS for form in TRAINING_FORMS]
    asked = [q for q in asked if q not in QUESTIONS]
    if len(asked) < questions:
        raise SystemExit(f"only {len(asked)} training questions; asked for {questions}")
    kinds = [rewrite_prompts(count, TRAINING_REWRITE_MODULES),
             summary_prompts(count, TRAINING_SUMMARY_MODULES, frozenset(docstring_paragraphs(SUMMARY_MODULES))),
             [asked[i * len(asked) // questions] for i in range(questions)]]  # spread over subjects and forms
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(str(gguf)))
    mixed = [text for row in itertools.zip_longest(*kinds) for text in row if text is not None]
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True) for text in mixed]


def chat_ids(model, texts: Sequence[str]) -> list[list[int]]:
    """`texts` as user messages, rendered and tokenized as the router does (the model's chat template, the
    generation prompt added): the prompt ids of the in-process benchmarks that drive the worker directly."""
    from specula_router.chat_template import load_chat_template
    from specula_server.hub import resolve_model_dir
    from specula_server.tokens import load_tokenizer

    model_dir = resolve_model_dir(str(model))
    template, tokenizer = load_chat_template(model_dir), load_tokenizer(model_dir)
    return [tokenizer.encode(template.render([{"role": "user", "content": text}]), add_special_tokens=False).ids
            for text in texts]


def level_size(c: int, per_stream: int) -> int:
    """Requests at concurrency `c`: `per_stream` per stream, and at least 3 (one stream alone is noisy)."""
    return max(3, c * per_stream)


def make_prompts(levels: list[int], per_stream: int, kinds: Sequence[str] = KINDS
                 ) -> dict[str, dict[int, list[str]]]:
    """Distinct prompts per kind (of `kinds`) and level, and at level 0 the warm-up prompts no level uses."""
    total = sum(level_size(c, per_stream) for c in levels) + max(levels)
    every = {}
    if "rewrite" in kinds:
        every["rewrite"] = rewrite_prompts(total)
    if "summary" in kinds:
        every["summary"] = summary_prompts(total)
    if "question" in kinds:  # repeated questions would hit prefix caches: each is made distinct
        every["question"] = [q if i < len(QUESTIONS) else f"{q} Answer as if to a child of {5 + i // len(QUESTIONS)}."
                             for i, q in enumerate((QUESTIONS * (total // len(QUESTIONS) + 1))[:total])]
    prompts: dict[str, dict[int, list[str]]] = {}
    for kind, texts in every.items():
        prompts[kind], base = {0: texts[-max(levels):]}, 0  # level 0: the warm-up prompts
        for c in levels:
            prompts[kind][c] = texts[base:base + level_size(c, per_stream)]
            base += level_size(c, per_stream)
    return prompts


# -- the servers ------------------------------------------------------------------------------------------------


def write_float_dir(gguf: Path, out: Path) -> Path:
    """The GGUF's dequantized tensors as float32 safetensors, with the config and tokenizer Specula derives."""
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file

    from specula_server.gguf_checkpoint import GGUFTensors
    from specula_server.hub import resolve_model_dir

    out.mkdir(parents=True, exist_ok=True)
    meta = resolve_model_dir(str(gguf))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_text((meta / name).read_text())
    tensors = GGUFTensors(gguf)
    save_file({name: tensors.get_tensor(name) for name in tensors.keys()}, str(out / "model.safetensors"))
    return out


def requantized_gguf(gguf: Path, kind: str, llama_server: Path, work: Path) -> Path:
    """`gguf` as it is (`q4_1`), or converted to `kind` by the tree's `llama-quantize --allow-requantize`."""
    if kind == "q4_1":
        return gguf
    out = work / f"{gguf.stem}.{kind}.gguf"
    if not out.is_file():
        quantize = llama_server.parent / "llama-quantize"
        subprocess.run([str(quantize), "--allow-requantize", str(gguf), str(out), kind.upper()], check=True,
                       capture_output=True)
    return out


@dataclass
class Context:
    args: argparse.Namespace
    gguf: Path
    float_dir: Path
    work: Path


def start(setting: str, ctx: Context, max_concurrency: int) -> Server:
    server, flags = SETTINGS[setting]
    if any("{eagle3}" in f for f in flags):
        if ctx.args.eagle3 is None:
            raise SystemExit(f"{setting} needs --eagle3 DIR (a drafter trained for this model)")
        flags = [f.replace("{eagle3}", str(ctx.args.eagle3.resolve())) for f in flags]
    ctx.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{setting}-", dir=ctx.work))  # its own sockets and log, every turn
    if server == "specula":
        port = free_port()
        extra = ["--max-concurrent-requests", str(4 * max_concurrency), "--dtype", "float32", *flags]
        proc = start_launcher(ctx.gguf, port, work, extra)
        return Server("specula", proc, f"http://127.0.0.1:{port}", work / "server.log", "tgi", "ignore_eos_token")
    if server == "vllm":
        return start_vllm(ctx.float_dir, work, ctx.args.vllm_python, {}, flags, False)
    kind = server.split(":")[1]
    gguf = requantized_gguf(ctx.gguf, kind, ctx.args.llama_server, ctx.work)
    slot_tokens = 1024 + ctx.args.max_tokens
    return start_llamacpp(gguf, work, ctx.args.llama_server, ctx.args.llama_threads, max_concurrency, slot_tokens,
                          ["--jinja", *flags])


# -- the load ---------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    text: str
    tokens: int
    ttft: float = float("nan")  # seconds to the first streamed token (`--stream`)
    seconds: float = float("nan")  # the whole request

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first (`--stream`): the decode alone, without the prompt's prefill."""
        return (self.tokens - 1) / (self.seconds - self.ttft) if self.tokens > 1 else float("nan")


async def chat(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int, stream: bool) -> Answer:
    body = {"model": server.model or "tgi", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        response = await client.post(f"{server.url}/v1/chat/completions", json=body, timeout=1800)
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {response.text[:500]}")
        data = response.json()
        return Answer(data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"])
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    begin, ttft, text, tokens = time.perf_counter(), None, "", 0
    async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=1800) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            delta = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta and ttft is None:
                ttft = time.perf_counter() - begin
            text += delta or ""
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return Answer(text, tokens, ttft if ttft is not None else float("nan"), time.perf_counter() - begin)


async def run_level(server: Server, prompts: list[str], concurrency: int, max_tokens: int,
                    stream: bool = False) -> tuple[float, list[Answer]]:
    """`concurrency` clients sending their share of `prompts` one after another: (tokens/s, answers)."""
    per_stream = len(prompts) // concurrency
    answers: dict[int, Answer] = {}
    # Streamed, a connection per request: llama-server may close one after a streamed answer, and a request sent
    # on it as it closes fails (httpx reuses idle connections).
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0 if stream else None)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one_stream(c: int) -> None:
            for k in range(per_stream):
                i = c * per_stream + k
                answers[i] = await chat(client, server, prompts[i], max_tokens, stream)

        begin = time.perf_counter()
        await asyncio.gather(*(one_stream(c) for c in range(concurrency)))
        wall = time.perf_counter() - begin
    return sum(a.tokens for a in answers.values()) / wall, [answers[i] for i in range(len(answers))]


SPECULATION_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def speculation_counters(server: Server) -> dict[str, float]:
    """Specula's speculation counters from its /metrics, summed over labels: request steps that verified drafts,
    draft tokens verified, draft tokens accepted ({} for the peers)."""
    if server.name != "specula":
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    totals = dict.fromkeys(SPECULATION_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("specula_").removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
    return totals


def speculation_report(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a cell's requests drafted: verifying request steps, drafts per such step, accepted per draft."""
    if not before:
        return {}
    drafts, tokens, accepted = (after[k] - before[k] for k in SPECULATION_COUNTERS)
    return {"verifying_request_steps": drafts, "drafts_per_verifying_step": tokens / drafts if drafts else 0.0,
            "accepted_per_draft": accepted / tokens if tokens else 0.0}


def run_turn(setting: str, ctx: Context, prompts: dict[str, dict[int, list[str]]]) -> dict:
    levels = ctx.args.concurrency
    server = start(setting, ctx, max(levels))
    try:
        wait_healthy(server, ctx.args.startup_timeout)
        for c in levels:  # warm-up: short answers at every level
            asyncio.run(run_level(server, prompts[ctx.args.kinds[-1]][0][:c], c, 8, ctx.args.stream))
        result: dict = {}
        for kind in ctx.args.kinds:
            for c in levels:
                before = speculation_counters(server)
                rate, answers = asyncio.run(run_level(server, prompts[kind][c], c, ctx.args.max_tokens,
                                                      ctx.args.stream))
                drafting = speculation_report(before, speculation_counters(server))
                result[f"{kind}/{c}"] = {"tokens_per_s": rate, "answers": [a.text for a in answers], **drafting}
                shown = (f", {drafting['verifying_request_steps']:.0f} request steps verified drafts "
                         f"({drafting['drafts_per_verifying_step']:.2f} drafts, {drafting['accepted_per_draft']:.0%} "
                         "accepted)") if drafting else ""
                if ctx.args.stream:
                    result[f"{kind}/{c}"] |= {"ttft_ms": 1e3 * statistics.median(a.ttft for a in answers),
                                              "decode_tokens_per_s": statistics.median(a.decode_rate for a in answers)}
                    shown += (f"; first token {result[f'{kind}/{c}']['ttft_ms']:.0f} ms, then "
                              f"{result[f'{kind}/{c}']['decode_tokens_per_s']:.1f} tok/s a request (medians)")
                print(f"  {setting} {kind} c={c}: {rate:.1f} tok/s{shown}", flush=True)
    finally:
        stop(server)
    return result


# -- the report -------------------------------------------------------------------------------------------------


def agreement(answers: list[str], baseline: list[str]) -> float:
    return sum(a == b for a, b in zip(answers, baseline)) / max(1, len(baseline))


def summarize(rounds: list[dict[str, dict]], settings: list[str]) -> dict:
    cells = list(rounds[0][settings[0]])
    summary: dict = {"tokens_per_s": {}, "identical": {}, "ratios": {}}
    for s in settings:
        summary["tokens_per_s"][s] = {cell: statistics.median(r[s][cell]["tokens_per_s"] for r in rounds)
                                      for cell in cells}
        if "specula" in settings:
            summary["identical"][s] = {cell: statistics.mean(agreement(r[s][cell]["answers"],
                                                                       r["specula"][cell]["answers"]) for r in rounds)
                                       for cell in cells}
    ours = [s for s in settings if s.startswith("specula")]
    for a in ours:
        for b in settings:
            if b.startswith("specula") and not (b == "specula" and a != b):  # peers, and Specula without speculation
                continue
            summary["ratios"][f"{a}/{b}"] = {cell: statistics.median(
                r[a][cell]["tokens_per_s"] / r[b][cell]["tokens_per_s"] for r in rounds) for cell in cells}
    return summary


def print_table(summary: dict, settings: list[str]) -> None:
    cells = list(summary["tokens_per_s"][settings[0]])
    print("\n| setting | " + " | ".join(cells) + " |")
    print("|---|" + "---|" * len(cells))
    for s in settings:
        values = summary["tokens_per_s"][s]
        same = summary["identical"].get(s, {})
        print(f"| {s} | " + " | ".join(f"{values[c]:.1f}" + (f" ({same[c]:.0%})" if same else "")
                                       for c in cells) + " |")
    for pair, values in summary["ratios"].items():
        print(f"| {pair} | " + " | ".join(f"{values[c]:.2f}x" for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=["specula", "specula-ngram", "vllm"])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stream", action="store_true", help="stream the answers, and report each cell's median "
                        "time to first token and decode rate after it (tokens/s a request) beside its tokens/s")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, help="where the float32 directory and requantized GGUFs are kept "
                                                  "(default: a temporary directory)")
    parser.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    parser.add_argument("--llama-server", type=Path, default=Path(LLAMA_SERVER))
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--eagle3", type=Path, help="the EAGLE-3 drafter specula-eagle3 serves")
    parser.add_argument("--write-training-prompts", type=Path, metavar="FILE",
                        help="write EAGLE-3 training prompts (JSON lines) and exit")
    parser.add_argument("--training-prompts", type=int, default=160, help="training prompts of each kind")
    parser.add_argument("--training-questions", type=int, help="open questions among them (default: "
                                                               "--training-prompts)")
    args = parser.parse_args()

    from specula_testing.real_model import fetch_smollm2

    gguf = fetch_smollm2()
    if args.write_training_prompts:
        texts = training_prompts(args.training_prompts, gguf, args.training_questions)
        args.write_training_prompts.parent.mkdir(parents=True, exist_ok=True)
        args.write_training_prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        print(f"{len(texts)} prompts in {args.write_training_prompts}")
        return
    with tempfile.TemporaryDirectory(prefix="real-model-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        float_dir = write_float_dir(gguf, work / "float32") if any(
            SETTINGS[s][0] == "vllm" for s in args.settings) else work
        ctx = Context(args, gguf, float_dir, work)
        prompts = make_prompts(args.concurrency, args.requests_per_stream, args.kinds)
        rounds: list[dict[str, dict]] = []
        for r in range(args.rounds):
            order = args.settings if r % 2 == 0 else list(reversed(args.settings))
            print(f"round {r}: {' '.join(order)}", flush=True)
            rounds.append({s: run_turn(s, ctx, prompts) for s in order})
        summary = summarize(rounds, args.settings)
        print_table(summary, args.settings)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "summary": summary, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
