"""The collectives of a compiled (SPMD-partitioned) XLA program, read from its optimized HLO text.

``jitted.lower(...).compile().as_text()`` is the per-device program XLA runs on every device of
the mesh, so what a collective instruction lists as its operands is what one device hands to
that collective. Used to check that a sharded call exchanges per-system vectors, not leaves
(``impls/tests/test_jax_sharded_hlo.py``), and to count the bytes a device sends
(``benchmarks/sharded.py``).

Each instruction counts once as written: a collective inside a loop body runs once per trip,
and one inside a ``lax.cond`` branch only when that branch is taken.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

OPCODES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter",
           "collective-broadcast", "ragged-all-to-all")
# Collectives that move one device's data onto others (an all-reduce combines instead).
GATHERING = ("all-gather", "all-to-all", "collective-permute", "collective-broadcast",
             "ragged-all-to-all")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")


class Shape(NamedTuple):
  """Element count (largest array of a tuple) and bytes (all arrays) of an HLO type."""

  elements: int
  nbytes: int


class Collective(NamedTuple):
  name: str
  opcode: str  # without an async "-start"
  result: Shape
  operands: Shape  # summed over the operands
  op_name: str  # the JAX operation it came from (metadata), or ""


def shape_of(hlo_type: str) -> Shape:
  """The arrays of an HLO type string such as ``f32[256,128]{1,0}`` or ``(f64[], s8[4])``."""
  largest, nbytes = 0, 0
  for dtype, dims in _ARRAY.findall(hlo_type):
    if dtype not in _BYTES:
      continue
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    largest = max(largest, count)
    nbytes += count * _BYTES[dtype]
  return Shape(largest, nbytes)


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective instruction of the program (all computations: loop bodies and branches
  included), with its result and operand shapes."""
  types: dict[str, Shape] = {}
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, hlo_type, opcode, rest = match.groups()
    shape = shape_of(hlo_type)
    types[name] = shape
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    if base not in OPCODES:
      continue
    args = rest.split(")", 1)[0]
    operand_names = _OPERAND.findall(args)
    if operand_names:
      operands = Shape(max((types.get(o, Shape(0, 0)).elements for o in operand_names),
                           default=0),
                       sum(types.get(o, Shape(0, 0)).nbytes for o in operand_names))
    else:  # operands printed without a % sigil: read their inline types
      operands = shape_of(args)
    op_name = re.search(r'op_name="([^"]*)"', rest)
    found.append(Collective(name, base, shape, operands, op_name.group(1) if op_name else ""))
  return found


def bytes_sent(hlo_text: str) -> int:
  """Bytes one device hands to collectives in one pass over the program: the sum of every
  collective's operand sizes (each instruction once; see the module docstring)."""
  return sum(c.operands.nbytes for c in collectives(hlo_text))


def leaf_sized(hlo_text: str, smallest_shard_bytes: int) -> list[Collective]:
  """The collectives whose operand or result holds at least ``smallest_shard_bytes`` bytes
  (the smallest shard of any leaf or segment array): what moves leaves rather than per-system
  vectors. Bytes, not elements: an exchange of packed block results is a uint8 buffer."""
  return [c for c in collectives(hlo_text)
          if max(c.result.nbytes, c.operands.nbytes) >= smallest_shard_bytes]
