"""`posttrain validate` and `plan` check every input without training (issue 29, point 1):
real recipe files, data files and reward modules in tmp_path; the texts the issue quotes."""

from __future__ import annotations

import io
import json
import re
import textwrap
from pathlib import Path

import pytest

from flows.cli import cmd_plan, cmd_validate, main
from flows.failure_block import stage_failure_block
from posttrain.config.inputs_check import stage_data_problems
from posttrain.config.loader import load_recipe
from posttrain.plan.planner import plan
from posttrain.store.artifacts import write_manifest

HEAD = """
    run: {{name: checks, workspace: {ws}}}
    infra: {{device: cpu, precision: fp32}}
    ingest: {{source: from_config}}
"""
SFT = """
    sft:
      data: {{synthetic: {{n_examples: 50}}}}
"""


def _recipe(tmp_path: Path, body: str = SFT, **fmt: object) -> Path:
    path = tmp_path / "r.yaml"
    text = textwrap.dedent(HEAD) + textwrap.dedent(body)
    path.write_text(text.format(ws=tmp_path / "ws", d=tmp_path, **fmt))
    return path


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _validate(path: Path, overrides: list[str] | None = None) -> tuple[int, list[str]]:
    out, err = io.StringIO(), io.StringIO()
    code = cmd_validate(str(path), overrides or [], out, err)
    assert err.getvalue() == "", err.getvalue()
    return code, out.getvalue().splitlines()


def _plan(path: Path) -> tuple[int, list[str]]:
    out, err = io.StringIO(), io.StringIO()
    code = cmd_plan(str(path), [], out, err)
    assert err.getvalue() == "", err.getvalue()
    return code, out.getvalue().splitlines()


DPO_MISSING = """
    sft:
      data: {{synthetic: {{n_examples: 50}}}}
    dpo:
      data: {{path: {d}/data/nope.jsonl}}
"""


@pytest.mark.parametrize("command", [_validate, _plan])
def test_missing_dpo_data_is_refused_naming_the_field(tmp_path: Path, command) -> None:
    code, lines = command(_recipe(tmp_path, DPO_MISSING))
    assert code == 2
    assert lines[0] == f"posttrain: recipe {tmp_path}/r.yaml refused: 1 problem (nothing ran)"
    assert lines[1] == f"  dpo.data.path: {tmp_path}/data/nope.jsonl does not exist"
    assert lines[2].startswith("  fix:  correct the fields named above (or create the files")


def test_stage_refuses_missing_data_naming_the_field(tmp_path: Path) -> None:
    # What a stage checks before loading anything, and the fix its failure block then gives.
    recipe = load_recipe(_recipe(tmp_path, DPO_MISSING))
    problems = stage_data_problems(recipe, "dpo")
    assert problems == [f"dpo.data.path: {tmp_path}/data/nope.jsonl does not exist"]
    assert stage_data_problems(recipe, "sft") == []
    verdict = f"POSTTRAIN_ERROR stage dpo failed: DataFileMissing: {problems[0]}"
    block = stage_failure_block(f"stage 'dpo' failed\n--- end of the log ---\n{verdict}")
    assert block.what == problems[0]
    assert block.fix.startswith("correct dpo.data.path (or create the file), then run again")


def test_missing_ingest_folder_and_folder_without_config(tmp_path: Path) -> None:
    body = "ingest: {{source: path, path: {d}/base}}\nsft:\n  data: {{synthetic: {{}}}}\n"
    path = tmp_path / "r.yaml"
    path.write_text(
        f"run: {{name: checks, workspace: {tmp_path}/ws}}\n"
        "infra: {device: cpu, precision: fp32}\n" + body.format(d=tmp_path).replace("{{", "{")
    )
    code, lines = _validate(path)
    assert (code, lines[:2]) == (
        2,
        [
            f"posttrain: recipe {path} refused: 1 problem (nothing ran)",
            f"  ingest.path: {tmp_path}/base does not exist",
        ],
    )
    (tmp_path / "base").mkdir()
    code, lines = _validate(path)
    assert code == 2
    assert lines[1] == (
        f"  ingest.path: {tmp_path}/base exists but is not a Hugging Face model folder "
        "(no config.json)"
    )


