"""TransformerConfig: the sizes of the paper's models and of the CPU-friendly ones."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

# The feed-forward's activations (fastformer/nn/layers.py ACTIVATIONS computes them in Python, the C++
# decoder step, csrc/inference/decoder_step.cpp, by the same names): relu (the paper), gelu (exact, erf),
# silu (x sigmoid(x), called swish by Marian and CTranslate2).
ACTIVATIONS = ("relu", "gelu", "silu")

# The sinusoidal position tables (fastformer/nn/transformer.py position_table), each a family's layout; row p
# encodes position p (+ config.position_offset), with frequencies w_i for i = 0 .. d/2 - 1:
#   "paper":   PE(p, 2i) = sin(p w_i), PE(p, 2i + 1) = cos(p w_i), w_i = 10000^(-2i/d)  (interleaved)
#   "marian":  PE(p, i) = sin(p w_i), PE(p, d/2 + i) = cos(p w_i), w_i = 10000^(-2i/d)  (halves: Marian)
#   "fairseq": halves as "marian", w_i = 10000^(-i/(d/2 - 1))  (fairseq's, M2M-100's and NLLB's)
POSITION_TABLES = ("paper", "marian", "fairseq")


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1  # residual dropout and embedding + position dropout (P_drop in the paper)
    attention_dropout: float = 0.0  # on attention probabilities
    activation_dropout: float = 0.0  # after the feed-forward's activation
    activation: str = "relu"  # of the feed-forward, between fc1 and fc2: one of ACTIVATIONS
    label_smoothing: float = 0.1
    norm_first: bool = False  # False: post-norm as in the paper; True: pre-norm with a final LayerNorm
    layer_norm_eps: float = 1e-5
    max_positions: int = 1024  # sinusoid table size (extended on demand)
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3
    # Options of the models converted from transformers (fastformer/hf_convert.py; the defaults are the paper's):
    scale_embedding: bool = True  # embeddings times sqrt(d_model) before the positions are added
    output_bias: bool = False  # a bias (vocab,) on the output projection (Marian's final_logits_bias)
    positions: str = "paper"  # the sinusoid table's layout: one of POSITION_TABLES
    position_offset: int = 0  # position p reads the table's row p + offset (M2M-100: 2)
    decoder_start_id: Optional[int] = None  # the decoder's first input token (None: bos_id; Marian: pad)
    # The source's own vocabulary and embedding (Marian's share_encoder_decoder_embeddings false): src ids in
    # [0, src_vocab_size), embedded by Transformer.src_embed; vocab_size is then the target's, whose embedding
    # stays tied to the output projection. None: one joint vocabulary (the paper's).
    src_vocab_size: Optional[int] = None

    def __post_init__(self):
        if self.vocab_size <= max(self.pad_id, self.unk_id, self.bos_id, self.eos_id):
            raise ValueError(f"vocab_size {self.vocab_size} must exceed the special token ids")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")
        if self.positions not in POSITION_TABLES:
            raise ValueError(f"positions must be one of {', '.join(POSITION_TABLES)}, got {self.positions!r}")
        if self.position_offset < 0:
            raise ValueError(f"position_offset must be >= 0, got {self.position_offset}")
        if self.src_vocab_size is not None and self.src_vocab_size <= max(self.pad_id, self.unk_id):
            raise ValueError(f"src_vocab_size {self.src_vocab_size} must exceed pad_id and unk_id")
        if self.decoder_start_id is not None and not 0 <= self.decoder_start_id < self.vocab_size:
            raise ValueError(f"decoder_start_id {self.decoder_start_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        for name in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def source_vocab_size(self) -> int:
        """The source's vocabulary size: src_vocab_size, else the joint vocab_size."""
        return self.vocab_size if self.src_vocab_size is None else self.src_vocab_size

    @property
    def start_id(self) -> int:
        """The decoder's first input token: decoder_start_id, else bos_id."""
        return self.bos_id if self.decoder_start_id is None else self.decoder_start_id

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TransformerConfig":
        return cls(**d)

    def replace(self, **changes) -> "TransformerConfig":
        return replace(self, **changes)

    @classmethod
    def base(cls, vocab_size: int, **overrides) -> "TransformerConfig":
        """The paper's base model: N=6, d_model 512, d_ff 2048, 8 heads, dropout 0.1 (65M params at 37k vocab)."""
        return cls(vocab_size=vocab_size, **overrides)

    @classmethod
    def big(cls, vocab_size: int, **overrides) -> "TransformerConfig":
        """The paper's big model: N=6, d_model 1024, d_ff 4096, 16 heads, dropout 0.3 (213M params)."""
        kw = dict(d_model=1024, d_ff=4096, n_heads=16, dropout=0.3)
        return cls(vocab_size=vocab_size, **{**kw, **overrides})

    @classmethod
    def small(cls, vocab_size: int = 8000, **overrides) -> "TransformerConfig":
        """3+3 layers, d_model 256, 4 heads, d_ff 1024: the size trained on a 2-core CPU."""
        kw = dict(d_model=256, d_ff=1024, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, dropout=0.1)
        return cls(vocab_size=vocab_size, **{**kw, **overrides})

    @classmethod
    def tiny(cls, vocab_size: int = 64, **overrides) -> "TransformerConfig":
        """2+2 layers, d_model 32, 4 heads, d_ff 64: for tests."""
        kw = dict(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, dropout=0.1,
                  max_positions=256)
        return cls(vocab_size=vocab_size, **{**kw, **overrides})
