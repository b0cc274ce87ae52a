"""The measurement commands users run: bench, memory, fidelity, bench-serve (servebench.py)."""
