"""Built-in cells, each written as its equations.

LSTM and GRU follow PyTorch exactly (gate order, both biases, weight layout), so a state_dict of
torch.nn.LSTM/GRU (layer 0) is their parameter dict as it is.
"""

from __future__ import annotations

import numpy as np

from .cell import Cell
from .ops import layer_norm, linear, matmul, sigmoid, split, tanh


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


def _unit_gains(params: dict, gains: tuple, seed: int | None) -> dict:
    """Layer-norm gains near 1 (as torch initialises them, with a spread so that tests see them)."""
    rng = np.random.default_rng(None if seed is None else seed + 1)
    for name in gains:
        value = params[name]
        params[name] = (1.0 + 0.1 * rng.standard_normal(value.shape)).astype(value.dtype)
    return params


BUILTIN = {c.__name__: c for c in (LSTM, GRU, PeepholeLSTM, ResetBeforeGRU, LayerNormLSTM, LayerNormGRU)}
