"""The CPU routes of the own JAX and torch implementations (the numba kernels behind XLA FFI
and behind torch tensors): same bits as the kernels, errors as the API states them, and a
process that survives shape churn."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from clipbench.impls.own.jax import api as jax_api
from clipbench.impls.own.jax import xla_ffi
from clipbench.impls.own.numba import api as numba_api
from clipbench.impls.own.torch import compiled, eager, host_route


def _per_system_case(seed=0):
  rng = np.random.default_rng(seed)
  leaves = [rng.standard_normal((50, 3)).astype(np.float32),
            rng.standard_normal(7).astype(np.float32)]
  segments = [np.repeat(np.arange(5), 10), np.array([0, 1, 1, 2, 3, 4, 4])]
  return leaves, segments, np.array([0.5, 2.0, 3.0, 40.0, 5.0])


def _same_bits(outs, expected):
  return len(outs) == len(expected) and all(
      np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(
          np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8))
      for a, b in zip(outs, expected))


@pytest.mark.parametrize("op", ["clip_by_global_norm", "clip_by_max_step"])
def test_jax_eager_and_jitted_give_the_numba_bits(op):
  leaves, segments, c = _per_system_case()
  want_outs, want_norms = getattr(numba_api, op)(leaves, c, segments=segments, num_systems=5)
  function = getattr(jax_api, op)
  eager_result = function([jnp.asarray(x) for x in leaves], c,
                          segments=[jnp.asarray(g) for g in segments], num_systems=5)
  jitted = jax.jit(lambda xs, gs: function(xs, c, segments=gs, num_systems=5))
  jit_result = jitted([jnp.asarray(x) for x in leaves], [jnp.asarray(g) for g in segments])
  for outs, norms in (eager_result, jit_result):
    assert all(isinstance(o, jax.Array) for o in outs)
    assert _same_bits(outs, want_outs)
    assert _same_bits([norms], [want_norms])


def test_jax_traced_ids_out_of_range_raise_a_named_error():
  leaves, segments, c = _per_system_case()
  jitted = jax.jit(lambda xs, gs: jax_api.clip_by_global_norm(xs, c, segments=gs,
                                                               num_systems=5))
  with pytest.raises(Exception, match=r"segments\[0\].*outside \[0, 5\)"):
    jax.block_until_ready(jitted([jnp.asarray(x) for x in leaves],
                                 [jnp.asarray(g) + 3 for g in segments]))


def test_jax_vmap_and_grad_run_on_the_host_route():
  x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
  norms = jax.vmap(lambda row: jax_api.clip_grad_norm([row], 1.0)[1])(x)
  assert np.allclose(np.asarray(norms), np.linalg.norm(np.asarray(x), axis=1))
  grad = jax.grad(lambda v: jnp.sum(jax_api.clip_grad_norm([v], 1e9)[0][0]))(x[1])
  assert np.array_equal(np.asarray(grad), np.ones(4, np.float32))  # kept: the identity


def test_ffi_buffer_offsets_match_the_c_api_header():
  header = (jax.ffi.include_dir() + "/xla/ffi/api/c_api.h")
  text = open(header).read()
  assert f"#define XLA_FFI_API_MAJOR {xla_ffi.API_MAJOR}" in text
  assert f"#define XLA_FFI_API_MINOR {xla_ffi.API_MINOR}" in text
  # XLA_FFI_Buffer: struct_size, extension_start, dtype (padded), then data.
  assert "XLA_FFI_DataType dtype;\n  void* data;" in text


@pytest.mark.parametrize("impl", [eager, compiled], ids=["eager", "compiled"])
@pytest.mark.parametrize("op", ["clip_by_global_norm", "clip_by_max_step"])
def test_torch_cpu_tensors_give_the_numba_bits(impl, op):
  leaves, segments, c = _per_system_case(1)
  want_outs, want_norms = getattr(numba_api, op)(leaves, c, segments=segments, num_systems=5)
  outs, norms = getattr(impl, op)([torch.from_numpy(x) for x in leaves], torch.from_numpy(c),
                                  segments=[torch.from_numpy(g) for g in segments],
                                  num_systems=5)
  assert _same_bits([o.numpy() for o in outs], want_outs)
  assert _same_bits([norms.numpy()], [want_norms])


def _many_small_leaves(seed):
  """1,200 leaves of four dtypes and five shapes (0-d and empty ones among them): 300 small
  leaves of each dtype, more than the general route packs when it is handed arrays, so the
  torch and FFI routes, which hand it addresses and are not packed, are compared with it."""
  rng = np.random.default_rng(seed)
  dtypes = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16)
  shapes = ((7,), (3, 5), (), (0,), (2, 2, 3))
  return [rng.standard_normal(shapes[i % 5]).astype(dtypes[i % 4]) for i in range(1200)]


@pytest.mark.parametrize("impl", [eager, compiled], ids=["eager", "compiled"])
def test_torch_many_small_leaves_give_the_numba_bits(impl):
  leaves = _many_small_leaves(2)
  for max_norm in (1.0, 1e9):  # clipped, kept
    want_outs, want_norm = numba_api.clip_grad_norm(leaves, max_norm)
    outs, norm = impl.clip_grad_norm([host_route.to_tensor(x.copy()) for x in leaves], max_norm)
    assert [tuple(o.shape) for o in outs] == [x.shape for x in leaves]
    assert _same_bits([host_route.to_numpy(o) for o in outs], want_outs)
    assert _same_bits([norm.numpy()], [want_norm])


def test_jax_jitted_many_small_leaves_give_the_numba_bits():
  leaves = _many_small_leaves(3)
  want_outs, want_norm = numba_api.clip_grad_norm(leaves, 1.0)
  with jax.enable_x64(True):  # float64 leaves stay float64
    outs, norm = jax.jit(lambda xs: jax_api.clip_grad_norm(xs, 1.0))(
        [jnp.asarray(x) for x in leaves])
  assert _same_bits(outs, want_outs)
  assert _same_bits([norm], [want_norm])


@pytest.mark.parametrize("impl", [eager, compiled], ids=["eager", "compiled"])
@pytest.mark.parametrize("op", ["clip_grad_norm", "clip_by_global_norm"])
def test_torch_leaves_that_are_not_plain_memory_are_read_as_their_values(impl, op):
  base = torch.randn(300, 4, dtype=torch.float64)
  negated = torch._neg_view(base[:, 1].contiguous())  # memory holds minus its values
  assert negated.is_neg() and negated.is_contiguous() and not base.t().is_contiguous()
  # All contiguous (read in place where the route can), with a leaf that requires grad, with
  # strided views.
  for leaves in ([negated, torch.randn(3)], [negated, torch.randn(3, requires_grad=True)],
                 [base.t(), negated, base[::2, 0], torch.randn(3, requires_grad=True)]):
    values = [x.detach().resolve_neg().contiguous().numpy() for x in leaves]
    want_outs, want_norm = getattr(numba_api, op)(values, 0.5)
    outs, norm = getattr(impl, op)(leaves, 0.5)
    assert not any(o.requires_grad for o in outs)
    assert _same_bits([o.numpy() for o in outs], want_outs)
    assert _same_bits([norm.numpy()], [want_norm])


def test_torch_bfloat16_round_trips_through_its_bits():
  x = torch.randn(64, dtype=torch.float32).to(torch.bfloat16)
  outs, norm = eager.clip_grad_norm([x], 1.0)
  assert outs[0].dtype == torch.bfloat16 and norm.dtype == torch.float32
  assert float(torch.linalg.vector_norm(outs[0].float())) <= 1.0


_CHURN = textwrap.dedent("""
    import json, os, resource, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from clipbench.impls.own.jax import api
    mode, shapes = sys.argv[1], int(sys.argv[2])
    def maps():
      with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
    def rss():
      with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    tx = optax.clip_by_global_norm(1.0)
    def call(leaves):
      if mode == "optax":
        return jax.jit(lambda ls: tx.update(ls, tx.init(ls))[0])(leaves)
      if mode == "ours-jit":
        return jax.jit(lambda ls: api.clip_grad_norm(ls, 1.0)[0])(leaves)
      if mode == "graph":
        return api.xla_graph.clip_grad_norm(leaves, 1.0)[0]
      return api.clip_grad_norm(leaves, 1.0)[0]
    def leaves_of(n):  # device_put compiles nothing: the growth measured is the call's
      return jax.device_put([np.ones((n, 3), np.float32), np.ones((n + 1,), np.float32)])
    for n in range(1, 11):  # warm-up: first compilations and imports
      jax.block_until_ready(call(leaves_of(10_000 + n)))
    m0, r0 = maps(), rss()
    for n in range(shapes):
      jax.block_until_ready(call(leaves_of(n + 1)))
    print(json.dumps({"maps": (maps() - m0) / shapes, "rss": (rss() - r0) / shapes}))
