"""fastformer.nn: the Transformer of "Attention Is All You Need" on fastformer's fused ops."""
from fastformer.nn.attention import MultiHeadAttention
from fastformer.nn.config import TransformerConfig
from fastformer.nn.layers import Decoder, DecoderLayer, Encoder, EncoderLayer, FeedForward
from fastformer.nn.transformer import Transformer

__all__ = ["TransformerConfig", "Transformer", "MultiHeadAttention", "FeedForward", "EncoderLayer",
           "DecoderLayer", "Encoder", "Decoder"]
