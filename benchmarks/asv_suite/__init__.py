"""asv's benchmark folder (``benchmark_dir`` in asv.conf.json): the asv suite and nothing else.

asv imports every module of this folder to discover benchmarks, and its forkserver (the
configured launch method) forks every benchmark process from the process that did: what a
module here imports, every process starts with. In the forkserver the suite also imports the
frameworks that are safe to fork, those that start no thread, process or CUDA context when
imported (``grid_point.PRELOADED_MODULES``); the rest of ``benchmarks/`` (sharded runs, GPU
check, pytest-benchmark) imports more, and runs JAX and torch.
"""