""")


def _churn(mode: str, shapes: int) -> dict:
  done = subprocess.run([sys.executable, "-c", _CHURN, mode, str(shapes)], capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_no_faster(mode: str, growth: dict, optax_growth: dict) -> None:
  # The mapping count moves by a few either way as the allocator returns arenas (optax has
  # measured -0.08 a shape): 0.1 a shape of slack, where the graph route took ~100 a shape.
  assert growth["maps"] <= max(optax_growth["maps"], 0.0) + 0.1, (mode, growth, optax_growth)
  # Resident memory is noisier than the mapping count (allocator arenas): 10% and 16 KiB a
  # shape.
  assert growth["rss"] <= 1.1 * max(optax_growth["rss"], 0) + (16 << 10), (
      mode, growth, optax_growth)


@pytest.fixture(scope="module")
def optax_growth() -> dict:
  return _churn("optax", 60)  # per shape; optax compiles one graph a shape (~0.5 s each)


def test_shape_churn_grows_no_faster_than_optax(optax_growth):
  """Distinct shapes in one process (growth per shape): memory mappings and resident memory
  grow no faster than optax's under jax.jit. The graph route compiled an executable per shape
  (~100 mappings a shape; a process died after ~640 shapes); direct calls now compile nothing."""
  _assert_no_faster("ours-eager", _churn("ours-eager", 300), optax_growth)


@pytest.mark.slow
def test_shape_churn_under_a_users_jit_grows_no_faster_than_optax(optax_growth):
  """Inside the user's jax.jit every shape is the user's compilation; ours adds one custom call
  to it, which must cost no more than optax's reductions."""
  _assert_no_faster("ours-jit", _churn("ours-jit", 60), optax_growth)


