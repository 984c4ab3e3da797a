"""The CPU image as users run it: built from the Dockerfile, started with `docker run`, scraped by a real Prometheus.

scripts/docker-cpu-image.sh does the machine's part: a Docker engine (the one that answers, or, as root, a dockerd
with no bridge or NAT started here, installed from Debian's docker.io if missing), the base image (the registry's,
or one made from Debian's packages where no registry answers), torch from its index (or from a local index on
127.0.0.1 where that index does not answer), and Debian's Prometheus unpacked from its package. Every container
runs with `--network host` and listens on 127.0.0.1 at a port of its own (`-e PORT`, `-e SPECULA_HOSTNAME`).

One image build, then three containers, each used for several checks in this file's order:

    demo   the bundled demo model with --speculative-tokens 3: the routes, a demo adapter, the HEALTHCHECK, the
           processes' uid, Prometheus over PromQL and the Grafana dashboard's queries, `docker stop -t 45` mid-stream
    env    MODEL_ID (a Hub id in the Hub cache under the /data volume), NUM_SHARD=2, PORT: a restart serves the
           same model from the same cache, and `docker kill` leaves no process behind
    gguf   a GGUF file mounted under /data, served by --model-id: the same greedy text as the model it was made from

Where no engine can run (not root and none answers, or no dockerd to be had), the whole module is skipped with
that reason. At the end it removes its containers and every image the build added, and stops the dockerd it
started. SPECULA_DOCKER_KEEP_IMAGES=1 keeps the images (a rebuild then reuses the build cache).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from stack import REPO_ROOT, free_port
from wire import REQUEST_TIMEOUT_S, metric, sse_events, wait_until

pytestmark = pytest.mark.slow

SCRIPT = REPO_ROOT / "scripts" / "docker-cpu-image.sh"
TAG = "specula-test-image:cpu"
NAME = "specula-test-"  # every container this module starts is named so
UID = "10001"
HUB_REPO = "specula-test/tiny-llama"
STARTUP_TIMEOUT_S = 240.0
# A chunk of code repeated: prompt lookup drafts from it, so speculation verifies (and accepts) drafts.
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
PROMPT = CODE * 3


def report(config: pytest.Config, line: str) -> None:
    """A line in the test run's output, whatever the capture mode: build time, image size, each check."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[docker] {line}")


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert result.returncode == 0, f"docker {' '.join(args)}: {result.stderr[-3000:]}"
    return result


def image_ids() -> set[str]:
    return set(docker("image", "ls", "-aq", "--no-trunc").stdout.split())


def volume_names() -> set[str]:
    return set(docker("volume", "ls", "-q").stdout.split())


