"""Schedule recipes: how a lowered program runs on a target.

A recipe is a small class in the style of TVM's dlight rules: ``is_applicable(program, target)`` and
``apply(program, target, **knobs)``, which returns an ``s_tir.Schedule`` (its ``trace`` prints every
rewrite made) or None. ``knobs`` names each tunable and its candidate values; the first is the default.
``runs(program, target, knobs)`` says whether a setting can run at all (``halstm.compile`` refuses the
others), ``valid`` whether the tuner should measure it. Users write their own by subclassing ``Recipe``
and ``register`` them, which lets ``halstm.compile`` take them by name and read their tuning records;
``recipes_for`` lists the built-in ones.
"""

from __future__ import annotations

from .recipe import Recipe
from .cpu import CpuStepLoop
from .cuda import CudaStepLoop
from .cuda_persistent import CudaPersistent
from .scan import CpuScan, CudaScan

# preferred first where several apply: a scan where the step is diagonal
BUILTIN = (CpuScan(), CudaScan(), CpuStepLoop(), CudaPersistent(), CudaStepLoop())
_REGISTERED: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Make ``recipe`` known by its ``name``: ``halstm.compile(..., recipe=name)`` finds it, and
    compile without a recipe considers its tuning records. Registering the same class again (a module
    reloaded, a notebook cell run again) replaces the earlier one. Returns ``recipe``."""
    check_name(recipe)
    if recipe.name == Recipe.name:
        raise ValueError(f"{type(recipe).__name__} has the base class's name '{Recipe.name}': give it a name of its own")
    if recipe.name not in {r.name for r in BUILTIN}:
        _REGISTERED[recipe.name] = recipe
    return recipe


def known() -> dict[str, Recipe]:
    """Every recipe by name: the built-in ones and the registered ones."""
    return {**{r.name: r for r in BUILTIN}, **_REGISTERED}


def named(name: str) -> Recipe:
    """The built-in or registered recipe called ``name``."""
    recipes = known()
    if name not in recipes:
        raise ValueError(f"unknown recipe {name!r}: the built-in ones are {sorted(r.name for r in BUILTIN)}, the "
                         f"registered ones {sorted(_REGISTERED)} (halstm.schedules.register makes one's own known)")
    return recipes[name]


def check_name(recipe: Recipe) -> None:
    """Refuse ``recipe`` where another class's recipe, built-in or registered, has its name: tuning
    records, export sidecars and ``repr`` name a recipe by it, and would stand for both."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"expected a halstm.schedules.Recipe (an instance: MyRecipe()), got {recipe!r}")
    other = known().get(recipe.name)
    if other is not None and _class_id(other) != _class_id(recipe):
        raise ValueError(f"recipe name '{recipe.name}' of {_class_id(recipe)} is taken by {_class_id(other)}: "
                         f"give it a name of its own")


def _class_id(recipe: Recipe) -> str:
    """The recipe's class by module and qualified name, which a class defined again keeps."""
    return f"{type(recipe).__module__}.{type(recipe).__qualname__}"


def recipes_for(program, target) -> list[Recipe]:
    """The built-in recipes that apply to ``program`` on ``target``, preferred first: the persistent
    kernel goes last where ``CudaPersistent.preferred`` says so (it still applies; the tuner and the
    benchmark measure it)."""
    found = [r for r in BUILTIN if r.is_applicable(program, target)]
    found.sort(key=lambda r: isinstance(r, CudaPersistent) and not r.preferred(program, target))
    return found


__all__ = ["Recipe", "CpuStepLoop", "CudaStepLoop", "CudaPersistent", "CpuScan", "CudaScan", "recipes_for", "BUILTIN", "register",
           "known", "named", "check_name"]
