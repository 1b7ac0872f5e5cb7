"""Ingest validates a safetensors file's layout from its header: a truncated or corrupted file
fails naming the file and what is wrong, before any weight is loaded."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_model

from posttrain.stages.ingest import IngestError, check_safetensors_header, check_weights


def _tiny_model_file(folder: Path) -> Path:
    """A real file written by safetensors from a small model (two same-sized weights)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False), torch.nn.LayerNorm(8)
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    save_model(model, str(path))
    return path


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_a_real_file_passes_and_loads(tmp_path: Path) -> None:
    path = _tiny_model_file(tmp_path / "m")
    header = check_safetensors_header(path)
    assert set(load_file(str(path))) == {k for k in header if k != "__metadata__"}
    _, n_params, dtype = check_weights(path.parent, allow_pickle=False)
    assert (n_params, dtype) == (8 * 8 + 8 + 8 * 8 + 8 + 8, "F32")


def _truncate_data(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _truncate_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


def _huge_length(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])


def _length_off_by_some(path: Path) -> None:
    # A plausible length that cuts the JSON short: the header no longer parses.
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    path.write_bytes(struct.pack("<Q", n - 7) + raw[8:])


def _overlap(path: Path) -> None:
    header, data = _split(path)
    header["1.weight"]["data_offsets"] = header["0.weight"]["data_offsets"]
    _write(path, header, data)


def _wrong_span(path: Path) -> None:
    header, data = _split(path)
    header["0.weight"]["shape"] = [8, 9]
    _write(path, header, data)


def _gap(path: Path) -> None:
    header, data = _split(path)
    del header["2.bias"]
    _write(path, header, data)


def _unknown_dtype(path: Path) -> None:
    header, data = _split(path)
    header["0.bias"]["dtype"] = "F33"
    _write(path, header, data)


def _not_an_object(path: Path) -> None:
    _write(path, [1, 2, 3], _split(path)[1])  # type: ignore[arg-type]


def _negative_offsets(path: Path) -> None:
    header, data = _split(path)
    header["0.bias"]["data_offsets"] = [-4, 28]
    _write(path, header, data)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated data": (
        _truncate_data,
        r"end beyond the \d+-byte data section: the file is truncated "
        r"\(it needs at least \d+ bytes, has \d+\)",
    ),
    "truncated header": (_truncate_header, r"header length \d+ exceeds the 32 bytes after it"),
    "corrupted header length": (_huge_length, r"header length 1099511627776 exceeds"),
    "length cuts the json": (_length_off_by_some, r"header is not valid JSON"),
    "overlapping offsets": (_overlap, r"tensors '.*' and '.*' overlap"),
    "span differs from dtype x shape": (
        _wrong_span,
        r"tensor '0.weight': F32 \[8, 9\] needs 288 bytes but data_offsets \[\d+, \d+\] span 256",
    ),
    "bytes owned by no tensor": (_gap, r"bytes \d+\.\.\d+ of the data section belong to no tensor"),
    "unknown dtype": (_unknown_dtype, r"tensor '0.bias': unknown dtype 'F33'"),
    "header not an object": (_not_an_object, r"header is a JSON list, not an object"),
    "negative offsets": (_negative_offsets, r"are not 0 <= begin <= end"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_is_refused_naming_it_and_the_problem(tmp_path: Path, damage: str) -> None:
    path = _tiny_model_file(tmp_path / "m")
    corrupt, message = DAMAGE[damage]
    corrupt(path)
    with pytest.raises(IngestError, match=message) as exc:
        check_weights(path.parent, allow_pickle=False)
    assert str(exc.value).startswith(f"{path}: unreadable safetensors file (")


def test_every_dtype_size_matches_torch() -> None:
    from posttrain.stages.ingest import SAFETENSORS_DTYPE_BITS

    ours = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
    ours |= {"U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}
    for name, dtype in ours.items():
        assert SAFETENSORS_DTYPE_BITS[name] == torch.empty(0, dtype=dtype).element_size() * 8
