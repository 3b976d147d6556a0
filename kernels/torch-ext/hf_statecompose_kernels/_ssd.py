"""Triton chunked SSD scan (Mamba-2) with initial state and final state, forward and backward.

:func:`ssd_scan` runs the scan on a discretised Δ (the Triton part of
``hf_statecompose.ops.ssd_scan(..., backend="triton")``, whose wrapper discretises Δ, sums ΣΔ and adds the D
term in torch under autograd)::

    x [B, T, H, P], delta [B, T, H] (Δ), A [H], B, C [B, T, G, N] (head h reads group h // (H / G)),
    initial_state / final_state [B, H, P, N]
    -> (y [B, T, H, P] float32 without the D term, final_state [B, H, P, N] float32)

    h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t,     y_t = h_t C_t

The [B, T, H]-sized work (the log-decay a_t = Δ_t A padded to whole chunks; in the wrapper Δ, ΣΔ and the
D term) stays in torch under autograd. The O(T·H·P·N) work runs in Triton inside
:class:`_SSDChunkScan`, the chunked algorithm of the Mamba-2 paper (mamba-ssm's
``mamba_chunk_scan_combined``). Per chunk c of length L, cum_l = a_0 + ... + a_l inside the chunk
(cum_last = cum_{L-1}); every exponent below is <= 0. Written as differences for brevity, each is summed
directly from the a_j (same signs, no cancellation): cum_last - cum_s is the suffix sum Σ_{j>s} a_j (from the
wrapper), cum_l - cum_s the segment sum Σ_{s<j<=l} a_j (in the chunk-scan kernel); a difference of two prefix
sums would lose ulp(|cum|) of absolute accuracy in every exponent (fp32 y ~3e-6 off at |A| = 24, chunk 256):

    forward                                           backward (given dy, dS_final)
    cs_c  = Σ_s e^{cum_last-cum_s} Δ_s x_s ⊗ B_s       Q_c    = Σ_l e^{cum_l} dy_l ⊗ C_l
    S_{c+1} = e^{cum_last} S_c + cs_c  (S_0 = h0)      dS_c   = e^{cum_last} dS_{c+1} + Q_c  (dh0 = dS_0)
    y_l   = Σ_{s<=l} (C_l·B_s) e^{cum_l-cum_s} Δ_s x_s  dxΔ_s  = Σ_{l>=s} (B_s·C_l) e^{cum_l-cum_s} dy_l
            + e^{cum_l} S_c C_l      (= y_inter_l)              + e^{cum_last-cum_s} dS_{c+1} B_s
                                                      dC_l   = Σ_{s<=l} e^{cum_l-cum_s} (dy_l·Δ_s x_s) B_s
                                                               + e^{cum_l} dy_l S_c
                                                      dB_s   = Σ_{l>=s} e^{cum_l-cum_s} (dy_l·Δ_s x_s) C_l
                                                               + e^{cum_last-cum_s} Δ_s x_s dS_{c+1}
    dx = Δ dxΔ and dΔ (through xΔ) = x·dxΔ. The log-decay gradient of step t of chunk c is kept as plain
    sums of products (the identity dy·y - xΔ·dxΔ would subtract large, nearly equal numbers):

    da_t = Σ_{l>=t} dy_l·y_inter_l + Σ_{s<t} Δ_s x_s·(dxΔ_s)_state + e^{cum_last}<dS_{c+1}, S_c>
           + Σ_{l>=t} Σ_{s<t} W_ls,     W_ls = (C_l·B_s)(dy_l·Δ_s x_s) e^{cum_l-cum_s}

    and torch autograd takes da back to Δ and A.

Three kernels serve all of it: ``_chunk_state_kernel`` (cs and Q), ``_state_passing_kernel`` (the
sequential chain over chunks, forwards and backwards) and ``_chunk_scan_kernel`` (y, dxΔ, dC and dB: a
causal, decayed "attention" plus a state term, forwards or time-reversed, with the da pieces as
epilogues).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["ssd_scan"]

# fp32 operands in tl.dot: "tf32x3" keeps ~fp32 accuracy on NVIDIA tensor cores ("tf32" alone would
# lose ~3 decimal digits against the fp32 reference); "ieee" elsewhere (AMD, the interpreter accepts both).
_DOT_PRECISION = "ieee" if getattr(torch.version, "hip", None) else "tf32x3"


# test hook: an upper bound on _chunk_scan's row / key block (None: the heuristic alone)
_BLOCK_M_CAP = None


def _pow2(n: int, lo: int = 16, hi: int | None = None) -> int:
    size = max(lo, triton.next_power_of_2(max(int(n), 1)))
    return size if hi is None else min(size, hi)


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _add_exclusive(a1, b1, a2, b2):
    """Combine of an exclusive prefix sum: (sum before the last element, last element) of a segment."""
    return a1 + b1 + a2, b2


@triton.jit
def _chunk_state_kernel(
    U,
    V,
    DELTA,
    EXPO,
    OUT,
    T,
    L,
    nheads,
    K1,
    K2,
    ratio_u,
    ratio_v,
    s_ub,
    s_ut,
    s_uh,
    s_uk,
    s_vb,
    s_vt,
    s_vh,
    s_vk,
    s_db,
    s_dt,
    s_dh,
    s_cb,
    s_ch,
    s_ct,
    s_ob,
    s_oh,
    s_oc,
    s_o1,
    s_o2,
    FROM_START: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """OUT[b, h, c] = Σ_{t in chunk c} w_t (Δ_t if SCALE) U_t ⊗ V_t, a [K1, K2] tile per program.

    w_t = exp(EXPO_t): EXPO is the exclusive suffix sum Σ_{k>t in chunk} a_k (decay to the chunk end: chunk
    states) or, FROM_START, the prefix sum cum_t (decay from the chunk start, the backward's Q_c); both
    summed directly by the wrapper. U / V are [B, T, H or G, K]; head h reads row h // ratio.
    """
    n_k2 = tl.cdiv(K2, BLOCK_K2)
    n_tiles = tl.cdiv(K1, BLOCK_K1) * n_k2
    pid_k = tl.program_id(0) % n_tiles
    pid_c = tl.program_id(0) // n_tiles
    pid_bh = tl.program_id(1)
    b = (pid_bh // nheads).to(tl.int64)
    h = pid_bh % nheads
    k1 = (pid_k // n_k2) * BLOCK_K1 + tl.arange(0, BLOCK_K1)
    k2 = (pid_k % n_k2) * BLOCK_K2 + tl.arange(0, BLOCK_K2)
    t0 = pid_c * L
    U += b * s_ub + (h // ratio_u) * s_uh
    V += b * s_vb + (h // ratio_v) * s_vh
    DELTA += b * s_db + h * s_dh
    EXPO += b * s_cb + h * s_ch + t0 * s_ct
    acc = tl.zeros((BLOCK_K1, BLOCK_K2), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_T):
        l = l0 + tl.arange(0, BLOCK_T)
        in_chunk = l < L
        valid = in_chunk & (t0 + l < T)
        t = t0 + l
        u = tl.load(U + t[None, :] * s_ut + k1[:, None] * s_uk, mask=valid[None, :] & (k1 < K1)[:, None], other=0.0)
        v = tl.load(V + t[:, None] * s_vt + k2[None, :] * s_vk, mask=valid[:, None] & (k2 < K2)[None, :], other=0.0)
        expo = tl.load(EXPO + l * s_ct, mask=in_chunk, other=0.0)
        w = tl.exp(tl.where(valid, expo, float("-inf")))
        if SCALE:
            w = w * tl.load(DELTA + t * s_dt, mask=valid, other=0.0)
        acc += tl.dot(u.to(tl.float32) * w[None, :], v.to(tl.float32), input_precision=DOT_PREC)
    OUT += b * s_ob + h * s_oh + pid_c * s_oc
    tl.store(OUT + k1[:, None] * s_o1 + k2[None, :] * s_o2, acc, mask=(k1 < K1)[:, None] & (k2 < K2)[None, :])


@triton.jit
def _state_passing_kernel(
    X,
    CUM,
    START,
    FINAL,
    FWD_STATES,
    DDEC,
    nc,
    L,
    PN,
    nheads,
    s_xb,
    s_xh,
    s_xc,
    s_cb,
    s_ch,
    s_ct,
    s_sb,
    s_sh,
    s_fb,
    s_fh,
    s_gb,
    s_gh,
    s_gc,
    s_dk,
    s_dbh,
    HAS_START: tl.constexpr,
    REVERSE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The sequential chain over chunks, for a BLOCK of the flattened [P·N] state of one (b, h).

    forward : X[c] holds cs_c; overwritten in place with S_c (the state entering chunk c);
              S_{c+1} = e^{cum_last_c} S_c + cs_c, S_0 = START (h0, or 0); FINAL = S_nc.
    backward: X[c] holds Q_c; overwritten in place with dS_{c+1} (the gradient of the state leaving
              chunk c); dS_c = e^{cum_last_c} dS_{c+1} + Q_c, dS_nc = START (dfinal); FINAL = dS_0 (dh0);
              DDEC[k, bh, c] = e^{cum_last_c} <dS_{c+1}, S_c> over this block (S_c from FWD_STATES).
    """
    pid_k = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // nheads).to(tl.int64)
    h = pid_bh % nheads
    offs = pid_k * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    X += b * s_xb + h * s_xh + offs
    CUM += b * s_cb + h * s_ch
    if HAS_START:
        state = tl.load(START + b * s_sb + h * s_sh + offs, mask=m, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BLOCK,), dtype=tl.float32)
    if REVERSE:
        FWD_STATES += b * s_gb + h * s_gh + offs
        DDEC += pid_k * s_dk + pid_bh * s_dbh
        for i in range(nc):
            c = nc - 1 - i
            q = tl.load(X + c * s_xc, mask=m, other=0.0)
            tl.store(X + c * s_xc, state, mask=m)
            decay = tl.exp(tl.load(CUM + (c * L + L - 1) * s_ct))
            entering = tl.load(FWD_STATES + c * s_gc, mask=m, other=0.0)
            tl.store(DDEC + c, decay * tl.sum(state * entering, axis=0))
            state = decay * state + q
    else:
        for c in range(nc):
            cs = tl.load(X + c * s_xc, mask=m, other=0.0)
            tl.store(X + c * s_xc, state, mask=m)
            decay = tl.exp(tl.load(CUM + (c * L + L - 1) * s_ct))
            state = decay * state + cs
    tl.store(FINAL + b * s_fb + h * s_fh + offs, state, mask=m)


