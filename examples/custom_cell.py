import numpy as np
import halstm
from halstm import linear, sigmoid, split, tanh

class CoupledLSTM(halstm.Cell):
    """LSTM with coupled gates: the input gate is 1 - forget."""
    states = ("h", "c")
    biases = ("b",)  # what halstm.nn.RNN(..., bias=False) drops
    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"w_x": (3 * H, I), "w_h": (3 * H, H), "b": (3 * H,)}
    def step(self, p, x, h, c):
        f, g, o = split(linear(x, p.w_x, p.b) + linear(h, p.w_h), 3)
        c = sigmoid(f) * c + (1.0 - sigmoid(f)) * tanh(g)
        return sigmoid(o) * tanh(c), c

cell = CoupledLSTM(input_size=128, hidden_size=256)
print(halstm.make_plan(cell))                      # what the compiler decided
f = halstm.compile(cell, steps=50, batch=16)       # CPU; target="cuda" for a GPU
x = np.random.randn(50, 16, 128).astype(np.float32)
params = cell.init_parameters(seed=0)
y, states = f(x, params)                           # y: (50, 16, 256), states["h"], states["c"]
y_ref, _ = halstm.reference(cell, x, params)       # float64 NumPy oracle, same definition
print("max abs error vs float64:", np.abs(y - y_ref).max())