GRPO = """
    sft:
      data: {{synthetic: {{n_examples: 50}}}}
    grpo:
      data: {{path: {d}/prompts.jsonl}}
      rewards: [{{fn: "my_rewards:{fn}"}}]
"""
REWARDS = """
def word_overlap(prompts, completions, answer, **kwargs):
    return [0.0 for _ in completions]


def length_bonus(prompts, completions):
    return [1.0 for _ in completions]


def needs_topic(prompts, completions, topic, **kwargs):
    return [1.0 for _ in completions]
"""


@pytest.mark.parametrize(
    ("fn", "problem"),
    [
        (
            "word_overlapp",
            "my_rewards.py has no function 'word_overlapp' "
            "(it has: length_bonus, needs_topic, word_overlap)",
        ),
        ("length_bonus", "does not take completion_ids, stopped, answer, which posttrain passes"),
        ("needs_topic", "needs topic, which the data's rows lack (columns: answer)"),
    ],
)
def test_reward_function_checked_by_name_and_signature(
    tmp_path: Path, fn: str, problem: str
) -> None:
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    code, lines = _validate(_recipe(tmp_path, GRPO, fn=fn))
    assert code == 2 and lines[0].endswith("refused: 1 problem (nothing ran)")
    assert lines[1].startswith("  grpo.rewards.0.fn: ") and problem in lines[1], lines[1]


def test_good_reward_function_and_prompt_columns(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "2+2?", "answer": "4"}] * 3)
    code, lines = _validate(_recipe(tmp_path, GRPO, fn="word_overlap"))
    assert code == 0 and lines[0] == "recipe ok: 5 stages, 5 to run"
    prompts = tmp_path / "prompts.jsonl"
    assert (
        f"grpo.data.path: {prompts}: prompt (text), columns answer, all 3 rows read: 3 ok" in lines
    )
    assert "grpo.rewards.0.fn: my_rewards.py:word_overlap: takes posttrain's call" in lines


