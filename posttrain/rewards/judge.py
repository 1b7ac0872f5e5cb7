"""A model as judge: a reward "function" that asks a model behind an OpenAI-compatible server
(`/v1/chat/completions`) to score each response by the recipe's rubric (`judge:` of a reward
entry, `posttrain.sections.judge.JudgeConfig`).

`JudgeReward` takes TRL's reward-function call (prompts, completions, **columns) and returns one
score in [0, 1] (or None) per row, so the rewarder calls it like any function:
1. every row's request is rendered first (a column the rubric reads and a row lacks fails before
   any request, naming the row);
2. rows judged before (same judge identity, same rendered request) come from the cache;
3. the others are requested, `max_concurrency` at a time, each with its own timeout and retries
   with backoff: no row waits more than about timeout_s x (retries + 1);
4. replies are parsed (`posttrain.rewards.judge_parse`); an unparsed reply or a request that
   failed every try scores per `on_failure`.
Counters (`posttrain.rewards.counters`, into the step records): judge_calls (requests sent),
judge_cache_hits, judge_failures (no answer after retries), judge_unparsed.

The server (`url`, or the stage's own one started from `command`) is opened by
`posttrain.rewards.judge_server.judge_servers` around the stage's use of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from posttrain.errors import StageVerdict
from posttrain.rewards import counters
from posttrain.rewards.extract import completion_text
from posttrain.rewards.judge_parse import parse_choice, parse_number
from posttrain.sections.judge import JudgeConfig
from posttrain.serving.client import ServerClient, ServerFailed
from posttrain.store.artifacts import path_identity

CHAT_PATH = "/v1/chat/completions"
# Judgements kept in memory (a few hundred bytes each); the cache file holds at most twice as
# many lines before it is rewritten with these.
CACHE_SIZE = 100_000


class JudgeFailed(StageVerdict):
    """`on_failure: fail` and a row the judge gave no score for. `row`: its index in the call
    (`posttrain.rewards.combine` names the row from it without calling again)."""

    def __init__(self, message: str, row: int) -> None:
        super().__init__(message)
        self.row = row


class MissingColumn(KeyError):
    """A column the rubric reads that row `row` lacks (reported like a function's KeyError)."""

    def __init__(self, name: str, row: int) -> None:
        super().__init__(name)
        self.row = row

    def __repr__(self) -> str:  # how the row's error shows it: as a function's KeyError
        return f"KeyError({self.args[0]!r})"


def model_identity(model: str) -> Any:
    """A local model folder by its files' identity; a name (hub id, an API's model) by its text."""
    path = Path(model).expanduser()
    return {"folder": path_identity(path)} if path.is_dir() else model


def judge_identity(cfg: JudgeConfig) -> str:
    """sha256 of what decides a judgement besides the request: the model, rubric, system
    message, parse rule and sampling (never the server's address nor its key)."""
    keys = ("rubric", "system", "score", "range", "choices", "max_tokens", "temperature")
    what = {k: getattr(cfg, k) for k in keys} | {"model": model_identity(cfg.model)}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=list).encode()).hexdigest()


def prompt_text(prompt: Any) -> str:
    """The conversation before the reply, as text: a lone message's content, else one
    `role: content` paragraph per message."""
    if isinstance(prompt, str):
        return prompt
    messages = [m for m in prompt if isinstance(m, dict)]
    if len(messages) == 1:
        return completion_text([messages[0]])
    return "\n\n".join(f"{m.get('role', '?')}: {completion_text([m])}" for m in messages)


