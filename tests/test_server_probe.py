"""The stale-sampler check of `rollout.engine: server` (posttrain.rl.rollout.server_probe): the
server's log-probs of the tokens it sampled against the trainer's of the same tokens, on
hand-computed numbers, and fed by answers in vLLM's and SGLang's documented shapes through the
engine (a local HTTP server replays them)."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.errors import StaleSampler
from posttrain.rl.rollout.sample import Rollout, sample, sampling_of
from posttrain.rl.rollout.server_engine import ServerEngine
from posttrain.rl.rollout.server_probe import ServerCheck, completion_logps, not_comparable
from posttrain.sections.shared import RolloutConfig, RolloutServerConfig
from posttrain.serving.api import VLLMAPI, Completion, ServerAPI, SGLangAPI
from posttrain.serving.client import ServerClient
from posttrain.serving.server import RolloutServer

STOPS = [7]
CFG = RolloutConfig(max_new_tokens=4)  # temperature 1, no top-k/top-p: comparable
# Two rows: one stopped after 3 tokens, one cut at max_new_tokens.
IDS = [[11, 12, 7], [13, 14, 15, 16]]
SERVER_LOGPS = [[-0.5, -1.0, -0.25], [-0.1, -0.2, -0.3, -0.4]]
# The trainer's: |diff| 0.02, 0.02, 0 and 0, 0, 0, 0.06 -> mean 0.1 / 7, max 0.06.
TRAINER = [[-0.52, -0.98, -0.25, 0.0], [-0.1, -0.2, -0.3, -0.46]]
MEAN, MAX = 0.1 / 7, 0.06


def _rollout(sampler: list[list[float]], trainer: list[list[float]], version: int = 2) -> Rollout:
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])
    response = torch.tensor([[11, 12, 7, 0], [13, 14, 15, 16]])
    return Rollout(
        prompt_ids=torch.tensor([[5, 6], [5, 6]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.long),
        response=response,
        mask=mask,
        stopped=torch.tensor([True, False]),
        messages=[[], []],
        scored={
            "sampler_logps": torch.tensor(sampler),
            "logps": torch.tensor(trainer) * mask,
        },
        versions=torch.full((2,), version),
    )


def _check(api: str = "vllm", returns: bool = True, cfg: RolloutConfig = CFG) -> ServerCheck:
    return ServerCheck(api, returns, sampling_of(cfg), cfg.sampler_probe_tolerance)


SAMPLED = [[-0.5, -1.0, -0.25, math.nan], [-0.1, -0.2, -0.3, -0.4]]
NO_LAG = torch.zeros(2, dtype=torch.long)


def test_within_tolerance_gives_the_figures() -> None:
    figures = _check()(_rollout(SAMPLED, TRAINER), NO_LAG)
    assert figures["sampler_probe_mean"] == pytest.approx(MEAN, abs=1e-6)
    assert figures["sampler_probe_max"] == pytest.approx(MAX, abs=1e-6)


def test_a_stale_server_fails_the_stage_naming_the_engine_and_version() -> None:
    stale = [[x - 0.5 for x in row] for row in TRAINER]  # another policy's scores
    with pytest.raises(StaleSampler) as e:
        _check()(_rollout(SAMPLED, stale, version=5), NO_LAG)
    msg = str(e.value)
    assert msg.startswith(
        "rollout.engine 'server': after the weight refresh to policy version 5 the sampler "
        "scores the tokens it sampled (vllm's log-probs) 0.5"
    )
    assert "nats per token apart from the trainer on average (max " in msg
    assert "tolerance 0.05)" in msg
    tight = CFG.model_copy(update={"sampler_probe_tolerance": 0.01})  # 0.0143 is over it
    with pytest.raises(StaleSampler, match="tolerance 0.01"):
        _check(cfg=tight)(_rollout(SAMPLED, TRAINER), NO_LAG)


def test_rows_one_update_behind_are_held_against_the_snapshot_that_sampled_them() -> None:
    ro = _rollout(SAMPLED, [[x - 3.0 for x in row] for row in TRAINER])  # today's weights
    ro.scored["behaviour_logps"] = torch.tensor(TRAINER) * ro.mask  # the sampling version's
    lag = torch.tensor([1, 1])
    figures = _check()(ro, lag)
    assert figures["sampler_probe_mean"] == pytest.approx(MEAN, abs=1e-6)
    with pytest.raises(StaleSampler):
        _check()(ro, NO_LAG)  # held against today's weights, the rows look stale


def test_rows_without_the_servers_log_probs_are_left_out(caplog) -> None:
    """A re-tokenised answer (or one without log-probs) is NaN: not compared, whatever the
    trainer says of it; a rollout with none at all gives no figures, and the log says so."""
    caplog.set_level(logging.INFO, logger="posttrain.serving")
    sampled = [SAMPLED[0], [math.nan] * 4]
    wild = [TRAINER[0], [-9.0] * 4]
    figures = _check()(_rollout(sampled, wild), NO_LAG)
    assert figures["sampler_probe_mean"] == pytest.approx(0.04 / 3, abs=1e-6)
    assert _check()(_rollout([[math.nan] * 4] * 2, wild), NO_LAG) == {}
    assert [r.getMessage() for r in caplog.records] == [
        "rollout.engine server (vllm): the sampler is not checked: no answer carried the "
        "log-probs of its tokens"
    ]


def test_settings_the_two_sides_score_differently_are_not_checked_said_once(caplog) -> None:
    caplog.set_level(logging.INFO, logger="posttrain.serving")
    hot = CFG.model_copy(update={"temperature": 0.7})
    check = _check(cfg=hot)
    stale = [[x - 2.0 for x in row] for row in TRAINER]
    assert check(_rollout(SAMPLED, stale), NO_LAG) == {}
    assert check(_rollout(SAMPLED, stale), NO_LAG) == {}
    said = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert said == [
        "rollout.engine server (vllm): the sampler is not checked: rollout.temperature is 0.7: "
        "vLLM returns log-probs before temperature (its default logprobs_mode raw_logprobs), "
        "SGLang after it, and the trainer scores after it; they agree at temperature 1 only"
    ]
    assert "top-k/top-p" in str(not_comparable(sampling_of(CFG.model_copy(update={"top_k": 5}))))
    assert not_comparable(sampling_of(CFG.model_copy(update={"top_p": 1.0}))) is None


def test_a_server_without_log_probs_is_not_checked_said_once(caplog) -> None:
    caplog.set_level(logging.INFO, logger="posttrain.serving")
    check = _check("transformers", returns=False)
    assert check(_rollout(SAMPLED, TRAINER), NO_LAG) == {}
    said = [r.getMessage() for r in caplog.records if "not checked" in r.getMessage()]
    assert said == [
        "rollout.engine server (transformers): the sampler is not checked: the transformers "
        "server returns no log-probs of the tokens it samples"
    ]
    episodes = _rollout(SAMPLED, TRAINER)
    del episodes.scored["sampler_logps"]  # what `play` builds: no server log-probs kept
    assert _check()(episodes, NO_LAG) == {} and _check()(episodes, NO_LAG) == {}


def test_completion_logps_keeps_exact_answers_only() -> None:
    exact = Completion([11, 12, 7], True, True, "m", 2, 3, [-0.5, -1.0, -0.25])
    retok = Completion([11, 12], False, False, "m", 2, 2)
    short = Completion([13, 14], True, False, "m", 2, 2, [-0.1])  # not one per id
    long = Completion([13, 14, 15, 16, 17], True, False, "m", 2, 5, [-0.1] * 5)
    out = completion_logps([exact, retok, short, long], 4, 4)
    assert out[0, :3].tolist() == [-0.5, -1.0, -0.25] and out[0, 3].isnan()
    assert out[1].isnan().all() and out[2].isnan().all()
    assert out[3].tolist() == pytest.approx([-0.1] * 4)  # cut at max_new_tokens


# --- the parse -> compare path: answers in each server's shape, replayed over HTTP ----------


def _vllm_answer(ids: list[int], logps: list[float], stopped: bool) -> dict[str, Any]:
    choice = {"token_ids": ids, "finish_reason": "stop" if stopped else "length"}
    choice["logprobs"] = {"token_logprobs": logps}
    usage = {"prompt_tokens": 2, "completion_tokens": len(ids)}
    return {"model": "policy-v2", "choices": [choice], "usage": usage}


def _sglang_answer(ids: list[int], logps: list[float], stopped: bool) -> dict[str, Any]:
    pairs = [[lp, t, None] for lp, t in zip(logps, ids, strict=True)]
    meta = {"output_token_logprobs": pairs, "prompt_tokens": 2, "completion_tokens": len(ids)}
    return {"meta_info": meta}


PROMPTS = [[5, 6], [5, 8]]


@pytest.fixture
def replay() -> Iterator[tuple[str, dict[tuple[int, ...], dict[str, Any]]]]:
    """(url, answers by prompt ids): a local server that answers each POST with the answer
    recorded for its prompt (`prompt` for vLLM, `input_ids` for SGLang)."""
    answers: dict[tuple[int, ...], dict[str, Any]] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = json.dumps(answers[tuple(body.get("prompt") or body["input_ids"])]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", answers
    finally:
        httpd.shutdown()
        httpd.server_close()


def _engine(url: str, api: ServerAPI, tmp_path: Path) -> ServerEngine:
    cfg = RolloutServerConfig(url=url)
    client = ServerClient(url, 5.0, 2)
    server = RolloutServer(cfg, client, api, tmp_path, tmp_path / "base", 0, version=2)
    server.names["policy"] = "policy-v2"
    return ServerEngine(server, "policy", _check(api.name))


@pytest.mark.parametrize(
    ("api", "answer"), [(VLLMAPI(None), _vllm_answer), (SGLangAPI(None, False), _sglang_answer)]
)
def test_a_servers_answers_are_checked_against_the_trainer(replay, tmp_path, api, answer) -> None:
    url, answers = replay
    for p, ids, lp, stopped in zip(PROMPTS, IDS, SERVER_LOGPS, (True, False), strict=True):
        answers[tuple(p)] = answer(ids, lp, stopped)
    engine = _engine(url, api, tmp_path)
    try:
        ro = sample(engine, PROMPTS, [[], []], CFG, 0, STOPS, seed=1)
    finally:
        engine.server.client.close()
    assert ro.response.tolist() == [[11, 12, 7, 0], [13, 14, 15, 16]]
    got = ro.scored["sampler_logps"]
    assert got[0, :3].tolist() == [-0.5, -1.0, -0.25] and got[0, 3].isnan()
    assert got[1].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    ro.scored["logps"] = torch.tensor(TRAINER) * ro.mask  # what the scoring pass leaves
    figures = engine.check_rollout(ro, NO_LAG)
    assert figures["sampler_probe_mean"] == pytest.approx(MEAN, abs=1e-6)
    ro.scored["logps"] = (torch.tensor(TRAINER) - 1.0) * ro.mask
    with pytest.raises(StaleSampler, match=f"policy version 2 .*\\({api.name}'s log-probs\\)"):
        engine.check_rollout(ro, NO_LAG)
