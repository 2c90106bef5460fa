"""The native data plane's process, run by the router (`router.data_plane: native`).

    python -m router -c cluster.yaml     the control plane: admission, policy, cluster view,
      │                                  health, metrics (router/edge_control.py on a Unix
      │                                  socket), and HTTP on 127.0.0.1:<ephemeral> for
      │                                  every request the edge passes on
      └─ kvserve-edge serve --config F   router.host:router.port: plain completions and chat
                                         served natively, everything else proxied
                                         (docs/edge.md)

At start (before anything is served) the router checks that the edge can run at all (a
built binary, a tokenizer the edge implements) and writes what the edge loads into a
private directory: the tokenizer (Hugging Face's tokenizer.json), the chat template as a
program of pieces where one can be derived, and the EdgeConfig JSON (edge/src/config.rs).
Once the router serves on its internal listener it starts EdgeControl, then the edge,
and waits for its "kvserve-edge listening on HOST:PORT" line. An edge that exits is
logged and started again after a back-off (1 s, doubling to 30 s while it keeps dying
young); meanwhile router.port refuses connections. When the router stops, the edge is
stopped first (SIGTERM, then SIGKILL after 10 s), so that the requests it is serving can
still reach the control plane and the internal listener; the edge also gets SIGTERM from
the kernel should the router die (PR_SET_PDEATHSIG), and it exits when its control
socket closes. The process itself is router/edge_process.py's.

Network: the edge binds router.host only, the internal listener 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from modelinfo.info import ModelInfo
from protocol.internal_auth import SECRET_ENV
from router.config import RouterSettings
from router.edge_binary import EdgeUnavailable, edge_binary
from router.edge_control import EdgeControl
from router.edge_process import EdgeError, EdgeProcess
from router.edge_template import derive_template, write_template
from router.edge_tokenizer import edge_can_tokenize, write_tokenizer_json

INTERNAL_HOST = "127.0.0.1"


class EdgeFiles(msgspec.Struct, frozen=True, kw_only=True):
    """What the edge reads, in a private directory (mode 0700) removed at stop."""

    directory: Path
    config: Path
    tokenizer: Path
    chat_template: Path | None
    control_socket: Path


def check_native(model: ModelInfo) -> Path:
    """The edge's binary, once it is sure the edge can serve `model`; EdgeError naming
    what to do otherwise."""
    try:
        binary = edge_binary()
    except EdgeUnavailable as e:
        raise EdgeError(
            f"router.data_plane is native but there is no kvserve-edge binary ({e}); build "
            "it (scripts/setup.sh), or set router.data_plane: python"
        ) from e
    reason = edge_can_tokenize(model.tokenizer)
    if reason is not None:
        raise EdgeError(
            f"router.data_plane is native but the edge cannot tokenize for model "
            f"{model.source.spec!r}: {reason}; set router.data_plane: python for this model"
        )
    return binary


def served_model_names(settings: RouterSettings, model: ModelInfo) -> list[str]:
    """The names a request's `model` may carry, as router/preprocess.py accepts them (the
    first is the one answered with)."""
    served = settings.served_model_name or model.served_name
    return list(dict.fromkeys((served, model.source.spec, model.served_name)))


def edge_config(
    settings: RouterSettings, model: ModelInfo, files: EdgeFiles, python_url: str
) -> dict[str, Any]:
    """The EdgeConfig JSON (edge/src/config.rs), field for field. The cluster secret is
    not in it: the edge reads it from its environment."""
    return {
        "listen_host": settings.host,
        "listen_port": settings.port,
        "python_url": python_url,
        "control_socket": str(files.control_socket),
        "tokenizer_path": str(files.tokenizer),
        "chat_template_path": None if files.chat_template is None else str(files.chat_template),
        "served_model_names": served_model_names(settings, model),
        "eos_token_ids": list(model.eos_token_ids),
        "max_model_len": model.max_context_len,
        "api_key": settings.api_key,
        "session_headers": [h.lower() for h in settings.session_headers],
        "request_timeout_s": settings.request_timeout_s,
        "max_body_bytes": settings.http_limits.max_body_bytes,
        "worker_threads": settings.edge_threads,
        # The router's own limits (router/preprocess.py), read by serve.rs besides
        # EdgeConfig.
        "max_input_tokens": settings.max_input_tokens,
        "max_output_tokens": settings.max_output_tokens,
        "vocab_size": model.config.vocab_size,
    }


def write_edge_files(settings: RouterSettings, model: ModelInfo, python_url: str) -> EdgeFiles:
    """Write the tokenizer, the chat template program (when the template has one) and the
    config into a new private directory."""
    directory = Path(tempfile.mkdtemp(prefix="kvserve-edge-"))  # mode 0700
    try:
        tokenizer = directory / "tokenizer.json"
        write_tokenizer_json(model.tokenizer, tokenizer)
        template = directory / "chat_template.json"
        has_template = _write_template(model, template)
        files = EdgeFiles(
            directory=directory,
            config=directory / "edge.json",
            tokenizer=tokenizer,
            chat_template=template if has_template else None,
            control_socket=directory / "control.sock",
        )
        config = edge_config(settings, model, files, python_url)
        fd = os.open(files.config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return files


def internal_listener(backlog: int) -> socket.socket:
    """The router's own listening socket on loopback, at a port the kernel picks. Bound
    before the edge starts, so a request the edge passes on waits in the backlog rather
    than being refused while the router is still starting."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((INTERNAL_HOST, 0))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _write_template(model: ModelInfo, path: Path) -> bool:
    """Whether the model's chat template became a program the edge runs (checked against
    the router's own rendering); without one the edge passes every chat request on to the
    router."""
    program = derive_template(model.chat_template, model.tokenizer)
    if program is None:
        return False
    write_template(program, path)
    return True


