"""Triton causal depthwise conv1d that continues a conv window, row by row, under left padding.

:func:`causal_conv1d` is the Triton part of ``hf_statecompose.ops.causal_conv1d(..., backend="triton")``
(whose wrapper checks the arguments and turns the mask into per-row left padding)::

    x [B, C, T]   weight [C, K]   bias [C] | None   window [B, C, K]   pad [B] int32 (left padding per row)
    -> out [B, C, T] (dtype of x), new window [B, C, K] (dtype of x)

Row b has p_b left-padding tokens and L_b = T - p_b real ones. Its real tokens continue its own window
w_b (the last K inputs seen, oldest first): with seq_b = [w_b, real tokens of row b] (length K + L_b),

    y[b, c, t] = bias[c] + Σ_{j<K} weight[c, j] · seq_b[c, t - p_b + 1 + j],   out = act(y)   for t >= p_b
    out[b, c, t] = 0 for padded t < p_b  (as the reference; the vectorised op leaves them meaningless)
    new window = last K entries of seq_b:  x[b, c, T - K + i] if T - K + i >= p_b else w_b[c, L_b + i]

No gather: the kernels read a tap at x position s = t - (K - 1) + j from x when s >= p_b, else from the
window at index s - p_b + K. Everything is computed in float32.

Forward: one kernel, grid ``(cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), B)``, K taps unrolled; the programs with
pid_t = 0 also write the new window. Backward: two kernels on the same grid. The first recomputes y,
forms dy = dout · act'(y) (0 at padding) into a float32 buffer [B, C, T] and writes per-tile partials of
dweight and dbias ([B, n_T, C, K] and [B, n_T, C], summed in torch: deterministic, no atomics). The second
forms dx[s] = Σ_j weight[j] · dy[s + K - 1 - j] (+ dwindow_new[s - T + K] for the last K real positions)
and, in the pid_t = 0 programs, dconv_state (taps that read the window, + dwindow_new where the new window
copies the old one). Extra memory of the backward: dy (float32, the size of x) and the partials
((K + 1) / BLOCK_T of that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["causal_conv1d"]


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _tap(x_ptr, win_ptr, x_row, win_row, c, cm, s, tm, p, T, s_x_c, s_x_t, s_w_c, s_w_k, K: tl.constexpr):
    """seq value at x position s ([BLOCK_T]) for channels c ([BLOCK_C]): x if s >= p, else the window."""
    from_x = tm & (s >= p) & (s < T)
    u = s - p + K  # window index of position s
    from_w = tm & (s < p) & (u >= 0)
    # one load per tap: x and the window have the same element type, so the address is a select
    ptr = tl.where(
        from_x[None, :],
        x_row + c[:, None] * s_x_c + s[None, :] * s_x_t,
        win_row + c[:, None] * s_w_c + u[None, :] * s_w_k,
    )
    return tl.load(ptr, mask=cm[:, None] & (from_x | from_w)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _conv_tile(
    x_ptr,
    w_ptr,
    b_ptr,
    win_ptr,
    x_row,
    win_row,
    c,
    cm,
    t,
    tm,
    p,
    T,
    s_x_c,
    s_x_t,
    s_wt_c,
    s_wt_k,
    s_w_c,
    s_w_k,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Pre-activation y on the [BLOCK_C, BLOCK_T] tile (float32)."""
    acc = tl.zeros([BLOCK_C, BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(K):
        w_j = tl.load(w_ptr + c * s_wt_c + j * s_wt_k, mask=cm, other=0.0).to(tl.float32)
        seq = _tap(x_ptr, win_ptr, x_row, win_row, c, cm, t - (K - 1) + j, tm, p, T, s_x_c, s_x_t, s_w_c, s_w_k, K)
        acc += w_j[:, None] * seq
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _conv_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    win_ptr,
    pad_ptr,  # inputs (pad: int32 [B] left-padding counts)
    out_ptr,
    new_win_ptr,  # outputs: out [B, C, T], new window [B, C, K] (contiguous)
    C,
    T,
    s_x_b,
    s_x_c,
    s_x_t,
    s_wt_c,
    s_wt_k,
    s_w_b,
    s_w_c,
    s_w_k,
    K: tl.constexpr,
    KP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    p = tl.load(pad_ptr + b)
    x_row = x_ptr + b * s_x_b
    win_row = win_ptr + b * s_w_b

    y = _conv_tile(
        x_ptr,
        w_ptr,
        b_ptr,
        win_ptr,
        x_row,
        win_row,
        c,
        cm,
        t,
        tm,
        p,
        T,
        s_x_c,
        s_x_t,
        s_wt_c,
        s_wt_k,
        s_w_c,
        s_w_k,
        K,
        HAS_BIAS,
        BLOCK_C,
        BLOCK_T,
    )
    if SILU:
        y = y * tl.sigmoid(y)
    real = tm & (t >= p)
    y = tl.where(real[None, :], y, 0.0)
    tl.store(
        out_ptr + b * C * T + c[:, None] * T + t[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=cm[:, None] & tm[None, :],
    )

    if pid_t == 0:  # the new window: last K entries of [window, real tokens]
        i = tl.arange(0, KP)
        im = i < K
        seq = _tap(x_ptr, win_ptr, x_row, win_row, c, cm, T - K + i, im, p, T, s_x_c, s_x_t, s_w_c, s_w_k, K)
        tl.store(
            new_win_ptr + b * C * K + c[:, None] * K + i[None, :],
            seq.to(new_win_ptr.dtype.element_ty),
            mask=cm[:, None] & im[None, :],
        )


@triton.jit
def _conv_bwd_dy_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    win_ptr,
    pad_ptr,
    gout_ptr,
    dy_ptr,
    dw_part_ptr,
    db_part_ptr,  # dy [B, C, T] f32; partials [B, n_T, C, K], [B, n_T, C] f32
    C,
    T,
    n_t,
    s_x_b,
    s_x_c,
    s_x_t,
    s_wt_c,
    s_wt_k,
    s_w_b,
    s_w_c,
    s_w_k,
    s_g_b,
    s_g_c,
    s_g_t,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    p = tl.load(pad_ptr + b)
    x_row = x_ptr + b * s_x_b
    win_row = win_ptr + b * s_w_b
    real = tm & (t >= p)
    ctm = cm[:, None] & tm[None, :]

    g = tl.load(gout_ptr + b * s_g_b + c[:, None] * s_g_c + t[None, :] * s_g_t, mask=ctm, other=0.0)
    dy = g.to(tl.float32)
    if SILU:
        y = _conv_tile(
            x_ptr,
            w_ptr,
            b_ptr,
            win_ptr,
            x_row,
            win_row,
            c,
            cm,
            t,
            tm,
            p,
            T,
            s_x_c,
            s_x_t,
            s_wt_c,
            s_wt_k,
            s_w_c,
            s_w_k,
            K,
            HAS_BIAS,
            BLOCK_C,
            BLOCK_T,
        )
        sig = tl.sigmoid(y)
        dy = dy * sig * (1.0 + y * (1.0 - sig))
    dy = tl.where(cm[:, None] & real[None, :], dy, 0.0)
    tl.store(dy_ptr + b * C * T + c[:, None] * T + t[None, :], dy, mask=ctm)

    part = (b * n_t + pid_t) * C + c  # row of the partial buffers
    if HAS_BIAS:
        tl.store(db_part_ptr + part, tl.sum(dy, axis=1), mask=cm)
    for j in tl.static_range(K):
        seq = _tap(x_ptr, win_ptr, x_row, win_row, c, cm, t - (K - 1) + j, tm, p, T, s_x_c, s_x_t, s_w_c, s_w_k, K)
        tl.store(dw_part_ptr + part * K + j, tl.sum(dy * seq, axis=1), mask=cm)


@triton.jit
def _conv_bwd_dx_kernel(
    w_ptr,
    pad_ptr,
    dy_ptr,
    gwin_ptr,  # gwin: grad of the new window [B, C, K]
    dx_ptr,
    dwin_ptr,  # outputs: dx [B, C, T], d conv_state [B, C, K] (contiguous)
    C,
    T,
    s_wt_c,
    s_wt_k,
    s_gw_b,
    s_gw_c,
    s_gw_k,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    s = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    sm = s < T
    p = tl.load(pad_ptr + b)
    dy_row = dy_ptr + b * C * T
    gwin_row = gwin_ptr + b * s_gw_b

    # x[s] is tap j of output t = s + K - 1 - j; dy is 0 at padded outputs
    dx = tl.zeros([BLOCK_C, BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(K):
        w_j = tl.load(w_ptr + c * s_wt_c + j * s_wt_k, mask=cm, other=0.0).to(tl.float32)
        tt = s + (K - 1) - j
        d = tl.load(dy_row + c[:, None] * T + tt[None, :], mask=cm[:, None] & (sm & (tt < T))[None, :], other=0.0)
        dx += w_j[:, None] * d
    # the last K positions are also copied into the new window (if they are real tokens)
    i = s - (T - K)
    in_win = sm & (i >= 0)
    dx += tl.load(
        gwin_row + c[:, None] * s_gw_c + i[None, :] * s_gw_k, mask=cm[:, None] & in_win[None, :], other=0.0
    ).to(tl.float32)
    dx = tl.where((s >= p)[None, :], dx, 0.0)  # padding is never read
    tl.store(
        dx_ptr + b * C * T + c[:, None] * T + s[None, :], dx.to(dx_ptr.dtype.element_ty), mask=cm[:, None] & sm[None, :]
    )

    if pid_t == 0:  # window entry u plays x position p - K + u
        u = tl.arange(0, KP)
        um = u < K
        s_win = p - K + u
        dwin = tl.zeros([BLOCK_C, KP], dtype=tl.float32)
        for j in tl.static_range(K):
            w_tap = tl.load(w_ptr + c * s_wt_c + j * s_wt_k, mask=cm, other=0.0).to(tl.float32)
            t_out = s_win + (K - 1) - j
            ok = um & (t_out >= p) & (t_out < T)
            d_out = tl.load(dy_row + c[:, None] * T + t_out[None, :], mask=cm[:, None] & ok[None, :], other=0.0)
            dwin += w_tap[:, None] * d_out
        # new window[i] = old window[L + i] when fewer than K - i real tokens came: u = L + i
        i_new = u - (T - p)
        ok_new = um & (i_new >= 0)
        dwin += tl.load(
            gwin_row + c[:, None] * s_gw_c + i_new[None, :] * s_gw_k, mask=cm[:, None] & ok_new[None, :], other=0.0
        ).to(tl.float32)
        tl.store(
            dwin_ptr + b * C * K + c[:, None] * K + u[None, :],
            dwin.to(dwin_ptr.dtype.element_ty),
            mask=cm[:, None] & um[None, :],
        )


# --------------------------------------------------------------------------------------------- launch
def _blocks(channels: int, length: int) -> tuple[int, int, int]:
    """Tile [BLOCK_C, BLOCK_T] up to 32 x 64 and its warps: 8 elements per thread (no spills on sm_90)."""
    block_c = min(32, triton.next_power_of_2(max(channels, 1)))
    block_t = min(64, triton.next_power_of_2(max(length, 1)))
    return block_c, block_t, max(1, min(8, block_c * block_t // 256))


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, window, pad, silu):
        batch, channels, length = x.shape
        kernel = weight.shape[1]
        block_c, block_t, warps = _blocks(channels, length)
        n_t = max(1, triton.cdiv(length, block_t))  # >= 1 program: T = 0 still writes the window
        grid = (n_t, triton.cdiv(channels, block_c), batch)
        out = torch.empty((batch, channels, length), device=x.device, dtype=x.dtype)
        new_window = torch.empty((batch, channels, kernel), device=x.device, dtype=x.dtype)
        _conv_fwd_kernel[grid](
            x,
            weight,
            bias if bias is not None else weight,
            window,
            pad,
            out,
            new_window,
            channels,
            length,
            *x.stride(),
            *weight.stride(),
            *window.stride(),
            K=kernel,
            KP=triton.next_power_of_2(kernel),
            HAS_BIAS=bias is not None,
            SILU=silu,
            BLOCK_C=block_c,
            BLOCK_T=block_t,
            num_warps=warps,
        )
        ctx.save_for_backward(x, weight, bias, window, pad)
        ctx.silu = silu
        return out, new_window

    @staticmethod
    def backward(ctx, grad_out, grad_window):
        x, weight, bias, window, pad = ctx.saved_tensors
        batch, channels, length = x.shape
        kernel = weight.shape[1]
        block_c, block_t, warps = _blocks(channels, length)
        n_t = max(1, triton.cdiv(length, block_t))
        grid = (n_t, triton.cdiv(channels, block_c), batch)
        f32 = dict(device=x.device, dtype=torch.float32)
        dy = torch.empty((batch, channels, length), **f32)
        dw_part = torch.empty((batch, n_t, channels, kernel), **f32)
        db_part = torch.empty((batch, n_t, channels), **f32) if bias is not None else dw_part
        _conv_bwd_dy_kernel[grid](
            x,
            weight,
            bias if bias is not None else weight,
            window,
            pad,
            grad_out,
            dy,
            dw_part,
            db_part,
            channels,
            length,
            n_t,
            *x.stride(),
            *weight.stride(),
            *window.stride(),
            *grad_out.stride(),
            K=kernel,
            HAS_BIAS=bias is not None,
            SILU=ctx.silu,
            BLOCK_C=block_c,
            BLOCK_T=block_t,
            num_warps=warps,
        )
        dx = torch.empty((batch, channels, length), device=x.device, dtype=x.dtype)
        dwindow = torch.empty((batch, channels, kernel), device=x.device, dtype=window.dtype)
        _conv_bwd_dx_kernel[grid](
            weight,
            pad,
            dy,
            grad_window,
            dx,
            dwindow,
            channels,
            length,
            *weight.stride(),
            *grad_window.stride(),
            K=kernel,
            KP=triton.next_power_of_2(kernel),
            BLOCK_C=block_c,
            BLOCK_T=block_t,
            num_warps=warps,
        )
        dweight = dw_part.sum((0, 1)).to(weight.dtype)
        dbias = db_part.sum((0, 1)).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, dwindow, None, None


def causal_conv1d(x, weight, bias, window, pad, silu: bool):
    """``(out [B, C, T], new window [B, C, K])`` in the dtype of x (module docstring); differentiable.

    ``x [B, C, T]``, ``weight [C, K]``, ``bias [C]`` or None, ``window [B, C, K]`` in the dtype of x, ``pad [B]``
    int32 (the left padding of each row), ``silu``: apply SiLU. The caller checks shapes and dtypes (float32 /
    bfloat16 / float16).
    """
    return _CausalConv1d.apply(x, weight, bias, window, pad, bool(silu))
