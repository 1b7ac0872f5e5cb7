"""distill (on-policy distillation): the section's checks, the graph's teacher link, the update's
loss against the divergence written out over full logits on a tiny model (however the rows are
split into forwards), and (slow) the stage end to end on one and two ranks with a teacher on a
wider base of its own, its policy taken by evaluate."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from fixtures_tiny import load_base
from pydantic import ValidationError
from rl_tiny import MAX_PROMPT_LEN, prompt_rows, role_model, rollout_setup

from posttrain.config.batch import ResolvedBatch
from posttrain.config.loader import RecipeError, resolve, validate_recipe
from posttrain.errors import RecipeVerdict
from posttrain.kinds.distill import DistillConfig
from posttrain.models.adapters import POLICY
from posttrain.models.roles import RoleModel
from posttrain.plan.planner import plan
from posttrain.rl.distill import check_shapes, distill_update
from posttrain.rl.rollout.collect import collect_rollout
from posttrain.rl.rollout.sample import row_tokens
from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import SMALL_EVALUATE, TINY, planned_dir, run_inprocess, run_torchrun

# The tiny model, a gloo world of one and one torch thread: the RL update tests' fixtures.
from tests.test_rl_update import _one_thread, _session, tiny, world  # noqa: F401

DATA = {"synthetic": {"n_examples": 16}, "max_prompt_len": MAX_PROMPT_LEN}


def section(**fields: Any) -> DistillConfig:
    return DistillConfig.model_validate({"data": DATA, **fields})


# --- the section and the graph -----------------------------------------------------------------


def test_section_defaults_and_what_it_refuses() -> None:
    cfg = section()
    assert (cfg.loss, cfg.beta, cfg.temperature, cfg.reduction) == (
        "reverse_kl", 0.5, 1.0, "token_mean"
    )  # fmt: skip
    assert cfg.rollout.samples_per_prompt == 1 and cfg.kl.coef == 0.0
    DistillConfig.model_validate(cfg.model_dump(mode="json"))
    for fields, message in (
        ({"kl": {"coef": 0.05}}, "divergence to the teacher"),
        ({"update_epochs": 2}, "clipped policy-gradient update"),
        ({"rollout": {"max_staleness": 1}}, "max_staleness"),
        ({"loss": "kto"}, "loss"),
        ({"beta": 1.5}, "beta"),
        ({"temperature": 0}, "temperature"),
    ):
        with pytest.raises(ValidationError, match=message):
            section(**fields)


def test_batch_shapes_one_step_per_rollout() -> None:
    cfg = section(rollout={"prompts_per_step": 8, "samples_per_prompt": 2})
    assert check_shapes("d", cfg, ResolvedBatch(4, 1, 8, 2), 2) == (8, 1)
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        check_shapes("d", cfg, ResolvedBatch(4, 1, 12, 3), 3)
    with pytest.raises(RecipeVerdict, match=r"d.batch.grad_accum_steps: .* at 1 \(got 2\)"):
        check_shapes("d", cfg, ResolvedBatch(4, 2, 16, 2), 2)


HEAD: dict[str, Any] = {
    "run": {"name": "d", "workspace": "/tmp/posttrain-distill-graph"},
    "infra": {"device": "cpu", "precision": "fp32"},
    "ingest": {"source": "from_config"},
    "sft": {"data": {"synthetic": {}}},
}
TEACHER_BASE = {"kind": "ingest", "name": "tbase", "source": "from_config",
                "from_config": {"hidden_size": 256}}  # fmt: skip
TEACHER_SFT = {"kind": "sft", "name": "tsft", "base": "tbase", "data": {"synthetic": {}}}
ENTRY = {"kind": "distill", "name": "distill", "data": {"synthetic": {}}}


def recipe(*stages: dict[str, Any]) -> Any:
    return validate_recipe({**copy.deepcopy(HEAD), "stages": list(stages)})


def test_a_distill_stage_needs_a_teacher_and_takes_a_policy_or_base() -> None:
    with pytest.raises(RecipeError) as exc:
        recipe(ENTRY)
    assert exc.value.errors == [
        "stages.distill.teacher: a distill stage needs a teacher: name the policy stage or base "
        "it learns from (`teacher: <name>`)"
    ]
    with pytest.raises(RecipeError, match="not a policy to learn from"):
        recipe({"kind": "reward", "name": "rm", "data": {"synthetic": {}}},
               {**ENTRY, "teacher": "rm"})  # fmt: skip
    prefs = {"synthetic": {}}
    with pytest.raises(RecipeError, match="stages.dpo.teacher: a dpo stage takes no teacher"):
        recipe({"kind": "dpo", "name": "dpo", "data": prefs, "teacher": "sft"})
    # The raw base of another family member teaches too.
    r = recipe(TEACHER_BASE, {**ENTRY, "teacher": "tbase"})
    assert {s.name: s for s in plan(resolve(r)).stages}["distill"].roles["teacher_base"] == "tbase"


def test_the_teacher_and_its_base_are_the_stages_parents_by_role() -> None:
    r = recipe(TEACHER_BASE, TEACHER_SFT, {**ENTRY, "from": "sft", "teacher": "tsft"})
    stages = {s.name: s for s in plan(resolve(r)).stages}
    d = stages["distill"]
    assert d.roles == {
        "base": "ingest", "policy": "sft", "reference": "sft", "teacher": "tsft",
        "teacher_base": "tbase",
    }  # fmt: skip
    # The teacher runs before the student's distillation; its changes reach the print.
    order = [s.name for s in plan(resolve(r)).stages]
    assert order.index("tsft") < order.index("distill")
    wider = recipe({**TEACHER_BASE, "from_config": {"hidden_size": 320}}, TEACHER_SFT,
                   {**ENTRY, "from": "sft", "teacher": "tsft"})  # fmt: skip
    assert {s.name: s for s in plan(resolve(wider)).stages}["distill"].fingerprint != d.fingerprint
    # The student stands on its own base: the teacher's does not become its base.
    assert stages["distill"].roles["base"] == "ingest"


def test_teacher_batches_are_the_same_at_any_number_of_ranks() -> None:
    from posttrain.rl.teacher_answers import world_batches

    one = world_batches(10, 4, 0, 1)
    assert one == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    two = [world_batches(10, 4, r, 2) for r in range(2)]
    assert two == [[[0, 1, 2, 3], [8, 9]], [[4, 5, 6, 7], []]]  # as many batches per rank
    three = [world_batches(10, 4, r, 3) for r in range(3)]
    assert sorted(b for bs in three for b in bs if b) == one
    assert world_batches(0, 4, 0, 2) == []


# --- the update on a tiny model ------------------------------------------------------------------


def written_out(
    student: RoleModel, teacher: RoleModel, ro: Any, cfg: DistillConfig, vocab: int
) -> tuple[torch.Tensor, float]:
    """The step's loss over all rows in one forward, each divergence written out from the
    definitions (not through the chunked function), and the teacher-forced agreement."""
    rows = list(range(ro.n))
    inp = ro.inputs(rows)
    s = student(POLICY, **inp)[..., :vocab] / cfg.temperature  # [N, R, V]
    with torch.no_grad():
        t = teacher(POLICY, **inp)[..., :vocab] / cfg.temperature
    log_s, log_t = F.log_softmax(s, -1), F.log_softmax(t, -1)
    p_s, p_t = log_s.exp(), log_t.exp()
    if cfg.loss == "reverse_kl":
        per = (p_s * (log_s - log_t)).sum(-1)
    elif cfg.loss == "forward_kl":
        per = (p_t * (log_t - log_s)).sum(-1)
    else:
        b = cfg.beta
        log_m = torch.log(b * p_t + (1 - b) * p_s)
        per = b * (p_t * (log_t - log_m)).sum(-1) + (1 - b) * (p_s * (log_s - log_m)).sum(-1)
    m = ro.mask
    if cfg.reduction == "token_mean":
        loss = (per * m).sum() / m.sum()
    else:
        loss = ((per * m).sum(1) / m.sum(1).clamp_min(1)).mean()
    agree = float(((s.argmax(-1) == t.argmax(-1)).float() * m).sum() / m.sum())
    return loss, agree


@pytest.mark.parametrize(
    "fields",
    [
        {"loss": "reverse_kl"},
        {"loss": "forward_kl", "temperature": 2.0},
        {"loss": "jsd", "beta": 0.5, "reduction": "sequence_mean"},
    ],
)
def test_distill_step_is_the_written_out_divergence_however_rows_are_split(
    tiny,  # noqa: F811
    world,  # noqa: F811
    tmp_path,
    fields,
) -> None:
    """Student: the trained tiny adapter; teacher: the tiny base without it (another
    distribution on the same vocabulary). The step's loss, divergence and agreement equal the
    formulas over full logits, and the gradient is the same whether the rows go in one forward
    or one by one, padded or packed (where the heads see the response tokens only)."""
    cfg = section(
        rollout={"prompts_per_step": 4, "max_new_tokens": 6}, optim={"max_grad_norm": None},
        **fields,
    )  # fmt: skip
    teacher = RoleModel(load_base(tiny), None, None).eval()
    vocab = len(tiny.tokenizer)
    s = rollout_setup(role_model(tiny, False), tiny.tokenizer, cfg, "alternating")
    ro = collect_rollout(s, prompt_rows(tiny.tokenizer, 4), 0).rollout
    assert ro.mask.sum() > 0
    norms = []
    # By tokens (`batch.by_tokens`): each row alone (a budget of one token) or two to a forward.
    two = sum(sorted(row_tokens(ro))[-2:])
    # Packed rows (padding-free): the heads run on the response tokens only.
    for micro, by_tokens, packed in (
        (4, None, False),
        (1, None, False),
        (4, 1, False),
        (4, two, False),
        (4, None, True),
        (1, None, True),
    ):
        student = role_model(tiny, False)
        want, agree = written_out(student, teacher, ro, cfg, vocab)
        (g_want,) = torch.autograd.grad(
            want, [p for p in student.parameters() if p.requires_grad][0]
        )
        tr = _session(tmp_path / f"m{micro}-{by_tokens}-{packed}-{cfg.loss}", world, student)
        stats = distill_update(tr, teacher, ro, cfg, micro, vocab, 1, packed, by_tokens)
        assert stats.updates == 1 and stats.tokens == int(ro.mask.sum())
        assert stats.means["loss"] == pytest.approx(want.item(), rel=1e-5)
        assert stats.means["teacher_agreement"] == pytest.approx(agree)
        if cfg.reduction == "token_mean":
            assert stats.means["teacher_kl"] == pytest.approx(want.item(), rel=1e-5)
        assert g_want.abs().sum() > 0
        norms.append(stats.grad_norm)
    assert norms == pytest.approx([norms[0]] * len(norms), rel=1e-4) and norms[0] > 0


def test_a_student_equal_to_its_teacher_has_nothing_to_learn(tiny, world, tmp_path) -> None:  # noqa: F811
    cfg = section(rollout={"prompts_per_step": 2, "max_new_tokens": 4})
    s = rollout_setup(role_model(tiny, False), tiny.tokenizer, cfg, "alternating")
    ro = collect_rollout(s, prompt_rows(tiny.tokenizer, 2), 0).rollout
    teacher = role_model(tiny, False).eval()  # the same adapter: the same distribution
    tr = _session(tmp_path / "same", world, role_model(tiny, False))
    stats = distill_update(tr, teacher, ro, cfg, 2, len(tiny.tokenizer), step=1)
    assert stats.means["loss"] == pytest.approx(0.0, abs=1e-6)
    assert stats.means["teacher_agreement"] == 1.0


# --- the stage end to end (slow) ---------------------------------------------------------------

FROM_CONFIG = TINY["ingest"]["from_config"]
DISTILL = {
    "data": {"synthetic": {"n_examples": 120, "seed": 7}, "eval_fraction": 0.1,
             "max_prompt_len": 40},
    "optim": {"lr": 5e-3},
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
    "rollout": {"prompts_per_step": 4, "max_new_tokens": 12},
    "checkpoint_every": 0,
    "eval_prompts": 8,
    "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}],
}  # fmt: skip


OFFPOLICY = {
    **copy.deepcopy(TINY["sft"]),
    "max_steps": 4,
    "teacher_sampling": {"max_new_tokens": 16, "batch_size": 8},
}


@pytest.fixture(scope="module")
def teacher_recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY with a teacher: a wider base of the same tokenizer, its own SFT, and a distill
    stage from the student's SFT; ingest, both bases and both SFTs built once."""
    folder = tmp_path_factory.mktemp("distill")
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(folder / "ws")
    # The bases and SFTs train as long as they must for the teacher to score a higher reward
    # than the student's SFT (so that the gap closed is checked); evaluate only has to take the
    # distilled policy.
    data["evaluate"] = copy.deepcopy(SMALL_EVALUATE)
    data["stages"] = [
        {"kind": "ingest", "name": "teacher_base", "source": "from_config",
         "from_config": {**FROM_CONFIG, "hidden_size": 96}},
        {"kind": "sft", "name": "teacher_sft", "base": "teacher_base",
         **copy.deepcopy(TINY["sft"])},
        {"kind": "sft", "name": "offpolicy", "from": "sft", "teacher": "teacher_sft",
         **OFFPOLICY},
        # Last: the final policy, the one evaluate scores.
        {"kind": "distill", "name": "distill", "from": "sft", "teacher": "teacher_sft",
         **DISTILL, "max_steps": 3},
    ]  # fmt: skip
    path = folder / "distill.yaml"
    path.write_text(yaml.safe_dump(data))
    for kind, name in (("ingest", "ingest"), ("ingest", "teacher_base"), ("sft", "sft"),
                       ("sft", "teacher_sft")):  # fmt: skip
        run_inprocess(kind, path, name=name)
    return path


