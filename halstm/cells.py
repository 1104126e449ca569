"""Built-in cells, each written as its equations.

LSTM and GRU follow PyTorch exactly (gate order, both biases, weight layout), so a state_dict of
torch.nn.LSTM/GRU (layer 0) is their parameter dict as it is.
"""

from __future__ import annotations

import numpy as np

from .cell import Cell
from .ops import exp, expm1, layer_norm, linear, log1p, matmul, sigmoid, split, sqrt, tanh


class LSTM(Cell):
    """i, f, g, o = split(W_ih x + b_ih + W_hh h + b_hh); c' = f c + i g; h' = o tanh(c')."""

    states = ("h", "c")
    biases = ("bias_ih", "bias_hh")

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"weight_ih": (4 * H, I), "weight_hh": (4 * H, H), "bias_ih": (4 * H,), "bias_hh": (4 * H,)}

    def step(self, p, x, h, c):
        gates = linear(x, p.weight_ih, p.bias_ih) + linear(h, p.weight_hh, p.bias_hh)
        i, f, g, o = split(gates, 4)
        c = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h = sigmoid(o) * tanh(c)
        return h, c


class GRU(Cell):
    """PyTorch's GRU: the reset gate scales (W_hn h + b_hn), after the recurrent matmul."""

    biases = ("bias_ih", "bias_hh")

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"weight_ih": (3 * H, I), "weight_hh": (3 * H, H), "bias_ih": (3 * H,), "bias_hh": (3 * H,)}

    def step(self, p, x, h):
        xr, xz, xn = split(linear(x, p.weight_ih, p.bias_ih), 3)
        hr, hz, hn = split(linear(h, p.weight_hh, p.bias_hh), 3)
        r = sigmoid(xr + hr)
        z = sigmoid(xz + hz)
        n = tanh(xn + r * hn)
        return (1.0 - z) * n + z * h


class PeepholeLSTM(Cell):
    """LSTM whose gates also see the cell state (Gers & Schmidhuber 2000): i, f peek at c, o at c'."""

    states = ("h", "c")
    biases = ("bias",)  # the peepholes are weights

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {
            "weight_ih": (4 * H, I),
            "weight_hh": (4 * H, H),
            "bias": (4 * H,),
            "peep_i": (H,),
            "peep_f": (H,),
            "peep_o": (H,),
        }

    def step(self, p, x, h, c):
        gi, gf, gg, go = split(linear(x, p.weight_ih, p.bias) + linear(h, p.weight_hh), 4)
        c_next = sigmoid(gf + p.peep_f * c) * c + sigmoid(gi + p.peep_i * c) * tanh(gg)
        h_next = sigmoid(go + p.peep_o * c_next) * tanh(c_next)
        return h_next, c_next


class ResetBeforeGRU(Cell):
    """The GRU of Cho et al. (2014): n = tanh(W_n x + U_n (r * h)).

    The reset gate scales h before the recurrent matmul, so that matmul must wait for r: the planner
    gives the step two stages.
    """

    biases = ("bias",)

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {
            "weight_ih": (3 * H, I),
            "weight_hr": (H, H),
            "weight_hz": (H, H),
            "weight_hn": (H, H),
            "bias": (3 * H,),
        }

    def step(self, p, x, h):
        xr, xz, xn = split(linear(x, p.weight_ih, p.bias), 3)
        r = sigmoid(xr + linear(h, p.weight_hr))
        z = sigmoid(xz + linear(h, p.weight_hz))
        n = tanh(xn + linear(r * h, p.weight_hn))
        return (1.0 - z) * n + z * h


class LayerNormLSTM(Cell):
    """Layer-normalised LSTM (Ba et al. 2016, as Haste's LayerNormLSTM): each matmul's gates
    normalised over all 4H before the bias, c' normalised before the output tanh.

        i, f, g, o = split(LN(W_ih x) + LN(W_hh h) + b); c' = f c + i g; h' = o tanh(LN(c'))
    """

    states = ("h", "c")
    biases = ("bias", "beta_c")  # the layer norms' additive terms too, as torch's LayerNorm(bias=False)

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"weight_ih": (4 * H, I), "weight_hh": (4 * H, H), "bias": (4 * H,),
                "gamma_ih": (4 * H,), "gamma_hh": (4 * H,), "gamma_c": (H,), "beta_c": (H,)}

    def init_parameters(self, seed=None, dtype="float32"):
        return _unit_gains(super().init_parameters(seed, dtype), ("gamma_ih", "gamma_hh", "gamma_c"), seed)

    def step(self, p, x, h, c):
        gates = layer_norm(matmul(x, p.weight_ih), p.gamma_ih) + layer_norm(matmul(h, p.weight_hh), p.gamma_hh) + p.bias
        i, f, g, o = split(gates, 4)
        c = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h = sigmoid(o) * tanh(layer_norm(c, p.gamma_c, p.beta_c))
        return h, c