@triton.jit
def _chunk_scan_kernel(
    U,
    V,
    W,
    S,
    DELTA,
    EXPO,
    LOGA,
    OUT,
    Z,
    SDOT,
    RSUM,
    INTRA,
    T,
    L,
    nheads,
    K1,
    K2,
    ratio_u,
    ratio_v,
    ratio_w,
    ratio_z,
    s_ub,
    s_ut,
    s_uh,
    s_uk,
    s_vb,
    s_vt,
    s_vh,
    s_vk,
    s_wb,
    s_wt,
    s_wh,
    s_wk,
    s_sb,
    s_sh,
    s_sc,
    s_s1,
    s_s2,
    s_db,
    s_dt,
    s_dh,
    s_cb,
    s_ch,
    s_ct,
    s_ob,
    s_ot,
    s_oh,
    s_ok,
    s_zb,
    s_zt,
    s_zh,
    s_zk,
    s_qb,
    s_qt,
    s_qh,
    s_im,
    s_ib,
    s_ih,
    s_it,
    REVERSE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    COL_SCALE: tl.constexpr,
    EPI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """For the rows r of one BLOCK_M tile of chunk c (all K2 output columns at once):

        OUT_r = e^{sw_r} U_r S_c + Σ_k (U_r·V_k) e^{dec_rk} [Δ_k if COL_SCALE] W_k,   times Δ_r if ROW_SCALE

    forward: keys k <= r, dec_rk = Σ_{k<j<=r} a_j, sw_r = EXPO_r = cum_r (decay from the chunk start);
    REVERSE: keys k >= r, dec_rk = Σ_{r<j<=k} a_j, sw_r = EXPO_r = Σ_{j>r} a_j (decay to the chunk end).
    a = LOGA (the log-decays); sw comes summed from the wrapper. dec is summed directly here, never as a
    difference of prefix sums (cum_r - cum_k loses ulp(|cum|) of absolute accuracy): on the diagonal key
    block a cumulative sum over the tile of the masked a_j, off it (row block R, key block K) a sum of
    three direct sums: inside the later block, the blocks in between, inside the earlier block.
    U, V: [B, T, H or G, K1]; W, OUT: [B, T, H or G, K2]; S[b, h, c]: [K1, K2] by its strides.

    EPI == 1 (the dxΔ pass, Z = x): OUT = Δ_r dxΔ_r (= dx), RSUM_r = x_r·dxΔ_r (dΔ through xΔ) and
        SDOT_r = Δ_r x_r·(state term of dxΔ_r) (the chunk-state part of the log-decay gradient).
    EPI == 2 (the dC pass, Z = C): SDOT_r = C_r·(state term of dC_r) = dy_r·y_inter_r, and the intra-chunk
        log-decay gradient Σ_{l >= t, l in tile} Σ_{s < t} W_ls, W_ls = (C_l·B_s)(dy_l·Δ_s x_s) e^{cum_l-cum_s},
        into INTRA[pid_m, b, h, t] (one row tile's share; the wrapper sums the tiles). Every term is a plain
        sum of products: no difference of large numbers, the diagonal W_ll never enters.
    """
    n_m = tl.cdiv(L, BLOCK_M)
    pid_m = tl.program_id(0) % n_m
    pid_c = tl.program_id(0) // n_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // nheads).to(tl.int64)
    h = pid_bh % nheads
    t0 = pid_c * L
    U += b * s_ub + (h // ratio_u) * s_uh
    V += b * s_vb + (h // ratio_v) * s_vh
    W += b * s_wb + (h // ratio_w) * s_wh
    S += b * s_sb + h * s_sh + pid_c * s_sc
    DELTA += b * s_db + h * s_dh
    EXPO += b * s_cb + h * s_ch + t0 * s_ct
    LOGA += b * s_cb + h * s_ch + t0 * s_ct

    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_in = r < L
    r_ok = r_in & (t0 + r < T)
    t = t0 + r
    k2 = tl.arange(0, BLOCK_K2)
    k2_ok = k2 < K2
    out_mask = r_ok[:, None] & k2_ok[None, :]
    r0 = pid_m * BLOCK_M
    # the rows' own share of dec off the diagonal: forward Σ_{j in R, j<=r} a_j (inclusive prefix),
    # REVERSE Σ_{j in R, j>r} a_j (exclusive suffix: the next position's a, summed from the block end)
    if REVERSE:
        a_next = tl.load(LOGA + (r + 1) * s_ct, mask=(r + 1 < L) & (r + 1 < r0 + BLOCK_M), other=0.0)
        part_r = tl.cumsum(a_next, 0, reverse=True)
    else:
        part_r = tl.cumsum(tl.load(LOGA + r * s_ct, mask=r_in, other=0.0), 0)
    if ROW_SCALE or EPI == 1:
        delta_r = tl.load(DELTA + t * s_dt, mask=r_ok, other=0.0)
    # Z rows are (re)loaded where they are used, not held in registers across the key loop
    Z += b * s_zb + (h // ratio_z) * s_zh

    # state term: U_r S_c, decayed from the chunk start (forward) or to the chunk end (reverse)
    acc = tl.zeros((BLOCK_M, BLOCK_K2), dtype=tl.float32)
    for k1_0 in range(0, K1, BLOCK_K1):
        k1 = k1_0 + tl.arange(0, BLOCK_K1)
        u = tl.load(U + t[:, None] * s_ut + k1[None, :] * s_uk, mask=r_ok[:, None] & (k1 < K1)[None, :], other=0.0)
        s = tl.load(S + k1[:, None] * s_s1 + k2[None, :] * s_s2, mask=(k1 < K1)[:, None] & k2_ok[None, :], other=0.0)
        acc += tl.dot(u.to(tl.float32), s.to(tl.float32), input_precision=DOT_PREC)
    state_expo = tl.load(EXPO + r * s_ct, mask=r_in, other=0.0)
    acc = acc * tl.exp(tl.where(r_ok, state_expo, float("-inf")))[:, None]
    if EPI != 0:
        z = tl.load(Z + t[:, None] * s_zt + k2[None, :] * s_zk, mask=out_mask, other=0.0).to(tl.float32)
        sdot = tl.sum(z * acc, axis=1)
        if EPI == 1:
            sdot = delta_r * sdot
        tl.store(SDOT + b * s_qb + h * s_qh + t * s_qt, sdot, mask=r_ok)
    if EPI == 2:
        carry = tl.zeros((BLOCK_M,), dtype=tl.float32)
        INTRA += pid_m * s_im + b * s_ib + h * s_ih + t0 * s_it

    # intra-chunk term over the causal key blocks (keys tiled like the rows)
    if REVERSE:
        lo = pid_m * BLOCK_M
        hi = L
    else:
        lo = 0
        hi = tl.minimum((pid_m + 1) * BLOCK_M, L)
    for k0 in range(lo, hi, BLOCK_M):
        k = k0 + tl.arange(0, BLOCK_M)
        k_in = k < L
        k_ok = k_in & (t0 + k < T)
        uv = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k1_0 in range(0, K1, BLOCK_K1):
            k1 = k1_0 + tl.arange(0, BLOCK_K1)
            u = tl.load(U + t[:, None] * s_ut + k1[None, :] * s_uk, mask=r_ok[:, None] & (k1 < K1)[None, :], other=0.0)
            vt = tl.load(
                V + (t0 + k)[None, :] * s_vt + k1[:, None] * s_vk, mask=k_ok[None, :] & (k1 < K1)[:, None], other=0.0
            )
            uv += tl.dot(u.to(tl.float32), vt.to(tl.float32), input_precision=DOT_PREC)
        if k0 == r0:
            # diagonal block: dec_rk = Σ_j a_j over r < j <= k (REVERSE) or k < j <= r, a cumulative sum of
            # the masked log-decays along the tile
            if REVERSE:
                a_k = tl.load(LOGA + k * s_ct, mask=k_in, other=0.0)
                expo = tl.cumsum(tl.where(k[None, :] > r[:, None], a_k[None, :], 0.0), 1)
            else:
                a_r = tl.load(LOGA + r * s_ct, mask=r_in, other=0.0)
                expo = tl.cumsum(tl.where(r[:, None] > k[None, :], a_r[:, None], 0.0), 0)
        else:
            # the blocks strictly between the row and key blocks, then the key block's own share: forward
            # Σ_{j in K, j>k} a_j (exclusive suffix), REVERSE Σ_{j in K, j<=k} a_j (inclusive prefix)
            if REVERSE:
                gap_lo = r0 + BLOCK_M
                gap_hi = k0
                part_k = tl.cumsum(tl.load(LOGA + k * s_ct, mask=k_in, other=0.0), 0)
            else:
                gap_lo = k0 + BLOCK_M
                gap_hi = r0
                a_next = tl.load(LOGA + (k + 1) * s_ct, mask=(k + 1 < L) & (k + 1 < k0 + BLOCK_M), other=0.0)
                part_k = tl.cumsum(a_next, 0, reverse=True)
            between = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for j0 in range(gap_lo, gap_hi, BLOCK_M):
                between += tl.load(LOGA + (j0 + tl.arange(0, BLOCK_M)) * s_ct)  # whole blocks, all < L
            expo = part_r[:, None] + (part_k + tl.sum(between, 0))[None, :]
        if REVERSE:
            keep = k[None, :] >= r[:, None]
        else:
            keep = k[None, :] <= r[:, None]
        keep = keep & k_ok[None, :] & r_ok[:, None]
        uv = uv * tl.exp(tl.where(keep, expo, float("-inf")))
        if COL_SCALE:
            uv = uv * tl.load(DELTA + (t0 + k) * s_dt, mask=k_ok, other=0.0)[None, :]
        w = tl.load(W + (t0 + k)[:, None] * s_wt + k2[None, :] * s_wk, mask=k_ok[:, None] & k2_ok[None, :], other=0.0)
        w = w.to(tl.float32)
        acc += tl.dot(uv, w, input_precision=DOT_PREC)
        if EPI == 2:
            # W_ls = (C_l·B_s) uv_ls, C_l·B_s summed over K2 in BLOCK_K1-wide slices re-read from cache (no
            # [BLOCK_M, K2] tile of C held in registers next to acc and w: that spilled on sm_90)
            cb = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
            for n0 in range(0, K2, BLOCK_K1):
                n = n0 + tl.arange(0, BLOCK_K1)
                zc = tl.load(
                    Z + t[:, None] * s_zt + n[None, :] * s_zk, mask=r_ok[:, None] & (n < K2)[None, :], other=0.0
                )
                wc = tl.load(
                    W + (t0 + k)[None, :] * s_wt + n[:, None] * s_wk, mask=k_ok[None, :] & (n < K2)[:, None], other=0.0
                )
                cb += tl.dot(zc.to(tl.float32), wc.to(tl.float32), input_precision=DOT_PREC)
            wls = uv * cb
            # prefix_lt = Σ_{s < t} W_ls (carry: the earlier key blocks; the strict prefix inside the block as
            # an exclusive scan: plain sums, W_lt itself never added. A product with a strictly upper triangle
            # of ones, tl.dot(wls, upper), was the same sum but spilled ~1 KB of registers on sm_90)
            excl, _ = tl.associative_scan((tl.zeros_like(wls), wls), 1, _add_exclusive)
            prefix = carry[:, None] + excl
            col = tl.sum(tl.where((r[:, None] >= k[None, :]) & r_ok[:, None], prefix, 0.0), axis=0)
            tl.store(INTRA + k * s_it, col, mask=k_in)
            carry += tl.sum(wls, axis=1)

    if ROW_SCALE:
        acc = acc * delta_r[:, None]
    OUT += b * s_ob + h * s_oh
    if EPI == 1:
        # acc = dxΔ: dx = Δ dxΔ; dΔ through xΔ = x·dxΔ
        tl.store(OUT + t[:, None] * s_ot + k2[None, :] * s_ok, acc * delta_r[:, None], mask=out_mask)
        z = tl.load(Z + t[:, None] * s_zt + k2[None, :] * s_zk, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(RSUM + b * s_qb + h * s_qh + t * s_qt, tl.sum(z * acc, axis=1), mask=r_ok)
    else:
        tl.store(OUT + t[:, None] * s_ot + k2[None, :] * s_ok, acc, mask=out_mask)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------


def _chunk_state(u, v, delta, expo, L, nc, ratio_u, ratio_v, from_start, scale):
    """[B, H, nc, K1, K2] float32 (see _chunk_state_kernel); expo: cum if from_start, else the suffix sums."""
    batch, length, heads = delta.shape
    k1, k2 = u.shape[-1], v.shape[-1]
    out = torch.empty((batch, heads, nc, k1, k2), device=u.device, dtype=torch.float32)
    block_t, block_k1, block_k2 = _pow2(L, hi=32), _pow2(k1, hi=64), _pow2(k2, hi=64)
    grid = (triton.cdiv(k1, block_k1) * triton.cdiv(k2, block_k2) * nc, batch * heads)
    _chunk_state_kernel[grid](
        u,
        v,
        delta,
        expo,
        out,
        length,
        L,
        heads,
        k1,
        k2,
        ratio_u,
        ratio_v,
        *u.stride(),
        *v.stride(),
        *delta.stride(),
        *expo.stride(),
        *out.stride(),
        FROM_START=from_start,
        SCALE=scale,
        BLOCK_T=block_t,
        BLOCK_K1=block_k1,
        BLOCK_K2=block_k2,
        DOT_PREC=_DOT_PRECISION,
        num_warps=4,
        num_stages=2,
    )
    return out


def _state_passing(chunk, cum, L, start, reverse, fwd_states=None):
    """In place on chunk [B, H, nc, P, N]; returns (final [B, H, P, N], ddec [B, H, nc] or None)."""
    batch, heads, nc, p, n = chunk.shape
    pn = p * n
    block = _pow2(pn, hi=256)
    n_blocks = triton.cdiv(pn, block)
    final = torch.empty((batch, heads, p, n), device=chunk.device, dtype=torch.float32)
    has_start = start is not None
    start = start.contiguous() if has_start else final
    if reverse:
        ddec = torch.empty((n_blocks, batch * heads, nc), device=chunk.device, dtype=torch.float32)
    else:
        ddec, fwd_states = final, chunk  # unused
    _state_passing_kernel[(n_blocks, batch * heads)](
        chunk,
        cum,
        start,
        final,
        fwd_states,
        ddec,
        nc,
        L,
        pn,
        heads,
        chunk.stride(0),
        chunk.stride(1),
        chunk.stride(2),
        *cum.stride(),
        start.stride(0),
        start.stride(1),
        final.stride(0),
        final.stride(1),
        fwd_states.stride(0),
        fwd_states.stride(1),
        fwd_states.stride(2),
        ddec.stride(0),
        ddec.stride(1),
        HAS_START=has_start,
        REVERSE=reverse,
        BLOCK=block,
        num_warps=4,
    )
    return final, (ddec.sum(0).view(batch, heads, nc) if reverse else None)


def _chunk_scan(
    u,
    v,
    w,
    s,
    delta,
    expo,
    log_a,
    L,
    nc,
    ratios,
    reverse,
    row_scale=False,
    col_scale=False,
    s_transposed=False,
    epi=0,
    z=None,
    ratio_z=1,
):
    """OUT [B, T, H, K2] float32 (see _chunk_scan_kernel); expo: cum forward, the suffix sums if reverse.

    epi=1 returns (dx, rsum [B, T, H], sdot [B, T, H]); epi=2 returns (OUT, sdot, intra [B, H, nc·L]).
    """
    batch, length, heads = delta.shape
    k1, k2 = u.shape[-1], w.shape[-1]
    dev, f32 = u.device, torch.float32
    out = torch.empty((batch, length, heads, k2), device=dev, dtype=f32)
    block_k2 = _pow2(k2)
    block_m = _pow2(L, hi=64 if k2 <= 64 else (32 if k2 <= 128 else 16))
    if _BLOCK_M_CAP is not None:  # tests: several row / key blocks per chunk in the interpreter
        block_m = min(block_m, _BLOCK_M_CAP)
    # K1 in slices of <= 32 and 8 warps for the big tiles: the tf32x3 dots split every fp32 operand in two,
    # and with 64-wide slices / 4 warps these variants spilled registers when compiled for sm_90
    block_k1 = _pow2(k1, hi=32)
    num_warps = 8 if block_m * block_k2 >= 64 * 64 else 4
    n_m = triton.cdiv(L, block_m)
    # S[b, h, c] read as [K1, K2]: the stored [P, N] state, or its transpose [N, P]
    s_strides = (s.stride(0), s.stride(1), s.stride(2)) + (
        (s.stride(4), s.stride(3)) if s_transposed else (s.stride(3), s.stride(4))
    )
    sdot = torch.empty((batch, length, heads), device=dev, dtype=f32) if epi else out
    rsum = torch.empty((batch, length, heads), device=dev, dtype=f32) if epi == 1 else sdot
    intra = torch.zeros((n_m,) + tuple(expo.shape), device=dev, dtype=f32) if epi == 2 else out.view(1, -1, 1, 1)
    if z is None:
        z = out
    q_strides = sdot.stride() if epi else (0, 0, 0)
    grid = (n_m * nc, batch * heads)
    _chunk_scan_kernel[grid](
        u,
        v,
        w,
        s,
        delta,
        expo,
        log_a,
        out,
        z,
        sdot,
        rsum,
        intra,
        length,
        L,
        heads,
        k1,
        k2,
        *ratios,
        ratio_z,
        *u.stride(),
        *v.stride(),
        *w.stride(),
        *s_strides,
        *delta.stride(),
        *expo.stride(),
        *out.stride(),
        *z.stride(),
        *q_strides,
        *intra.stride(),
        REVERSE=reverse,
        ROW_SCALE=row_scale,
        COL_SCALE=col_scale,
        EPI=epi,
        BLOCK_M=block_m,
        BLOCK_K1=block_k1,
        BLOCK_K2=block_k2,
        DOT_PREC=_DOT_PRECISION,
        num_warps=num_warps,
        num_stages=2,
    )
    if epi == 1:
        return out, rsum, sdot
    if epi == 2:
        return out, sdot, intra.sum(0)
    return out


# --------------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------------


class _SSDChunkScan(torch.autograd.Function):
    """(x, Δ, log_a, B, C, h0) -> (y without the D term [B, T, H, P] fp32, final state [B, H, P, N] fp32).

    log_a [B, H, nc·L] is Δ·A, zero-padded past T to whole chunks of length L. Every decay exponent is a
    direct sum of log_a terms (same signs, no cancellation): cum (inclusive prefix sums in each chunk),
    suffix (exclusive suffix sums, the decay to the chunk end) and, inside the chunk-scan kernel, the
    segment sums Σ_{s<j<=l} a_j.
    Saved for backward: x, Δ, log_a, cum, suffix, B, C and the entering chunk states [B, H, nc, P, N] fp32.
    """

    @staticmethod
    def forward(ctx, x, delta, log_a, B, C, h0, L):
        batch, _, heads, _ = x.shape
        ratio = heads // B.shape[2]
        nc = log_a.shape[-1] // L
        chunks = log_a.view(batch, heads, nc, L)
        cum = chunks.cumsum(-1).view(batch, heads, nc * L)
        # Σ_{j>t} a_j inside the chunk, summed directly (cum_last - cum_t would lose ulp(|cum|))
        suffix = F.pad(chunks[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1)).reshape(batch, heads, nc * L)
        states = _chunk_state(x, B, delta, suffix, L, nc, 1, ratio, from_start=False, scale=True)
        final, _ = _state_passing(states, cum, L, h0, reverse=False)  # states: now the entering S_c
        y = _chunk_scan(
            C,
            B,
            x,
            states,
            delta,
            cum,
            log_a,
            L,
            nc,
            (ratio, ratio, 1),
            reverse=False,
            col_scale=True,
            s_transposed=True,
        )
        ctx.save_for_backward(x, delta, log_a, cum, suffix, B, C, states)
        ctx.L, ctx.has_h0 = L, h0 is not None
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, delta, log_a, cum, suffix, B, C, states = ctx.saved_tensors
        L = ctx.L
        batch, length, heads, _ = x.shape
        groups, n = B.shape[2], B.shape[3]
        ratio = heads // groups
        nc = cum.shape[-1] // L
        dy = dy.contiguous()
        # Q_c, then the backward chain: dstates[c] = dS_{c+1}, dh0 = dS_0
        dstates = _chunk_state(dy, C, delta, cum, L, nc, 1, ratio, from_start=True, scale=False)
        dh0, ddec = _state_passing(dstates, cum, L, dfinal, reverse=True, fwd_states=states)
        dx, ddelta, v = _chunk_scan(
            B,
            C,
            dy,
            dstates,
            delta,
            suffix,
            log_a,
            L,
            nc,
            (ratio, ratio, 1),
            reverse=True,
            s_transposed=True,
            epi=1,
            z=x,
        )
        dC, alpha, intra = _chunk_scan(
            dy,
            x,
            B,
            states,
            delta,
            cum,
            log_a,
            L,
            nc,
            (1, 1, ratio),
            reverse=False,
            col_scale=True,
            epi=2,
            z=C,
            ratio_z=ratio,
        )
        dB = _chunk_scan(x, dy, C, dstates, delta, suffix, log_a, L, nc, (1, 1, ratio), reverse=True, row_scale=True)
        # da_t (module docstring): read-outs of the entering state at l >= t, chunk-state inputs at s < t,
        # the whole-chunk decay, and the intra-chunk pairs s < t <= l (from the dC pass)
        pad = nc * L - length
        alpha = F.pad(alpha.transpose(1, 2), (0, pad)).view(batch, heads, nc, L)
        v = F.pad(v.transpose(1, 2), (0, pad)).view(batch, heads, nc, L)
        dlog_a = alpha.flip(-1).cumsum(-1).flip(-1) + ddec[..., None]
        dlog_a[..., 1:] += v[..., :-1].cumsum(-1)
        dlog_a = dlog_a.view(batch, heads, nc * L) + intra
        if ratio > 1:  # the heads of a group share B and C
            dB = dB.view(batch, length, groups, ratio, n).sum(3)
            dC = dC.view(batch, length, groups, ratio, n).sum(3)
        return (dx.to(x.dtype), ddelta, dlog_a, dB.to(B.dtype), dC.to(C.dtype), dh0 if ctx.has_h0 else None, None)


# --------------------------------------------------------------------------------------------------
# public function
# --------------------------------------------------------------------------------------------------


def ssd_scan(x, delta, A, B, C, initial_state=None, chunk_size: int = 64):
    """The chunked scan on a discretised Δ: ``(y [B, T, H, P], final_state [B, H, P, N])``, float32, y without
    the D term.

    ``x [B, T, H, P]``, ``delta [B, T, H]`` (Δ, float32, 0 at padding), ``A [H]``, ``B, C [B, T, G, N]``,
    ``initial_state [B, H, P, N]`` or None (zeros); the caller checks shapes and dtypes (float32 / bfloat16 /
    float16). Differentiable in x, delta, A, B, C and initial_state.
    """
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, heads, head_dim = x.shape
    f32 = torch.float32
    h0 = initial_state.to(f32) if initial_state is not None else None
    if length == 0:
        final = h0 if h0 is not None else x.new_zeros((batch, heads, head_dim, B.shape[3]), dtype=f32)
        return x.to(f32).clone(), final
    L = min(int(chunk_size), length)
    nc = triton.cdiv(length, L)
    log_a = F.pad(delta * A.to(f32), (0, 0, 0, nc * L - length))  # [B, nc·L, H], every entry <= 0
    log_a = log_a.transpose(1, 2).contiguous()  # [B, H, nc·L]
    return _SSDChunkScan.apply(x.contiguous(), delta.contiguous(), log_a, B.contiguous(), C.contiguous(), h0, L)
