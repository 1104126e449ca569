"""A lowered function is built by splicing the prologue's and the step's functions into a parsed
shell (``halstm.splice``): the same IR as TVMScript's parser makes of the function's whole text, and
well-formed TIR (every variable defined once before its use, every access typed as its buffer: the
check the parser would make, which neither the splice nor ``lowering.parsed`` makes)."""

import pytest
import tvm
import tvm_ffi
from tvm.s_tir.stmt import SBlock

import halstm
from halstm.backward.program import lower_backward
from halstm.cells import BUILTIN
from halstm.lowering import parsed
from halstm.splice import splice


def parsed_whole(program) -> tvm.tirx.PrimFunc:
    return tvm.script.from_source(program.source, check_well_formed=False)


def well_formed(func: tvm.tirx.PrimFunc) -> None:
    """The checks of ``tvm.script.from_source(check_well_formed=True)``."""
    tvm.s_tir.analysis.verify_well_formed(tvm.IRModule({"main": func}))
    if not func.attrs.get("s_tir", False):
        tvm.tirx.analysis.verify_tirx_well_formed(func)


def buffer_names(func: tvm.tirx.PrimFunc) -> list[str]:
    names = [p.name for p in func.params if isinstance(p.ty, tvm.tirx.BufferType)]
    tvm_ffi.structural_walk(func.body, (SBlock, lambda b: names.extend(a.name for a in b.alloc_buffers)))
    return sorted(names)


def same_and_well_formed(program) -> None:
    """The same IR as the parsed text, its buffers named alike (each name once: the functions'
    buffers are passed by name), and well-formed."""
    whole = parsed_whole(program)
    tvm.ir.assert_structural_equal(program.func, whole)
    assert buffer_names(program.func) == buffer_names(whole)
    assert len(set(buffer_names(whole))) == len(buffer_names(whole))
    well_formed(program.func)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_spliced_forward_equals_the_parsed_text(name):
    cell = BUILTIN[name](8, 16)
    for program in (halstm.lower(cell, 3, 2, "float32"), halstm.lower(cell, None, 2, "float16"),
                    halstm.lower(cell, 3, 2, "float32", keep_results=True)):
        assert program.shell is not None
        same_and_well_formed(program)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_spliced_backward_equals_the_parsed_text(name):
    cell = BUILTIN[name](8, 16)
    # for any T, and given the forward's hoisted (and step) GEMM results: SRU's prologue computes nothing
    settings = [(3, {})] + ([(None, {}), (None, {"given_hoisted": True}), (3, {"given_hoisted": True,
                                                                              "given_results": True})]
                            if name in ("LSTM", "LayerNormGRU", "SRU") else [])
    for T, options in settings:
        for program in lower_backward(cell, T, 2, "float32", **options).functions.values():
            same_and_well_formed(program)


def test_a_part_that_differs_from_the_text_is_caught():
    """The comparison can fail: the step of a batch of 4 spliced into the shell of a batch of 2."""
    cell = BUILTIN["LSTM"](8, 16)
    program, other = halstm.lower(cell, 3, 2, "float32"), halstm.lower(cell, 3, 4, "float32")
    assert not tvm_ffi.structural_equal(splice(parsed(program.shell), {**program.parts, "step": other.parts["step"]}),
                                        parsed_whole(program))


def test_a_part_that_reads_a_buffer_the_shell_lacks_is_refused():
    program = halstm.lower(BUILTIN["LSTM"](8, 16), 3, 2, "float32")
    peephole = halstm.lower(BUILTIN["PeepholeLSTM"](8, 16), 3, 2, "float32")  # its step reads its peepholes
    with pytest.raises(ValueError, match="which the shell does not name"):
        splice(parsed(program.shell), {**program.parts, "step": peephole.parts["step"]})


def test_an_ill_formed_function_is_caught():
    """The well-formedness check can fail: a variable used where nothing defines it."""
    func = halstm.lower(BUILTIN["LSTM"](8, 16), 3, 2, "float32").func
    stray = tvm.tirx.Evaluate(tvm.tirx.Var("stray", "int32"))
    with pytest.raises(Exception, match="stray"):
        well_formed(func.with_body(tvm.tirx.SeqStmt([stray, func.body])))


def test_an_attribute_error_inside_a_programs_property_is_said_as_what_it_is():
    """Not taken for a missing attribute (``Problem.__getattr__``, which names a lowered program's)."""
    program = halstm.lower(BUILTIN["LSTM"](7, 13), 2, 3, "float32")  # a program no other test builds
    program.parts = {**program.parts, "step": object()}
    with pytest.raises(RuntimeError, match="Program.func: AttributeError"):
        program.func
