"""Implementations under test: our own kernels (``own/``) and adapters over libraries (``adapters/``).

Any importable object with a ``framework`` attribute and any subset of the three canonical
functions is an implementation; :mod:`clipbench.impls.registry` loads them by name or by
``package.module:attr``.
"""
