"""The Hopper MoE layer's plans (backends/sm90/moe.py runs them): the token tile, each
grouped GEMM's kernel, K splits and CTAs an SM, and which launches fold into which.

``choose`` picks them by ordered rules (ids and reasons below, measurements in
docs/tuning.md), from the shapes alone: routing is not known on the host, so the rules size for
uniformly routed tokens. ``forced(...)`` overrides parts of a plan for benchmarks and tests
(``for_call`` applies them; never read from the environment).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

from ...quant import BLOCK, cdiv
from .plan import DECODE_TWO_PER_SM_MAX_BT as TWO_PER_SM_MAX_BT
from .tiles import DECODE_TILES, GEMM_TILES, MOE_PREFILL_CONFIG, MOE_PREFILL_CONFIGS

ROWS = 128  # weight rows a CTA owns (moe.cu instantiates 128-row CTAs only)
# the prefill kernel's tile: its token tile and the output columns a tile covers
PREFILL_TILE, PREFILL_TILE_N = GEMM_TILES[MOE_PREFILL_CONFIG].bm, GEMM_TILES[MOE_PREFILL_CONFIG].bn
TILE_2X_MIN_HIDDEN = 4096
TILE_2X_MIN_TOKENS = 16
# moe-token-tile-spread: standard deviations of an expert's tokens a tile holds past the mean
TILE_SPREAD_SDS = 1.0
TILE_SPREAD_SDS_WIDE = 1.25  # hidden >= TILE_2X_MIN_HIDDEN
PREFILL_PAIRS_MIN_TOKENS = 128
# the pairs' tile (moe-prefill-pairs): 128x192 in pairs along M
PREFILL_PAIRS_CONFIG = next(c for c in MOE_PREFILL_CONFIGS
                            if GEMM_TILES[c].cluster == 2 and GEMM_TILES[c].bn == 192)
PREFILL_BAND = 4
PREFILL_BAND_MIN_BYTES = 64 << 20
PARALLEL_ROUTE_MIN_SLOTS = 256
FUSED_ACT_MAX_HIDDEN = 4096
SLOT_TILES_MAX_REREAD_BYTES = 30e6
SLOT_TILES_MAX_KBS = 64
SLOT_THREE_MAX_KBS = 32  # moe-slot-three
SORTED_WINDOW = 4  # moe-decode-window
TOKEN_ROWS_MAX_HIDDEN = 2048  # moe-token-rows


@dataclass(frozen=True)
class GroupedGemmPlan:
    splits: int       # K ranges, reduced in split order (deterministic); 1 for the prefill kernel
    ctas_per_sm: int  # 1, or 2 (token tiles <= 32)
    group_m: int = 1  # the prefill kernel's tile order: M blocks a band walks per N block
    prefill_config: int = MOE_PREFILL_CONFIG  # the prefill kernel's tile (GEMM_TILES index)
    window: int = -1  # the decode kernel's weight stages in flight: -1 its rule, 0 the ring


@dataclass(frozen=True)
class MoePlan:
    config: int              # token tile DECODE_TILES[config]
    gate_up: GroupedGemmPlan
    down: GroupedGemmPlan
    pdl: bool = True         # moe-pdl: the GEMMs stream their weights under the kernel before
    prefill: bool = False    # moe-prefill: both GEMMs on the persistent large-M kernel
    parallel_route: bool = False  # moe-route-parallel: routing in three parallel launches
    slot_tiles: bool = False      # moe-slot-tiles: no routing, a tile a (token, slot) pair
    fused_act: bool = False       # moe-prefill-fused-act: SiLU-and-mul + quant in gate_up
    tile_route: bool = False      # moe-tile-route: gate_up finds its tiles' experts from the ids
    token_rows: bool = False      # moe-token-rows: gate_up reads the tokens' rows (no gather)
    down_route: bool = False      # moe-down-route: down finds its tiles' experts from the ids
    gather_x_first: bool = False  # moe-gather-x-first: the gather quantizes x before its wait
    rule: str = dataclasses.field(default="", compare=False)

    @property
    def token_tile(self) -> int:
        return DECODE_TILES[self.config]


def expected_active(slots: int, experts: int) -> float:
    """Experts that uniformly random routing of ``slots`` (token, slot) pairs touches."""
    return experts * (1.0 - (1.0 - 1.0 / experts) ** slots)


@functools.lru_cache(maxsize=4096)
def choose(m: int, top_k: int, experts: int, hidden: int, inter: int, sms: int,
           slot_tiles: bool | None = None) -> MoePlan:
    """The plan by the rules (``slot_tiles`` forces moe-slot-tiles on or off: ``forced``);
    ``rule`` names every rule that shaped it."""
    slots = m * top_k
    active = expected_active(slots, experts)
    per_expert = math.ceil(slots / active - 1e-3)
    want, rule = token_tile_want(per_expert, hidden)
    if slot_tiles is None:
        slot_tiles = slot_tiles_take(m, slots, active, hidden, inter)
    if slot_tiles:
        want, rule = DECODE_TILES[0], "moe-slot-tiles"
    prefill = not slot_tiles and prefill_kernel_takes(want, hidden, inter)
    if prefill:
        want, rule = PREFILL_TILE, "moe-prefill"
    config = next((i for i, t in enumerate(DECODE_TILES) if t >= want), len(DECODE_TILES) - 1)
    bt = DECODE_TILES[config]
    ctas = ctas_per_sm(bt)
    window = decode_window(ctas, slot_tiles)
    if prefill:  # (the persistent kernel walks whole K: nothing to split)
        band = prefill_band(hidden, inter, per_expert)
        pairs = prefill_pairs_take(per_expert)
        tile = PREFILL_PAIRS_CONFIG if pairs else MOE_PREFILL_CONFIG
        gate_up = down = GroupedGemmPlan(1, 1, band, tile)
        taken = [("moe-prefill-band", band > 1), ("moe-prefill-pairs", pairs)]
    else:
        tiles = slots if slot_tiles else active * cdiv(per_expert, bt)
        gate_up = decode_gemm(2 * inter, hidden, tiles, ctas, sms, slot_tiles, window)
        down = decode_gemm(hidden, inter, tiles, ctas, sms, slot_tiles, window)
        taken = [("moe-split-fill", True),
                 ("moe-slot-three", 3 in (gate_up.ctas_per_sm, down.ctas_per_sm))]
    # moe-pdl: both GEMMs launch under PDL and stream their experts' weights while the kernel
    # before them runs (reading their activations after their own wait)
    taken.append(("moe-pdl", True))
    taken.append(("moe-decode-window", not prefill and window > 0))
    fused_act = prefill and fused_act_takes(hidden, gate_up.prefill_config)
    tile_route = tile_route_takes(prefill, slot_tiles)
    token_rows = token_rows_takes(tile_route, hidden, bt)
    down_route = down_route_takes(prefill, slot_tiles)
    parallel = parallel_route_takes(slots)
    x_first = gather_x_first_takes(prefill)
    taken += [("moe-prefill-fused-act", fused_act), ("moe-tile-route", tile_route),
              ("moe-token-rows", token_rows), ("moe-down-route", down_route),
              ("moe-route-parallel", parallel), ("moe-gather-x-first", x_first)]
    rule += "".join(f"+{name}" for name, on in taken if on)
    return MoePlan(config, gate_up, down, True, prefill, parallel, slot_tiles, fused_act,
                   tile_route, token_rows, down_route, x_first, rule)


def token_tile_want(per_expert: int, hidden: int) -> tuple[float, str]:
    """The tokens a decode tile should hold, and the rule that says so. moe-token-tile: more
    tokens pad tensor-core work, fewer split an expert over tiles that each stream its weights.
    moe-token-tile-2x: wide experts with >= 16 tokens each, twice the mean, so that the experts
    routed past it still stream their weights once. moe-token-tile-spread: below that, the
    mean plus 1.25 standard deviations of an expert's near-Poisson tokens (hidden >= 4096; one
    below), for the same reason."""
    wide = hidden >= TILE_2X_MIN_HIDDEN
    if wide and per_expert >= TILE_2X_MIN_TOKENS:
        return 2 * per_expert, "moe-token-tile-2x"
    sds = TILE_SPREAD_SDS_WIDE if wide else TILE_SPREAD_SDS
    return per_expert + sds * math.sqrt(per_expert), "moe-token-tile-spread"


def slot_tiles_take(m: int, slots: int, active: float, hidden: int, inter: int) -> bool:
    """moe-slot-tiles: a tile a (token, slot) pair and no routing (three launches, not six),
    where the experts' rereads it costs ((pairs - active experts) x 3·H·I bytes) are <= 30 MB,
    and always for one token (its k experts are distinct)."""
    return m == 1 or (slots - active) * 3 * hidden * inter <= SLOT_TILES_MAX_REREAD_BYTES


def prefill_kernel_takes(want: float, hidden: int, inter: int) -> bool:
    """moe-prefill: where the decode token tile would hold more than 32 tokens (one CTA an
    SM), 128-token tiles on the persistent large-M kernel: its deep pipeline and one wave of
    CTAs over all the experts' tiles beat the decode kernel's one-tile CTAs, padding included."""
    return want > TWO_PER_SM_MAX_BT and prefill_takes(hidden, inter)


def prefill_band(hidden: int, inter: int, per_expert: int) -> int:
    """moe-prefill-band: experts whose gate_up weights pass the L2 by far (>= 64 MB), with >= 2
    token tiles each, walk bands of 4 M blocks an N block, so that the CTAs running together
    share an expert's weight tiles in L2 (experts of one tile lose with bands). 1: no bands."""
    wide = 2 * inter * hidden >= PREFILL_BAND_MIN_BYTES
    return PREFILL_BAND if wide and per_expert >= 2 * PREFILL_TILE else 1


