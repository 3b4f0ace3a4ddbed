"""python -m fastformer.export --ctranslate2 CHECKPOINT OUT: a CTranslate2 model of a fastformer checkpoint.
(``--transformers CHECKPOINT OUT``, a transformers folder, is fastformer/hf_export.py.)

CTranslate2 (``pip install "fastformer[ctranslate2]"``) is the engine Transformer translation models are
deployed with. The converted model decodes to the same tokens as ``Transformer.generate`` on the same
input (``tests/test_export.py`` checks it), given the same search settings:

- weights: the shared embedding serves the encoder's and decoder's embeddings and the output projection
  (CTranslate2 stores it once); a model with its own source vocabulary (config.src_vocab_size) gives the
  encoder its ``src_embed`` and CTranslate2 its source vocabulary; the fused q|k|v projection of
  self-attention and the fused k|v projection of cross-attention are CTranslate2's own layouts, copied as
  they are; post-norm or pre-norm as trained.
- positions: the model's table (config.positions: the paper's sin and cos interleaved, or a converted
  model's family's layout and offset) is stored in the model, so CTranslate2 does not use its own.
- a converted model's options: the embedding scale on or off, the output bias, the decoder's start token.
- tokens: CTranslate2 reads sentencepiece pieces; ``ctranslate2_translate`` below turns fastformer's ids
  into pieces and back, with the source's eos appended as fastformer's ``collate`` does and bos as the
  decoder's start token.
- search: CTranslate2 4.x normalizes a finished hypothesis by len ** alpha; fastformer by GNMT's
  ((5 + len) / 6) ** alpha. With ``length_penalty=0`` both rank by the raw sum of log-probabilities and
  agree exactly; with alpha > 0 they can pick different hypotheses. CTranslate2's ``max_decoding_length``
  is one limit for the whole batch (eos included), where fastformer gives each sentence its own
  ``length_limit`` (fastformer/nn/decoding.py) of tokens before its eos: ``ctranslate2_translate`` passes
  each sentence's own limit by translating sentences with different limits in separate calls.
"""
from __future__ import annotations

import argparse
import os
import sys

from fastformer import checkpoint as ckpt
from fastformer.cli import HelpFormatter
from fastformer.nn import decoding
from fastformer.nn.layers import DECODER_LAYER, decoder_layer_weights
from fastformer.nn.transformer import position_table

# Where each weight of the decoder layer (fastformer/nn/layers.py DECODER_LAYER, by name) goes in
# CTranslate2's TransformerDecoderLayerSpec. The fused q|k|v and k|v projections are CTranslate2's own
# layouts. An entry of DECODER_LAYER without a place here stops the export (a new weight needs one).
_CT2_DECODER_LAYER = {
    "self_attn_norm": lambda layer: layer.self_attention.layer_norm,
    "self_attn.qkv_proj": lambda layer: layer.self_attention.linear[0],  # q | k | v
    "self_attn.out_proj": lambda layer: layer.self_attention.linear[1],
    "cross_attn_norm": lambda layer: layer.attention.layer_norm,
    "cross_attn.q_proj": lambda layer: layer.attention.linear[0],
    "cross_attn.kv_proj": lambda layer: layer.attention.linear[1],  # k | v
    "cross_attn.out_proj": lambda layer: layer.attention.linear[2],
    "ffn_norm": lambda layer: layer.ffn.layer_norm,
    "ffn.fc1": lambda layer: layer.ffn.linear_0,
    "ffn.fc2": lambda layer: layer.ffn.linear_1,
}


def _ctranslate2():
    try:
        import ctranslate2
    except ImportError as exc:
        raise SystemExit("error: the CTranslate2 export needs the ctranslate2 package: "
                         "pip install 'fastformer[ctranslate2]' (or pip install ctranslate2)") from exc
    return ctranslate2


def vocabulary(tokenizer) -> list[str]:
    """The pieces of ids 0 .. V - 1: CTranslate2's (target) vocabulary."""
    return tokenizer.pieces()


def source_vocabulary(tokenizer) -> list[str]:
    """The source's pieces by id: the target's, unless the model has its own source vocabulary."""
    return tokenizer.source_pieces()


