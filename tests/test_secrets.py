"""Credentials are refused in recipes and scrubbed from manifests and run records; the digests
and fingerprints that fill manifests are never mistaken for them."""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from posttrain.config.loader import RecipeError, apply_overrides, resolve, validate_recipe
from posttrain.config.schema import Recipe
from posttrain.secrets import (
    find_in_text,
    find_secrets,
    redact,
    redact_obj,
    secret_key_name,
)
from posttrain.store.artifacts import fingerprint, read_manifest, verify, write_manifest

# Fake tokens are assembled at run time so that no token-shaped literal sits in the repository
# (secret scanners on a push would rightly flag it).
HF = "hf_" + "Qw3rTy8uIoPaSdFgHjKlZxCvBnM1234567"
OPENAI = "sk-" + "proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0f"
ANTHROPIC = "sk-" + "ant-api03-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa-_Q"
AWS = "AKIA" + "IOSFODNN7EXAMPLE"
GITHUB = "ghp_" + "16C7e42F292c6912E7710c838347Ae178B4a"
GITHUB_PAT = "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"
PREFECT = "pnu_" + "aB1cD2eF3gH4iJ5kL6mN7oP8qR9sT0uV1wX2"
SLACK = "xoxb-" + "123456789012-1234567890123-AbCdEfGhIjKlMnOp"
PEM = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n"
    "-----END OPENSSH PRIVATE KEY-----"
)
RANDOM_PASSWORD = "x8fJ2kLm9QpR4sTv7WyZ1bC3"

TOKENS = {
    "Hugging Face token": HF,
    "API key (sk-...)": OPENAI,
    "AWS access key id": AWS,
    "GitHub token": GITHUB,
    "Prefect Cloud API key": PREFECT,
    "Slack token": SLACK,
    "private key": PEM,
}

_RNG = random.Random(40)
# Everything a manifest, report or recipe is made of that must never be flagged.
NEAR_MISSES = [
    hashlib.sha256(b"weights").hexdigest(),  # file and content digests
    hashlib.sha1(b"commit").hexdigest(),  # git commit ids
    fingerprint("sft", "1", {"lr": 1e-3}, ["0123456789abcdef"]),  # 16-hex stage fingerprints
    # Launch and flow run ids: random uuid4s, drawn from a seeded generator so that every
    # collection of the suite (each pytest-xdist worker's too) names the same cases.
    *(uuid.UUID(int=_RNG.getrandbits(128), version=4).hex for _ in range(3)),
    *(str(uuid.UUID(int=_RNG.getrandbits(128), version=4)) for _ in range(3)),
    "2026-11-30T10:01:46Z",
    "/tmp/pytest-of-user/pytest-12/test_x0/ws/artifacts/sft/3f2a9c0d1b7e4a65/adapter",
    "http://127.0.0.1:4200/api",  # PREFECT_API_URL: no credentials in it
    "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct",
    "sk-learn-compatible-estimators-2024-edition",  # a slug, not random
    "hf_hub_download",
    "task-hf_model_cache",
    "ghp_short",
    "AKIAIOSFODNN7EXAMPL",  # one character short
    "posttrain-sft-3f2a9c0d1b7e4a65",  # Prefect cache key
    "torch==2.13.0+cpu",
    "<|im_start|>assistant\n{{ message['content'] }}<|im_end|>",
    "LlamaForCausalLM",
    "eval_pref_accuracy=0.7688, eval_margin=0.4088, train_loss=0.5336, mfu=0.1399",
]


@pytest.mark.parametrize("kind", list(TOKENS))
def test_each_kind_of_token_is_found_and_redacted_inside_text(kind: str) -> None:
    text = f"401 Unauthorized for {TOKENS[kind]} while reading config"
    assert find_in_text(text) == [kind]
    assert redact(text) == "401 Unauthorized for *** while reading config"


def test_more_token_shapes() -> None:
    for token in (ANTHROPIC, GITHUB_PAT):
        assert find_in_text(token), token
        assert redact(f"[{token}]") == "[***]"


@pytest.mark.parametrize("text", NEAR_MISSES)
def test_near_misses_are_not_flagged(text: str) -> None:
    assert find_in_text(text) == []
    assert redact(text) == text


def test_only_the_password_of_a_url_is_redacted() -> None:
    url = "postgresql+asyncpg://prefect:s3cr3t-Pw@db.internal:5432/prefect"
    assert find_in_text(url) == ["password in a URL"]
    assert redact(url) == "postgresql+asyncpg://prefect:***@db.internal:5432/prefect"


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("hf_token", True),
        ("HF_TOKEN", True),
        ("apiKey", True),
        ("aws_secret_access_key", True),
        ("DB_PASSWORD", True),
        ("private_key", True),
        ("credentials", True),
        ("max_new_tokens", False),
        ("tokenizer", False),
        ("tokenizer_sha256", False),
        ("token_sha256", False),
        ("template_sha256", False),
        ("key", False),  # Prefect artifact keys, sort keys, metric keys
        ("tokens_per_s", False),
    ],
)
def test_key_names(name: str, secret: bool) -> None:
    assert secret_key_name(name) is secret


