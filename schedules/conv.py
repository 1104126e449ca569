"""What the convolution recipes (``conv_cpu``, ``conv_cuda``) share: the blocks a recipe schedules by
the tag of the computation that made them (``halstm.models.conv``), and the rewrites made first on
every target."""

from __future__ import annotations

from tvm.s_tir import Schedule

from .recipe import Recipe, inline_elementwise, is_reduction


class ConvRecipe(Recipe):
    """A recipe for an ``OpProgram``: each block by its tag (GEMM, taps, rows, head), after
    ``prepare``."""

    kind = ""  # the target kind
    biased = ()  # the tags of the sums that may start from a bias (see ``prepare``)

    def is_applicable(self, program, target) -> bool:
        return target.kind == self.kind and hasattr(program, "tags")

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        sch = Schedule(program.mod)
        prepare(sch, program, self.biased)
        for name in [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]:
            self.schedule_block(sch, sch.get_sblock(name), program.tags.get(name), target, k)
        return sch

    def schedule_block(self, sch: Schedule, block, tag: str | None, target, knobs: dict) -> None:
        raise NotImplementedError


def prepare(sch: Schedule, program, biased=()) -> None:
    """Elementwise blocks inlined into their readers (except those that write an argument of the
    function, and those with arithmetic that feed a reduction, which are computed once), then every
    ``out = sum + b`` after a sum tagged as in ``biased`` made the sum's initial value (a bias; dx's
    taps start from dx through the Linear): one block, its tile stored once. The sum must be the
    last of the block's producers, so that its initial value is ready."""
    root = sch.get_sblock("root")
    inline_elementwise(sch, root, keep=_writing_arguments(sch, root))
    for block in sch.get_child_blocks(root):
        producers = sch.get_producers(block)
        if is_reduction(sch, block) or type(sch.get(block).body.value).__name__ != "Add" or not producers:
            continue
        order = [sch.get(b).name_hint for b in sch.get_child_blocks(root)]
        last = sch.get(max(producers, key=lambda p: order.index(sch.get(p).name_hint))).name_hint
        if program.tags.get(last) in biased and last not in _writing_arguments(sch, root):
            sch.fuse_reduction_epilogue(last, block)


def _writing_arguments(sch: Schedule, scope) -> set[str]:
    return {sch.get(b).name_hint for b in sch.get_output_blocks(scope)}
