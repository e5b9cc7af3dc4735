"""Benchmarks for humanline-kernels: ``python -m bench {logits,linear,sync} [--quick] [--out DIR]``."""
