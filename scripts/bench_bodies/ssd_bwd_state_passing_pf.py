"""ssd_bwd_state_passing with the next chunk's dstates / states_in / decay loaded one chunk ahead of their use (the
committed kernel loads them in the step that uses them): the same arithmetic in the same order, so outputs are
bitwise equal. An arm for scripts/bench_configs.py --body."""
import torch
import helion
import helion.language as hl

from kernels import tuning


@helion.kernel(static_shapes=True, ignore_warnings=tuning.IGNORED_HELION_WARNINGS)
def ssd_bwd_state_passing_pf(
    dstates: torch.Tensor,
    states_in: torch.Tensor,
    dA_last: torch.Tensor,
    keep: torch.Tensor | None,
    dfinal: torch.Tensor,
    dl_like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, nc, h, s, blk = dstates.shape
    dL = torch.empty([b, nc, h, s, blk], dtype=dl_like.dtype, device=dstates.device)
    ddA_part = torch.empty([b, h, nc, s], dtype=torch.float32, device=dstates.device)
    dinit = torch.empty_like(dfinal)
    for ib, ih, isp in hl.grid([b, h, s]):
        gacc = dfinal[ib, ih, isp, :]
        dsn = dstates[ib, nc - 1, ih, isp, :]
        stn = states_in[ib, nc - 1, ih, isp, :]
        scn = torch.exp(dA_last[ib, ih, nc - 1])
        if keep is not None:
            scn = scn * keep[ib, nc - 1]
        for i in hl.grid(nc - 1):
            j = nc - 1 - i
            jn = nc - 2 - i
            ds_j = dsn
            st_j = stn
            scale = scn
            dsn = dstates[ib, jn, ih, isp, :]
            stn = states_in[ib, jn, ih, isp, :]
            scn = torch.exp(dA_last[ib, ih, jn])
            if keep is not None:
                scn = scn * keep[ib, jn]
            dL[ib, j, ih, isp, :] = gacc.to(dL.dtype)
            ddA_part[ib, ih, j, isp] = torch.sum(gacc * st_j, dim=0) * scale
            gacc = ds_j + scale * gacc
        # chunk 0: its inputs were loaded by the last step above
        dL[ib, 0, ih, isp, :] = gacc.to(dL.dtype)
        ddA_part[ib, ih, 0, isp] = torch.sum(gacc * stn, dim=0) * scn
        gacc = dsn + scn * gacc
        dinit[ib, ih, isp, :] = gacc
    return dL, ddA_part, dinit
