"""Runners: the kvpark.Runner protocol, the built-in torch runner, the ONE place a plan becomes
tensors (batch.py), CUDA graphs, the CPU path rule. Imports sched.plan, model, tokenizer, config.
"""
