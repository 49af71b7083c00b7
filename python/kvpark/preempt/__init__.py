"""Preemption: the planner's snapshot and actions, carrying out parks and resumes, host buffers
within --preempt-ram, sync and CUDA-stream copies. Imports sched, model.ops, config, the Rust core;
never engine: what it reports into (the engine's events and counters) it names by the protocols of
reports.py.
"""