def test_malformed_row_names_file_and_line(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    data = _jsonl(tmp_path / "chat.jsonl", [good, '{"messages": [}', good])
    body = "sft:\n  data: {{path: {d}/chat.jsonl}}\n"
    code, lines = _validate(_recipe(tmp_path, body))
    assert code == 2
    assert lines[1].startswith(f"  sft.data.path: {data}:2: invalid JSON: ")


MSG = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
SHAPES = {
    "sharegpt": (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        "sharegpt (conversations/from/value)",
    ),
    "alpaca": (
        {"instruction": "Add", "input": "2 2", "output": "4"},
        "alpaca (instruction/input/output)",
    ),
    "messages": ({"messages": MSG}, "messages (role/content)"),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_sft_shape_is_printed(tmp_path: Path, name: str) -> None:
    row, shape = SHAPES[name]
    data = _jsonl(tmp_path / f"{name}.jsonl", [row] * 7)
    body = f"sft:\n  data: {{{{path: {{d}}/{name}.jsonl}}}}\n"
    code, lines = _validate(_recipe(tmp_path, body))
    assert code == 0, lines
    # The first 5 only, and the line says so.
    assert f"sft.data.path: {data}: {shape}, first 5 rows read (--full reads all): 5 ok" in lines


def test_ultrafeedback_pairs_shape_and_skip_count(tmp_path: Path) -> None:
    user = {"role": "user", "content": "2+2?"}
    row = {
        "prompt": "2+2?",
        "chosen": [user, {"role": "assistant", "content": "4"}],
        "rejected": [user, {"role": "assistant", "content": "5"}],
    }
    pairs = _jsonl(tmp_path / "uf.jsonl", [row, row, {**row, "rejected": row["chosen"]}])
    body = SFT + "    dpo:\n      data: {{path: {d}/uf.jsonl, on_invalid: skip}}\n"
    code, lines = _validate(_recipe(tmp_path, body))
    assert code == 0, lines
    shape = "prompt/chosen/rejected (message lists, UltraFeedback-style)"
    read = "all 3 rows read: 2 ok, 1 would be skipped "
    assert f"dpo.data.path: {pairs}: {shape}, {read}" in "\n".join(lines)


def test_verdict_counts_stages_to_run(tmp_path: Path) -> None:
    path = _recipe(tmp_path)
    code, lines = _validate(path)
    assert (code, lines[0]) == (0, "recipe ok: 4 stages, 4 to run")
    assert lines[1:] == [
        "ingest: from_config (llama, 4 blocks, hidden 128, vocab 2048); tokenizer and chat "
        "template (chatml) built and checked at ingest",
        "sft.data: synthetic (task quickstart, 50 rows)",
    ]
    ingest = plan(load_recipe(path)).stages[0]
    ingest.out_dir.mkdir(parents=True)
    (ingest.out_dir / "base.txt").write_text("a finished ingest")
    write_manifest(
        ingest.out_dir,
        stage="ingest",
        fp=ingest.fingerprint,
        parents=[],
        section={},
        seed=0,
        summary={},
    )
    assert _validate(path)[1][0] == "recipe ok: 4 stages, 3 to run"


def test_plan_prints_resolved_input_paths(tmp_path: Path) -> None:
    _jsonl(tmp_path / "chat.jsonl", [{"messages": MSG}] * 3)
    code, lines = _plan(_recipe(tmp_path, "sft:\n  data: {{path: {d}/chat.jsonl}}\n"))
    assert code == 0
    at = lines.index("resolved inputs:")
    assert lines[at + 1] == f"  sft.data.path  {tmp_path}/chat.jsonl"


def test_resolved_flag_through_main(tmp_path: Path, capsys) -> None:
    path = _recipe(tmp_path)
    assert main(["validate", str(path), "--resolved"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("recipe ok: 4 stages, 4 to run\n")
    assert "--- # resolved recipe\nrun:\n  name: checks\n" in text
    assert main(["plan", str(path)]) == 0
    assert "--- # resolved recipe" not in capsys.readouterr().out


TOOL_TRACE = {
    "messages": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
}


@pytest.mark.parametrize("template", ["chatml", "chatml_tools"])
def test_chat_template_of_a_local_base_checked_for_tool_rows(tmp_path: Path, template: str) -> None:
    from posttrain.data.synthetic import pretrain_corpus
    from posttrain.models.chatml import TEMPLATES
    from posttrain.models.tiny import train_tokenizer

    base = tmp_path / "base"
    train_tokenizer(pretrain_corpus(100, seed=0), 300).save_pretrained(str(base))
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "t.jinja").write_text(TEMPLATES[template])
    _jsonl(tmp_path / "tools.jsonl", [TOOL_TRACE] * 2)
    path = tmp_path / "r.yaml"
    path.write_text(
        f"run: {{name: checks, workspace: {tmp_path}/ws}}\n"
        "infra: {device: cpu, precision: fp32}\n"
        f"ingest: {{source: path, path: {base}, chat_template: {tmp_path}/t.jinja}}\n"
        f"sft:\n  data: {{path: {tmp_path}/tools.jsonl}}\n"
        "export: {gguf: []}\n"
    )
    code, lines = _validate(path)
    if template == "chatml":
        assert code == 2
        assert lines[1].startswith("  sft.data: the chat template renders no tool calls")
    else:
        assert code == 0, lines
        assert (
            f"chat template of {base}: prefix strategy, system turn accepted, tool calls "
            "hermes, generation prompt ok"
        ) in lines


# An environment as TRL's docs write one for `environment_factory`: tools as documented public
# methods, a `reset(**kwargs)`, no get_reward (the trainer's reward functions score it).
TRL_ENV = '''
class CalcEnv:
    def reset(self, **kwargs):
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b
'''
SECRET_ENV = """
class Secret:
    def reset(self, secret):
        self.secret = secret

    def step(self, message):
        return [], 1.0, True


class Strict:
    def reset(self):
        pass

    def step(self, message):
        return [], 1.0, True
"""
ENV_REWARD = """
def env_reward(environments, **kwargs):
    return [float(env.calls > 0) for env in environments]
"""
ENV_GRPO = """
    sft:
      data: {{synthetic: {{n_examples: 50}}}}
    grpo:
      data: {{path: {d}/prompts.jsonl}}
      rollout: {{environment: "calc_env:CalcEnv", max_turns: 2, samples_per_prompt: 2}}
"""


def test_an_environment_without_get_reward_needs_reward_functions_and_is_refused_at_validate(
    tmp_path: Path,
) -> None:
    (tmp_path / "calc_env.py").write_text(TRL_ENV)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "2+2?", "answer": "4"}] * 3)
    tools = ["ingest.from_config.template=chatml_tools"]  # a template that renders tool calls
    rewarded = ENV_GRPO + '      rewards: [{{fn: "my_rewards:word_overlap"}}]\n'
    code, lines = _validate(_recipe(tmp_path, rewarded), tools)
    assert code == 0, lines
    assert "grpo.rollout.environment: calc_env.py:CalcEnv: tools add" in lines
    # TRL's `def env_reward(environments, **kwargs)`: taken in a stage with an environment,
    # refused in one without, naming why.
    (tmp_path / "env_rewards.py").write_text(ENV_REWARD)
    with_env = ENV_GRPO + '      rewards: [{{fn: "env_rewards:env_reward"}}]\n'
    code, lines = _validate(_recipe(tmp_path, with_env), tools)
    assert (
        code == 0
        and "grpo.rewards.0.fn: env_rewards.py:env_reward: takes posttrain's call" in lines
    )
    plain = GRPO.replace("my_rewards:{fn}", "env_rewards:env_reward")
    code, lines = _validate(_recipe(tmp_path, plain, fn=""))
    assert code == 2 and lines[1].endswith(
        "needs environments, which only a stage with a rollout.environment passes"
    ), lines
    # reset(**row_columns) is held against the data's columns, as reward functions are.
    (tmp_path / "secret_env.py").write_text(SECRET_ENV)
    secret = rewarded.replace("calc_env:CalcEnv", "secret_env:Secret")
    code, lines = _validate(_recipe(tmp_path, secret), tools)
    assert code == 2 and lines[1] == (
        "  grpo.rollout.environment: Secret.reset(self, secret) needs secret, which the data's "
        "rows lack (columns: answer)"
    ), lines
    code, lines = _validate(_recipe(tmp_path, secret.replace("Secret", "Strict")), tools)
    assert code == 2 and lines[1] == (
        "  grpo.rollout.environment: Strict.reset(self) does not take the columns answer: add "
        "**kwargs"
    ), lines
    code, lines = _validate(_recipe(tmp_path, ENV_GRPO), tools)
    assert code == 2 and lines[0].endswith("refused: 1 problem (nothing ran)"), lines
    assert lines[1] == (
        "  grpo.rollout.environment: CalcEnv has no get_reward() and no step(), and grpo.rewards "
        "is empty: its episodes would have no reward; add a get_reward() method or list reward "
        "functions in grpo.rewards"
    )