def test_jax_jitted_near_ties_are_settled_in_xlas_result_buffers():
  """A norm equal to its threshold (3-4-5) is a near-tie the kernels settle on the host,
  writing the kept system into the result buffers themselves."""
  leaves = [np.array([[3.0, 4.0], [6.0, 8.0], [0.3, 0.4]], np.float32)]
  segments = [np.array([0, 1, 2])]
  c = np.array([5.0, 10.0, 0.25])
  want_outs, want_norms = numba_api.clip_by_global_norm(leaves, c, segments=segments,
                                                        num_systems=3)
  jitted = jax.jit(lambda xs, gs: jax_api.clip_by_global_norm(xs, c, segments=gs,
                                                               num_systems=3))
  outs, norms = jitted([jnp.asarray(x) for x in leaves], [jnp.asarray(g) for g in segments])
  assert _same_bits(outs, want_outs) and _same_bits([norms], [want_norms])
  assert np.array_equal(np.asarray(outs[0])[:2], leaves[0][:2])  # norm == max: kept


def test_torch_compile_keeps_one_graph_when_the_row_count_changes():
  """Inside a user's torch.compile graph the kernels are one custom-operator node: a new row
  count reuses the compiled graph (dynamic shapes) instead of recompiling."""
  import torch._dynamo

  def step(positions, ids):
    return eager.clip_by_max_step([positions], 0.5, segments=[ids], num_systems=3)

  compiled_step = torch.compile(step, dynamic=True)
  torch._dynamo.reset()
  rng = np.random.default_rng(3)
  for n, check in ((30, False), (45, True), (61, True)):
    positions = torch.from_numpy(rng.standard_normal((n, 3)).astype(np.float32))
    ids = torch.from_numpy(np.sort(rng.integers(0, 3, n)))
    with torch._dynamo.config.patch(error_on_recompile=check):
      outs, norms = compiled_step(positions, ids)
    want_outs, want_norms = step(positions, ids)
    assert torch.equal(outs[0], want_outs[0]) and torch.equal(norms, want_norms)
