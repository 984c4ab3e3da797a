"""Through the real launcher: one request cannot stop the server, a cut drain is answered, a hung shard ends.

Each test is the regression test of a defect seen on a running server: a `top_k` too large for the wire format
ended the batching loop (and with it the router and every shard); a drain longer than --shutdown-timeout cut
streams with no error event while the launcher exited 0; a stopped shard (SIGSTOP) left every request hanging.
"""

from __future__ import annotations

import json
import os
import signal

import httpx

from stack import is_alive
from wire import REQUEST_TIMEOUT_S, generate, wait_until


def _data_events(lines) -> list[dict]:
    return [json.loads(line[5:]) for line in lines if line.startswith("data:")]


def test_a_top_k_the_wire_cannot_hold_is_refused_and_the_server_goes_on(server):
    r = generate(server.url, "hi", top_k=4294967296)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and "top_k" in r.json()["error"]
    r = generate(server.url, "hi", max_new_tokens=3)
    assert r.status_code == 200 and r.json()["generated_text"], r.text
    assert server.returncode is None


def test_a_drain_cut_short_ends_streams_with_a_shutdown_event_and_a_nonzero_exit(launch):
    launcher = launch("--shutdown-timeout", "1")
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", f"{launcher.url}/generate_stream", json={
                "inputs": "a", "parameters": {"max_new_tokens": 1900, "ignore_eos_token": True}}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(launcher.pid, signal.SIGTERM)
            events = _data_events(lines)
    assert events and events[-1].get("error_type") == "shutdown", events[-3:]
    assert "--shutdown-timeout" in events[-1]["error"]
    code = launcher.wait(timeout=60)
    output = launcher.output()
    assert code == 3, output
    assert "drain" in output and "cut" in output


def test_a_stopped_shard_fails_its_requests_after_the_step_timeout_and_stops_the_group(launch):
    launcher = launch("--step-timeout", "3")
    children = launcher.children()
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", f"{launcher.url}/generate_stream", json={
                "inputs": "a", "parameters": {"max_new_tokens": 1900, "ignore_eos_token": True}}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(children["shard-0"], signal.SIGSTOP)
            try:
                events = _data_events(lines)
            finally:
                code = launcher.wait(timeout=60)
    output = launcher.output(tail=None)
    assert events and "--step-timeout" in events[-1].get("error", ""), (events[-3:], output[-3000:])
    assert code == 1, output[-3000:]
    assert "router exited unexpectedly" in output, output[-3000:]
    wait_until(lambda: not any(is_alive(pid) for pid in children.values()), timeout=30,
               what="every child, the stopped shard included, to be gone")