def _check_run(out: Path, steps: int) -> dict[str, Any]:
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == steps
    for row in train:
        assert row["updates"] == 1 and math.isfinite(row["loss"]) and row["loss"] > 0
        assert row["teacher_kl"] == pytest.approx(row["loss"])
        assert 0.0 <= row["teacher_agreement"] <= 1.0
    import json

    summary = json.loads((out / "manifest.json").read_text())["summary"]
    head = summary["headline"]
    for key in ("eval_teacher_kl", "eval_teacher_agreement", "teacher_reward", "eval_reward"):
        assert math.isfinite(head[key]), key
    final, sft = summary["eval_final"], summary["eval_sft"]
    if final["teacher_reward"] > sft["reward"]:
        gap = (final["reward"] - sft["reward"]) / (final["teacher_reward"] - sft["reward"])
        assert head["reward_gap_closed"] == pytest.approx(gap, abs=1e-3)
    assert summary["teacher"] == "teacher_sft" and summary["teacher_base"] == "teacher_base"
    ref = json.loads((out / "reference.json").read_text())
    assert ref["teacher"] == "teacher_sft" and ref["teacher_base"] == "teacher_base"
    return summary


@pytest.mark.slow
def test_distill_on_one_rank_from_a_wider_teacher_and_evaluate_takes_it(teacher_recipe) -> None:
    from safetensors.torch import load_file

    out = run_inprocess("distill", teacher_recipe, name="distill")
    summary = _check_run(out, 3)
    assert summary["teacher_params"] > summary["params_total"]  # the wider model teaches
    sft = planned_dir("sft", teacher_recipe)
    before = load_file(sft / "adapter" / "adapter_model.safetensors")
    after = load_file(out / "adapter" / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    ev = run_inprocess("evaluate", teacher_recipe)
    assert out.name in (ev / "manifest.json").read_text()


@pytest.mark.slow
def test_distill_on_two_ranks(teacher_recipe) -> None:
    over = ("infra.devices_per_node=2", "sft.batch.micro_batch_size=4",
            "stages.teacher_sft.batch.micro_batch_size=4",
            "stages.distill.batch.micro_batch_size=2")  # fmt: skip
    proc = run_torchrun("distill", teacher_recipe, 2, *over, name="distill")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = planned_dir("distill", teacher_recipe, *over)
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["world_size"] == 2
    _check_run(out, 3)
    # Off-policy on two ranks: each rank answers its batches, every rank trains on all of them,
    # and the answers are one rank's (sampled here with settings no other test uses).
    other = ("stages.offpolicy.teacher_sampling.max_new_tokens=12",)
    two_ranks = (*over, *other, "stages.offpolicy.batch.micro_batch_size=4")
    proc = run_torchrun("sft", teacher_recipe, 2, *two_ranks, name="offpolicy")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    off = planned_dir("offpolicy", teacher_recipe, *two_ranks)
    two = json.loads((off / "manifest.json").read_text())["summary"]
    assert not two["teacher_answers_reused"]
    # One rank with both cores samples under other numerics (2 threads, not 1 per rank): into a
    # cache file of its own (decision 71), and the same answers, the batches being cut alike.
    one = run_inprocess("sft", teacher_recipe, *other, "stages.offpolicy.optim.lr=7e-3",
                        name="offpolicy")  # fmt: skip
    one_summary = json.loads((one / "manifest.json").read_text())["summary"]
    assert not one_summary["teacher_answers_reused"]
    assert one_summary["teacher_answers_file"] != two["teacher_answers_file"]
    answers = (Path(s["teacher_answers_file"]).read_text() for s in (one_summary, two))
    assert next(answers) == next(answers)
    assert _rows(one / "data" / "train.jsonl") == _rows(off / "data" / "train.jsonl")


def _rows(path: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in path.read_text().splitlines() if x]


@pytest.mark.slow
def test_offpolicy_sft_trains_on_the_teachers_answers_cached_once(teacher_recipe) -> None:
    """An sft entry with a teacher: its training rows are the prompts of the data with the
    teacher's greedy answers, its held-out rows the data's own; the answers are cached in the
    workspace, and a re-run with another learning rate reuses them without the teacher."""
    import json

    out = run_inprocess("sft", teacher_recipe, name="offpolicy")
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    assert summary["teacher"] == "teacher_sft" and not summary["teacher_answers_reused"]
    train, held = _rows(out / "data" / "train.jsonl"), _rows(out / "data" / "eval.jsonl")
    data_train = _rows(planned_dir("sft", teacher_recipe) / "data" / "train.jsonl")
    assert summary["teacher_answers"] == len(train) == len(data_train)
    # Same prompts in the same order; the answers are the teacher's (most differ from the data).
    assert [r["messages"][:-1] for r in train] == [r["messages"][:-1] for r in data_train]
    differ = sum(
        a["messages"][-1] != b["messages"][-1] for a, b in zip(train, data_train, strict=True)
    )
    assert differ > len(train) // 4
    assert held == _rows(planned_dir("sft", teacher_recipe) / "data" / "eval.jsonl")
    cache = Path(summary["teacher_answers_file"])
    answers = [json.loads(x)["answer"] for x in cache.read_text().splitlines()]
    assert answers == [r["messages"][-1]["content"] for r in train]
    again = run_inprocess("sft", teacher_recipe, "stages.offpolicy.optim.lr=5e-3", name="offpolicy")
    assert again != out
    second = json.loads((again / "manifest.json").read_text())["summary"]
    assert second["teacher_answers_reused"] and second["teacher_answers_file"] == str(cache)
    assert _rows(again / "data" / "train.jsonl") == train
