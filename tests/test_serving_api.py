"""How rollouts are asked of each kind of server and read back (posttrain.serving.api), and what
the server engine checks of every answer (posttrain.rl.rollout.server_engine). The answers are
written by hand in each server's documented shape; the slow tests run a real
`transformers serve`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures_tiny import TinyAssets, tiny_assets
from tokenizers import processors

from posttrain.rl.rollout.server_engine import ServerEngine
from posttrain.sections.shared import RolloutServerConfig, SamplingConfig
from posttrain.serving.api import (
    VLLMAPI,
    Completion,
    ServerError,
    SGLangAPI,
    TransformersAPI,
    server_api,
)
from posttrain.serving.client import ServerClient, ServerFailed
from posttrain.serving.server import RolloutServer

SAMPLE = SamplingConfig(name="r", strategy="sample", temperature=0.7, top_k=20, max_new_tokens=9)
GREEDY = SamplingConfig(name="g", strategy="greedy", max_new_tokens=5)
STOPS = [3, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


def test_transformers_request_names_every_knob_and_sends_text(tiny: TinyAssets) -> None:
    tok = tiny.tokenizer
    api = TransformersAPI(tok, turn_stop=3)
    ids = tok("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)["input_ids"]
    body = api.request(ids, "/v/policy-v2", SAMPLE, STOPS, seed=11)
    assert body["model"] == "/v/policy-v2" and body["seed"] == 11
    assert body["prompt"] == "<|im_start|>user\nhi<|im_end|>\n"
    config = json.loads(body["generation_config"])
    assert config["do_sample"] is True and config["temperature"] == 0.7
    assert (config["top_k"], config["top_p"], config["max_new_tokens"]) == (20, 1.0, 9)
    assert config["eos_token_id"] == STOPS and "use_cache" not in config
    greedy = json.loads(api.request(ids, "m", GREEDY, STOPS, 0)["generation_config"])
    assert greedy["do_sample"] is False and greedy["max_new_tokens"] == 5


def test_transformers_answers_are_retokenised_and_checked_against_the_servers_count(
    tiny: TinyAssets,
) -> None:
    tok = tiny.tokenizer
    api = TransformersAPI(tok, turn_stop=3)
    text = " the cat"
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    stopped = {
        "model": "m",
        "choices": [{"text": text, "finish_reason": "stop", "index": 0}],
        "usage": {"prompt_tokens": 5, "completion_tokens": n + 1},
    }
    c = api.parse(stopped, STOPS)
    assert c.ids == tok(text, add_special_tokens=False)["input_ids"] + [3]
    assert c.stopped and not c.exact and c.model == "m" and c.prompt_tokens == 5
    assert not c.known_mismatch  # the server sampled as many tokens as the text gives back
    long = stopped | {
        "choices": [{"text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": n + 2},
    }
    c = api.parse(long, STOPS)
    assert not c.stopped and c.ids[-1] != 3 and c.known_mismatch
    with pytest.raises(ServerError, match="no text"):
        api.parse({"choices": [{"finish_reason": "stop"}]}, STOPS)
    with pytest.raises(ServerError, match="no choices"):
        api.parse({"error": "boom"}, STOPS)


def test_transformers_prompt_leaves_out_the_bos_the_servers_tokenizer_adds(
    tiny: TinyAssets,
) -> None:
    """A tokenizer that puts a BOS before any text (Llama 3's) would get it twice: the server
    tokenises the text it is sent with the special tokens on."""
    tok = type(tiny.tokenizer).from_pretrained(str(tiny.base_dir))
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    api = TransformersAPI(tok, turn_stop=3)
    assert api.auto_prefix == [bos]
    ids = tok("hello there")["input_ids"]  # the BOS included, as a template would render it
    assert ids[0] == bos
    body = api.request(ids, "m", SAMPLE, STOPS, 0)
    assert tok(body["prompt"])["input_ids"] == ids  # what the server will read


def test_vllm_sends_token_ids_and_reads_the_sampled_ones(tiny: TinyAssets) -> None:
    tok = tiny.tokenizer
    api = VLLMAPI(tok)
    body = api.request([5, 6, 7], "policy-v4", SAMPLE, STOPS, seed=2)
    assert body["prompt"] == [5, 6, 7] and body["model"] == "policy-v4"
    assert body["return_token_ids"] and body["stop_token_ids"] == STOPS
    assert (body["temperature"], body["top_k"], body["top_p"], body["max_tokens"]) == (
        0.7,
        20,
        1.0,
        9,
    )
    assert api.request([1], "m", GREEDY, STOPS, 0)["temperature"] == 0.0
    answer = {
        "model": "policy-v4",
        "choices": [
            {
                "text": "ab",
                "token_ids": [11, 12, 7, 13],
                "finish_reason": "stop",
                "logprobs": {"token_logprobs": [-0.5, -1.0, -0.25, -2.0]},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    c = api.parse(answer, STOPS)
    assert c.ids == [11, 12, 7] and c.stopped and c.exact  # cut at the first stop id
    assert c.logps == [-0.5, -1.0, -0.25]
    # Its text "ab" re-tokenises to other ids than 11, 12: counted (what re-tokenising a
    # text-only answer would have got wrong), though the ids trained are the sampled ones.
    assert c.text_differs and c.known_mismatch
    same = tok(" the cat", add_special_tokens=False)["input_ids"]
    answer["choices"][0] |= {"text": " the cat", "token_ids": [*same, 7]}
    assert not api.parse(answer, STOPS).known_mismatch
    with pytest.raises(ServerError, match="return_token_ids"):
        api.parse({"choices": [{"text": "ab", "finish_reason": "stop"}]}, STOPS)
    assert api.load("policy-v4", "/f") == [
        ("/v1/load_lora_adapter", {"lora_name": "policy-v4", "lora_path": "/f"})
    ]
    assert api.unload("policy-v3") == [("/v1/unload_lora_adapter", {"lora_name": "policy-v3"})]


def test_sglang_generate_with_an_adapter_or_merged_weights(tiny: TinyAssets) -> None:
    lora, merged = SGLangAPI(tiny.tokenizer, False), SGLangAPI(tiny.tokenizer, True)
    body = lora.request([5, 6], "policy-v1", SAMPLE, STOPS, seed=3)
    assert body["input_ids"] == [5, 6] and body["lora_path"] == "policy-v1"
    params = body["sampling_params"]
    assert params["stop_token_ids"] == STOPS and params["sampling_seed"] == 3
    assert params["max_new_tokens"] == 9 and params["top_k"] == 20
    assert "lora_path" not in merged.request([5], "x", SAMPLE, STOPS, 0)
    assert lora.named_versions and not merged.named_versions
    from_ids = {"output_ids": [9, 3], "meta_info": {"prompt_tokens": 2, "completion_tokens": 2}}
    assert lora.parse(from_ids, STOPS).ids == [9, 3]
    pairs = {
        "meta_info": {
            "output_token_logprobs": [[-0.1, 9, None], [-0.2, 8, None]],
            "completion_tokens": 2,
        }
    }
    c = lora.parse(pairs, STOPS)
    assert c.ids == [9, 8] and not c.stopped and c.logps == [-0.1, -0.2] and c.model is None
    assert c.text_differs is None and not c.known_mismatch  # no text in that answer
    assert merged.load("policy-v2", "/f") == [("/update_weights_from_disk", {"model_path": "/f"})]
    assert merged.unload("policy-v1") == []
    assert lora.load("policy-v2", "/f")[0][0] == "/load_lora_adapter"


def test_server_api_names_the_field(tiny: TinyAssets) -> None:
    with pytest.raises(ValueError, match="rollout.server.api: unknown 'tgi'"):
        server_api("tgi", tiny.tokenizer, 3, False)


def _server(tmp_path: Path) -> RolloutServer:
    cfg = RolloutServerConfig(url="http://127.0.0.1:9")
    client = ServerClient(cfg.url, 5.0, 1, lambda: "INFO: ready")
    api = VLLMAPI(None)  # parse is not called: answers are handed to the check
    return RolloutServer(cfg, client, api, tmp_path, tmp_path / "base", 0, version=3)


def test_the_engine_refuses_an_answer_from_another_model_and_counts_the_rest(
    tmp_path: Path,
) -> None:
    server = _server(tmp_path)
    server.names["policy"] = "policy-v3"
    engine = ServerEngine(server, "policy")
    assert engine.version == 3 and ServerEngine(server, "reference").version == -1
    exact = Completion([1, 3], True, True, "policy-v3", 4, 2)
    engine._check(exact, "policy-v3", 4)
    retok = Completion([1, 3], False, True, None, 5, 3)  # the server read 5 prompt tokens
    engine._check(retok, "policy-v3", 4)
    assert engine.take_counts() == {
        "responses": 2.0,
        "exact": 1.0,
        "retokenized_mismatch": 1.0,
        "prompt_mismatch": 1.0,
    }
    assert engine.take_counts() == {}
    stale = Completion([1], True, False, "policy-v2", 4, 1)
    with pytest.raises(ServerFailed, match=r"http://127.0.0.1:9 answered with model 'policy-v2'"):
        engine._check(stale, "policy-v3", 4)
    with pytest.raises(ValueError, match="only the policy"):
        ServerEngine(server, "reference").sync_weights(None)  # type: ignore[arg-type]
    server.client.close()
