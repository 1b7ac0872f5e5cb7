"""The same inputs give the same bits (issue 39): what a pass's arithmetic depends on besides its
inputs, each case measured on real tensors and a real tiny model.

- MKL (torch's CPU matmul) rounds by its operands' memory addresses and its thread count unless
  its reproducible mode is on; importing posttrain turns it on (`posttrain.numerics.pin`). The
  control is a process whose MKL started before posttrain was imported, as a user's script
  that multiplies first would.
- The frozen reference's log-probs do not depend on dropout or the RNG stream: it runs in eval
  mode (`reference_pass`), whatever dropout the adapter it copies was trained with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures_tiny import MAX_LEN, TinyAssets, load_base, one_torch_thread, tiny_assets

from posttrain import numerics
from posttrain.data.preference import encode_pairs, quickstart_preference_rows
from posttrain.models.adapters import policy_with_reference
from posttrain.stages.dpo import reference_logps

ROOT = Path(__file__).resolve().parents[1]

# Products of the same values at four addresses and at 1, 2 and 3 threads
# (`posttrain.numerics.distinct_products`), in a process of their own: MKL's mode is per process.
PROBE = """
import json, sys, torch
if sys.argv[1] == "late":  # MKL starts before posttrain is imported
    torch.ones(8, 8) @ torch.ones(8, 8)
from posttrain.numerics import distinct_products, mkl_mode
print(json.dumps({"mode": mkl_mode(), "outcomes": distinct_products()}))
"""


def _probe(when: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, when],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# Slow: two fresh interpreters import torch and multiply at many addresses (~5-13 s).
@pytest.mark.slow
@pytest.mark.skipif(numerics.mkl_mode() is None, reason="torch here has no MKL")
def test_importing_posttrain_makes_matmul_independent_of_address_and_threads() -> None:
    pinned = _probe("first")
    assert pinned == {"mode": numerics.STRICT_MKL, "outcomes": 1}
    # The control: MKL started before the pin could act, so its default mode decides, and the
    # same values at other addresses or thread counts round differently.
    late = _probe("late")
    assert late["mode"] != numerics.STRICT_MKL
    assert late["outcomes"] > 1, late
    # This test process: conftest imports posttrain first.
    assert numerics.mkl_mode() == numerics.STRICT_MKL and numerics.distinct_products() == 1


@pytest.mark.skipif(numerics.mkl_mode() is None, reason="torch here has no MKL")
def test_reproducibility_record_says_what_the_process_ran_under() -> None:
    assert numerics.reproducibility("cpu")["bit_exact"] is True
    cuda = numerics.reproducibility("cuda")
    assert cuda["bit_exact"] is False and "atomic" in cuda["why"]
    sig = numerics.device_signature("cpu")
    assert sig["mkl_cbwr"] == numerics.STRICT_MKL and sig["threads"] == torch.get_num_threads()
    assert sig["isa"] == torch.backends.cpu.get_cpu_capability() and sig["cpu"]


def test_reference_log_probs_ignore_dropout_and_the_rng(tmp_path_factory) -> None:
    """The stage's reference pass over an adapter trained with LoRA dropout 0.5, on a model in
    training mode as in the stage: the same table under two RNG streams, and the table of the
    same weights without dropout."""
    assets: TinyAssets = tiny_assets(tmp_path_factory)
    with_dropout = tmp_path_factory.mktemp("dropout") / "adapter"
    with_dropout.mkdir()
    for f in assets.adapter_trained.iterdir():
        data = f.read_bytes()
        if f.name == "adapter_config.json":
            cfg = json.loads(data)
            cfg["lora_dropout"] = 0.5
            data = json.dumps(cfg).encode()
        (with_dropout / f.name).write_bytes(data)
    pairs = encode_pairs(assets.tokenizer, quickstart_preference_rows(12, seed=5), MAX_LEN, 48)[0]
    pad = assets.tokenizer.pad_token_id

    def table(adapter: Path, seed: int) -> torch.Tensor:
        model = policy_with_reference(load_base(assets), adapter).train()
        torch.manual_seed(seed)
        with one_torch_thread():
            out = reference_logps(model, pairs, pad, 4, torch.device("cpu"), 0, 1, flat=True)
        assert model.training  # the stage's mode is given back
        return out

    first = table(with_dropout, seed=1)
    assert torch.equal(first, table(with_dropout, seed=2))
    assert torch.equal(first, table(assets.adapter_trained, seed=3))
