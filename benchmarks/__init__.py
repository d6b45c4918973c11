"""Benchmarks: workloads defined once, run by asv (``bench_clipping``) and pytest-benchmark
(``bench_workloads``, behind ``clipbench bench``), related to this machine's memory roofline.

asv imports every module of this folder to discover benchmarks, so none may import a framework
(torch, jax, tensorflow) at import time: frameworks load in a benchmark's ``setup`` only.
"""
