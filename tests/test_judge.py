"""A model as judge (`rewards: [{judge: ...}]`): parsing its replies, the entry's schema, and the
client against a real HTTP server this test starts (stdlib `http.server` answering OpenAI
chat-completions JSON: the environment, not the thing under test)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from posttrain.config import judge_check
from posttrain.rewards import counters
from posttrain.rewards import judge as judge_module
from posttrain.rewards.combine import RewardFunctionError, load_rewards, score_functions
from posttrain.rewards.judge_parse import parse_choice, parse_number
from posttrain.rewards.judge_server import judge_servers
from posttrain.sections.rewards import RewardSpec
from posttrain.serving.client import ServerFailed

CHOICES = {"A": 1.0, "B": 0.0}


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("7", 0.7),
        ("Score: 7/10", 0.7),
        ("8.5 out of 10", 0.85),
        ("It is fine. Rating: 9", 0.9),
        ("Step 1 then step 2; final: 4", 0.4),
        ("no number here", None),
        ("42", None),  # outside the range: the judge did not follow the rubric
        ("", None),
    ],
)
def test_a_number_reply_maps_its_score_to_the_unit_range(reply: str, score: float | None) -> None:
    got = parse_number(reply, 0.0, 10.0)
    assert got == pytest.approx(score) if score is not None else got is None


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("[[A]]", 1.0),
        ("B", 0.0),
        ("answer: a", 1.0),
        ("Verdict: **B**", 0.0),
        ("The better one is [[B]].", 0.0),
        ("A or B", None),  # ambiguous
        ("neither", None),
    ],
)
def test_a_choice_reply_scores_the_choice_it_names(reply: str, score: float | None) -> None:
    assert parse_choice(reply, CHOICES) == score


def _judge(**over: Any) -> dict[str, Any]:
    return {"url": "http://127.0.0.1:1", "model": "judge-m", "rubric": "Rate: {completion}"} | over


def test_an_entry_is_a_function_or_a_judge_exactly_one() -> None:
    both = {"fn": "posttrain.rewards.match:exact_match", "judge": _judge()}
    for entry, which in ((both, "both"), ({"weight": 1.0}, "neither")):
        with pytest.raises(ValidationError, match=f"fn, judge: give exactly one .* got {which}"):
            RewardSpec.model_validate(entry)
    assert RewardSpec.model_validate({"judge": _judge()}).label == "judge"


@pytest.mark.parametrize(
    ("over", "said"),
    [
        ({"rubric": "Rate this answer."}, "judge.rubric: no {completion} placeholder"),
        ({"rubric": "{completion} {}"}, "judge.rubric: placeholder {} is not a name"),
        ({"rubric": "{completion"}, "judge.rubric: "),
        ({"command": "serve --port {port}"}, "give `url` .* or `command` .* exactly one"),
        ({"url": None, "command": "serve {gpu}"}, r"judge.command: unknown placeholder \{gpu\}"),
        ({"score": "choice"}, "judge.choices: `score: choice` needs choices"),
        ({"range": [5, 1]}, r"judge.range: \[5, 1\] needs lo < hi"),
    ],
)
def test_a_judge_section_refuses_what_it_cannot_run(over: dict, said: str) -> None:
    with pytest.raises(ValidationError, match=said):
        RewardSpec.model_validate({"judge": _judge(**over)})


# -- against a server -------------------------------------------------------------------------


class FakeJudge(ThreadingHTTPServer):
    """Answers each chat request with `answer(n, body)` -> (status, content, delay_s); counts
    the requests it got."""

    daemon_threads = True

    def __init__(self, answer: Callable[[int, dict], tuple[int, str, float]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer, self.requests, self.bodies = answer, 0, []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeJudge

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests += 1
            n = self.server.requests
            self.server.bodies.append(body | {"auth": self.headers.get("Authorization")})
        status, content, delay = self.server.answer(n, body)
        time.sleep(delay)
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on a slow answer (its timeout)


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeJudge]]:
    servers: list[FakeJudge] = []

    def start(answer: Callable[[int, dict], tuple[int, str, float]]) -> FakeJudge:
        s = FakeJudge(answer)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


PROMPTS = [[{"role": "user", "content": f"What is {i}+{i}?"}] for i in range(3)]
REPLIES = ["2", "4", "6"]


def _score(
    tmp: Path, judge: dict, rows: int = 3, columns: dict | None = None
) -> tuple[list[float | None], dict[str, list[float]]]:
    """Score the first `rows` replies through a judge entry, as the rewarder calls it."""
    funcs = load_rewards([RewardSpec.model_validate({"judge": judge})], where="grpo.rewards")
    with judge_servers(funcs, tmp):
        counters.take(0)
        _, per = score_functions(
            funcs,
            PROMPTS[:rows],
            REPLIES[:rows],
            [columns or {} for _ in range(rows)],
            [[1]] * rows,
            [True] * rows,
            [f"prompts.jsonl:{i + 1}" for i in range(rows)],
        )
        got = counters.take(rows)
    values = [None if v != v else round(float(v), 4) for v in per["judge"].tolist()]
    return values, got


def test_the_cache_file_is_bounded_and_keeps_the_newest(
    serve, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory keeps CACHE_SIZE judgements; the file is rewritten with them once it holds more
    than twice as many lines, and a resumed judge reads back the newest."""
    monkeypatch.setattr(judge_module, "CACHE_SIZE", 1)
    server = serve(lambda n, _: (200, "6", 0.0))
    judge = _judge(url=server.url)
    _score(tmp_path, judge)  # 3 judgements: the third append passes 2 lines and compacts
    (cache,) = (tmp_path / "logs").glob("judge-cache-judge.rank*.jsonl")
    kept = [json.loads(line) for line in cache.read_text().splitlines()]
    assert len(kept) == 1 and not list(cache.parent.glob("*.tmp"))
    # A resumed judge: the newest reply ("6", row 3) from the file, the others asked again.
    values, got = _score(tmp_path, judge)
    assert values == [0.6] * 3 and got["judge_cache_hits"] == [0.0, 0.0, 1.0]
    assert server.requests == 5
    assert len(cache.read_text().splitlines()) <= 2


