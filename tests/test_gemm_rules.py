"""Which of the GEMM rules (schedules/gemm_rules.py, first match wins) takes each GEMM of the CUDA
step loop: the rule by the problem, the target and the knobs, without building anything."""

import pytest

import halstm
from halstm.layout import PackedLayout
from halstm.schedules import CudaStepLoop, cuda, gemm_rules
from halstm.schedules.cuda_tensorcore import tensorize_works
from halstm.targets import CudaTarget

H100 = CudaTarget("sm_90", sms=132)
A100 = CudaTarget("sm_80", sms=108)


def rules_taken(monkeypatch, cell, batch, dtype, target, knobs=None, layout=None):
    """{GEMM block name: the class name of the rule that scheduled it} as the recipe applies."""
    taken = {}

    def recording(sch, block, *args, **kwargs):
        name = sch.get(block).name_hint
        taken[name] = type(gemm_rules.schedule_gemm(sch, block, *args, **kwargs)).__name__

    monkeypatch.setattr(cuda, "schedule_gemm", recording)
    recipe = CudaStepLoop()
    program = halstm.lower(cell, 3, batch, dtype)
    resolved = recipe.resolve(program, target, knobs)
    program = halstm.lower(cell, 3, batch, dtype, layout=layout or recipe.layout(program, target, resolved))
    recipe.apply(program, target, **resolved)
    return taken


def test_hopper_takes_wgmma(monkeypatch):
    assert tensorize_works()
    taken = rules_taken(monkeypatch, halstm.LSTM(64, 64), 16, "float16", H100)
    assert set(taken.values()) == {"WgmmaGemm"} and len(taken) == 2


def test_without_wgmma_a_fragment_of_rows_takes_wmma(monkeypatch):
    assert tensorize_works()
    taken = rules_taken(monkeypatch, halstm.LSTM(8, 16), 16, "float16", A100)
    assert set(taken.values()) == {"WmmaGemm"} and len(taken) == 2


@pytest.mark.parametrize("target", [H100, A100], ids=["H100", "A100"])
def test_off_tensor_cores_every_gemm_takes_the_ffma_tile(monkeypatch, target):
    taken = rules_taken(monkeypatch, halstm.LSTM(8, 16), 2, "float32", target, {"tensor_cores": False})
    assert set(taken.values()) == {"FfmaGemm"} and len(taken) == 2


def test_a_gemm_in_k_slices_off_tensor_cores_sums_a_slice_a_thread(monkeypatch):
    taken = rules_taken(monkeypatch, halstm.LSTM(8, 16), 4, "float32", H100, {"tensor_cores": False},
                        PackedLayout(k_major=True, split_k=2))
    assert taken == {"x_proj0": "FfmaGemm", "gemm0": "SlicedFfmaGemm"}
