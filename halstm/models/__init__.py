"""Models beyond recurrent cells, written as algorithms on the same machinery: lightweight and
dynamic convolution (``conv``: the math; ``conv_torch``: PyTorch modules; ``conv_reference``: plain
PyTorch)."""