class LayerNormGRU(Cell):
    """GRU (PyTorch's gates) whose input and recurrent pre-activations are each layer-normalised
    over all 3H before their biases.

        xr, xz, xn = split(LN(W_ih x) + b_ih); hr, hz, hn = split(LN(W_hh h) + b_hh)
        r = sigmoid(xr + hr); z = sigmoid(xz + hz); n = tanh(xn + r hn); h' = (1 - z) n + z h
    """

    biases = ("bias_ih", "bias_hh")

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"weight_ih": (3 * H, I), "weight_hh": (3 * H, H), "bias_ih": (3 * H,), "bias_hh": (3 * H,),
                "gamma_ih": (3 * H,), "gamma_hh": (3 * H,)}

    def init_parameters(self, seed=None, dtype="float32"):
        return _unit_gains(super().init_parameters(seed, dtype), ("gamma_ih", "gamma_hh"), seed)

    def step(self, p, x, h):
        xr, xz, xn = split(layer_norm(matmul(x, p.weight_ih), p.gamma_ih) + p.bias_ih, 3)
        hr, hz, hn = split(layer_norm(matmul(h, p.weight_hh), p.gamma_hh) + p.bias_hh, 3)
        r = sigmoid(xr + hr)
        z = sigmoid(xz + hz)
        n = tanh(xn + r * hn)
        return (1.0 - z) * n + z * h


# Cells whose state update is linear and elementwise in the state: h' = a(x) h + b(x)


class MinGRU(Cell):
    """z, h~ = split(W x + b); z = sigmoid(z); h' = (1 - z) h + z h~ (Feng et al. 2024, "Were RNNs all we needed?")."""

    biases = ("bias_ih",)

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"weight_ih": (2 * H, I), "bias_ih": (2 * H,)}

    def step(self, p, x, h):
        z, h_tilde = split(linear(x, p.weight_ih, p.bias_ih), 2)
        z = sigmoid(z)
        return (1.0 - z) * h + z * h_tilde


class MinLSTM(Cell):
    """f, i, h~ = split(W x + b); f, i = sigmoid(f), sigmoid(i); h' = (f h + i h~) / (f + i) (Feng et al. 2024)."""

    biases = ("bias_ih",)

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"weight_ih": (3 * H, I), "bias_ih": (3 * H,)}

    def step(self, p, x, h):
        f, i, h_tilde = split(linear(x, p.weight_ih, p.bias_ih), 3)
        f = sigmoid(f)
        i = sigmoid(i)
        total = f + i
        return f / total * h + i / total * h_tilde


class SRU(Cell):
    """x~, f, r = split(W x); f, r = sigmoid(f + b_f), sigmoid(r + b_r); c' = f c + (1 - f) x~;
    h' = r tanh(c') + (1 - r) x (Lei et al. 2017, "Training RNNs as fast as CNNs", without peepholes).

    Where input_size != hidden_size, the highway carries W_skip x instead of x, as Lei et al. do.
    """

    states = ("h", "c")
    biases = ("bias_f", "bias_r")

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        params = {"weight": (3 * H, I), "bias_f": (H,), "bias_r": (H,)}
        if I != H:
            params["weight_skip"] = (H, I)
        return params

    def step(self, p, x, h, c):
        xt, f, r = split(matmul(x, p.weight), 3)
        f = sigmoid(f + p.bias_f)
        r = sigmoid(r + p.bias_r)
        c = f * c + (1.0 - f) * xt
        skip = x if self.input_size == self.hidden_size else matmul(x, p.weight_skip)
        return r * tanh(c) + (1.0 - r) * skip, c


class RGLRU(Cell):
    """r, i, u = split(W x + b); a_t = sigmoid(Lambda)^(8 sigmoid(r)); h' = a_t h + sqrt(1 - a_t^2) (sigmoid(i) u)
    (Griffin's RG-LRU, De et al. 2024, its input projected).

    ``log_a`` is Lambda, initialised so that sigmoid(Lambda)^8 is uniform in [0.9, 0.999] as in
    Griffin. a_t is then within 1e-3 of 1: log a_t = -8 r log1p(exp(-Lambda)) and 1 - a_t^2 =
    -expm1(2 log a_t) are computed without the cancellation of 1 + small and 1 - a_t^2.
    """

    biases = ("bias_ih",)

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"weight_ih": (3 * H, I), "bias_ih": (3 * H,), "log_a": (H,)}

    def init_parameters(self, seed=None, dtype="float32"):
        params = super().init_parameters(seed, dtype)
        rng = np.random.default_rng(None if seed is None else seed + 1)
        a = rng.uniform(0.9, 0.999, self.hidden_size) ** (1 / 8)
        params["log_a"] = (np.log(a) - np.log1p(-a)).astype(params["log_a"].dtype)  # logit(a)
        return params

    def step(self, p, x, h):
        r, i, u = split(linear(x, p.weight_ih, p.bias_ih), 3)
        r = sigmoid(r)
        i = sigmoid(i)
        log_a = r * log1p(exp(-p.log_a)) * -8.0  # -8 r softplus(-Lambda)
        return exp(log_a) * h + sqrt(expm1(log_a * 2.0) * -1.0) * (i * u)  # sqrt(1 - a_t^2)


def _unit_gains(params: dict, gains: tuple, seed: int | None) -> dict:
    """Layer-norm gains near 1 (as torch initialises them, with a spread so that tests see them)."""
    rng = np.random.default_rng(None if seed is None else seed + 1)
    for name in gains:
        value = params[name]
        params[name] = (1.0 + 0.1 * rng.standard_normal(value.shape)).astype(value.dtype)
    return params


BUILTIN = {c.__name__: c for c in (LSTM, GRU, PeepholeLSTM, ResetBeforeGRU, LayerNormLSTM, LayerNormGRU,
                                   MinGRU, MinLSTM, SRU, RGLRU)}