def test_random_value_under_a_credential_key() -> None:
    data = {
        "db": {"password": RANDOM_PASSWORD, "user": "prefect"},
        "hf_token": "${HF_TOKEN}",  # a placeholder, not a value
        "token_file": "/run/secrets/hf-token-abc123def456ghi789",  # where a secret is
        "eos_token": "<|endoftext|>",
        "tokenizer_sha256": hashlib.sha256(b"t").hexdigest(),
        "max_new_tokens": 48,
    }
    assert find_secrets(data) == [("db.password", "credential under the key 'password'")]
    scrubbed = redact_obj(data)
    assert scrubbed["db"]["password"] == "***"
    assert {k: v for k, v in scrubbed.items() if k != "db"} == {
        k: v for k, v in data.items() if k != "db"
    }


def test_a_real_manifest_has_nothing_to_flag(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    (folder / "adapter").mkdir(parents=True)
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    (folder / "metrics.jsonl").write_text('{"kind": "train", "loss": 1.0}\n')
    summary = {
        "headline": {"train_loss": 1.369, "tokens/s": 2996},
        "template_sha256": hashlib.sha256(b"tpl").hexdigest(),
        "model_dir": str(folder),
        "source_files": {"model.safetensors": hashlib.sha256(b"w").hexdigest()},
        "max_new_tokens": 32,
    }
    ref = write_manifest(
        folder,
        stage="sft",
        fp="3f2a9c0d1b7e4a65",
        parents=["0123456789abcdef"],
        section={"lr": 1e-3, "chat_template": NEAR_MISSES[-3]},
        seed=0,
        summary=summary,
    )
    manifest = read_manifest(folder)
    assert manifest is not None
    assert find_secrets(manifest) == []
    assert manifest["summary"] == summary and redact_obj(manifest) == manifest
    assert verify(folder)[0] and ref.sha256 == manifest["content_sha256"]


def test_manifest_writer_scrubs_a_token_from_a_summary(tmp_path: Path) -> None:
    folder = tmp_path / "artifact"
    folder.mkdir()
    (folder / "out.txt").write_text("x")
    write_manifest(
        folder,
        stage="ingest",
        fp="0123456789abcdef",
        parents=[],
        section={},
        seed=0,
        summary={"warning": f"hub said 401 for {HF}", "env": {"AWS_KEY": AWS}},
        extra={"api_key": RANDOM_PASSWORD},
    )
    text = (folder / "manifest.json").read_text()
    assert HF not in text and AWS not in text and RANDOM_PASSWORD not in text
    manifest = json.loads(text)
    assert manifest["summary"]["warning"] == "hub said 401 for ***"
    assert manifest["api_key"] == "***"
    assert verify(folder)[0], "scrubbing leaves the file table intact"


MINIMAL = {"ingest": {"source": "from_config"}, "sft": {"data": {"synthetic": {}}}}


def test_recipe_with_a_token_is_refused_naming_the_field() -> None:
    data = apply_overrides(MINIMAL, [f"ingest.chat_template=Hello {HF}"])
    with pytest.raises(RecipeError) as exc:
        validate_recipe(data)
    assert exc.value.errors == [
        "ingest.chat_template: looks like a secret (Hugging Face token); a recipe holds no "
        "credentials (they would be copied into run folders, manifests and the Prefect UI): "
        "pass them through the environment, e.g. HF_TOKEN"
    ]
    assert HF not in str(exc.value)


def test_recipe_with_a_credential_under_an_unknown_key_is_refused_without_echoing_it() -> None:
    data = {**MINIMAL, "run": {"hf_token": RANDOM_PASSWORD, "name": "x"}}
    with pytest.raises(RecipeError) as exc:
        validate_recipe(data)
    assert exc.value.errors[0].startswith("run.hf_token: looks like a secret (credential")
    assert RANDOM_PASSWORD not in str(exc.value)


def test_recipe_from_a_ui_form_is_refused_too_and_the_error_hides_the_value() -> None:
    data = {**MINIMAL, "sft": {"data": {"synthetic": {}, "path": None}}}
    data["run"] = {"workspace": f"/data/{GITHUB}"}
    with pytest.raises(ValidationError) as exc:
        Recipe.model_validate(data)  # what Prefect does with a deployment parameter
    assert "run.workspace: looks like a secret (GitHub token)" in str(exc.value)
    assert GITHUB not in str(exc.value)


def test_run_record_is_scrubbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.run_record as fp
    from flows.report.tables import StageRecord
    from posttrain.plan.planner import plan
    from posttrain.store.summary import Summary

    shown: dict[str, object] = {}
    monkeypatch.setattr(fp, "create_markdown_artifact", lambda text, **kw: shown.update(md=text))
    monkeypatch.setattr(fp, "create_table_artifact", lambda rows, **kw: shown.update(table=rows))
    recipe = validate_recipe({**MINIMAL, "run": {"workspace": str(tmp_path / "ws")}})
    failed = StageRecord(
        "ingest",
        "0123456789abcdef",
        "failed",
        1.0,
        error=f"HTTP 401: token {HF} rejected; retry with {OPENAI}",
        summary=Summary(headline={"note": f"key {AWS}"}),
    )
    run_dir = fp.record_run(plan(resolve(recipe)), "run-1", [failed], failed=True).run_dir
    for name in ("report.md", "lineage.json", "recipe.resolved.yaml"):
        text = (run_dir / name).read_text()
        assert HF not in text and OPENAI not in text and AWS not in text, name
    assert "token *** rejected; retry with ***" in (run_dir / "report.md").read_text()
    assert HF not in str(shown["md"]) and AWS not in json.dumps(shown["table"])
    assert yaml.safe_load((run_dir / "recipe.resolved.yaml").read_text())["run"]["name"]
