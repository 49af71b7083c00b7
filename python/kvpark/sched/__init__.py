"""Scheduling: requests and their states, the wait queue and its admission rule, decodes and prompt
chunks, the cells a step reserves, the step plan. Imports sampling, config and the Rust core; no
torch.
"""
