"""Rule 14: a call on sharded leaves gives the bits of the same call on unsharded leaves.

Framework-neutral parts: ``layouts`` (the named shard layouts and the inputs of each case) and
``compare`` (sharded against unsharded, bit for bit, in numpy: the ulp difference, a changed
clip decision, a broken bound). JAX: ``jax_runner`` places the leaves on meshes of host CPU
devices and calls each implementation in a process started with ``host_devices``' flags;
``checks`` starts that process once per pytest session and turns its rows into findings.
Nothing here imports a framework at import time except ``jax_runner``, so the suite lists the
cases in any process.
"""