MULTI_GRPO = """
    sft:
      data: {{synthetic: {{n_examples: 50}}}}
    grpo:
      data: {{path: {d}/multi.jsonl}}
      rollout:
        environment: {{calc: "calc_env:CalcEnv", secret: "secret_env:Secret"}}
        max_turns: 2
        samples_per_prompt: 2
      rewards: [{{fn: "env_rewards:env_reward"}}]
"""


def test_several_environments_are_checked_each_and_every_row_names_one(tmp_path: Path) -> None:
    """TRL's multi-environment shape: a mapping of classes, each row naming its own in an
    `environment` column that reset() never gets; a row naming none is refused at validate."""
    (tmp_path / "calc_env.py").write_text(TRL_ENV)
    (tmp_path / "secret_env.py").write_text(SECRET_ENV)
    (tmp_path / "env_rewards.py").write_text(ENV_REWARD)
    rows = [
        {"prompt": "2+2?", "environment": "calc"},
        {"prompt": "Guess.", "environment": "secret", "secret": 3},
    ]
    _jsonl(tmp_path / "multi.jsonl", rows)
    tools = ["ingest.from_config.template=chatml_tools"]
    code, lines = _validate(_recipe(tmp_path, MULTI_GRPO), tools)
    assert code == 0, lines
    assert "grpo.rollout.environment.calc: calc_env.py:CalcEnv: tools add" in lines
    assert "grpo.rollout.environment.secret: secret_env.py:Secret: step() environment" in lines
    _jsonl(tmp_path / "multi.jsonl", [*rows, {"prompt": "Again.", "environment": "secrte"}])
    code, lines = _validate(_recipe(tmp_path, MULTI_GRPO), tools)
    assert code == 2 and lines[1] == (
        f"  {tmp_path}/multi.jsonl:3: names environment 'secrte', which rollout.environment "
        "does not list (calc, secret); did you mean 'secret'? (grpo.rollout.environment)"
    ), lines
    # A bad name past the first rows: the default check reads 5 rows, --full reads them all.
    late = [*rows, *rows, *rows, {"prompt": "Late.", "environment": "cal"}]
    _jsonl(tmp_path / "multi.jsonl", late)
    assert _validate(_recipe(tmp_path, MULTI_GRPO), tools)[0] == 0
    out = io.StringIO()
    code = cmd_validate(str(_recipe(tmp_path, MULTI_GRPO)), tools, out, io.StringIO(), full=True)
    assert (
        code == 2
        and (
            f"  {tmp_path}/multi.jsonl:7: names environment 'cal', which rollout.environment does "
            "not list (calc, secret); did you mean 'calc'? (grpo.rollout.environment)"
        )
        in out.getvalue().splitlines()
    ), out.getvalue()
    # Each class's tools are described to the template at validate: one it cannot describe is
    # refused by its own field.
    _jsonl(tmp_path / "multi.jsonl", rows)
    undocumented = re.sub(r'        """Add two.*?"""\n', "", TRL_ENV, flags=re.S)
    (tmp_path / "bad_env.py").write_text(undocumented)
    bad = MULTI_GRPO.replace("calc_env:CalcEnv", "bad_env:CalcEnv")
    code, lines = _validate(_recipe(tmp_path, bad), tools)
    assert code == 2 and lines[1] == (
        f"  grpo.rollout.environment.calc: {tmp_path}/bad_env.py:CalcEnv.add: cannot describe it "
        "to the model: Cannot generate JSON schema for add because it has no docstring! (a tool "
        "needs type hints on every argument and a Google-style docstring with an Args: section)"
    ), lines
    # Without rewards, the class that cannot score itself is named by its own field.
    unrewarded = MULTI_GRPO.replace('      rewards: [{{fn: "env_rewards:env_reward"}}]\n', "")
    code, lines = _validate(_recipe(tmp_path, unrewarded), tools)
    assert code == 2 and lines[1].startswith(
        "  grpo.rollout.environment.calc: CalcEnv has no get_reward() and no step(), and "
        "grpo.rewards is empty"
    ), lines


CODE_GRPO = """
    sft:
      data: {{synthetic: {{n_examples: 50}}}}
    grpo:
      data: {{path: {d}/prompts.jsonl}}
      rewards: [{{fn: "posttrain.rewards.code:code_tests", kwargs: {kwargs}}}]
"""


def test_code_verifier_kwargs_checked_at_validate(tmp_path: Path) -> None:
    """The code verifier's settings are refused by field before anything runs; good ones pass
    (this host runs bubblewrap: `scripts/dev.sh test` installs it)."""
    _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "add?", "test_list": ["assert add(1, 2) == 3"]}])
    code, lines = _validate(_recipe(tmp_path, CODE_GRPO, kwargs="{scoring: most}"))
    assert code == 2, lines
    assert lines[1] == (
        "  grpo.rewards.0.kwargs: scoring must be one of ('fraction', 'all'), got 'most'"
    ), lines[1]
    code, lines = _validate(_recipe(tmp_path, CODE_GRPO, kwargs="{sandbox: bwrap}"))
    assert code == 0, lines
    assert "grpo.rewards.0.fn: posttrain.rewards.code:code_tests: takes posttrain's call" in lines
