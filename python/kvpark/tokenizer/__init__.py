"""Tokenizers and chat templates, incremental detokenizing, stop strings on the text stream.
Imports nothing else of kvpark; no torch.
"""
