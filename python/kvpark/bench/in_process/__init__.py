"""The benchmarks that run an engine in their own process: ``kvpark bench --scenario NAME``
starts each module here as ``python -m kvpark.bench.in_process.<module>`` (bench/suites/
in_process.py). The one part of the bench that imports the engine, the runners or torch; nothing
of kvpark imports it, so the bench client above stays a client.
"""
