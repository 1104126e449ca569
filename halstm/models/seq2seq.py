"""A GRU encoder-decoder with greedy decoding (Cho et al., 2014), on halstm, beside ``TorchSeq2Seq``,
the plain PyTorch model with the same parameters (state_dict) that it is checked and timed against.

    encoder   outputs, h_n = GRU_L(E_src[x])             L-layer GRU over the (T, B, E) embeddings
    context   c = h_n[L - 1]                              the top layer's final state
    decoder   h_0 = c                                     (as the PyTorch seq2seq tutorial; Cho et al.: tanh(V c))
              h_t = GRU([E_tgt[y_{t-1}]; c], h_{t-1})     the context at every step (Cho et al.)
              logits_t = W_o [E_tgt[y_{t-1}]; h_t; c] + b_o   Cho et al.'s output layer, without its maxout
              y_t = argmax logits_t                       greedy

GRU is PyTorch's (nn.GRU, nn.GRUCell), not the reset-before variant of Cho et al. In ``Seq2Seq`` the
encoder is ``halstm.nn.GRU`` and greedy decoding one compiled function (``halstm.models.decoding``)
of ``GRUDecoder.step``, the decoder's math. Forward only, float32.
"""

from __future__ import annotations

import torch

from .. import nn as halstm_nn
from ..cells import GRU
from ..ops import concat, embedding, linear
from . import decoding


class GRUDecoder:
    """One decoder step as math: the next state and the logits over the vocabulary."""

    def __init__(self, vocab_size: int, embed_size: int, hidden_size: int):
        self.vocab_size, self.embed_size, self.hidden_size = vocab_size, embed_size, hidden_size
        self.gru = GRU(embed_size + hidden_size, hidden_size)

    def parameters(self) -> dict[str, tuple[int, ...]]:
        V, E, H = self.vocab_size, self.embed_size, self.hidden_size
        return {"embedding": (V, E), **self.gru.parameters(), "out_weight": (V, E + 2 * H), "out_bias": (V,)}

    def step(self, p, token, h, context):
        e = embedding(p.embedding, token)
        h = self.gru.step(p, concat(e, context), h)
        return h, linear(concat(e, h, context), p.out_weight, p.out_bias)

    def __repr__(self):
        return f"GRUDecoder(vocab_size={self.vocab_size}, embed_size={self.embed_size}, hidden_size={self.hidden_size})"


class TorchSeq2Seq(torch.nn.Module):
    """The reference: the model above in plain PyTorch, decoding step by step in Python."""

    def __init__(self, vocab_size: int, embed_size: int, hidden_size: int, num_layers: int = 1):
        super().__init__()
        self.src_embedding = torch.nn.Embedding(vocab_size, embed_size)
        self.encoder = torch.nn.GRU(embed_size, hidden_size, num_layers)
        self.tgt_embedding = torch.nn.Embedding(vocab_size, embed_size)
        self.decoder = torch.nn.GRUCell(embed_size + hidden_size, hidden_size)
        self.out = torch.nn.Linear(embed_size + 2 * hidden_size, vocab_size)

    def decoder_parameters(self) -> dict[str, torch.Tensor]:
        """``GRUDecoder``'s parameters by name: this module's own tensors."""
        gru = {n: getattr(self.decoder, n) for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
        return {"embedding": self.tgt_embedding.weight, **gru, "out_weight": self.out.weight, "out_bias": self.out.bias}

    def encode(self, source):
        """Source tokens (T, B) -> every output of the top layer (T, B, H), final states (L, B, H)."""
        return self.encoder(self.src_embedding(source))

    def decode(self, context, start, steps: int):
        """``steps`` greedy tokens from the context (B, H) and start tokens (B,): tokens (N, B), hidden
        states (N + 1, B, H) with h_0 first, logits (N, B, V)."""
        h, token = context, start
        tokens, hidden, logits = [], [h], []
        for _ in range(steps):
            e = self.tgt_embedding(token)
            h = self.decoder(torch.cat([e, context], 1), h)
            out = self.out(torch.cat([e, h, context], 1))
            token = out.argmax(1)
            tokens.append(token)
            hidden.append(h)
            logits.append(out)
        return torch.stack(tokens), torch.stack(hidden), torch.stack(logits)

    def forward(self, source, start, steps: int):
        """Encode ``source``, then decode ``steps`` tokens greedily: (tokens, hidden, logits)."""
        _, final = self.encode(source)
        return self.decode(final[-1], start, steps)


class Seq2Seq(TorchSeq2Seq):
    """The same model and state_dict, run by halstm: the encoder is ``halstm.nn.GRU``; decoding is
    compiled per (steps, batch, device) on first use, its weights packed once per parameter version."""

    def __init__(self, vocab_size: int, embed_size: int, hidden_size: int, num_layers: int = 1):
        super().__init__(vocab_size, embed_size, hidden_size, num_layers)
        self.encoder = halstm_nn.GRU(embed_size, hidden_size, num_layers)
        self.step = GRUDecoder(vocab_size, embed_size, hidden_size)
        self._compiled, self._packed = {}, {}

    def decode(self, context, start, steps: int):
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            raise NotImplementedError("halstm decodes forward only: use torch.no_grad() or torch.inference_mode()")
        f = self.compiled_decoder(steps, context.shape[0], context.device)
        tokens, hidden, logits = f(self._weights(f), context, context, start.int())
        return tokens.long(), hidden, logits

    def compiled_decoder(self, steps: int, batch: int, device) -> decoding.GreedyDecoder:
        """The compiled greedy decoding that ``decode`` runs for this shape (compiled on first use)."""
        key = (steps, batch, torch.device(device))
        if key not in self._compiled:
            self._compiled[key] = decoding.compile(self.step, steps, batch, halstm_nn._target(key[2]))
        return self._compiled[key]

    def _weights(self, f):
        """The packed weights for ``f``'s layout and device, packed again after a parameter changed."""
        params = self.decoder_parameters()
        version = tuple((p.data_ptr(), p._version) for p in params.values())
        key = (f.program.layout, f.target)
        if self._packed.get(key, (None,))[0] != version:
            self._packed[key] = (version, f.pack(params))
        return self._packed[key][1]
