"""Failures that are the user's to fix end in a block naming the field or file and the fix, never
"this looks like a bug in posttrain": each test raises the verdict with the real function that
raises it, reports it as a stage process does (`_report_failure`, its `POSTTRAIN_ERROR` line)
and reads the block the run ends with. That every verdict class has a fix: tests/test_terminal.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from chat_template_fixtures import FIXTURES, fixture_tokenizer
from torch import nn

from flows.failure_block import BUG, Block, stage_failure_block
from posttrain.agents.tool_calls import require_format
from posttrain.config.schema import Recipe
from posttrain.data.sft_data import prepare
from posttrain.errors import RecipeVerdict
from posttrain.export.gguf import pre_tokenizer_name
from posttrain.models.reward import score_head
from posttrain.models.varlen_attention import confined_attention
from posttrain.rl.setup import check_shapes
from posttrain.runtime.context import StageContext
from posttrain.runtime.spec import PlannedStage
from posttrain.sections.shared import DataConfig, RolloutServerConfig
from posttrain.serving.server import RolloutServer
from posttrain.stages.common import _report_failure
from tests.stage_helpers import TINY

RERUN = "then run again: finished stages are reused"
# TINY with a second SFT round as a `stages:` entry: its fields are `stages.sft2.*`.
RECIPE = {**copy.deepcopy(TINY), "stages": [{**TINY["sft"], "kind": "sft", "name": "sft2"}]}
RECIPE["stages"][0]["from"] = "sft"


def _ctx(tmp_path: Path, stage: str) -> StageContext:
    recipe = Recipe.model_validate({**RECIPE, "run": {**RECIPE["run"], "workspace": str(tmp_path)}})
    planned = PlannedStage(stage, "posttrain.stages.sft", "f" * 16, tmp_path / stage, {}, 1, 60.0)
    return StageContext(planned, recipe, {})


def _block(ctx: StageContext, exc: BaseException, capsys: pytest.CaptureFixture[str]) -> Block:
    """The block a run ends with when `ctx`'s stage fails with `exc` (raised, so that the
    report has its traceback): the stage's real report, the flow's real block."""
    try:
        raise exc
    except BaseException as raised:
        _report_failure(ctx, raised)
    err = capsys.readouterr().err
    tail = "\n".join(x for x in err.splitlines() if x.startswith("POSTTRAIN_ERROR "))
    log = ctx.stage.out_dir / "logs" / "stage.log"
    name = ctx.stage.name
    block = stage_failure_block(
        f"stage '{name}' exited with code 1. Log: {log}\n--- end of the log ---\n{tail}"
    )
    assert block.fix != BUG and "unexpected error" not in block.what, block.text()
    return block


def _raised(call, *args) -> BaseException:
    with pytest.raises(Exception) as info:
        call(*args)
    return info.value


def test_an_architecture_that_cannot_go_padding_free_names_its_stages_entry_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Library code below a stage names the field within the section; the stage's report puts
    the section's path in front: a `stages:` entry's, not the shorthand one's."""
    model = nn.Module()
    model.config = SimpleNamespace(_attn_implementation="sdpa")

    def forward_without_attention() -> None:
        with confined_attention(model):
            pass

    exc = _raised(forward_without_attention)
    assert isinstance(exc, RecipeVerdict)
    block = _block(_ctx(tmp_path, "sft2"), exc, capsys)
    assert block.what == (
        "stages.sft2.batch.padding_free: no attention layer of Module ran padding-free (this "
        "architecture cannot); set it to false"
    )
    assert block.fix == f"change stages.sft2.batch.padding_free as said above, {RERUN}"
    assert "RecipeVerdict: stages.sft2.batch" in (tmp_path / "sft2/logs/error.txt").read_text()


def test_a_reward_model_without_a_score_head_names_padding_free(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    block = _block(_ctx(tmp_path, "sft"), _raised(score_head, nn.Linear(2, 2)), capsys)
    assert block.what.startswith("sft.batch.padding_free: Linear has no `score` head")
    assert block.fix == f"change sft.batch.padding_free as said above, {RERUN}"


def test_too_few_rows_for_the_held_out_split_name_eval_fraction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "one.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    cfg = DataConfig(path=str(path), eval_fraction=0.1)
    exc = _raised(prepare, cfg, fixture_tokenizer(FIXTURES[0]), 0)
    block = _block(_ctx(tmp_path, "sft"), exc, capsys)
    assert block.what == (
        "sft.data.eval_fraction: 0.1 holds out 1 of the 1 rows, which leaves nothing to train "
        "on; give more rows, or hold out fewer (or give data.eval_path)"
    )
    assert block.fix == f"change sft.data.eval_fraction as said above, {RERUN}"


def test_rollout_shapes_that_do_not_fit_the_ranks_name_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollout = SimpleNamespace(prompts_per_step=6, samples_per_prompt=2)
    exc = _raised(check_shapes, "stages.ppo2", SimpleNamespace(rollout=rollout), None, 4)
    block = _block(_ctx(tmp_path, "ppo2"), exc, capsys)
    assert block.what == (
        "stages.ppo2.rollout.prompts_per_step: 6 must be a multiple of the 4 ranks (each rank "
        "rolls out the same number of prompts)"
    )
    assert block.fix == f"change stages.ppo2.rollout.prompts_per_step as said above, {RERUN}"


def test_a_merged_server_refusing_an_adapter_is_a_server_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Raised on rank 0 inside a weight sync, it must be the verdict `sync` hands every rank."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "use_dora": True}))
    cfg = RolloutServerConfig(url="http://127.0.0.1:1", weights="merged")
    server = RolloutServer(cfg, None, None, tmp_path / "serving", tmp_path / "base", 0)  # type: ignore[arg-type]
    exc = _raised(server._write, tmp_path / "serving" / "v1", adapter)
    block = _block(_ctx(tmp_path, "sft"), exc, capsys)
    assert block.what.startswith("rollout.server.weights: merged folds plain LoRA")
    assert "logs/rollout-server.log" in block.fix and "rollout.server" in block.fix


def test_a_template_without_tool_calls_and_a_tokenizer_gguf_cannot_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = _ctx(tmp_path, "sft")
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    block = _block(ctx, _raised(require_format, plain, "tiny-gemma"), capsys)
    assert block.what.startswith("tiny-gemma: its chat template renders no tool calls")
    assert "ingest.chat_template" in block.fix and "rollout.tools" in block.fix
    block = _block(ctx, _raised(pre_tokenizer_name, {"model": {"type": "Unigram"}}), capsys)
    assert block.what.startswith("export.gguf: the tokenizer is not a byte-level BPE")
    assert block.fix.startswith("remove export.gguf")
