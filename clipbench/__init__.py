"""clipbench: conformance suite and benchmark for update-clipping operations.

The five parts live in top-level folders of the repository and install as subpackages:
``clipbench.reference`` (the exact reference, the spec), ``clipbench.impls`` (implementations
under test), ``clipbench.conformance`` (the pytest suite), ``clipbench.benchmarks`` (workloads,
asv and pytest-benchmark) and ``clipbench.reports`` (comparison reports).
"""

__version__ = "0.1.0"