# config.activation -> CTranslate2's name (its GELU is the exact one, as fastformer's)
_CT2_ACTIVATION = {"relu": "RELU", "gelu": "GELU", "silu": "SWISH"}


def ctranslate2_spec(model, pieces: list[str], source_pieces: list[str] | None = None):
    """The ``ctranslate2.specs.TransformerSpec`` of a fastformer Transformer (float32 weights); ``pieces``
    is the (target) vocabulary (the special tokens are those at the config's unk, bos and eos ids),
    ``source_pieces`` the source's where the model has its own (config.src_vocab_size; default: pieces)."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.config
    if model.quantization is not None:
        raise ValueError(f"the CTranslate2 export takes a float model, not a {model.quantization} one: export the "
                         "float checkpoint and let CTranslate2 quantize it (compute_type)")
    missing = [w.name for w in DECODER_LAYER if w.name not in _CT2_DECODER_LAYER]
    if missing:
        raise ValueError(f"the CTranslate2 export has no place for decoder weights {missing}")
    spec = transformer_spec.TransformerSpec.from_config((cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads,
                                                        pre_norm=cfg.norm_first,
                                                        activation=getattr(common_spec.Activation,
                                                                           _CT2_ACTIVATION[cfg.activation]))
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    numpy = {name: p.detach().float().cpu().numpy() for name, p in model.state_dict().items()}

    def linear(target, prefix):
        target.weight, target.bias = numpy[prefix + ".weight"], numpy[prefix + ".bias"]

    def norm(target, prefix):
        target.gamma, target.beta = numpy[prefix + ".weight"], numpy[prefix + ".bias"]

    positions = position_table(cfg.max_positions, cfg).float().numpy()  # config.positions' layout and offset
    source_pieces = pieces if source_pieces is None else source_pieces
    if len(pieces) != cfg.vocab_size or len(source_pieces) != cfg.source_vocab_size:
        raise ValueError(f"the vocabularies have {len(source_pieces)} source and {len(pieces)} target pieces, the "
                         f"model {cfg.source_vocab_size} and {cfg.vocab_size}")
    embed = numpy["embed.weight"]
    for side, stack in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        table = numpy["src_embed.weight"] if side == "encoder" and model.src_embed is not None else embed
        (stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings).weight = table
        stack.scale_embeddings = cfg.scale_embedding  # x sqrt(d_model), or not
        stack.position_encodings.encodings = positions
        if cfg.norm_first:
            norm(stack.layer_norm, f"{side}.final_norm")
        for i, layer in enumerate(stack.layer):
            p = f"{side}.layers.{i}"
            if side == "decoder":  # by name, as DECODER_LAYER describes the layer (shapes checked)
                weights = decoder_layer_weights(model.decoder.layers[i], cfg)
                for w in DECODER_LAYER:
                    target = _CT2_DECODER_LAYER[w.name](layer)
                    module = weights[w.name]
                    weight, bias = (t.detach().float().cpu().numpy() for t in (module.weight, module.bias))
                    if w.kind == "norm":
                        target.gamma, target.beta = weight, bias
                    else:
                        target.weight, target.bias = weight, bias
                continue
            linear(layer.self_attention.linear[0], p + ".self_attn.qkv_proj")  # q | k | v
            linear(layer.self_attention.linear[1], p + ".self_attn.out_proj")
            norm(layer.self_attention.layer_norm, p + ".self_attn_norm")
            linear(layer.ffn.linear_0, p + ".ffn.fc1")
            linear(layer.ffn.linear_1, p + ".ffn.fc2")
            norm(layer.ffn.layer_norm, p + ".ffn_norm")
    spec.decoder.projection.weight = embed
    if cfg.output_bias:  # Marian's final_logits_bias
        spec.decoder.projection.bias = numpy["output_bias"]
    spec.register_source_vocabulary(source_pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = (
        pieces[cfg.unk_id], pieces[cfg.bos_id], pieces[cfg.eos_id])
    spec.config.decoder_start_token = pieces[cfg.start_id]
    spec.config.add_source_eos = True
    return spec


def write_ctranslate2(model, pieces: list[str], out_dir: str, force: bool = False,
                      source_pieces: list[str] | None = None) -> str:
    """Writes the CTranslate2 model of a Transformer with vocabulary ``pieces`` (and the source's,
    ``source_pieces``, where it has its own) into ``out_dir``."""
    ctranslate2 = _ctranslate2()

    class _Converter(ctranslate2.converters.Converter):
        def _load(self):
            return ctranslate2_spec(model, pieces, source_pieces)

    return _Converter().convert(out_dir, force=force)


def export_ctranslate2(checkpoint: str, out_dir: str, force: bool = False) -> str:
    """Writes the CTranslate2 model of ``checkpoint`` (file or run folder) into ``out_dir``."""
    model, tokenizer, _ = ckpt.load_model(checkpoint)
    return write_ctranslate2(model, vocabulary(tokenizer), out_dir, force, source_vocabulary(tokenizer))


def ctranslate2_translate(translator, pieces: list[str], ids: list[list[int]], *, beam_size: int = 4,
                          length_penalty: float = 0.0, max_len_a: float = decoding.MAX_LEN_A,
                          max_len_b: int = decoding.MAX_LEN_B, source_pieces: list[str] | None = None,
                          **options) -> list[list[int]]:
    """Best translations (ids, no bos/eos) of source id lists ``ids`` (no eos) by a CTranslate2
    ``Translator`` of an exported model with vocabulary ``pieces`` (the source ids read by ``source_pieces``
    where the model has its own source vocabulary), each sentence limited to
    ``decoding.length_limit(n, a, b)`` tokens before its eos (n counting the source's eos, as in ``Transformer.generate``). Sentences that share a limit go in
    one ``translate_batch`` call. fastformer's search never produces pad or bos; CTranslate2 can (its
    ``suppress_sequences`` option forbids them but renormalizes the other tokens' probabilities, which
    fastformer does not, so it is not set here)."""
    piece_ids = {piece: i for i, piece in enumerate(pieces)}
    source_pieces = pieces if source_pieces is None else source_pieces
    limits = [decoding.length_limit(len(s) + 1, max_len_a, max_len_b) for s in ids]
    out: list[list[int]] = [[] for _ in ids]
    for limit in sorted(set(limits)):
        group = [i for i, n in enumerate(limits) if n == limit]
        results = translator.translate_batch([[source_pieces[t] for t in ids[i]] for i in group],
                                             beam_size=beam_size, length_penalty=length_penalty,
                                             max_decoding_length=limit, **options)
        for i, result in zip(group, results):
            out[i] = [piece_ids[piece] for piece in result.hypotheses[0]]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastformer.export",
                                description="Export a fastformer checkpoint to another inference engine: a CTranslate2 "
                                            "model, or a transformers folder that AutoModelForSeq2SeqLM and "
                                            "AutoTokenizer load offline.",
                                formatter_class=HelpFormatter)
    engine = p.add_mutually_exclusive_group(required=True)
    engine.add_argument("--ctranslate2", action="store_true",
                        help="write a CTranslate2 model folder (needs: pip install ctranslate2)")
    engine.add_argument("--transformers", action="store_true",
                        help="write a transformers folder (needs: pip install 'fastformer[hf]'): a converted model "
                             "as the family it came from (Marian, M2M-100, NLLB), a model of fastformer.train as "
                             "Marian (its residual dimensions reordered so that Marian's position table is the "
                             "paper's: the same function); what the family has no field for is refused "
                             "(docs/transformers.md)")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file, or run folder (its latest)")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if os.path.exists(args.out) and not args.force:
        raise SystemExit(f"error: {args.out} exists (use --force to overwrite it)")
    try:
        if args.transformers:
            from fastformer.hf_export import ExportError, export_transformers

            try:
                out, family = export_transformers(args.checkpoint, args.out)
            except ExportError as exc:
                raise SystemExit(f"error: {exc}") from exc
            print(f"wrote the transformers {family} folder {out}", file=sys.stderr)
            return
        out = export_ctranslate2(args.checkpoint, args.out, force=args.force)
    except ckpt.CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from exc
    print(f"wrote the CTranslate2 model to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
