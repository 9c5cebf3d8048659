"""The configuration's workload sections: which built-in model, its size, and its data."""

from dataclasses import dataclass

from gradmesh.config import checks as _checks
from gradmesh.config.checks import finite as _finite
from gradmesh.config.checks import one_of as _one_of
from gradmesh.config.checks import positive as _positive
from gradmesh.errors import UsageError
from gradmesh.paths import check_name

HF_MODELS = ("hf:gpt2", "hf:llama")
"""Hugging Face transformers models built from their config class alone (no weights, no hub), sized
by the model.* settings and trained on gpt-char's text: the `hf` extra brings transformers."""
TEXT_MODELS = ("gpt-char", *HF_MODELS)
"""The models that read characters of text (data.path, the char vocabulary, block_size)."""
RL_MODELS = ("rl-cartpole",)
"""Reinforcement-learning workloads: they train on experience their own actors make (Gymnasium's
CartPole-v1), under the actor-learner strategy only (`Strategy.experience`)."""
MODELS = ("gpt-char", "mlp-digits", "recsys", "resnet", *HF_MODELS, *RL_MODELS)
MODULES, WIDTH = 1024, 2**20
LIMITS = {
    "n_layer": MODULES,
    "tables": MODULES,
    "n_embd": WIDTH,
    "n_head": WIDTH,
    "hidden": WIDTH,
    "dim": 2**16,
    "width": 2**12,
    "image_size": 2**10,
    "block_size": 2**24,
    "rows": 2**40,
}
"""Upper bounds of the model's size knobs. Blocks and tables are Python modules, built (on the meta
device) before launch to check the model fits: 10^5 blocks take minutes there (GPT-3 has 96
blocks, Criteo's click log 26 tables). Widths and lengths stay far below where their products
overflow torch's 64-bit element counts (an error inside torch, not the memory check's one line)."""
MIN_IMAGE_SIZE = 16
MAX_CHARS = 100_000_000
"""data.max_chars at most: every rank holds the corpus as 8-byte tokens (~800 MB at the bound)."""


@dataclass(kw_only=True)
class ModelConfig:
    """Which built-in model to train and its size (nanoGPT's names)."""

    name: str = "gpt-char"
    """Built-in model: gpt-char (character-level transformer), mlp-digits, recsys (DLRM-style
    click model on a synthetic click log), resnet (torchvision's ResNet-18 on generated images of
    coloured shapes), or hf:gpt2 / hf:llama (Hugging Face transformers' GPT2LMHeadModel /
    LlamaForCausalLM, built from their config class, on gpt-char's text), or rl-cartpole (an
    actor-critic MLP learning CartPole-v1 from its actors' experience: the [rl] section)."""
    n_layer: int = 4
    """Transformer blocks (gpt-char, hf:*)."""
    n_head: int = 4
    """Attention heads per block (gpt-char, hf:*); must divide n_embd (hf:llama: into an even head width)."""
    n_embd: int = 128
    """Embedding width (gpt-char, hf:*)."""
    block_size: int = 128
    """Context length in characters (gpt-char, hf:*)."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps training deterministic and parity exact."""
    bias: bool = True
    """Bias terms in Linear and LayerNorm layers (gpt-char)."""
    hidden: int = 128
    """Hidden width of the two hidden layers (mlp-digits, rl-cartpole; recsys: of the bottom and top MLPs)."""
    tables: int = 8
    """Embedding tables, one per categorical feature (recsys)."""
    rows: int = 100_000
    """Rows of all embedding tables together, split evenly among them (recsys)."""
    dim: int = 16
    """Embedding dimension (recsys)."""
    zipf: float = 1.1
    """Exponent of the Zipf distribution the click log's ids are drawn from (recsys)."""
    samples: int = 3_000_000
    """Samples in the synthetic click log (recsys) or image set (resnet; its default 24,000),
    training and held out."""
    width: int = 64
    """Channels of the ResNet's first stage; the later stages have twice, four and eight times as
    many (resnet; 64 is torchvision's ResNet-18)."""
    image_size: int = 16
    """Side of the generated images in pixels, at least 16: smaller shapes stop being told apart
    with certainty (resnet)."""
    sync_bn: bool = True
    """Batch statistics over every data-parallel rank's share together, so that N ranks train the
    model one process does (resnet); false: each rank normalises by its own share and keeps its
    own running statistics (rank 0's are saved)."""

    def __post_init__(self):
        _finite(self)
        _one_of("model", "name", self.name, MODELS)
        names = ("n_layer", "n_head", "n_embd", "block_size", "hidden", "tables", "rows", "dim", "samples", "width")
        for name in names:
            _positive("model", name, getattr(self, name))
        for name, limit in LIMITS.items():
            if getattr(self, name) > limit:
                raise UsageError(
                    f"model.{name} must be at most {limit:,} (a model built before launch to check that "
                    f"it fits), got {getattr(self, name):,}"
                )
        if self.image_size < MIN_IMAGE_SIZE:
            raise UsageError(
                f"model.image_size must be at least {MIN_IMAGE_SIZE} (smaller shapes stop being told apart "
                f"with certainty), got {self.image_size}"
            )
        if self.zipf <= 0:
            raise UsageError(f"model.zipf must be > 0 (a Zipf exponent; 1.1 is the default), got {self.zipf}")
        if self.rows < self.tables:
            raise UsageError(
                f"model.rows={self.rows} gives the {self.tables} tables no row each; use model.rows >= model.tables"
            )
        _checks.fraction("model", "dropout", self.dropout)
        if self.n_embd % self.n_head:
            raise UsageError(f"model.n_head={self.n_head} must divide model.n_embd={self.n_embd}")
        if self.name == "hf:llama" and (self.n_embd // self.n_head) % 2:  # rotary embeddings turn pairs
            raise UsageError(
                f"hf:llama's head width model.n_embd / model.n_head = {self.n_embd // self.n_head} must be even "
                "(rotary position embeddings rotate pairs of channels)"
            )


@dataclass(kw_only=True)
class DataConfig:
    """Where the training text comes from (gpt-char, hf:*)."""

    path: str = ""
    """UTF-8 text file or folder of text files; empty means the Python standard library's source."""
    max_chars: int = 3_000_000
    """Characters of corpus to use at most (the first ones, files in sorted order); at most 10^8."""
    eval_fraction: float = 0.1
    """Share of the corpus (its end) held out for eval loss."""

    def __post_init__(self):
        _finite(self)
        if self.path:
            check_name(self.path, "data.path")
        _positive("data", "max_chars", self.max_chars)
        if self.max_chars > MAX_CHARS:
            raise UsageError(
                f"data.max_chars must be at most {MAX_CHARS:,} (every rank holds the corpus in memory), "
                f"got {self.max_chars:,}"
            )
        if not 0.0 < self.eval_fraction < 0.5:
            raise UsageError(f"data.eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
