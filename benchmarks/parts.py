"""The parts of benchmarks/run.py, in the order it runs them (no Django here: the tests
import it without setting Django up for the benchmarks)."""

PARTS = [
    "raw",
    "throughput",
    "enqueue",
    "latency",
    "claim",
    "claimpath",
    "memory",
    "duplicates",
    "relay",
    "workflows",
    "fairness",
]
