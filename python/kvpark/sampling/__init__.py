"""Sampling: SamplingParams and their validation, logits -> tokens with per-request generators.
Imports config only.
"""
