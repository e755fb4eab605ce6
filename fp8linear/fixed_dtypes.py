"""The FP8 layers' base: parameters whose dtype model.to(dtype) must not change."""
from __future__ import annotations

from torch import nn


class FixedDtypes(nn.Module):
    """torch counts float8 as floating point, so model.to(dtype) / .half() would cast an fp8
    weight and round its fp32 scales: the parameters named in ``FIXED_DTYPES`` keep their
    dtype and follow only device moves; the others (a bias) move as usual."""

    FIXED_DTYPES: tuple = ()

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name).data for name in self.FIXED_DTYPES}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            p = getattr(self, name)
            if p.dtype != old.dtype:
                p.data = old.to(device=p.device)
        return self