class NativeDataPlane:
    """Everything `router.data_plane: native` adds to a router process: the internal
    listener, the edge's files, the control plane's socket and the edge itself.

    run_router calls `prepare` before serving (it raises EdgeError for what cannot
    work), serves on `listener`, then `start(app)` once its listener accepts, and
    `stop_edge()` / `close()` when it stops."""

    def __init__(self, settings: RouterSettings, model: ModelInfo, backlog: int) -> None:
        if settings.processes != 1:
            raise EdgeError(
                f"router.data_plane native needs router.processes 1, not {settings.processes}"
            )
        self._binary = check_native(model)
        self.listener = internal_listener(backlog)
        port = self.listener.getsockname()[1]
        self.python_url = f"http://{INTERNAL_HOST}:{port}"
        try:
            self.files = write_edge_files(settings, model, self.python_url)
        except BaseException:
            self.listener.close()
            raise
        self._settings = settings
        self._control: EdgeControl | None = None
        self.edge: EdgeProcess | None = None

    def edge_env(self) -> dict[str, str]:
        """The router's environment, with the cluster secret the router itself uses."""
        env = dict(os.environ)
        env.pop(SECRET_ENV, None)
        if self._settings.cluster_secret:
            env[SECRET_ENV] = self._settings.cluster_secret
        return env

    async def start(self, app: Any, stopping: Callable[[], bool]) -> str:
        """Start the control plane's socket and the edge; the edge's HOST:PORT."""
        control = EdgeControl(
            app.state.serving.services,
            app.state.metrics,
            request_timeout_s=self._settings.request_timeout_s,
        )
        await control.start(str(self.files.control_socket))
        self._control = control
        argv = [str(self._binary), "serve", "--config", str(self.files.config)]
        self.edge = EdgeProcess(argv, self.edge_env(), stopping=stopping)
        return await self.edge.start()

    async def stop_edge(self) -> None:
        if self.edge is not None:
            await self.edge.stop()

    async def close(self) -> None:
        """After the edge is gone: the control socket, then the files."""
        if self._control is not None:
            await self._control.stop()
            self._control = None
        self.remove_files()

    def remove_files(self) -> None:
        shutil.rmtree(self.files.directory, ignore_errors=True)
