"""Environments from the recipe's folder: one instance per episode, its public methods the
episode's tools, a gym-like step for games; its own failures named in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.agents.environment import EnvironmentFailed, Episode, load_environment
from posttrain.agents.tools import ToolLoadError
from posttrain.data.errors import DataError
from posttrain.rl.rollout.multiturn import EpisodeSetup

ENVS = '''
class Counter:
    """Count up to the row's target with a tool."""

    def reset(self, target, **columns):
        self.target, self.value = target, 0
        return f"Count to {target}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0

    def _helper(self):
        return None


class Guess:
    """Higher or lower."""

    def reset(self, secret, **columns):
        self.secret = secret

    def step(self, message):
        guess = int(message["content"])
        if guess == self.secret:
            return [], 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


class BadReset:
    def reset(self, **columns):
        raise KeyError("secret")

    def step(self, message):
        return [], 0.0, True


class WrongTypes:
    def reset(self, **columns):
        return 7

    def step(self, message):
        return message["content"]

    def get_reward(self):
        return float("nan")


class Nothing:
    def reset(self, **columns):
        return None


class Undocumented:
    def reset(self, **columns):
        return None

    def lookup(self, key):
        return key
'''


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "envs.py").write_text(ENVS)
    return tmp_path


def test_a_tool_environment_gives_each_episode_its_own_state(folder: Path) -> None:
    env = load_environment("envs:Counter", [folder])
    assert env.tool_names == ["increment"] and not env.is_gym and env.has_reward
    a, b = Episode(env, "train.jsonl:1"), Episode(env, "train.jsonl:2")
    assert a.reset({"target": 3, "answer": "x"}) == "Count to 3."
    b.reset({"target": 5})
    assert a.tools()["increment"](by=3) == 3 and b.tools()["increment"](by=1) == 1
    assert (a.reward(), b.reward()) == (1.0, 0.0)
    assert env.schemas[0]["function"]["parameters"]["properties"]["by"]["type"] == "integer"


def test_a_gym_environment_answers_each_turn(folder: Path) -> None:
    env = load_environment("envs:Guess", [folder])
    assert env.is_gym and env.tool_names == [] and not env.has_reward
    ep = Episode(env, "train.jsonl:1")
    assert ep.reset({"secret": 42}) is None
    first = ep.step({"role": "assistant", "content": "50"})
    assert first.observations == [{"role": "user", "content": "lower"}] and not first.done
    last = ep.step({"role": "assistant", "content": "42"})
    assert (last.observations, last.reward, last.done) == ([], 1.0, True)
    assert ep.reward() is None


@pytest.mark.parametrize(
    ("cls", "method", "columns", "words"),
    [
        (
            "BadReset",
            "reset",
            {},
            "BadReset.reset raised KeyError: 'secret' (row data/train.jsonl:7)",
        ),
        (
            "WrongTypes",
            "reset",
            {},
            "WrongTypes.reset returned int, not str or None (row data/train.jsonl:7",
        ),
        ("WrongTypes", "step", None, "WrongTypes.step did not return (observations, reward, done)"),
        (
            "WrongTypes",
            "get_reward",
            None,
            "WrongTypes.get_reward returned nan, not a finite number",
        ),
    ],
)
def test_an_environments_failure_is_one_line_naming_class_method_and_row(
    folder: Path, cls: str, method: str, columns: dict | None, words: str
) -> None:
    ep = Episode(load_environment(f"envs:{cls}", [folder]), "data/train.jsonl:7")
    with pytest.raises(EnvironmentFailed) as info:
        if method == "reset":
            ep.reset(columns or {})
        elif method == "step":
            ep.step({"role": "assistant", "content": "1"})
        else:
            ep.reward()
    assert words in str(info.value) and "\n" not in str(info.value)


def test_classes_outside_the_protocol_are_refused_at_load(folder: Path) -> None:
    with pytest.raises(ToolLoadError, match="Nothing has neither tools"):
        load_environment("envs:Nothing", [folder])
    with pytest.raises(ToolLoadError, match=r"envs:Undocumented\.lookup: cannot describe it"):
        load_environment("envs:Undocumented", [folder])
    (folder / "notcls.py").write_text("def f():\n    return 1\n")
    with pytest.raises(ToolLoadError, match="not a class"):
        load_environment("notcls:f", [folder])


def test_the_shipped_number_game_answers_higher_lower_and_costs_turns() -> None:
    from posttrain.data.guess import guess_prompts

    env = load_environment("guess_number:GuessNumber", [Path(__file__).parents[1] / "recipes"])
    assert env.is_gym and not env.tool_names and not env.has_reward
    row = guess_prompts(1, 0)[0]
    ep = Episode(env, "synthetic row 0")
    target = row["columns"]["target"]
    assert ep.reset(row["columns"]) is None  # the prompt says it all
    said = [ep.step({"role": "assistant", "content": c}) for c in ("9", "no idea", "= 9 26: 99")]
    assert [s.observations[0]["content"] for s in said] == ["higher", "Say a number.", "lower"]
    assert [(s.reward, s.done) for s in said] == [(-0.1, False)] * 3
    found = ep.step({"role": "assistant", "content": f"{target}"})
    assert (found.reward, found.done) == (pytest.approx(0.9), True)


def test_the_guess_sft_games_are_ones_the_environment_plays_back() -> None:
    from posttrain.data.guess import guess_prompts, guess_sft_rows

    env = load_environment("guess_number:GuessNumber", [Path(__file__).parents[1] / "recipes"])
    rows = guess_sft_rows(50, 3)
    assert rows == guess_sft_rows(50, 3)
    for row in rows:
        msgs = row["messages"]
        # The prompt is the RL task's, so the SFT policy is asked what it learned on.
        assert msgs[:2] == guess_prompts(1, 0)[0]["messages"]
        ep = Episode(env, "trace")
        ep.reset({"target": int(msgs[-1]["content"].split(": ")[1])})
        replies, answers = msgs[2::2], [m["content"] for m in msgs[3::2]]
        said = [ep.step(m) for m in replies]
        assert [s.observations[0]["content"] for s in said[:-1]] == answers
        assert said[-1].done and not any(s.done for s in said[:-1])
        # Each reply's bounds are what the answers before it set, and its guess is between them.
        low, high = 9, 26
        for reply, answer in zip(replies, [*answers, None], strict=True):
            bounds, guess = reply["content"].split(": ")
            assert bounds == f"= {low} {high}" and low < int(guess) < high
            if answer is not None:
                low, high = (int(guess), high) if answer == "higher" else (low, int(guess))


def test_each_row_plays_the_class_its_environment_column_names(folder: Path) -> None:
    """Several classes in one stage: a row's episode gets its own class's instance and tools,
    reset() gets the row's columns without the `environment` one, and a row naming no class
    fails naming its file and line."""
    envs = {
        n: load_environment(f"{folder}/envs.py:{c}")
        for n, c in (("count", "Counter"), ("guess", "Guess"))
    }
    setup = EpisodeSetup(None, None, None, {}, None, envs, False)  # type: ignore[arg-type]
    assert setup.routed and setup.env_rewards
    prompts = [
        ([{"role": "user", "content": "Go."}], {"environment": "count", "target": 2}, "p.jsonl:1"),
        ([{"role": "user", "content": "Go."}], {"environment": "guess", "secret": 5}, "p.jsonl:2"),
    ]
    rows, episodes = setup.start(prompts)
    assert [r.get("environment") for r in rows] == [None, None]
    assert [type(e.instance).__name__ for e in episodes] == ["Counter", "Guess"]
    assert episodes[0].reset({k: v for k, v in rows[0].items() if k != "prompt"}) == "Count to 2."
    assert list(episodes[0].tools()) == ["increment"] and episodes[1].tools() == {}
    with pytest.raises(DataError) as exc:
        setup.start([([{"role": "user", "content": "Go."}], {"environment": "cuont"}, "p.jsonl:3")])
    assert str(exc.value) == (
        "p.jsonl:3: names environment 'cuont', which rollout.environment does not list "
        "(count, guess); did you mean 'count'?"
    )
    with pytest.raises(DataError, match=r"^p.jsonl:4: has no 'environment' column naming its "):
        setup.start([([{"role": "user", "content": "Go."}], {}, "p.jsonl:4")])
    # One class: every row plays it, and an `environment` column is just another column.
    single = EpisodeSetup(None, None, None, {}, None, {"": envs["count"]}, False)  # type: ignore[arg-type]
    rows, episodes = single.start([([], {"environment": "x", "target": 1}, "p.jsonl:5")])
    assert not single.routed and rows[0]["environment"] == "x"