def prefill_pairs_take(per_expert: int) -> bool:
    """moe-prefill-pairs: from 128 expected tokens an expert (whole M tiles: near compute-bound),
    128x192 tiles in pairs along M multicasting the weight tile: fewer L2 bytes a FLOP, so a
    higher clock at the power cap (below, an expert's one or two tiles rarely share a pair)."""
    return per_expert >= PREFILL_PAIRS_MIN_TOKENS


def decode_gemm(n: int, k: int, tiles: float, ctas: int, sms: int, slot_tiles: bool,
                window: int) -> GroupedGemmPlan:
    """A grouped GEMM on the decode kernel, ``tiles`` token tiles of n x k outputs.
    moe-split-fill: split K until the expected CTAs fill the SMs' slots in one wave, >= 2 K
    blocks a split (the reduction pass costs more below). moe-slot-kbs (slot tiles): <= 64 K
    blocks a split, so that a CTA's quantized token slice stays resident beside >= 2 weight
    stages in two CTAs' share of an SM; then moe-slot-three."""
    num_kb = cdiv(k, BLOCK)
    grid = max(1.0, cdiv(n, ROWS) * tiles)
    splits = max(1, min(int(ctas * sms // grid), num_kb // 2))
    if slot_tiles:
        splits = max(splits, cdiv(num_kb, SLOT_TILES_MAX_KBS))
        if slot_three_takes(cdiv(n, ROWS) * tiles * splits, sms, cdiv(num_kb, splits)):
            return GroupedGemmPlan(splits, 3, window=window)
    return GroupedGemmPlan(splits, ctas, window=window)


def parallel_route_takes(slots: int) -> bool:
    """moe-route-parallel: from 256 (token, slot) pairs the routing's three parallel launches
    (count, scan, place), not the one-program route whose serial walk grows with the slots."""
    return slots >= PARALLEL_ROUTE_MIN_SLOTS


def ctas_per_sm(token_tile: int) -> int:
    """The decode kernel's CTAs an SM at a token tile: two for tiles <= 32 (moe.cu)."""
    return 2 if token_tile <= TWO_PER_SM_MAX_BT else 1


def slot_three_takes(ctas: int, sms: int, kbs: int) -> bool:
    """moe-slot-three: a slot-tile GEMM runs three CTAs an SM where that takes its CTAs in
    fewer waves than two an SM do and a split's <= 32 K blocks fit a third of the SM (at as
    many waves the two-CTA kernel's deeper ring wins)."""
    return kbs <= SLOT_THREE_MAX_KBS and cdiv(ctas, 3 * sms) < cdiv(ctas, 2 * sms)


def decode_window(ctas: int, slot_tiles: bool) -> int:
    """moe-decode-window: sorted tiles two CTAs an SM keep 4 weight stages in flight a CTA,
    not the dense decode's 2 (here the weight stream is the layer); slot tiles keep the
    kernel's 2. -1: the kernel's rule."""
    return SORTED_WINDOW if ctas == 2 and not slot_tiles else -1


def tile_route_takes(prefill: bool, slot_tiles: bool) -> bool:
    """moe-tile-route: the decode kernel's sorted tiles: gate_up's first-wave CTAs find their
    tile's expert from the ids themselves, so the routing's completion no longer gates
    gate_up's weight stream."""
    return not prefill and not slot_tiles


def down_route_takes(prefill: bool, slot_tiles: bool) -> bool:
    """moe-down-route: the decode kernel's sorted tiles: down's first-wave CTAs find their
    tiles' experts from the ids too, so that down's weights stream while gate_up's last CTAs
    and SiLU-and-mul run, not after them."""
    return tile_route_takes(prefill, slot_tiles)


def gather_x_first_takes(prefill: bool) -> bool:
    """moe-gather-x-first: the prefill kernel's layers gather their tokens quantized before
    the wait for the routing (x was written before it), so that only the stores wait; at
    decode sizes, where gate_up launches at the gather's start, it bought nothing."""
    return prefill


def token_rows_takes(tile_route: bool, hidden: int, token_tile: int) -> bool:
    """moe-token-rows: under moe-tile-route, gate_up over 8-token tiles of experts of hidden
    <= 2048 reads its rows' tokens and quantizes them itself: no gather launch between the
    routing and gate_up (wider experts quantize each token again in every row-block CTA)."""
    return tile_route and hidden <= TOKEN_ROWS_MAX_HIDDEN and token_tile == DECODE_TILES[0]


def prefill_takes(hidden: int, inter: int) -> bool:
    """Whether the prefill kernel takes both GEMMs: whole 128-column tiles of outputs."""
    return hidden % PREFILL_TILE_N == 0 and 2 * inter % PREFILL_TILE_N == 0


def fused_act_takes(hidden: int, config: int) -> bool:
    """Whether the prefill kernel's gate_up on tile ``config`` runs SiLU-and-mul +
    quantization in its epilogue (moe-prefill-fused-act; the plan rule and a forced prefill
    kernel alike): the epilogue runs 128 channels a tile."""
    return hidden <= FUSED_ACT_MAX_HIDDEN and GEMM_TILES[config].bn == PREFILL_TILE_N


_forced: dict = {}


@contextlib.contextmanager
def forced(token_tile: int | None = None, splits: int | None = None, pdl: bool | None = None,
           prefill: bool | None = None, slot_tiles: bool | None = None,
           group_m: int | None = None, fused_act: bool | None = None,
           prefill_config: int | None = None, window: int | None = None,
           tile_route: bool | None = None, token_rows: bool | None = None,
           ctas: int | None = None, down_route: bool | None = None):
    """Overrides the rules' token tile, both GEMMs' K splits, PDL, the prefill kernel (which
    takes 128-token tiles only), the slot tiles (8-token tiles, not with the prefill
    kernel), the prefill kernel's tile order band, its SiLU-and-mul epilogue and its tile
    (one of MOE_PREFILL_CONFIGS; the epilogue runs 128-column tiles) and the decode kernel's
    weight stages in flight (0: its whole ring), gate_up's tile experts from the ids
    (moe-tile-route; the decode kernel's sorted tiles) and its tokens' rows read without the
    gather (moe-token-rows; with tile_route), down's tile experts from the ids (moe-down-route;
    sorted tiles), and both grouped GEMMs' CTAs an SM (``ctas``: 1, 2 with token tiles <= 32,
    3 with slot tiles) (benchmarks, tests)."""
    if ctas not in (None, 1, 2, 3):
        raise ValueError(f"ctas must be 1, 2 or 3, got {ctas}")
    if token_tile is not None and token_tile not in DECODE_TILES:
        raise ValueError(f"token_tile must be one of {DECODE_TILES}, got {token_tile}")
    if slot_tiles and (prefill or token_tile not in (None, DECODE_TILES[0])):
        raise ValueError(f"slot tiles run {DECODE_TILES[0]}-token tiles without the prefill "
                         f"kernel, got token_tile={token_tile}, prefill={prefill}")
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 (0: the whole ring), got {window}")
    if group_m is not None and group_m < 1:
        raise ValueError(f"group_m must be >= 1, got {group_m}")
    if prefill_config is not None and prefill_config not in MOE_PREFILL_CONFIGS:
        raise ValueError(f"prefill_config must be one of {MOE_PREFILL_CONFIGS}, got "
                         f"{prefill_config}")
    if prefill and token_tile not in (None, PREFILL_TILE):
        raise ValueError(f"the prefill kernel takes {PREFILL_TILE}-token tiles, got {token_tile}")
    if slot_tiles is None and (prefill or token_tile is not None):
        slot_tiles = False  # (a forced tile or kernel is the sorted layer's)
    old = dict(_forced)
    _forced.update({k: v for k, v in (("token_tile", token_tile), ("splits", splits),
                                      ("pdl", pdl), ("prefill", prefill),
                                      ("slot_tiles", slot_tiles), ("group_m", group_m),
                                      ("fused_act", fused_act),
                                      ("prefill_config", prefill_config),
                                      ("window", window), ("tile_route", tile_route),
                                      ("token_rows", token_rows), ("down_route", down_route),
                                      ("ctas", ctas))
                   if v is not None})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(old)


def _apply_forced(plan: MoePlan, hidden: int, inter: int) -> MoePlan:
    config = plan.config
    prefill = _forced.get("prefill", plan.prefill)
    if prefill and not prefill_takes(hidden, inter):
        raise ValueError(f"the prefill kernel needs hidden and 2 * intermediate multiples of "
                         f"{PREFILL_TILE_N}, got {hidden}, {inter}")
    if _forced.get("fused_act") and not prefill:
        raise ValueError("the SiLU-and-mul epilogue is the prefill kernel's: fused_act=True "
                         "needs prefill, got the decode kernel's plan")
    tile = _forced.get("prefill_config", plan.gate_up.prefill_config)
    fused_act = prefill and _forced.get("fused_act", fused_act_takes(hidden, tile))
    if fused_act and GEMM_TILES[tile].bn != PREFILL_TILE_N:
        raise ValueError(f"the SiLU-and-mul epilogue runs {PREFILL_TILE_N}-column tiles, got "
                         f"prefill_config={tile} ({GEMM_TILES[tile].bn} columns)")

    def sorted_piece(name: str, rule: bool) -> bool:
        # a piece of the decode kernel's sorted tiles: forced on only where they run
        if _forced.get(name) and not rule:
            raise ValueError(f"{name}=True runs the decode kernel's sorted tiles, got the "
                             + ("prefill kernel" if prefill else "slot tiles"))
        return _forced.get(name, rule)
    tile_route = sorted_piece("tile_route", tile_route_takes(prefill, plan.slot_tiles))
    if _forced.get("token_rows") and not tile_route:
        raise ValueError("token_rows=True needs tile_route (gate_up finds its tiles' tokens "
                         "from the ids)")
    if "token_tile" in _forced:
        config = DECODE_TILES.index(_forced["token_tile"])
    if prefill:
        config = DECODE_TILES.index(PREFILL_TILE)
    bt = DECODE_TILES[config]
    token_rows = _forced.get("token_rows", token_rows_takes(tile_route, hidden, bt))
    down_route = sorted_piece("down_route", down_route_takes(prefill, plan.slot_tiles))
    forced_ctas = _forced.get("ctas")
    if ((forced_ctas == 3 and (prefill or not plan.slot_tiles))
            or (forced_ctas == 2 and bt > TWO_PER_SM_MAX_BT)):
        raise ValueError(f"ctas={forced_ctas} runs slot tiles (3) or token tiles <= "
                         f"{TWO_PER_SM_MAX_BT} (2), got token tile {bt}"
                         + (", the prefill kernel" if prefill else ""))

    def g(old: GroupedGemmPlan, k: int) -> GroupedGemmPlan:
        splits = min(_forced.get("splits", old.splits), cdiv(k, BLOCK))
        group_m = _forced.get("group_m", old.group_m)
        # (the plan's CTAs an SM, moe-slot-three's included, unless forced or the tile is)
        ctas = (forced_ctas if forced_ctas is not None
                else old.ctas_per_sm if bt == plan.token_tile else ctas_per_sm(bt))
        return GroupedGemmPlan(splits, ctas, group_m,
                               _forced.get("prefill_config", old.prefill_config),
                               _forced.get("window", decode_window(ctas, plan.slot_tiles)))
    return MoePlan(config, g(plan.gate_up, hidden), g(plan.down, inter),
                   _forced.get("pdl", plan.pdl), prefill, plan.parallel_route, plan.slot_tiles,
                   fused_act, tile_route, token_rows, down_route, gather_x_first_takes(prefill),
                   "forced")


def for_call(m: int, top_k: int, experts: int, hidden: int, inter: int, sms: int) -> MoePlan:
    """The plan a call runs: the rules', with ``forced``'s overrides (benchmarks, tests)."""
    plan = choose(m, top_k, experts, hidden, inter, sms, _forced.get("slot_tiles"))
    return _apply_forced(plan, hidden, inter) if _forced else plan
