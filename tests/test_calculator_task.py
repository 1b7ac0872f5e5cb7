"""The agent demo's pieces: the ChatML template with tools (hermes calls, parsed back), the
generated calculator traces (schemas equal to recipes/calculator.py's, answers right, seeded),
ingest recording a template's tool format, and a real tiny SFT on the traces (slow)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import yaml
from chat_template_fixtures import FIXTURES, base_tokenizer, with_chat_tokens
from stage_helpers import TINY, run_inprocess, write_recipe
from tool_templates import STYLES

from posttrain.agents.tool_calls import ToolCall, format_of_template, parse_reply
from posttrain.agents.tools import load_tools
from posttrain.data.calculator import calculator_schemas, calculator_sft_rows
from posttrain.data.chat import IGNORE, encode_chat, render, template_info
from posttrain.kinds.ingest import IngestConfig
from posttrain.models.chatml import CHATML_TEMPLATE, CHATML_TOOLS_TEMPLATE
from posttrain.models.tiny import IM_END
from posttrain.stages.ingest import install_template
from posttrain.telemetry.records import read_metrics

ROOT = Path(__file__).resolve().parents[1]
REFS = ["calculator:add", "calculator:subtract", "calculator:multiply"]


def _tok():
    return with_chat_tokens(base_tokenizer(), CHATML_TOOLS_TEMPLATE, (), None, IM_END)


def test_the_schemas_are_those_of_the_recipe_tools() -> None:
    tools = load_tools(REFS, roots=[ROOT / "recipes"])
    assert calculator_schemas() == [t.schema for t in tools]
    assert all(r["tools"] == calculator_schemas() for r in calculator_sft_rows(5, 0))


def test_traces_are_seeded_and_answer_exactly() -> None:
    rows = calculator_sft_rows(60, 3)
    assert rows == calculator_sft_rows(60, 3) and rows != calculator_sft_rows(60, 4)
    fns = {t.name: t.fn for t in load_tools(REFS, roots=[ROOT / "recipes"])}
    signs = {"+": "add", "-": "subtract", "*": "multiply"}
    assert {r["messages"][1]["content"].split()[3] for r in rows} == set(signs)
    for r in rows:
        system, user, call_turn, result, final = r["messages"]
        _, _, a, sign, b = user["content"].rstrip("?").split()
        (call,) = call_turn["tool_calls"]
        assert call["function"] == {"name": signs[sign], "arguments": {"a": int(a), "b": int(b)}}
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        answer = str(fns[signs[sign]](int(a), int(b)))
        assert r["answer"] == result["content"] == final["content"] == answer
        assert result["tool_call_id"] == call["id"] and system["role"] == "system"


def test_the_warm_up_corpus_reads_the_result_back() -> None:
    from posttrain.data.calculator import calculator_corpus

    # The answer follows the tool's result, never the call alone: a warm-up on "call, then the
    # sum" taught the tiny base to guess sums, and SFT then answered 6% of additions right
    # (92% with this corpus, same recipe).
    for doc, row in zip(calculator_corpus(20, 5), calculator_sft_rows(20, 5), strict=True):
        answer = row["answer"]
        assert doc.startswith(row["messages"][1]["content"])
        assert doc.endswith(f"</tool_call>\ntool\n{answer}\nassistant\n{answer}")


def test_the_template_lists_tools_compactly_and_its_calls_parse_back() -> None:
    tok = _tok()
    assert format_of_template(CHATML_TOOLS_TEMPLATE) == "hermes"
    assert template_info(tok).strategy == "prefix"
    row = calculator_sft_rows(1, 0)[0]
    msgs, tools = row["messages"], row["tools"]
    prompt = render(tok, msgs[:2], True, tools)
    assert "add(a, b): Add two integers.\nsubtract(a, b): Subtract b from a." in prompt
    assert '"parameters"' not in prompt  # one line per tool, not its schema
    reply = render(tok, msgs[:3], False, tools)[len(prompt) :]
    assert reply.endswith(IM_END + "\n")
    fn = msgs[2]["tool_calls"][0]["function"]
    parsed = parse_reply(reply.removesuffix(IM_END + "\n"), "hermes")
    assert parsed.calls == [ToolCall(fn["name"], fn["arguments"])] and not parsed.errors
    # Without tools or calls it renders what CHATML_TEMPLATE does.
    plain = [m for m in msgs if m["role"] in ("system", "user")]
    plain = [*plain, {"role": "assistant", "content": "82"}]
    chatml = with_chat_tokens(base_tokenizer(), CHATML_TEMPLATE, (), None, IM_END)
    assert render(tok, plain, False) == render(chatml, plain, False)


def test_the_mask_trains_the_call_and_the_answer_only() -> None:
    tok = _tok()
    row = calculator_sft_rows(1, 0)[0]
    enc = encode_chat(tok, row["messages"], 4096, tools=row["tools"])
    learned = tok.decode(
        [i for i, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab != IGNORE]
    )
    fn = row["messages"][2]["tool_calls"][0]["function"]
    call = f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {json.dumps(fn["arguments"])}}}'
    assert learned == f"{call}\n</tool_call>{IM_END}\n{row['answer']}{IM_END}\n"


def test_ingest_records_the_template_tool_format() -> None:
    found = {}
    for fmt, (template, specials, bos, eos, _) in STYLES.items():
        tok = with_chat_tokens(base_tokenizer(), template, specials, bos, eos)
        found[fmt] = install_template(tok, IngestConfig(source="from_config"))
    assert {fmt: s["chat_template_tools"] for fmt, s in found.items()} == {f: f for f in STYLES}
    for template in (CHATML_TOOLS_TEMPLATE, CHATML_TEMPLATE, FIXTURES[1].template):
        tok = with_chat_tokens(base_tokenizer(), template, (), None, IM_END)
        tools = install_template(tok, IngestConfig(source="from_config"))["chat_template_tools"]
        assert tools == ("hermes" if template == CHATML_TOOLS_TEMPLATE else None)


@pytest.mark.slow
def test_a_tiny_sft_on_calculator_traces_learns(tmp_path: Path) -> None:
    data = copy.deepcopy(TINY)
    data["ingest"]["from_config"] |= {"template": "chatml_tools"}
    data["ingest"]["from_config"] |= {"max_position_embeddings": 256, "vocab_size": 1024}
    data["sft"]["data"] = {
        "synthetic": {"task": "calculator", "n_examples": 200},
        "eval_fraction": 0.1,
        "max_seq_len": 256,
    }
    data["sft"]["max_steps"] = 12
    recipe = write_recipe(tmp_path, data)
    ingest = run_inprocess("ingest", recipe)
    base = json.loads((ingest / "manifest.json").read_text())["summary"]
    assert base["chat_template_tools"] == "hermes"
    sft = run_inprocess("sft", recipe)
    s = json.loads((sft / "manifest.json").read_text())["summary"]
    assert s["train_dropped"] == 0 and s["train_at_max_len"] == 0
    assert s["eval_loss_final"] < s["eval_loss_start"] - 0.3, s
    train = read_metrics(sft / "metrics.jsonl", "train")
    first, last = (sum(r["loss"] for r in rs) / 3 for rs in (train[:3], train[-3:]))
    assert last < first, (first, last)
    saved = json.loads((sft / "data" / "train.jsonl").read_text().splitlines()[0])
    assert set(saved) == {"messages", "tools", "answer"}


@pytest.mark.slow
def test_the_agent_calculator_recipe_runs_shrunk(tmp_path: Path) -> None:
    """recipes/agent-calculator.yaml as shipped, but a few steps of each stage: SFT on the
    traces, then GRPO episodes calling the recipe's tools, with their figures in the records."""
    data = yaml.safe_load((ROOT / "recipes" / "agent-calculator.yaml").read_text())
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"]["device"] = "cpu"
    data["ingest"]["from_config"] |= {"pretrain_steps": 120, "corpus_examples": 400}
    data["sft"]["data"]["synthetic"]["n_examples"] = 800
    data["sft"] |= {"max_steps": 50, "checkpoint_every": 0}
    grpo = data["grpo"]
    grpo["data"]["synthetic"]["n_examples"] = 40
    # Nearly greedy: a policy this short-trained calls its tool at its most likely first token.
    grpo["rollout"] |= {"prompts_per_step": 2, "samples_per_prompt": 4, "temperature": 0.05}
    grpo |= {"max_steps": 2, "checkpoint_every": 0, "eval_prompts": 4, "max_kl": None}
    grpo["batch"] = {"micro_batch_size": 4, "grad_accum_steps": 1}
    for later in ("evaluate", "export", "schedule"):
        data.pop(later, None)
    # The tools are found beside the recipe, as they are beside the shipped one.
    shutil.copy(ROOT / "recipes" / "calculator.py", tmp_path / "calculator.py")
    recipe = tmp_path / "agent-calculator.yaml"
    recipe.write_text(yaml.safe_dump(data))
    for stage in ("ingest", "sft"):
        run_inprocess(stage, recipe)
    out = run_inprocess("grpo", recipe)
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 2
    for record in train:
        assert record["turns_mean"] >= 1 and 0 <= record["tool_call_validity"] <= 1
        assert "reward_fn_exact_match" in record and "tool_calls_mean" in record
    evals = {k: v for r in read_metrics(out / "metrics.jsonl", "eval") for k, v in r.items()}
    assert {"eval_turns_mean", "sft_turns_mean", "eval_tool_call_validity"} <= set(evals)
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all("episode" in s and "answer" in s for s in samples)
    # The prompts are the system turn and the question; the tools came from rollout.tools.
    assert all([m["role"] for m in s["prompt"]] == ["system", "user"] for s in samples)
    # Fifty SFT steps teach the call format: some episodes call a tool and read its result.
    assert any(m["role"] == "tool" for s in samples for m in s["episode"]), samples
