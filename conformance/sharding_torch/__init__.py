"""Rule 14 on torch.distributed: DTensor leaves on 2 and 4 gloo processes, bit for bit.

The test (``conformance/test_sharding_torch.py``) lists the cases (``layouts``), starts one
group of processes per world size (``launch``), and each group runs every case of its world
size (``worker``): the call on DTensor leaves, the outputs gathered, and on rank 0 the same
call on the unsharded leaves and the comparison (``compare``). Nothing here imports torch at
import time, so cases can be listed in any process.
"""
