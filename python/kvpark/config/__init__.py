"""Configuration: one frozen dataclass per layer (layers.py), and every KVPARK_* knob in one table
(env.py). Imports nothing else of kvpark: every layer may import it.
"""
