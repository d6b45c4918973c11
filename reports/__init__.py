"""Comparison reports: which implementation to trust, which is fastest, and the evidence.

Data flows one way, from recorded results to documents; nothing here measures anything:

* ``results``: read and validate the raw results (conformance CSV, pytest-benchmark JSON, asv
  results folder), with errors that name the file and why;
* ``tables``: the derived tables (conformance matrix, accuracy, divergences, summary, asv
  history), small pure functions on DataFrames;
* ``plots``: matplotlib figures as PNG bytes; ``machine``: the machine and library versions;
* ``render``: one document model rendered to self-contained HTML and to GitHub Markdown;
* ``build``: assembles the report and writes ``<out>/<stamp>/`` and ``<out>/latest/``;
* ``files``: atomic writes of files and folders.

``clipbench report`` (``clipbench/cli.py``) runs the suite and the benchmarks, then calls
``build``.
"""
