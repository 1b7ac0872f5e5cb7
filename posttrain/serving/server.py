"""The rollout server of one RL stage: started (or found), fed each policy version, stopped.

`rollout_server` is the stage's hold on it, a context manager around the stage's loop:
1. rank 0 stops a server an earlier attempt left (`process.stop_leftover`), starts the
   recipe's `command` (or takes its `url`), waits for `health_path`, and tells every rank
   the URL - or the reason it could not, so every rank fails with the same line;
2. rank 0 writes the reference policy's folder (`serving/reference`) and has the server load
   it; `sync` then writes and loads each policy version (a collective: every rank gathers its
   shards of the adapter, rank 0 writes and loads it, every rank waits for that);
3. on the way out, however the stage ends, rank 0 stops the server it started and removes
   `serving/` (a server given by `url` is left running; its old versions are unloaded).

A version's name is what every request of the policy carries (`transformers`: its folder's
path; vLLM, SGLang: `policy-v<N>`), and what the server's answers are checked against.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.distributed import agree
from posttrain.models.adapters import POLICY
from posttrain.sections.shared import RolloutServerConfig
from posttrain.serving.api import ServerAPI, server_api
from posttrain.serving.client import ServerClient, ServerFailed
from posttrain.serving.process import ServerProcess, fill_command, stop_leftover
from posttrain.serving.weights import (
    adapter_version,
    merge_into,
    servable_base,
    version_name,
)

log = logging.getLogger("posttrain.serving")

REFERENCE_NAME = "reference"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class RolloutServer:
    """One stage's server: where it is, how to talk to it, which policy version it holds."""

    cfg: RolloutServerConfig
    client: ServerClient
    api: ServerAPI
    folder: Path  # <stage>/serving
    base: Path  # a servable folder of the base model and the stage's tokenizer
    rank: int
    process: ServerProcess | None = None
    version: int = -1  # the policy version the server holds (-1: none yet)
    names: dict[str, str] = field(default_factory=dict)  # "policy"/"reference" -> model name
    sync_s: float = 0.0  # seconds the last `sync` took

    def _name(self, name: str, folder: Path) -> str:
        return str(folder) if self.api.name == "transformers" else name

    def _load(self, name: str, folder: Path) -> None:
        for path, body in self.api.load(name, str(folder)):
            self.client.post(path, body)

    def load_reference(self, adapter_dir: Path) -> None:
        """The reference policy (held-out baseline) as a model the server answers to."""
        folder = self.folder / REFERENCE_NAME
        if self.rank == 0:
            self._write(folder, adapter_dir)
            if self.api.named_versions:
                self._load(REFERENCE_NAME, folder)
        self.names["reference"] = self._name(REFERENCE_NAME, folder)

    def _write(self, folder: Path, adapter_dir: Path) -> None:
        if self.cfg.weights == "merged":
            # An adapter `merged` cannot fold (`rollout.server.weights: ...`) is a verdict that
            # `sync` passes to every rank: raised as it is, it would end rank 0 alone while the
            # other ranks wait for its word.
            try:
                merge_into(folder, self.base, adapter_dir)
            except ValueError as e:
                raise ServerFailed(str(e)) from None
        else:
            by_path = self.api.name == "transformers"
            adapter_version(folder, adapter_dir, self.base if by_path else None)

    def sync(self, model: torch.nn.Module, version: int) -> float:
        """Make the server sample from `model`'s policy adapter as version `version` (a
        collective) -> seconds taken, also kept in `sync_s`."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        t0 = time.perf_counter()
        full = get_model_state_dict(
            model,
            options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
            ),
        )
        name, folder = version_name(version), self.folder / version_name(version)
        error = None
        if self.rank == 0:
            try:
                saved = self.folder / f".saving-{version}"
                model.save_pretrained(str(saved), state_dict=full, selected_adapters=[POLICY])
                self._write(folder, saved)
                shutil.rmtree(saved, ignore_errors=True)
                self._load(name, folder)
                self._drop_older(version)
            except ServerFailed as e:
                error = str(e)
        error = agree.from_rank0(error)
        if error is not None:
            raise ServerFailed(error)
        self.version = version
        self.names["policy"] = self._name(name, folder)
        self.sync_s = time.perf_counter() - t0
        return self.sync_s

    def _drop_older(self, version: int) -> None:
        """Unload and delete versions before the previous one (a lagging rollout may still be
        read from the previous one's name until the next sync)."""
        for old in self.folder.glob("policy-v*"):
            n = int(old.name.removeprefix("policy-v"))
            if n < version - 1:
                for path, body in self.api.unload(old.name):
                    with contextlib.suppress(ServerFailed):  # already gone is fine
                        self.client.post(path, body)
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Stop the server the stage started (rank 0), forget the folders."""
        self.client.close()
        if self.rank != 0:
            return
        if self.process is not None:
            self.process.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def _start(
    cfg: RolloutServerConfig, logs: Path, base: Path, beat: Callable[[], None]
) -> tuple[str, ServerProcess | None]:
    """Rank 0: the URL of the recipe's server, started and healthy when it has a command."""
    if cfg.url is not None:
        return cfg.url, None
    from posttrain.distributed.runtime import free_port

    port = cfg.port or free_port(cfg.host if cfg.host not in LOOPBACK else "127.0.0.1")
    assert cfg.command is not None  # the section requires url or command
    argv = fill_command(cfg.command, cfg.host, port, str(base))
    env = dict(cfg.env)
    if cfg.api == "vllm":  # vLLM refuses /v1/load_lora_adapter without it
        env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    log.info("starting the rollout server: %s", " ".join(argv))
    proc = ServerProcess.start(argv, env, logs / "rollout-server.log", logs / "rollout-server.json")
    wildcard = cfg.host in ("0.0.0.0", "::")
    client = ServerClient(
        f"http://{'127.0.0.1' if wildcard else cfg.host}:{port}", cfg.request_timeout_s, 1,
        proc.last_said,
    )  # fmt: skip
    try:
        waited = client.wait_healthy(cfg.health_path, cfg.startup_timeout_s, proc.exit_reason, beat)
    except BaseException:
        proc.stop()
        raise
    finally:
        client.close()
    # The other ranks (on other nodes, too) reach a server listening everywhere by this
    # node's name.
    url = f"http://{socket.gethostname() if wildcard else cfg.host}:{port}"
    log.info("rollout server %s healthy after %.1f s", url, waited)
    return url, proc


@contextlib.contextmanager
def rollout_server(
    cfg: RolloutServerConfig,
    out_dir: Path,
    model_dir: Path,
    tokenizer_dir: Path,
    tok: Any,
    turn_stop: int,
    beat: Callable[[], None],
) -> Iterator[RolloutServer]:
    """The stage's server from start to stop (see the module docstring)."""
    rank, folder, logs = agree.rank(), out_dir / "serving", out_dir / "logs"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", agree.world()))
    if cfg.command is not None and cfg.host in LOOPBACK and agree.world() > local:
        raise ServerFailed(
            f"rollout.server.host {cfg.host} is this node's own address, which the ranks on "
            "the other nodes cannot reach: set rollout.server.host: 0.0.0.0"
        )
    url = error = None
    proc: ServerProcess | None = None
    if rank == 0:
        if said := stop_leftover(logs / "rollout-server.json"):
            log.warning("%s", said)
        shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt's versions
        try:
            base = servable_base(folder / "base", model_dir, tokenizer_dir)
            url, proc = _start(cfg, logs, base, beat)
        except ServerFailed as e:
            error = str(e)
        except (ValueError, OSError) as e:  # no weights to serve, a command that cannot run
            error = f"rollout.server: {type(e).__name__}: {e}"
    url, error = agree.from_rank0((url, error))
    if error is not None:
        raise ServerFailed(error)
    assert url is not None
    said = proc.last_said if proc is not None else None
    client = ServerClient(url, cfg.request_timeout_s, cfg.max_concurrency, said)
    api = server_api(cfg.api, tok, turn_stop, cfg.weights == "merged")
    server = RolloutServer(cfg, client, api, folder, folder / "base", rank, proc)
    try:
        yield server
    finally:
        server.close()
