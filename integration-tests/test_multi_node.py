"""Multi-node tensor parallelism, on one machine: two launchers form one TP=2 group over 127.0.0.1 (gloo), as two
nodes would (torchrun's flags). Node 0 runs shard 0 and the router; node 1 runs shard 1, which the router reaches
over TCP. Greedy output equals one shard's, and a shard dying on node 1 stops node 0 with a clear error.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from stack import LauncherProcess, free_port
from wire import generate

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture
def two_nodes(model_dir, tmp_path):
    port = free_port()
    common = ["--num-shard", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node0 = LauncherProcess(model_dir, tmp_path / "node0", [*common, "--node-rank", "0"], "node-0").start()
    node1 = LauncherProcess(model_dir, tmp_path / "node1", [*common, "--node-rank", "1", "--node-host", "127.0.0.1"],
                            "node-1").start()
    try:
        node0.wait_healthy()
        yield node0, node1
    finally:
        for node in (node0, node1):
            node.terminate()
            node.close()


def test_two_launchers_form_one_group_whose_greedy_output_equals_one_shard(base_url, two_nodes):
    node0, node1 = two_nodes
    for prompt in PROMPTS:
        alone = generate(base_url, prompt, max_new_tokens=16, details=True).json()
        split = generate(node0.url, prompt, max_new_tokens=16, details=True).json()
        assert [t["id"] for t in split["details"]["tokens"]] == [t["id"] for t in alone["details"]["tokens"]]
        assert split["generated_text"] == alone["generated_text"]
    assert "router" not in node1.children() and set(node1.children()) == {"shard-1"}
    assert "shards only: the router runs on node 0" in node1.output()


def test_a_shard_dying_on_another_node_stops_the_group(two_nodes):
    node0, node1 = two_nodes
    assert generate(node0.url, PROMPTS[0], max_new_tokens=4).status_code == 200
    os.kill(node1.children()["shard-1"], signal.SIGKILL)
    assert node1.wait(60) == 1  # its launcher saw its shard die
    # Node 0 finds out at its next step at the latest: the request fails, and its shard (a collective's peer is
    # gone) and then its launcher stop with an error rather than serve a group that cannot answer. It may also
    # find out before that request (the router's connection to shard 1 closing) and be gone already.
    try:
        response = generate(node0.url, PROMPTS[1], max_new_tokens=4)
    except httpx.ConnectError:
        pass  # already stopped: what follows checks how
    else:
        assert response.status_code >= 400
    assert node0.wait(120) != 0
    assert "exited unexpectedly" in node0.output(tail=None)
