"""ingest: the base checkpoint (a local folder or hub id, checked and recorded), or a tiny
model built from a config with a trained tokenizer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.kinds._kind import StageKind
from posttrain.sections.fields import Execution, Result, _Section

# Real models' shapes for `ingest.from_config.shape`: random-init stand-ins with the exact width,
# depth, heads and vocabulary of a public checkpoint (its config.json), for memory and throughput
# checks where the hub is out of reach. `vocab_size` is the tokenizer's size, `embedding_rows`
# the model's (Qwen pads its embedding past the tokenizer).
_SHAPE_FIELDS = (  # a row of MODEL_SHAPES
    "architecture",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "vocab_size",
    "embedding_rows",
    "max_position_embeddings",
    "tie_word_embeddings",
)
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    name: dict(zip(_SHAPE_FIELDS, row, strict=True))
    for name, row in {
        "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 151_665, 151_936, 32_768, True),
        "qwen2.5-1.5b": ("qwen2", 1536, 28, 12, 2, 8960, 151_665, 151_936, 32_768, True),
        "qwen2.5-3b": ("qwen2", 2048, 36, 16, 2, 11_008, 151_665, 151_936, 32_768, True),
        "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 18_944, 151_665, 152_064, 32_768, False),
        "llama3.1-8b": ("llama", 4096, 32, 32, 8, 14_336, 128_256, 128_256, 131_072, False),
    }.items()
}


# The from_config fields the trained tokenizer depends on (with `run.seed`, which seeds its
# corpus and is one per recipe): two from_config bases of one recipe that agree on these
# tokenize alike whatever their widths (posttrain.stages.ingest.from_config_tokenizer).
TOKENIZER_FIELDS = ("vocab_size", "fill_vocab", "corpus_examples", "corpus_task", "template")


class FromConfigModel(_Section):
    shape: (
        Literal["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama3.1-8b"] | None
    ) = Result(
        None,
        description="A public model's exact shape (width, depth, heads, vocabulary) as the "
        "default for every model field not set here; the BPE is filled to the real vocabulary "
        "size. Set `num_layers`/`hidden_size`... to shrink it (e.g. the real 151,936-row "
        "vocabulary on a 2-block model).",
    )
    architecture: Literal["llama", "qwen2"] = Result(
        "llama", description="transformers model family."
    )
    hidden_size: int = Result(128, ge=8, description="Model width.")
    num_layers: int = Result(4, ge=1, description="Decoder blocks.")
    num_heads: int = Result(4, ge=1, description="Attention heads.")
    num_kv_heads: int | None = Result(
        None, ge=1, description="KV heads (GQA); default = num_heads."
    )
    intermediate_size: int = Result(256, ge=8, description="MLP width.")
    vocab_size: int = Result(2048, ge=300, description="BPE vocabulary size to train.")
    max_position_embeddings: int = Result(
        512, ge=16, description="Longest sequence the model takes."
    )
    embedding_rows: int | None = Result(
        None,
        ge=300,
        description="Rows of the model's embedding and LM head (config.vocab_size); default the "
        "tokenizer's size. Real checkpoints pad it (Qwen2.5: 151,936 rows, 151,665 tokens).",
    )
    fill_vocab: bool = Result(
        False,
        description="Extend the trained BPE with merges of its own tokens to exactly `vocab_size` "
        "tokens, for a real-size vocabulary from a small corpus (on by default with `shape`).",
    )
    tie_word_embeddings: bool = Result(True, description="Share input embedding and LM head.")
    pretrain_steps: int = Result(
        0,
        ge=0,
        description="Causal-LM warm-up steps on the synthetic corpus, so LoRA has a "
        "non-random base to adapt (0 = random init).",
    )
    pretrain_lr: float = Result(3e-3, gt=0, description="Warm-up learning rate.")
    pretrain_batch_size: int = Result(16, ge=1, description="Warm-up sequences per step.")
    pretrain_seq_len: int = Result(128, ge=8, description="Warm-up sequence length.")
    corpus_examples: int = Result(
        4000, ge=100, description="Synthetic examples used to train the tokenizer and warm-up."
    )
    corpus_task: Literal["quickstart", "code"] = Result(
        "quickstart",
        description="What the tokenizer and warm-up corpus hold: `quickstart`, sentences over "
        "the quickstart skills and their chats; `code`, the code task's requests and "
        "programs (fences, `def`, indentation, operators get merges; "
        "posttrain.data.code_tasks), for `task: code` stages.",
    )
    template: Literal["chatml", "chatml_tools"] = Result(
        "chatml",
        description="The built tokenizer's chat template: ChatML, or ChatML with tools "
        "(hermes `<tool_call>` blocks, `tool` turns, tools listed one line each in the system "
        "turn) for tool-use SFT and agents; its corpus then holds tool-call text too. "
        "`ingest.chat_template`, when set, replaces it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _shape_defaults(cls, data: Any) -> Any:
        # The shape fills only what the recipe leaves out, so `num_layers: 2` shrinks it.
        if isinstance(data, dict) and data.get("shape") in MODEL_SHAPES:
            data = {**MODEL_SHAPES[data["shape"]], "fill_vocab": True, **data}
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> FromConfigModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {kv}")
        if self.embedding_rows is not None and self.embedding_rows < self.vocab_size:
            raise ValueError(
                f"embedding_rows {self.embedding_rows} is smaller than vocab_size "
                f"{self.vocab_size}: every token needs an embedding row"
            )
        return self


class IngestConfig(_Section):
    source: Literal["path", "from_config"] = Result(
        "path",
        description="`path`: a local Hugging Face folder or a hub id. `from_config`: build a "
        "small random-init model and train a BPE tokenizer offline (quickstart, tests).",
    )
    path: str | None = Result(
        None,
        source="model",
        description="Local model folder (config, weights, tokenizer), or a hub id `org/name` "
        "(anything that is not an existing local path), read from the huggingface_hub cache "
        "(downloaded first unless HF_HUB_OFFLINE=1).",
    )
    revision: str = Result(
        "main",
        min_length=1,
        description="Hub ids only: branch, tag or commit sha. The commit it resolves to is "
        "part of the fingerprint and the manifest.",
    )
    allow_pickle: bool = Execution(
        False, description="Accept pickle weights (*.bin, *.pt). Pickle can run code when loaded."
    )
    trust_remote_code: bool = Result(
        False, description="Accept models whose config needs custom code from the folder."
    )
    chat_template: str | None = Result(
        None,
        source="template",
        description="Jinja chat template to install, as text or the path of a file holding "
        "it (e.g. `templates/qwen3.jinja`). Required when the tokenizer has none; replaces the "
        "tokenizer's own when given.",
    )
    from_config: FromConfigModel = Field(
        default_factory=FromConfigModel, description="Model to build when source = from_config."
    )

    @model_validator(mode="after")
    def _path_given(self) -> IngestConfig:
        if self.source == "path" and not self.path:
            raise ValueError(
                "source 'path' needs ingest.path (a local Hugging Face model folder or a hub id)"
            )
        return self


KIND = StageKind(
    name="ingest",
    section=IngestConfig,
    module="posttrain.stages.ingest",
    help="Base checkpoint.",
    order=0,
    produces="base",
    version="3",
    placement="first",
    timeout_s=1800,
)
