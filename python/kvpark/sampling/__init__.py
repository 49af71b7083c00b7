"""Sampling: SamplingParams and their validation, logits -> tokens with per-request generators and
grammar masks. Imports config and tokenizer (a grammar is compiled over the served tokenizer).
"""
