"""The asv benchmark classes of ``clipbench.benchmarks.bench_clipping``, under their asv names
(``bench_clipping.GlobalCpu.time_clip``, ...): each environment runs its own commit's classes.

asv's forkserver imports this module once and forks every benchmark process from it, so there
the frameworks are imported too (``grid_point.preload_frameworks``): no process pays for them.
asv's other processes import it once each and fork nothing: they skip that import.
"""

from clipbench.benchmarks import bench_clipping as _suite
from clipbench.benchmarks import grid_point as _grid_point

# getattr: `asv continuous` and `asv run` over history import this module (the working tree's)
# over older commits' clipbench, which had no preloading.
if getattr(_grid_point, "in_asv_forkserver", lambda: False)():
  _grid_point.preload_frameworks()

globals().update({cls.__name__: cls for cls in
                  (*_suite.SPEED_CLASSES, *_suite.TRACK_CLASSES, _suite.CudaRouteCosts,
                   _suite.Machine)})
