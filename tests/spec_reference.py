"""Float64 references of UN, MABN and PN, written line by line from shared/spec/unified_norm.md.

Deliberately naive (Python control flow, ``.item()``, explicit loops over the spec's steps)
and independent of ``unnorm``'s code: the tests compare the package against these.
Each ``step`` is one training iteration: forward on ``x`` (``(N, C)`` rows, no padding),
backward of ``dy``; it returns ``y, dx, dweight, dbias``.
"""
from __future__ import annotations

import torch

D = torch.float64


class RefUN:
    def __init__(self, weight, bias, window=4, warmup=4000, alpha=0.9, eps=1e-5,
                 outlier_filtration=False, threshold=None, per_channel=False,
                 fwd_gm=True, bwd_am=True, bwd_ema=True, grad_compensation=True):
        self.w, self.b = weight.to(D).clone(), bias.to(D).clone()
        C = self.w.numel()
        self.M, self.warmup, self.alpha, self.eps = window, warmup, alpha, eps
        self.of, self.per_channel = outlier_filtration, per_channel
        self.threshold = window if threshold is None else threshold
        self.fwd_gm, self.bwd_am, self.bwd_ema, self.gc = fwd_gm, bwd_am, bwd_ema, grad_compensation
        self.running_var = torch.ones(C, dtype=D)
        self.fwd_buffer = torch.zeros(window, C, dtype=D)
        self.bwd_buffer = torch.zeros(window, C, dtype=D)
        self.ema_grad = torch.zeros(C, dtype=D)
        self.t = 0
        self.skipped = 0
        self.margins = []  # relative distance of each outlier decision from its threshold

    def step(self, x, dy):
        x, dy = x.to(D), dy.to(D)
        self.t += 1
        t, M, eps, alpha = self.t, self.M, self.eps, self.alpha
        # forward 1: quadratic mean
        s = (x * x).mean(dim=0)
        # forward 2: variance of sqrt(window) before writing s
        roots = torch.sqrt(self.fwd_buffer)
        if self.per_channel:
            v_prev = roots.var(dim=0, unbiased=True)
        else:
            v_prev = roots.reshape(-1).var(unbiased=True)
        self.fwd_buffer[t % M] = s
        # forward 3: outlier filtration
        skip = M == 1
        if self.of and t >= self.warmup and M > 1:
            am = self.fwd_buffer.mean(dim=0)
            gm = torch.exp(torch.log(self.fwd_buffer).mean(dim=0))
            bound = self.threshold * v_prev
            gap = (am - gm) - bound
            self.margins.append((gap.abs() / bound.abs().clamp_min(1e-30)).min().item())
            if bool((gap > 0).any()):
                self.fwd_buffer[t % M] = self.running_var
                self.skipped += 1
                skip = True
        # forward 4: the statistic used
        if t <= M or t < self.warmup or skip or not self.fwd_gm:
            v = s
        else:
            v = torch.exp(torch.log(self.fwd_buffer).mean(dim=0))
        # forward 5: gradient compensation
        r = torch.sqrt(v + eps) / torch.sqrt(self.running_var + eps)
        if not self.gc or t <= max(1000, self.warmup) or skip:
            r = torch.ones_like(r)
        else:
            r = r.clamp(1 / 5, 5)
        # forward 6, 7
        z = x / torch.sqrt(v + eps)
        y = self.w * z + self.b
        self.running_var = alpha * self.running_var + (1 - alpha) * v
        # backward
        g = dy * self.w * r
        q = (g * z).mean(dim=0)
        self.bwd_buffer[t % M] = self.ema_grad if skip else q
        if t <= M or t < self.warmup or skip or not self.bwd_am:
            m = q
        else:
            m = self.bwd_buffer.mean(dim=0)
        self.ema_grad = alpha * self.ema_grad + (1 - alpha) * m if self.bwd_ema else m
        psi = m if skip else self.ema_grad
        dx = (g - z * psi) / torch.sqrt(v + eps)
        dweight = (dy * r * z).sum(dim=0)
        dbias = dy.sum(dim=0)
        return y, dx, dweight, dbias


class RefMABN:
    def __init__(self, weight, bias, window=16, warmup=100, alpha=0.98, eps=1e-5):
        self.w, self.b = weight.to(D).clone(), bias.to(D).clone()
        C = self.w.numel()
        self.W, self.warmup, self.alpha, self.eps = window, warmup, alpha, eps
        self.running_var = torch.ones(C, dtype=D)
        self.x_window = torch.zeros(window, C, dtype=D)
        self.g_window = torch.zeros(window, C, dtype=D)
        self.t = 0

    def step(self, x, dy):
        x, dy = x.to(D), dy.to(D)
        self.t += 1
        t, W, eps = self.t, self.W, self.eps
        s = (x * x).mean(dim=0)
        self.x_window[t % W] = s
        averaging = not (t <= W or t < self.warmup)
        v = self.x_window.mean(dim=0) if averaging else s
        z = x / torch.sqrt(v + eps)
        if t > max(1000, self.warmup):
            r = (torch.sqrt(v + eps) / torch.sqrt(self.running_var + eps)).clamp(1 / 5, 5)
        else:
            r = torch.ones_like(v)
        y = self.w * (r * z) + self.b
        self.running_var = self.alpha * self.running_var + (1 - self.alpha) * v
        g = dy * self.w * r
        q = (g * z).mean(dim=0)
        self.g_window[t % W] = q
        psi = self.g_window.mean(dim=0) if averaging else q
        dx = (g - z * psi) / torch.sqrt(v + eps)
        return y, dx, (dy * r * z).sum(dim=0), dy.sum(dim=0)