def test_a_failed_request_is_retried_and_the_reply_scored(serve, tmp_path: Path) -> None:
    server = serve(lambda n, _: (500, "", 0.0) if n == 1 else (200, "Score: 8", 0.0))
    values, got = _score(tmp_path, _judge(url=server.url, retries=2), rows=1)
    assert values == [0.8] and server.requests == 2
    assert got == {
        "judge_calls": [2.0],
        "judge_cache_hits": [0.0],
        "judge_failures": [0.0],
        "judge_unparsed": [0.0],
    }


def test_the_request_carries_the_rubric_the_system_and_the_key(
    serve, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    server = serve(lambda n, _: (200, "7", 0.0))
    judge = _judge(
        url=server.url,
        system="You grade.",
        rubric="Q: {prompt}\nA: {completion}\nRef: {answer}",
        api_key_env="JUDGE_KEY",
        max_tokens=4,
    )
    values, _ = _score(tmp_path, judge, rows=1, columns={"answer": "0"})
    (body,) = server.bodies
    assert values == [0.7]
    assert body["model"] == "judge-m" and body["max_tokens"] == 4 and body["temperature"] == 0
    assert body["messages"] == [
        {"role": "system", "content": "You grade."},
        {"role": "user", "content": "Q: What is 0+0?\nA: 2\nRef: 0"},
    ]
    assert body["auth"] == "Bearer sekrit"


@pytest.mark.parametrize(("on_failure", "value"), [("zero", 0.0), ("skip", None)])
def test_a_garbage_reply_is_unparsed_and_scored_by_on_failure(
    serve, tmp_path: Path, on_failure: str, value: float | None
) -> None:
    server = serve(lambda n, _: (200, "I cannot grade this.", 0.0))
    values, got = _score(tmp_path, _judge(url=server.url, on_failure=on_failure))
    assert values == [value] * 3
    assert got["judge_unparsed"] == [1.0] * 3 and got["judge_failures"] == [0.0] * 3


def test_on_failure_fail_names_the_judge_the_row_and_the_reply(serve, tmp_path: Path) -> None:
    server = serve(lambda n, body: (200, "8" if "Rate: 6" not in str(body) else "great!", 0.0))
    with pytest.raises(RewardFunctionError) as err:
        _score(tmp_path, _judge(url=server.url, on_failure="fail"))
    assert str(err.value) == (
        "grpo.rewards.0.judge (judge judge-m) raised JudgeFailed: judge judge-m replied "
        "'great!', which has no score in [0, 10] on row 2 (prompts.jsonl:3): prompt "
        "'What is 2+2?', response '6'"
    )


def test_a_slow_judge_fails_within_its_timeout(serve, tmp_path: Path) -> None:
    server = serve(lambda n, _: (200, "9", 3.0))
    t0 = time.monotonic()
    values, got = _score(tmp_path, _judge(url=server.url, timeout_s=0.5, retries=1), rows=2)
    # Two tries of 0.5 s and a 0.5 s backoff per row, the rows concurrent.
    assert time.monotonic() - t0 < 2.9
    assert values == [0.0, 0.0]
    assert got["judge_failures"] == [1.0, 1.0] and got["judge_calls"] == [2.0, 2.0]


def test_a_slow_judge_that_must_not_fail_says_why(serve, tmp_path: Path) -> None:
    server = serve(lambda n, _: (200, "9", 3.0))
    with pytest.raises(
        RewardFunctionError,
        match="gave no answer after 1 tries: judge server "
        r"http://127.0.0.1:\d+ did not answer /v1/chat/completions within 0.5 s",
    ):
        _score(tmp_path, _judge(url=server.url, timeout_s=0.5, retries=0, on_failure="fail"), 1)


def test_a_response_judged_before_is_not_asked_again(serve, tmp_path: Path) -> None:
    server = serve(lambda n, _: (200, "6", 0.0))
    judge = _judge(url=server.url)
    first, got = _score(tmp_path, judge)
    assert first == [0.6] * 3 and server.requests == 3 and got["judge_cache_hits"] == [0.0] * 3
    # A new judge object (a resumed stage) reads the stage's cache file back.
    again, got = _score(tmp_path, judge)
    assert again == first and server.requests == 3 and got["judge_calls"] == [0.0] * 3
    assert got["judge_cache_hits"] == [1.0] * 3
    # Another rubric is another judgement.
    _score(tmp_path, judge | {"rubric": "Grade: {completion}"})
    assert server.requests == 6


def test_a_column_the_rows_lack_fails_with_the_row_before_any_request(
    serve, tmp_path: Path
) -> None:
    server = serve(lambda n, _: (200, "6", 0.0))
    with pytest.raises(RewardFunctionError) as err:
        _score(tmp_path, _judge(url=server.url, rubric="{completion} vs {answr}"), rows=2,
               columns={"answer": "4"})  # fmt: skip
    assert str(err.value) == (
        "grpo.rewards.0.judge (judge judge-m) raised KeyError('answr') on row 0 "
        "(prompts.jsonl:1): prompt 'What is 0+0?', response '2'; the row's columns are: answer "
        "(beside prompts, completions, completion_ids, stopped); did you mean answer?"
    )
    assert server.requests == 0


def test_the_rubric_and_the_judge_model_folder_enter_the_stage_fingerprint(tmp_path: Path) -> None:
    from test_fingerprint_rule import JUDGE, _base, _files, _prints

    _files(tmp_path)
    base = _base(tmp_path)
    first = _prints(base, ["ppo"])
    base["ppo"]["rewards"][0]["judge"] = JUDGE | {"rubric": "Grade strictly: {completion}"}
    assert _prints(base, ["ppo"]) != first
    folder = tmp_path / "judge-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    base["ppo"]["rewards"][0]["judge"] = JUDGE | {"model": str(folder)}
    by_folder = _prints(base, ["ppo"])
    (folder / "config.json").write_text('{"hidden_size": 8}')
    assert _prints(base, ["ppo"]) != by_folder  # its files, not only its name
    base["ppo"]["rewards"][0]["judge"] = JUDGE | {"timeout_s": 5.0, "max_concurrency": 2}
    assert _prints(base, ["ppo"]) == first  # how it is asked is not what it judges


JUDGE_GRPO = """
    sft:
      data: {{synthetic: {{n_examples: 50}}}}
    grpo:
      data: {{path: {d}/prompts.jsonl}}
      rewards:
        - judge: {{{server}, model: judge-m, rubric: "{{completion}} vs {{{column}}}"}}
"""


@pytest.mark.parametrize(
    ("server", "column", "line"),
    [
        (
            "url: 'http://127.0.0.1:9'",
            "answer",
            "grpo.rewards.0.judge: judge-m at http://127.0.0.1:9, scored by number in [0, 10]",
        ),
        (
            "url: 'http://127.0.0.1:9'",
            "topic",
            "  grpo.rewards.0.judge.rubric: {{topic}} is not a column of {d}/prompts.jsonl:1 (its "
            "columns: answer)",
        ),
        (
            "command: 'transformers serve --port {{port}}'",
            "answer",
            "  grpo.rewards.0.judge.command: `transformers serve` needs not_installed_xyz (not "
            "installed): pip install 'posttrain[serving]'",
        ),
    ],
)
def test_validate_says_what_a_judge_asks_or_why_it_cannot(
    tmp_path: Path, monkeypatch, server: str, column: str, line: str
) -> None:
    from test_inputs_check import _jsonl, _recipe, _validate

    # A machine without one of the modules `transformers serve` needs.
    monkeypatch.setattr(judge_check, "SERVING_MODULES", ("not_installed_xyz",))
    _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    recipe = _recipe(tmp_path, JUDGE_GRPO, server=server, column=column)
    code, lines = _validate(recipe)
    assert line.format(d=tmp_path) in lines, lines
    assert code == (0 if "scored by" in line else 2)


def test_a_judge_command_that_dies_fails_naming_the_field_and_what_it_said(
    tmp_path: Path,
) -> None:
    command = "python -c \"print('no GPU here'); raise SystemExit(3)\" {port}"
    funcs = load_rewards(
        [RewardSpec.model_validate({"judge": _judge(url=None, command=command)})],
        where="grpo.rewards",
    )
    with pytest.raises(ServerFailed) as err, judge_servers(funcs, tmp_path):
        pass
    assert str(err.value).startswith("judge server http://127.0.0.1:")
    assert str(err.value).endswith(
        "did not come up: its process exited with code 3; it last said: no GPU here (its "
        "process exited with code 3)"
    )


def test_a_judge_command_is_stopped_when_the_block_ends(tmp_path: Path) -> None:
    from test_rollout_server import left_running

    # A stdlib file server stands for the judge: healthy at `/`, stopped with the block.
    command = "python -m http.server {port} --bind {host}"
    judge = _judge(url=None, command=command, health_path="/")
    funcs = load_rewards([RewardSpec.model_validate({"judge": judge})], where="grpo.rewards")
    with judge_servers(funcs, tmp_path):
        log = (tmp_path / "logs" / "judge-judge.log").read_text().splitlines()
        pgid = int([x for x in log if x.startswith("== process group ")][-1].split()[-1])
        assert left_running(pgid)
        assert (tmp_path / "logs" / "judge-judge.json").exists()
    assert not left_running(pgid) and not (tmp_path / "logs" / "judge-judge.json").exists()
