"""The asv benchmark classes of ``clipbench.benchmarks.bench_clipping``, under their asv names
(``bench_clipping.GlobalCpu.time_clip``, ...): each environment runs its own commit's classes."""

from clipbench.benchmarks import bench_clipping as _suite

globals().update({cls.__name__: cls for cls in
                  (*_suite.SPEED_CLASSES, *_suite.TRACK_CLASSES, _suite.Machine)})
