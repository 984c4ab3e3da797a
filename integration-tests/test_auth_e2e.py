"""API_KEY (TGI's variable) protects a server started by the real launcher: the router gets the key, no process's
command line shows it, and the probes stay open."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

KEY = "e2e-s3cret-key-9876"
BODY = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 2}}


def command_lines_with(secret: str) -> list[str]:
    """The command lines (as `ps` shows them) of every process that names `secret` in its arguments."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        if secret in args:
            found.append(args)
    return found


def test_api_key_from_the_environment_protects_the_server(launch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_KEY", KEY)
    server = launch()  # healthy means /health answered without the key
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        refused = client.post("/generate", json=BODY)
        assert refused.status_code == 401 and refused.json()["error_type"] == "authentication", refused.text
        assert client.post("/generate", json=BODY, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/v1/models").json()["error"]["code"] == "invalid_api_key"
        served = client.post("/generate", json=BODY, headers=auth)
        assert served.status_code == 200 and served.json()["generated_text"], served.text
        assert client.get("/v1/models", headers=auth).status_code == 200
        assert client.get("/info", headers=auth).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    assert command_lines_with(KEY) == []
    assert KEY not in server.output(tail=None)


TEXT_GENERATION_WITH_KEY = """
from text_generation import Client
from text_generation.errors import UnknownError

prompt, headers = ARGS["prompt"], {"Authorization": "Bearer " + ARGS["key"]}
out = {}
client = Client(ARGS["url"], headers=headers, timeout=60)
out["text"] = client.generate(prompt, max_new_tokens=4).generated_text
out["stream"] = [e.token.id for e in client.generate_stream(prompt, max_new_tokens=4)]
try:
    Client(ARGS["url"], timeout=60).generate(prompt, max_new_tokens=4)
    out["without_key"] = None
except UnknownError as e:
    out["without_key"] = str(e)
print(json.dumps(out))
"""


def test_the_published_client_sends_the_key_in_its_headers(launch, run_client, monkeypatch) -> None:
    monkeypatch.setenv("API_KEY", KEY)
    server = launch()
    out = run_client(TEXT_GENERATION_WITH_KEY, url=server.url, key=KEY, prompt=BODY["inputs"])
    assert out["text"] and len(out["stream"]) == 4
    assert out["without_key"] is not None and "API key" in out["without_key"] and KEY not in out["without_key"]
