"""Models beyond recurrent cells, on the same machinery: a GRU encoder-decoder with compiled greedy
decoding (``seq2seq``, ``decoding``); lightweight and dynamic convolution (``conv``: the math,
``conv_torch``: PyTorch modules, ``conv_reference``: plain PyTorch)."""
