"""asv's benchmark folder (``benchmark_dir`` in asv.conf.json): the asv suite and nothing else.

asv imports every module of this folder to discover benchmarks, and its forkserver (the
configured launch method) forks every benchmark process from the process that did: a module
here that loaded a framework would be loaded in every process, CUDA context included. The
rest of ``benchmarks/`` (sharded runs, GPU check, pytest-benchmark) imports JAX and torch.
"""
