"""A model served by `transformers serve` on a free loopback port, for as long as a run (or a test) needs it.

A judge, an analyzer, an editor or the task audit reads an OpenAI-compatible endpoint. With `serve_model` set (a model
folder, or the packaged real model `smollm2`), train.py starts `transformers serve` on that model before its start-up
checks, points every endpoint whose backend is `openai` and whose base URL is unset at it (`judge_*`, `analyzer_*`,
`editor_*`: the base URL and the model id, since the server answers for its one model), and stops the server when the
run ends, however it ends:

    python train.py --config configs/smollm2_draco_guess_the_number.yaml     # DRACO judged by the served start model

    with serve("smollm2") as endpoint:                # the same from Python
        client = openai.OpenAI(base_url=endpoint.base_url, api_key="EMPTY")
        client.chat.completions.create(model=endpoint.model, messages=[...])

The server is a separate process with its own copy of the model: it judges with the weights it was started with (the
run's start model, not the policy as it trains), and its generation shares the machine's cores with the run
(`threads`, default 1, is its torch thread count). Its output goes to `log_path` (default: a temporary file, shown
when it fails to start).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent_trl.real_model import is_real, real_model

#: The endpoint settings of each role a served model can answer for: (backend field, base URL field, model field).
ROLES = ("judge", "analyzer", "editor")


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # http://127.0.0.1:<port>/v1
    model: str  # the model id requests name: the served folder
    log_path: Path


def transformers_command() -> str:
    """The `transformers` CLI of this interpreter's environment (installed with transformers)."""
    found = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if found is None:
        raise SystemExit("error: serve_model needs the `transformers` command (pip install transformers[serving])")
    return found


def model_folder(name: str) -> str:
    """The folder to serve: the packaged real model's converted folder for its name, else `name` as a folder."""
    if is_real(name):
        try:
            return real_model(name)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"error: serve_model {name!r}: {e}") from e
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise SystemExit(
            f"error: serve_model {name!r} is not a model folder (no config.json there); give a folder a model was "
            "saved to (save_pretrained, or python -m agent_trl.export), or smollm2"
        )
    return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(server: subprocess.Popen, base_url: str, log_path: Path, timeout: float) -> None:
    """Return once the server lists its models; stop (SystemExit, with its log's tail) if it exits first or
    `timeout` seconds pass."""
    import openai

    deadline = time.monotonic() + timeout
    with openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=5) as client:
        while True:
            if server.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise SystemExit(f"error: transformers serve exited with status {server.returncode}:\n{tail}")
            try:
                client.models.list()
                return
            except (openai.APIConnectionError, openai.APITimeoutError):
                if time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise SystemExit(
                        f"error: transformers serve did not answer within {timeout:g} s:\n{tail}"
                    ) from None
                time.sleep(0.25)


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextmanager
def serve(
    name: str, *, threads: int = 1, startup_timeout: float = 180.0, log_path: str | Path | None = None
) -> Iterator[Endpoint]:
    """`transformers serve` on the model `name` (a folder, or `smollm2`) at a free loopback port, on the CPU with
    `threads` torch threads; yields its `Endpoint` once it answers and stops it on leaving the block."""
    folder = model_folder(name)
    port = free_port()
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="agent-trl-serve-")) / "serve.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = [transformers_command(), "serve", folder, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as sink:
        server = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_up(server, base_url, log_path, startup_timeout)
        yield Endpoint(base_url=base_url, model=folder, log_path=log_path)
    finally:
        stop(server)


def servable_roles(config) -> list[str]:
    """The roles of `config` a served model answers for: backend `openai` and base URL unset."""
    return [
        role
        for role in ROLES
        if getattr(config, f"{role}_backend", None) == "openai" and not getattr(config, f"{role}_base_url", None)
    ]


def point_at(config, endpoint: Endpoint) -> list[str]:
    """Point every servable role of `config` at `endpoint`: its base URL, and its model id (the server answers for
    its one model). Returns the roles pointed, e.g. ['judge']."""
    roles = servable_roles(config)
    for role in roles:
        setattr(config, f"{role}_base_url", endpoint.base_url)
        setattr(config, f"{role}_model", endpoint.model)
    return roles