class JudgeReward:
    """One judge entry, callable as a reward function (see the module docstring)."""

    def __init__(self, cfg: JudgeConfig, label: str) -> None:
        self.cfg, self.label = cfg, label
        self.identity = judge_identity(cfg)
        self.client: ServerClient | None = None
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_file: Path | None = None
        self._file_lines = 0  # lines in the cache file: compacted past 2 x CACHE_SIZE
        self._lock = threading.Lock()
        self.__name__ = label  # how signature checks and logs name a function

    # -- the server ---------------------------------------------------------------------------
    def open(self, url: str, cache_file: Path | None = None, last_said: Any = None) -> None:
        """Talk to the judge server at `url`; keep judgements in `cache_file` too (read back
        now: a resumed stage does not ask again)."""
        key = os.environ.get(self.cfg.api_key_env, "") if self.cfg.api_key_env else ""
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self.client = ServerClient(
            url, self.cfg.timeout_s, self.cfg.max_concurrency, last_said, "judge server", headers
        )
        self._cache_file = cache_file
        if cache_file is not None and cache_file.is_file():
            self._load(cache_file)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    # -- the reward function ------------------------------------------------------------------
    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[float | None]:
        if self.client is None:  # a `url` judge used outside `judge_servers`
            if self.cfg.url is None:
                raise RuntimeError(f"judge {self.label}: its server was not started")
            self.open(self.cfg.url)
        bodies = [self._body(i, prompts, completions, columns) for i in range(len(completions))]
        keys = [self._key(b) for b in bodies]
        replies: list[str | None] = [self._cached(k) for k in keys]
        hits = [float(r is not None) for r in replies]
        todo = [i for i, r in enumerate(replies) if r is None]
        calls, errors = [0.0] * len(bodies), [""] * len(bodies)
        with ThreadPoolExecutor(min(self.cfg.max_concurrency, max(1, len(todo)))) as pool:
            asked = pool.map(self._ask, [bodies[i] for i in todo])
            for i, (reply, tries, error) in zip(todo, asked, strict=True):
                replies[i], calls[i], errors[i] = reply, float(tries), error
                if reply is not None:
                    self._remember(keys[i], reply)
        return self._scores(replies, errors, hits, calls)

    def _scores(
        self, replies: list[str | None], errors: list[str], hits: list[float], calls: list[float]
    ) -> list[float | None]:
        failed = [float(r is None) for r in replies]
        values = [None if r is None else self.parse(r) for r in replies]
        unparsed = [
            float(r is not None and v is None) for r, v in zip(replies, values, strict=True)
        ]
        counters.record("judge_calls", calls)
        counters.record("judge_cache_hits", hits)
        counters.record("judge_failures", failed)
        counters.record("judge_unparsed", unparsed)
        out: list[float | None] = []
        for i, (reply, value) in enumerate(zip(replies, values, strict=True)):
            if value is not None:
                out.append(value)
            elif self.cfg.on_failure == "fail":
                raise JudgeFailed(self._failure(reply, errors[i]), i)
            else:
                out.append(0.0 if self.cfg.on_failure == "zero" else None)
        return out

    def _failure(self, reply: str | None, error: str) -> str:
        if reply is None:
            tries = self.cfg.retries + 1
            return f"judge {self.cfg.model} gave no answer after {tries} tries: {error}"
        said = " ".join(reply.split())[:200]
        return f"judge {self.cfg.model} replied {said!r}, which has no {self._rule()}"

    def _rule(self) -> str:
        if self.cfg.score == "number":
            lo, hi = self.cfg.range
            return f"score in [{lo:g}, {hi:g}]"
        return "choice among " + ", ".join(self.cfg.choices)

    def parse(self, reply: str) -> float | None:
        if self.cfg.score == "number":
            return parse_number(reply, *self.cfg.range)
        return parse_choice(reply, self.cfg.choices)

    def _body(
        self, i: int, prompts: Sequence[Any], completions: Sequence[Any], columns: dict
    ) -> dict:
        values = {}
        for name in self.cfg.columns:
            value = columns.get(name, [None] * len(completions))[i]
            if value is None:
                raise MissingColumn(name, i)
            values[name] = value
        text = self.cfg.rubric.format(
            prompt=prompt_text(prompts[i]), completion=completion_text(completions[i]), **values
        )
        system = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return {
            "model": self.cfg.model,
            "messages": [*system, {"role": "user", "content": text}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "stream": False,
        }

    def _ask(self, body: dict) -> tuple[str | None, int, str]:
        """(the reply's text or None, requests sent, the last error)."""
        assert self.client is not None
        error = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(min(5.0, 0.5 * 2 ** (attempt - 1)))  # backoff: 0.5, 1, 2, 4, 5 s
            try:
                answer = self.client.post(CHAT_PATH, body)
                return str(answer["choices"][0]["message"]["content"] or ""), attempt + 1, ""
            except ServerFailed as exc:
                error = str(exc)
            except (KeyError, IndexError, TypeError):
                error = f"answered {CHAT_PATH} without choices[0].message.content"
        return None, self.cfg.retries + 1, error

    # -- the cache ----------------------------------------------------------------------------
    def _key(self, body: dict) -> str:
        request = json.dumps(body["messages"], sort_keys=True)
        return hashlib.sha256(f"{self.identity}\0{request}".encode()).hexdigest()

    def _cached(self, key: str) -> str | None:
        with self._lock:
            reply = self._cache.get(key)
            if reply is not None:
                self._cache.move_to_end(key)
            return reply

    def _remember(self, key: str, reply: str) -> None:
        with self._lock:
            self._keep(key, reply)
            if self._cache_file is not None:
                with open(self._cache_file, "a") as f:
                    f.write(json.dumps([key, reply]) + "\n")
                self._file_lines += 1
                if self._file_lines > 2 * CACHE_SIZE:
                    self._compact()

    def _keep(self, key: str, reply: str) -> None:
        """In memory, the newest last; the oldest dropped past CACHE_SIZE."""
        self._cache[key] = reply
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    def _load(self, path: Path) -> None:
        """A resumed stage's judgements, the newest CACHE_SIZE of them (a line cut short by a
        killed stage is skipped); a file grown past twice that is rewritten with them."""
        lines = path.read_text().splitlines()
        for line in lines:
            try:
                k, reply = json.loads(line)
            except (ValueError, TypeError):
                continue
            self._keep(k, reply)
        self._file_lines = len(lines)
        if self._file_lines > 2 * CACHE_SIZE:
            self._compact()

    def _compact(self) -> None:
        """The cache file rewritten with what memory keeps (at most CACHE_SIZE lines), by an
        atomic replace: appended to for a whole run, it would grow with every judgement."""
        assert self._cache_file is not None
        tmp = self._cache_file.with_name(self._cache_file.name + ".tmp")
        tmp.write_text("".join(json.dumps([k, r]) + "\n" for k, r in self._cache.items()))
        os.replace(tmp, self._cache_file)
        self._file_lines = len(self._cache)
