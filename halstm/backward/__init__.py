"""Backward through time, lowered like the forward.

Given the forward's state sequences and the gradient of a loss with respect to each state at each
step (``g<s>_seq``, (T+1)*B rows, the initial state first, as the forward stores them), four
functions compute the gradients with respect to x, every parameter and the initial states:

  prepare   over all T*B rows, no recurrence: the hoisted and first-stage GEMMs recomputed from x
            and the stored states, and with the states and the gradients written, the steps
            reversed, as the input of the adjoint cell (``halstm.adjoint``); its initial states
            (the final states' gradients) and its weights (the recurrent ones, transposed).
  adjoint   the reversed time loop: ``AdjointCell``, a cell compiled as any forward is (the
            persistent kernel, tensor cores, the tuner), for T + 1 steps; its states hold the
            adjoints D_{t+1} of the states after each step, the last one D_0.
  rows      over all T*B rows, no recurrence: the forward step differentiated from D_{t+1}, as
            ``halstm.autodiff`` derives it from the step's expressions, where a recurrent GEMM
            G = A W^T passes dA = dG W: each GEMM result's adjoint dG, each recurrent GEMM's operand
            A, the elementwise parameters' adjoints and, where the step's math reads x itself
            (``Plan.x_in_step``: a residual ``+ x``, a highway), the adjoint of that read.
  weights   per GEMM dW = dG^T A; per hoisted GEMM dA = dG W, then back through the hoisted
            operand's expression to x and the parameters; dx is the hoisted GEMMs' part plus the
            steps' own.

With ``steps=None`` the functions serve any T: their first argument is T (``runtime.STEPS``), the rows
of every buffer that grows with T follow it, and the reversed loop is compiled for any T (called for
T + 1 steps).

The buffers between the functions are float32, but for the adjoint cell's (in the storage dtype, as
any cell's) and the weight gradients' GEMM operands (in the storage dtype, on tensor cores: ``between_dtype``);
gradients come out in the storage dtype.
"""

from .plan import BackwardPlan, GradGemm
from .program import BackwardProgram, lower_backward

__all__ = ["BackwardPlan", "BackwardProgram", "GradGemm", "lower_backward"]