# --- the engine, the image, the data volume ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("docker")
    up = subprocess.run([str(SCRIPT), "engine-up", str(state)], capture_output=True, text=True, timeout=900)
    if up.returncode == 3:
        reason = up.stderr.strip().splitlines()[-1] if up.stderr.strip() else "no reason given"
        report(request.config, f"SKIPPED: no Docker engine can run on this machine: {reason}")
        pytest.skip(f"the Docker image test needs a Docker engine, and none can run here: {reason}")
    assert up.returncode == 0, up.stdout + up.stderr
    report(request.config, up.stderr.strip().splitlines()[-1])
    before, volumes = image_ids(), volume_names()
    yield state
    try:
        for name in docker("ps", "-aq", "--filter", f"name=^{NAME}", check=False).stdout.split():
            docker("rm", "-f", "-v", name, check=False)  # -v: and its anonymous /data volume
        assert volume_names() <= volumes, f"volumes left behind: {volume_names() - volumes}"
        if os.environ.get("SPECULA_DOCKER_KEEP_IMAGES") != "1":
            docker("rmi", "-f", TAG, check=False, timeout=300)
            for _ in range(3):  # children before their parents: what is left goes in the next round
                added = image_ids() - before
                if not added:
                    break
                docker("rmi", "-f", *added, check=False, timeout=300)
            left = image_ids() - before
            assert not left, f"images left behind: {left}"
    finally:
        subprocess.run([str(SCRIPT), "engine-down", str(state)], capture_output=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def image(request, engine) -> str:
    start = time.monotonic()
    build = subprocess.run([str(SCRIPT), "build", TAG, str(engine)], capture_output=True, text=True, timeout=2400)
    assert build.returncode == 0, build.stderr[-6000:]
    elapsed = time.monotonic() - start
    size = int(docker("image", "inspect", "-f", "{{.Size}}", TAG).stdout)
    base = (engine / "base-image").read_text().strip()
    for line in build.stderr.strip().splitlines():
        report(request.config, line)
    report(request.config, f"built {TAG} on {base} in {elapsed:.0f} s (base image and torch index included); "
                           f"image size {size / 1e9:.2f} GB")
    layers = docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", TAG).stdout.splitlines()
    for layer in layers:
        layer_size, _, created_by = layer.partition("\t")
        if layer_size.endswith(("MB", "GB")):
            report(request.config, f"  layer {layer_size:>8}  {' '.join(created_by.split())[:110]}")
    return TAG


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The /data volume: a Hub cache holding HUB_REPO (as huggingface_hub lays one out) and that model as a GGUF
    file, owned by the image's user as docs/deployment.md says."""
    from specula_testing.gguf_files import write_gguf
    from specula_testing.models import build_tiny_model

    data = tmp_path_factory.mktemp("data")
    model = build_tiny_model(tmp_path_factory.mktemp("model") / "llama", "llama", max_position_embeddings=2048)
    write_gguf(model, data / "tiny-llama-f32.gguf", "F32")
    write_hub_cache(model, data / "hub", HUB_REPO)
    for path in [data, *data.rglob("*")]:
        if os.geteuid() == 0:
            os.lchown(path, int(UID), int(UID))
        elif not path.is_symlink():
            path.chmod(0o777 if path.is_dir() else 0o666)
    return data


def write_hub_cache(model_dir: Path, hub: Path, repo_id: str) -> None:
    """`model_dir`'s files as a Hub snapshot in huggingface_hub's cache layout: blobs, a snapshot of relative
    links to them, and refs/main naming the snapshot's commit."""
    import hashlib

    repo = hub / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for file in sorted(model_dir.iterdir()):
        if file.suffix not in (".json", ".safetensors"):
            continue
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / blob)
        (repo / "snapshots" / commit / file.name).symlink_to(f"../../blobs/{blob}")


# --- containers -------------------------------------------------------------------------------------------------


class Container:
    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = NAME + name, port
        self.url = f"http://127.0.0.1:{port}"

    def logs(self, tail: int = 6000) -> str:
        result = docker("logs", self.name, check=False)
        return (result.stdout + result.stderr)[-tail:]

    def state(self, field: str) -> str:
        return docker("inspect", "-f", f"{{{{.State.{field}}}}}", self.name).stdout.strip()

    def wait_serving(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.state("Running") == "true", f"{self.name} exited:\n{self.logs()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.name} did not serve within {timeout:.0f} s:\n{self.logs()}")

    def processes(self) -> list[tuple[str, int, str]]:
        """(uid, host pid, command line) of every process in the container, as the host sees them."""
        lines = docker("top", self.name, "-eo", "uid,pid,args").stdout.splitlines()[1:]
        return [(uid, int(pid), args) for uid, pid, args in (line.split(None, 2) for line in lines)]


def run_container(name: str, *args: str, env: dict[str, str] | None = None, data: Path | None = None,
                  options: tuple[str, ...] = ()) -> Container:
    """`docker run -d` of the image on the host's network, listening on 127.0.0.1 at a free port (-e PORT)."""
    container = Container(name, free_port())
    docker("rm", "-f", "-v", container.name, check=False)
    environment = {"PORT": str(container.port), "SPECULA_HOSTNAME": "127.0.0.1", **(env or {})}
    command = ["run", "-d", "--name", container.name, "--network", "host", *options]
    for key, value in environment.items():
        command += ["-e", f"{key}={value}"]
    if data is not None:
        command += ["-v", f"{data}:/data"]
    docker(*command, TAG, *args)
    container.wait_serving()
    return container


