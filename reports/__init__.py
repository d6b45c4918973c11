"""Comparison reports: which implementation to trust, which is fastest, and the evidence.

Data flows one way, from recorded results to documents; nothing here measures anything:

* ``results``: read and validate the raw results (conformance CSV, pytest-benchmark JSON, asv
  results folder), with errors that name the file and why;
* ``tables``: the derived tables (library x severity, summary with verdicts, conformance
  matrix, accuracy, the divergence catalogue by manifest entry, asv history), small pure
  functions on DataFrames;
* ``plots``: matplotlib figures as PNG bytes; ``machine``: the machine and library versions;
* ``render``: one document model rendered to HTML and to GitHub Markdown (a report folder
  reads offline: no script, no network);
* ``build``: assembles the report and writes ``<out>/<stamp>/`` and ``<out>/latest/``;
* ``clipbench.files``: atomic writes of files and folders.

``clipbench report`` (``clipbench/report_command.py``) runs the suite and the benchmarks, then calls
``build``.
"""
