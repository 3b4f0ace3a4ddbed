"""Corpora, tokenizer and batching for training and evaluation."""
from fastformer.data.batching import PackedBatch, Sequences, collate, collate_packed, token_batches
from fastformer.data.corpus import BIBLE_PAIRS, ParallelCorpus, load_bible, load_text_files, read_sentence_file, read_sentences
from fastformer.data.tokenizer import Tokenizer

__all__ = ["BIBLE_PAIRS", "ParallelCorpus", "load_bible", "load_text_files", "read_sentence_file", "read_sentences", "Tokenizer", "token_batches", "collate",
           "collate_packed", "PackedBatch", "Sequences"]
