"""The launcher end to end: the demo model by default, tensor parallelism, a dying shard, and a graceful SIGTERM.

Process model under test (TGI's): the launcher starts one shard per rank and the router; if any child dies it
stops the others and exits non-zero naming the child; on SIGTERM it stops the router first, which finishes the
requests in flight, then the shards, and exits 0.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from stack import LauncherProcess, is_alive
from tokenizers import Tokenizer
from wire import REQUEST_TIMEOUT_S, generate, metric, sse_events, wait_until

from specula_launcher.defaults import DEMO_MODEL_DIR

PROMPTS = ["The quick brown fox", "héllo wörld, 漢字", "def main():\n    return"]



def details(base_url: str, inputs: str, **parameters) -> dict:
    r = generate(base_url, inputs, details=True, **parameters)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("inputs", PROMPTS)
def test_two_shards_generate_what_one_shard_generates(server, tp_server, inputs):
    info = httpx.get(f"{tp_server.url}/info", timeout=REQUEST_TIMEOUT_S).json()
    assert info["num_shard"] == 2
    for parameters in ({"max_new_tokens": 40, "ignore_eos_token": True, "decoder_input_details": True},
                       {"max_new_tokens": 40, "do_sample": True, "temperature": 1.3, "seed": 7}):
        one, two = details(server.url, inputs, **parameters), details(tp_server.url, inputs, **parameters)
        assert two["generated_text"] == one["generated_text"]
        assert [t["id"] for t in two["details"]["tokens"]] == [t["id"] for t in one["details"]["tokens"]]
        for a, b in zip(one["details"]["tokens"] + one["details"]["prefill"][1:],
                        two["details"]["tokens"] + two["details"]["prefill"][1:]):
            assert b["logprob"] == pytest.approx(a["logprob"], abs=1e-3)
    stream = httpx.post(f"{tp_server.url}/generate_stream", timeout=REQUEST_TIMEOUT_S,
                        json={"inputs": inputs, "parameters": {"max_new_tokens": 10, "ignore_eos_token": True}})
    assert sse_events(stream.text)[-1]["generated_text"] == details(server.url, inputs, max_new_tokens=10,
                                                                     ignore_eos_token=True)["generated_text"]


def test_a_killed_shard_stops_the_launcher_with_an_error_naming_it(launch):
    launcher = launch("--num-shard", "2")
    children = launcher.children()
    assert set(children) == {"shard-0", "shard-1", "router"}, children
    prefix = launcher.shard_uds_path()  # in a directory of the launcher's own (no --shard-uds-path given)
    sockets = [Path(f"{prefix}-{rank}") for rank in range(2)]
    assert all(s.exists() for s in sockets)

    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", f"{launcher.url}/generate_stream", json={
                "inputs": PROMPTS[0], "parameters": {"max_new_tokens": 1500, "ignore_eos_token": True}}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")  # in flight when the shard dies
            os.kill(children["shard-1"], signal.SIGKILL)
            code = launcher.wait(timeout=60)
            # The in-flight stream ends (an error event, or the connection closes) instead of hanging.
            events = []
            try:
                events = [line for line in lines if line.startswith("data:")]
            except httpx.HTTPError:
                pass
            assert not any('"generated_text": "' in e for e in events), "the stream finished normally"

    output = launcher.output(tail=None)
    assert code == 1, output
    assert "shard-1 exited unexpectedly (killed by SIGKILL)" in output, output
    assert "shard-1 failed" in output  # followed by the tail of its output
    wait_until(lambda: not any(is_alive(pid) for pid in children.values()), timeout=10,
               what="every child to be gone")
    assert not any(s.exists() for s in sockets), "stale shard sockets left behind"
    assert not prefix.parent.exists(), "the launcher's socket directory was left behind"


def test_sigterm_finishes_requests_in_flight_then_exits_0(launch):
    launcher = launch()
    children = launcher.children()
    tokens = 1000  # long enough that both are still running when the signal arrives, on any machine
    parameters = {"max_new_tokens": tokens, "ignore_eos_token": True}

    def plain() -> dict:
        return details(launcher.url, PROMPTS[1], **parameters)

    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        with client.stream("POST", f"{launcher.url}/generate_stream",
                           json={"inputs": PROMPTS[0], "parameters": {**parameters, "details": True}}) as stream:
            assert stream.status_code == 200
            chunks = stream.iter_text()
            body = next(chunks)
            while "\n\n" not in body:  # the stream's first token event: it is running
                body += next(chunks)
            plain_future = pool.submit(plain)
            wait_until(lambda: plain_future.done() or metric(launcher.url, "specula_batch_current_size") == 2,
                       timeout=30, what="both requests to be running", interval=0.02)
            assert not plain_future.done(), plain_future.result()
            os.kill(launcher.pid, signal.SIGTERM)
            body += "".join(chunks)
        plain_body = plain_future.result(timeout=REQUEST_TIMEOUT_S)
    events = sse_events(body)

    assert len(events) == tokens and events[-1]["details"]["generated_tokens"] == tokens
    assert events[-1]["details"]["finish_reason"] == "length"
    assert plain_body["details"]["generated_tokens"] == tokens
    assert plain_body["details"]["finish_reason"] == "length"
    code = launcher.wait(timeout=60)
    assert code == 0, launcher.output()
    assert "received SIGTERM" in launcher.output()
    wait_until(lambda: not any(is_alive(pid) for pid in children.values()), timeout=10,
               what="every child to be gone")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{launcher.url}/health", timeout=5)


def test_without_a_model_id_the_launcher_serves_the_bundled_demo_model(tmp_path):
    """`specula-launcher` with no --model-id serves the demo model: /info names it, and a greedy request gets
    the tokens transformers generates from the bundled weights."""
    launcher = LauncherProcess(None, tmp_path / "demo", name="demo").start()
    try:
        launcher.wait_healthy()
        info = httpx.get(f"{launcher.url}/info", timeout=REQUEST_TIMEOUT_S).json()
        assert info["model_id"] == str(DEMO_MODEL_DIR), info
        prompt = "def add(a, b):\n    return"
        served = details(launcher.url, prompt, max_new_tokens=12, decoder_input_details=False)
        assert "--model-id" not in launcher.argv
    finally:
        code = launcher.terminate()
        launcher.close()
    assert code == 0, launcher.output()

    ids = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json")).encode(prompt).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    got = [t["id"] for t in served["details"]["tokens"]]
    assert got == expected[: len(got)] and len(got) >= 1, (got, expected)
