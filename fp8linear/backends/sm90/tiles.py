"""The sm90 kernels' tables and limits, read from csrc/sm90/tables.def (their one definition,
which the C++ includes too): adding a tile there adds it here."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .build import source_dir


@dataclass(frozen=True)
class GemmTile:
    """One large-M configuration (csrc/sm90/gemm.cu kConfigs)."""
    bm: int
    bn: int
    stages: int
    cluster: int         # 2: a pair multicasting a shared tile
    share_a: bool        # the pair shares the activation tile (else the weight tile)
    queue_next: bool     # two partial accumulators: K block kb+1 queued before kb's promotion
    split_tail: bool     # a ragged last wave's tiles split along K over the idle SMs

    @property
    def lean(self) -> bool:
        # 64-row tiles of <= 64 columns are built with <= 128 registers a thread (no
        # setmaxnreg split), so their CTAs fit beside the previous kernel's (gemm_kernel.cuh)
        return self.bm == 64 and self.bn <= 64


_ENTRY = re.compile(r"^(FP8L_\w+)\(([^)]*)\)", re.M)


def _parse(text: str):
    tiles, decode, prefill, limits, codes, entries = [], [], [], {}, {}, {}
    for macro, args in _ENTRY.findall(text):
        vals = [a.strip() for a in args.split(",")]
        if macro == "FP8L_GEMM_TILE":
            ints, flags = [int(v) for v in vals[:4]], [v == "true" for v in vals[4:]]
            tiles.append(GemmTile(*ints, *flags))
        elif macro == "FP8L_DECODE_TILE":
            decode.append(int(vals[0]))
        elif macro == "FP8L_MOE_PREFILL_TILE":
            prefill.append(int(vals[0]))
        elif macro == "FP8L_LIMIT":
            limits[vals[0]] = int(vals[1])
        elif macro in ("FP8L_IN_DTYPE", "FP8L_OUT_DTYPE"):
            codes[vals[0]] = int(vals[1])
        elif macro == "FP8L_ARG":
            entries.setdefault(vals[0], []).append((vals[1], vals[2]))
    return tuple(tiles), tuple(decode), tuple(prefill), limits, codes, entries


# ENTRY_ARGS: the C entry points' argument structs, entry -> [(kind, field name)] in order;
# MOE_PREFILL_CONFIGS: the large-M tiles (GEMM_TILES indices) the grouped prefill expert GEMM
# is built for (sm90/gemm.cu), the first its default
GEMM_TILES, DECODE_TILES, MOE_PREFILL_CONFIGS, _LIMITS, DTYPE_CODES, ENTRY_ARGS = _parse(
    (source_dir() / "sm90" / "tables.def").read_text())
# dynamic shared memory of a CTA by CTAs an SM
SMEM_PER_CTA = {1: _LIMITS["kSmemOneCtaPerSm"], 2: _LIMITS["kSmemTwoCtasPerSm"],
                3: _LIMITS["kSmemThreeCtasPerSm"]}
# the C entry points' interface version (csrc/capi.cpp fp8l_abi_version)
ABI_VERSION = _LIMITS["kAbiVersion"]
MOE_PREFILL_CONFIG = MOE_PREFILL_CONFIGS[0]
