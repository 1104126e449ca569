"""The planner reads the cell's expressions: hoisting, combining, stages."""

import halstm


def weights(gemms):
    return [[m.weight for m in g.members] for g in gemms]


def test_lstm_hoists_input_and_keeps_one_recurrent_gemm():
    plan = halstm.make_plan(halstm.LSTM(8, 16))
    assert weights(plan.hoisted) == [["weight_ih"]]
    assert [weights(s) for s in plan.stages] == [[["weight_hh"]]]
    assert (plan.stages[0][0].rows, plan.stages[0][0].depth) == (64, 16)


def test_matmuls_sharing_h_are_combined_and_a_dependent_one_waits():
    plan = halstm.make_plan(halstm.ResetBeforeGRU(8, 16))
    (first,), (second,) = plan.stages
    assert [m.weight for m in first.members] == ["weight_hr", "weight_hz"]
    assert first.operand.op.name == "h" and first.rows == 32
    assert [m.weight for m in second.members] == ["weight_hn"]
    assert first.offset(first.members[1]) == 16


def test_plan_prints_what_was_decided():
    text = str(halstm.make_plan(halstm.ResetBeforeGRU(8, 16)))
    assert "x_proj0 = x @ [weight_ih]^T  (N=48, K=8)" in text
    assert "stage 1: gemm0 = h @ [weight_hr | weight_hz]^T  (N=32, K=16)" in text
    assert "stage 2: gemm1 =" in text and "-> next h" in text


def test_a_cell_without_matmuls_has_no_gemm():
    class Leaky(halstm.Cell):
        def parameters(self):
            return {"decay": (self.hidden_size,)}

        def step(self, p, x, h):
            return p.decay * h + x

    plan = halstm.make_plan(Leaky(6, 6))
    assert plan.hoisted == [] and plan.stages == []
