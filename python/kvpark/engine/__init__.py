"""The engine: one thread owns every mutation of the pool; the step loop, its asyncio
wrapper, the offline API, and what it streams back.
Imports sched, preempt, runner, sampling, tokenizer, config and the Rust core; never server or cli.
"""
