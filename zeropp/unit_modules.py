"""Which modules are units of sharding, and which parameters each unit holds.

[Note: units]
A unit is a module whose parameters live in one flat buffer, gathered before its forward and
released after it (``zeropp.unit``). By default every child of an ``nn.ModuleList`` (each
transformer block) is a unit, and the model itself is the *root* unit: it holds whatever no
other unit holds (embeddings, the final norm, a tied head).

A block larger than ``max_unit_numel`` parameters is split below itself: each child holding
at least ``min_child_numel`` parameters becomes a unit (split again while it is still above
the cap), and the block keeps a unit of its own for its direct parameters and its small
children (layer norms). One module's own parameters are never split, so a single
``nn.Linear`` above the cap is one unit.

The cap is a memory rule, not the prefetch window (``unit_cap``): a quarter of the
live-parameter budget (``stage3_max_live_parameters``). At backward's peak a rank holds four
unit-sized buffers: the weights of the unit in use, the next unit's weights prefetched, the
unit's gradients as autograd fills them, and the previous unit's gradients until their
reduction completes. Units sized so keep those four within the budget the user set for
parameters; whole blocks stay whole wherever they fit it (DeepSpeed's default 1e9: blocks of
up to 250M parameters, a 6.7B GPT's or Llama 3 8B's), and the 18B's 453M-parameter blocks
split into attention and the MLP's two Linears. How far ahead to gather is the prefetch
window's business (``stage3_prefetch_bucket_size``, ``zeropp.prefetch``), and it does not
make units smaller: a smaller unit only means more collectives for the same bytes. A budget
of 0 (release every unit as soon as it is used) leaves blocks whole.

Units may nest (a block's unit around its children's units, the root around everything).
A unit's parameters are those reachable from its module without passing through another
unit's module, each parameter in the first unit (in list order) that reaches it. The list
is in forward order: a parent before its children, since its forward pre-hook fires first.
The engine and the planner both call ``unit_parameters``, so they group alike.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

# Unit-sized buffers a rank holds at backward's peak ([Note: units]).
UNIT_BUFFERS_AT_PEAK = 4


def unit_cap(max_live_numel: int) -> int | None:
    """The largest unit for a live-parameter budget of ``max_live_numel`` ([Note: units]);
    None (whole blocks) for 0, which asks to release every unit as soon as it is used, not
    for units of one parameter."""
    if max_live_numel <= 0:
        return None
    return max(1, max_live_numel // UNIT_BUFFERS_AT_PEAK)


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _split(module: nn.Module, max_unit_numel: int, min_child_numel: int) -> list[nn.Module]:
    """``module`` as units: itself, or (above the cap) its own unit plus its children's."""
    if _parameter_count(module) <= max_unit_numel:
        return [module]
    children = [c for c in module.children() if _parameter_count(c) >= max(1, min_child_numel)]
    if not children:  # nothing below to split into: one module's parameters stay whole
        return [module]
    # The block's own unit holds its direct parameters and its small children, if any.
    remainder = _parameter_count(module) - sum(_parameter_count(c) for c in children)
    units = [module] if remainder > 0 else []
    for child in children:
        units.extend(_split(child, max_unit_numel, min_child_numel))
    return units


def default_unit_modules(model: nn.Module, max_unit_numel: int | None = None,
                         min_child_numel: int = 0) -> list[nn.Module]:
    """The children of every ``nn.ModuleList`` (the transformer blocks), each split below
    itself when it holds more than ``max_unit_numel`` parameters (None: never split).

    ``min_child_numel``: children smaller than this stay in their parent's unit instead of
    becoming units of their own (the persistence threshold: they would stay gathered anyway).
    """
    units: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                if max_unit_numel is None:
                    units.append(block)
                else:
                    units.extend(_split(block, max_unit_numel, min_child_numel))
    return units


def _reachable(module: nn.Module, stop: set[int]) -> Iterator[nn.Parameter]:
    """Parameters of ``module`` and its descendants in ``module.parameters()``'s order (so
    an unsplit unit's layout is what it always was), not entering modules in ``stop``."""
    seen: set[int] = set()

    def visit(current: nn.Module) -> Iterator[nn.Parameter]:
        for param in current._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield param
        for child in current._modules.values():
            if child is not None and id(child) not in stop:
                yield from visit(child)

    yield from visit(module)


def unit_parameters(model: nn.Module, unit_modules: list[nn.Module]
                    ) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, parameters) of every unit, the root (``model``) first, then ``unit_modules``
    in their order; see [Note: units]. A unit may be left without parameters."""
    unit_ids = {id(m) for m in unit_modules}
    if id(model) in unit_ids:
        raise ValueError("the model itself is the root unit; do not list it in unit_modules")
    assigned: set[int] = set()
    plan = []
    for module in unit_modules:
        params = []
        for param in _reachable(module, unit_ids - {id(module)}):
            if id(param) not in assigned:
                assigned.add(id(param))
                params.append(param)
        plan.append((module, params))
    root = []
    for param in model.parameters():  # registration order, as before units nested
        if id(param) not in assigned:
            assigned.add(id(param))
            root.append(param)
    return [(model, root), *plan]


def own_parameters(module: nn.Module, unit_modules: list[nn.Module]) -> list[nn.Parameter]:
    """Parameters ``module`` reaches without entering another of ``unit_modules``: what its
    unit must hold alone (a parameter it shares with another unit is an error)."""
    stop = {id(m) for m in unit_modules} - {id(module)}
    return list(_reachable(module, stop))


def check_no_sharing(plan: list[tuple[str, nn.Module, list[nn.Parameter]]],
                     unit_modules: list[nn.Module]) -> None:
    """A parameter registered in two units would be gathered by one and used by the other:
    refuse a plan of (unit name, module, parameters), the root named "<root>", where a unit
    other than the root does not hold alone every parameter its module reaches."""
    home: dict[int, str] = {}
    for name, _module, params in plan:
        for p in params:
            home[id(p)] = name
    for name, module, _ in plan:
        if name == "<root>":
            continue
        for p in own_parameters(module, unit_modules):
            if home.get(id(p)) != name:
                raise ValueError(
                    f"a parameter of unit {name!r} is shared with unit {home.get(id(p))!r}; "
                    "tie parameters only at the root module"
                )