def complete(url: str, inputs: str, **parameters) -> dict:
    r = httpx.post(f"{url}/generate", json={"inputs": inputs, "parameters": parameters}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# --- the demo model with speculation ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(request, image) -> Container:
    start = time.monotonic()
    container = run_container("demo", "--speculative-tokens", "3", options=("--health-interval", "2s"))
    report(request.config, f"demo container serving {time.monotonic() - start:.0f} s after `docker run`")
    return container


def test_the_routes_answer_with_speculation(request, demo):
    assert httpx.get(f"{demo.url}/health", timeout=30).status_code == 200
    info = httpx.get(f"{demo.url}/info", timeout=30).json()
    assert info["speculation"]["max_speculative_tokens"] == 3, info
    body = complete(demo.url, PROMPT, max_new_tokens=32, details=True)
    assert body["details"]["generated_tokens"] == 32
    r = httpx.post(f"{demo.url}/generate_stream", timeout=REQUEST_TIMEOUT_S,
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": 32}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = sse_events(r.text)
    assert events[-1]["generated_text"] == body["generated_text"]  # greedy: the stream says what /generate said
    chat = httpx.post(f"{demo.url}/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": "tgi", "messages": [{"role": "user", "content": "Write a function that adds two numbers."}],
        "max_tokens": 24, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] and chat.json()["usage"]["completion_tokens"] > 0
    report(request.config, "demo: /health, /info, /generate, /generate_stream, /v1/chat/completions answer")


def test_a_demo_adapter_by_adapter_id(request, demo):
    prompt = "def read_config(path):\n"
    base = complete(demo.url, prompt, max_new_tokens=32)["generated_text"]
    adapted = complete(demo.url, prompt, max_new_tokens=32, adapter_id="camel-case")["generated_text"]
    assert adapted != base
    assert metric(demo.url, "specula_request_success_total", adapter="camel-case") >= 1
    report(request.config, "demo: adapter_id camel-case served (its text differs from the base model's)")


def test_the_healthcheck_reports_healthy(request, demo):
    wait_until(lambda: demo.state("Health.Status") == "healthy", timeout=60, interval=1,
               what="the HEALTHCHECK to report healthy")
    report(request.config, "demo: HEALTHCHECK healthy")


def test_every_process_runs_as_the_image_user(request, demo):
    processes = demo.processes()
    assert len(processes) >= 3, processes  # launcher, router, shard
    assert {uid for uid, _, _ in processes} == {UID}, processes
    report(request.config, f"demo: all {len(processes)} processes run as uid {UID}")


# --- Prometheus -------------------------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
        return r.json()["data"]["result"]

    def value(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])


@pytest.fixture(scope="module")
def prometheus(request, demo, tmp_path_factory) -> Iterator[Prometheus]:
    binary = subprocess.run([str(SCRIPT), "prometheus"], capture_output=True, text=True, timeout=300)
    assert binary.returncode == 0, binary.stderr
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: specula\n"
        "    metrics_path: /metrics\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{demo.port}']}}]\n")
    port = free_port()
    log = (work / "prometheus.log").open("w")
    process = subprocess.Popen([binary.stdout.strip(), f"--config.file={work / 'prometheus.yml'}",
                                f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert process.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            try:
                return httpx.get(f"{url}/-/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=60, interval=0.5, what="Prometheus to be ready")
        version = subprocess.run([binary.stdout.strip(), "--version"], capture_output=True, text=True).stdout
        report(request.config, f"Prometheus {version.split()[2]} on 127.0.0.1:{port} scrapes {demo.url} every 1 s")
        yield Prometheus(url)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def traffic(url: str, seconds: float = 8.0) -> int:
    """Requests for `seconds` at least, four at a time: streams and plain ones, an adapter's, a repeated long prompt
    (the prefix cache), and an invalid one before and after (failures counted as `validation`: a counter's series
    appears at its first increment, so only the second shows in a rate). Returns how many succeeded."""
    def invalid() -> None:
        r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"temperature": -1}},
                       timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 422, r.text

    def one(i: int) -> httpx.Response:
        parameters = {"max_new_tokens": 64, **({"adapter_id": "two-space"} if i % 4 == 3 else {})}
        if i % 2:
            return httpx.post(f"{url}/generate_stream", timeout=REQUEST_TIMEOUT_S,
                              json={"inputs": PROMPT, "parameters": parameters})
        return httpx.post(f"{url}/generate", timeout=REQUEST_TIMEOUT_S,
                          json={"inputs": PROMPT + f"# {i}\n", "parameters": parameters})

    invalid()
    deadline, sent = time.monotonic() + seconds, 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline or sent < 12:
            responses = list(pool.map(one, range(sent, sent + 4)))
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
            sent += 4
    invalid()
    return sent


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((REPO_ROOT / "docs" / "grafana-dashboard.json").read_text())
    return [(f"{panel['title']} / {target.get('legendFormat', '')}", target["expr"])
            for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_prometheus_scrapes_the_container_while_requests_run(request, demo, prometheus):
    wait_until(lambda: prometheus.query('up{job="specula"} == 1'), timeout=30, interval=0.5,
               what="Prometheus' first scrape of the container")
    sent = traffic(demo.url)
    served = metric(demo.url, "specula_request_count_total")
    wait_until(lambda: prometheus.query("specula_request_count_total")
               and prometheus.value("sum(specula_request_count_total)") == served,
               timeout=30, interval=0.5, what="Prometheus to scrape the requests' counts")
    time.sleep(2)  # two more scrapes: every rate below has samples on both sides of the traffic
    count = prometheus.value("sum(specula_request_count_total)")
    assert count == served >= sent
    running = prometheus.value("max_over_time(sum(specula_batch_current_size)[1m:1s])")
    assert running >= 1  # scraped while requests ran
    ttft = prometheus.value(
        "histogram_quantile(0.9, sum by (le) (rate(specula_request_time_to_first_token_bucket[1m])))")
    assert 0 < ttft < 60, ttft
    drafted = prometheus.value("sum(specula_spec_decode_num_draft_tokens_total)")
    accepted = prometheus.value("sum(specula_spec_decode_num_accepted_tokens_total)")
    assert drafted > 0 and 0 <= accepted <= drafted, (drafted, accepted)
    report(request.config, f"PromQL: {count:.0f} requests (up to {running:.0f} running at a scrape), TTFT p90 "
                           f"{ttft * 1000:.0f} ms, speculative acceptance {accepted:.0f}/{drafted:.0f} = "
                           f"{accepted / drafted:.2f}")


def test_the_grafana_dashboard_queries_return_data(request, demo, prometheus):
    """Each query of docs/grafana-dashboard.json, as Grafana sends it with `All` instances picked and a rate
    interval of a minute, returns at least one series with a number (the failure rate a positive one)."""
    labels = httpx.get(f"{prometheus.url}/api/v1/label/instance/values", timeout=30,
                       params={"match[]": "specula_request_count_total"}).json()["data"]
    assert labels == [f"127.0.0.1:{demo.port}"], labels  # the dashboard's `instance` variable
    # As Grafana writes a multi-value variable into a query: each value's regex escaped, in a PromQL string.
    instances = "(" + "|".join(re.escape(label).replace("\\", "\\\\") for label in labels) + ")"
    empty = []
    for title, expr in dashboard_queries():
        query = expr.replace("$instance", instances).replace("$__rate_interval", "1m")
        values = [float(series["value"][1]) for series in prometheus.query(query)]
        if not any(math.isfinite(value) for value in values) or (title.startswith("Request rate / failed")
                                                                     and not any(value > 0 for value in values)):
            empty.append((title, expr, values))
        else:
            report(request.config, f"dashboard: {title}: {', '.join(f'{value:.3g}' for value in values)}")
    assert not empty, empty


def test_docker_stop_during_a_long_stream(request, demo):
    """`docker stop -t 45`: the router drains the stream in flight, then the launcher exits 0. The stream is sized
    from this machine's speed to run about 8 s, well inside the 30 s drain, and tokens must arrive after the stop."""
    begin = time.monotonic()
    complete(demo.url, PROMPT, max_new_tokens=48, ignore_eos_token=True)
    tokens = int(min(1200, max(40, 8.0 / ((time.monotonic() - begin) / 48))))

    def stream() -> list[tuple[float, dict]]:
        """(arrival time, event) of each SSE event, as they come."""
        events = []
        with httpx.stream("POST", f"{demo.url}/generate_stream", timeout=120, json={
                "inputs": PROMPT,
                "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True, "details": True}}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append((time.monotonic(), json.loads(line[len("data:"):])))
        return events

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream)
        wait_until(lambda: future.done() or metric(demo.url, "specula_batch_current_size") == 1, timeout=30,
                   interval=0.05, what="the stream to be running")
        assert not future.done(), future.result()
        start = time.monotonic()
        docker("stop", "-t", "45", demo.name, timeout=90)
        stopped = time.monotonic() - start
        events = future.result(timeout=60)
    after = sum(1 for arrival, _ in events if arrival > start)
    assert after > 0, "the stream had ended before `docker stop`"
    last = events[-1][1]
    code = int(demo.state("ExitCode"))
    if "error" in last:  # cut at the end of the drain: the shutdown event, and exit code 3 (docs/deployment.md)
        assert last.get("error_type") == "shutdown" and code == 3, (last, code, demo.logs())
        outcome = "cut by the shutdown event"
    else:
        assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == tokens, last
        assert code == 0, demo.logs()
        outcome = f"finished ({tokens} tokens, {after} of them after the stop)"
    assert "received SIGTERM" in demo.logs()
    report(request.config, f"docker stop -t 45 mid-stream: stream {outcome}, exit code {code}, "
                           f"stopped in {stopped:.1f} s")


# --- environment variables, the Hub cache in /data, docker kill --------------------------------------------------


def test_environment_variables_and_the_hub_cache_across_a_restart(request, image, data_dir):
    start = time.monotonic()
    env = run_container("env", env={"MODEL_ID": HUB_REPO, "NUM_SHARD": "2", "HF_HUB_OFFLINE": "1"}, data=data_dir)
    report(request.config, f"env container (MODEL_ID, NUM_SHARD=2, PORT) serving {time.monotonic() - start:.0f} s "
                           f"after `docker run`")
    info = httpx.get(f"{env.url}/info", timeout=30).json()
    assert info["model_id"] == HUB_REPO and info["num_shard"] == 2, info
    assert f"/data/hub/models--{HUB_REPO.replace('/', '--')}/snapshots/" in env.logs(tail=100_000)
    text = complete(env.url, "The quick brown fox", max_new_tokens=24)["generated_text"]
    started = env.state("StartedAt")
    docker("restart", "-t", "45", env.name, timeout=120)
    assert env.state("StartedAt") != started
    env.wait_serving()
    assert complete(env.url, "The quick brown fox", max_new_tokens=24)["generated_text"] == text
    report(request.config, "env: MODEL_ID from the Hub cache in /data, 2 shards, PORT; the same text after "
                           "`docker restart`")

    pids = [pid for _, pid, _ in env.processes()]
    assert len(pids) >= 4, pids  # launcher, router, two shards
    docker("kill", env.name)
    wait_until(lambda: env.state("Running") == "false", timeout=30, what="the killed container to stop")
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10, interval=0.2,
               what="every process of the killed container to be gone")
    report(request.config, f"env: `docker kill` left none of its {len(pids)} processes behind")
    GREEDY["hub"] = text


GREEDY: dict[str, str] = {}


def test_a_gguf_file_mounted_under_data(request, image, data_dir):
    gguf = run_container("gguf", "--model-id", "/data/tiny-llama-f32.gguf", data=data_dir)
    info = httpx.get(f"{gguf.url}/info", timeout=30).json()
    assert info["model_id"] == "/data/tiny-llama-f32.gguf", info
    text = complete(gguf.url, "The quick brown fox", max_new_tokens=24)["generated_text"]
    if "hub" in GREEDY:  # the same weights as the Hub snapshot, in F32: the same greedy text
        assert text == GREEDY["hub"]
    docker("stop", "-t", "45", gguf.name, timeout=90)
    assert gguf.state("ExitCode") == "0", gguf.logs()
    report(request.config, "gguf: /data/tiny-llama-f32.gguf served by --model-id, the greedy text of its "
                           "safetensors original")
