"""Scheduling: requests and their states, admission, decodes and prompt chunks, the step plan.
Imports sampling, config and the Rust core; no torch.
"""