class RefPN:
    def __init__(self, weight, bias, warmup=10000, alpha_fwd=0.9, alpha_bkw=0.9, eps=1e-5):
        self.w, self.b = weight.to(D).clone(), bias.to(D).clone()
        C = self.w.numel()
        self.warmup, self.afwd, self.abkw, self.eps = warmup, alpha_fwd, alpha_bkw, eps
        self.running_phi = torch.ones(C, dtype=D)
        self.ema_gz = torch.zeros(C, dtype=D)
        self.t = 0

    def step(self, x, dy):
        x, dy = x.to(D), dy.to(D)
        self.t += 1
        t, eps = self.t, self.eps
        s = (x * x).mean(dim=0)
        if t <= self.warmup:
            z = x / torch.sqrt(s + eps)
        else:
            z = x / torch.sqrt(self.running_phi + eps)
        if t < self.warmup:
            self.running_phi = self.running_phi * (t - 1) / t + s / t
        self.running_phi = self.afwd * self.running_phi + (1 - self.afwd) * s
        y = self.w * z + self.b
        g = dy * self.w
        a = g - (1 - self.abkw) * self.ema_gz * z
        self.ema_gz = self.ema_gz + (a * z).mean(dim=0)
        dx = a / torch.sqrt(s + eps)
        return y, dx, (dy * z).sum(dim=0), dy.sum(dim=0)


def group_scale(x, groups, eps=1e-5):
    """PN's layer-scale (GroupScaling1D) on (N, C) rows, float64."""
    n, c = x.shape
    grouped = x.to(D).reshape(n, groups, c // groups)
    moment2 = (grouped * grouped).mean(dim=-1, keepdim=True)
    return (grouped / torch.sqrt(moment2 + eps)).reshape(n, c)


class RefMaskPN(RefPN):
    """PN with a pad mask. Released (MaskPowerNorm): the forward statistic over the valid
    rows; the backward's means, of g z and of the corrected gradient's z^2, over every row.
    ``padded_in_backward=False``: padded rows add nothing to those means (their normaliser
    stays every row, as the releases' hosts give padding zero gradient)."""

    def __init__(self, *args, padded_in_backward=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.padded = padded_in_backward

    def step(self, x, dy, valid):
        x, dy = x.to(D), dy.to(D)
        self.t += 1
        t, eps = self.t, self.eps
        s = (x[valid] * x[valid]).mean(dim=0)
        z = x / torch.sqrt((s if t <= self.warmup else self.running_phi) + eps)
        if t < self.warmup:
            self.running_phi = self.running_phi * (t - 1) / t + s / t
        self.running_phi = self.afwd * self.running_phi + (1 - self.afwd) * s
        y = self.w * z + self.b
        a = dy * self.w - (1 - self.abkw) * self.ema_gz * z
        counted = torch.ones_like(valid) if self.padded else valid
        self.ema_gz = self.ema_gz + (a * z * counted[:, None]).mean(dim=0)
        return y, a / torch.sqrt(s + eps), (dy * z).sum(dim=0), dy.sum(dim=0)


class RefPRepBN:
    """SLAB's LinearNorm(LayerNorm, RepBN), written from its formulas with float64 autograd:
    LN for ``warmup`` steps, then lam * LN + (1 - lam) * (BN + alpha x) with
    lam = r0 * k / decay, k = decay, decay - 1, ..., 0; BN over the valid rows."""

    def __init__(self, params: dict, warmup, decay, r0=1.0, momentum=0.9, eps=1e-5):
        self.p = {k: v.detach().to(D).clone().requires_grad_(True) for k, v in params.items()}
        C = self.p["weight"].numel()
        self.warmup, self.decay, self.r0, self.m, self.eps = warmup, decay, r0, momentum, eps
        self.running_mean, self.running_var = torch.zeros(C, dtype=D), torch.ones(C, dtype=D)
        self.t = 0

    def step(self, x, dy, valid=None):
        """One training step on (N, C) rows: ``y, dx, {parameter: gradient}``."""
        p, eps = self.p, self.eps
        x = x.to(D).clone().requires_grad_(True)
        valid = torch.ones(x.shape[0], dtype=torch.bool) if valid is None else valid
        for value in p.values():
            value.grad = None
        self.t += 1
        ln = torch.nn.functional.layer_norm(x, (x.shape[1],), p["weight"], p["bias"], eps)
        if self.t <= self.warmup:
            y = ln
        else:
            rows = x[valid]
            mean, var = rows.mean(dim=0), rows.var(dim=0, unbiased=False)
            rep = (x - mean) / torch.sqrt(var + eps) * p["bn_weight"] + p["bn_bias"] + p["alpha"] * x
            k = max(self.decay - (self.t - self.warmup - 1), 0)
            lam = self.r0 * k / self.decay
            y = lam * ln + (1 - lam) * rep
            n = rows.shape[0]
            self.running_mean = self.m * self.running_mean + (1 - self.m) * mean.detach()
            self.running_var = self.m * self.running_var + (1 - self.m) * var.detach() * n / (n - 1)
        y.backward(dy.to(D))
        grads = {k: torch.zeros_like(v) if v.grad is None else v.grad for k, v in p.items()}
        return y.detach(), x.grad, grads

    def eval(self, x):
        p = self.p
        x = x.to(D)
        bn = (x - self.running_mean) / torch.sqrt(self.running_var + self.eps)
        return (bn * p["bn_weight"] + p["bn_bias"] + p["alpha"] * x).detach()
