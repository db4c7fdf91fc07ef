"""The hooks that move units through one iteration: gathers, prefetches and releases.

The module and autograd hooks follow [Note: protocol of one iteration] in
zeropp/sharded_model.py: a unit is gathered before its forward and its backward, released after
them, and the next units' gathers are issued ahead in the order the last iteration recorded
([Note: prefetch order]). The gradient path (reductions in flight, the flush at the end of
backward) stays with the sharded model, which these hooks tell when a unit's gradients are
about to arrive (``make_room``) and when they have all arrived (``backward_done``).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from zeropp.prefetch import blocks_kept_for_backward, distinct_ahead, units_to_prefetch
from zeropp.unit import ShardedUnit, UnitComm

if TYPE_CHECKING:
    from zeropp.sharded_model import ShardingOptions


class TrainingPhase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradient is complete."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def release_all(units: list[ShardedUnit]) -> None:
    """Free every unit's gathered weights and secondary shard (a prefetch nobody consumed is
    finished first)."""
    for unit in units:
        if unit.gathering:
            unit.wait_gather()
        unit.release(keep_secondary=False)
        unit.drop_secondary()


def _grad_ready(unit: weakref.ref, param) -> None:
    """A parameter's gradient is accumulated (autograd keeps it until the unit's reduction
    copies it, [Note: gradient buffer]): it must not come after that (see ``UnitHooks``)."""
    owner = unit()
    if owner is not None and owner.backward_done:
        raise RuntimeError(
            f"a gradient for a parameter of unit {owner.name!r} arrived after that module's "
            "backward had finished (is the parameter used outside its module's forward?)")


# [Note: a unit used several times]
# A module may run several times in one training forward (weights shared inside the model:
# DeepSpeed's SimpleModel calls ``linears[i // 2]``). Each use gathers the unit if it is not
# gathered (at stage 3 the previous use's post-forward released it) and gets its own nodes:
# a hook on its output (pre-backward) and an identity node on its inputs (post-backward).
# Backward meets the uses in reverse; autograd adds every use's share into the parameters'
# gradients, so the unit's post-backward work (release the weights, drop hpZ's secondary,
# start the reduction) runs once, after the last outstanding use's backward: the forward
# counts the uses (``_uses_left``) and each use's post-backward node takes one off. A use
# with no such node (its inputs need no gradient, or its output does not reach the loss)
# leaves the count above zero, and the unit is reduced and released when backward ends, as
# a unit with no post-backward point always is. The count is kept from forward to the end
# of backward, so two forwards before one backward count every use too.
# Memory: from its first backward gather (the last use's backward) to its last use's
# backward, such a unit stays gathered, where DeepSpeed releases it after each use's
# backward and gathers it again for the next one. Here the weights of all uses' saved
# tensors are views of the one gathered buffer ([Note: parameter storage] in zeropp/unit.py)
# and the unit's single reduction waits for the last use anyway; holding the buffer costs
# the unit's gathered size for that span and saves one gather per further use, with no
# state to keep between releases. The gradient memory is the same either way (one flat
# buffer per unit).


class UnitHooks:
    """Hooks on every unit's module (the root first in ``units``) and on its parameters, and
    the iteration's state they keep: the phase, the recorded orders, the units recomputed.

    ``make_room(numel)``: a unit's gradient buffer of ``numel`` elements opens now.
    ``backward_done(unit)``: the unit's backward is over and its weights are freed; its
    gradients are all in.
    """

    def __init__(self, units: list[ShardedUnit], options: ShardingOptions, comm: UnitComm,
                 make_room: Callable[[int], None],
                 backward_done: Callable[[ShardedUnit], None]) -> None:
        self.units = units
        self.root = units[0]
        self.options = options
        self.comm = comm
        self._make_room = make_room
        self._backward_done = backward_done
        self.phase = TrainingPhase.IDLE
        # Units whose backward has begun (their pre-backward hook fired) in this backward, and
        # units recomputed whose backward has not ([Note: release in recompute]).
        self._backward_started: set[ShardedUnit] = set()
        # Ordered (a dict of None) for O(1) removal when a unit's backward begins.
        self._recomputed: dict[ShardedUnit, None] = {}
        # True while a forward that will be backpropagated runs (grad mode on at the root):
        # blocks inside it that run under no_grad are checkpointed and will be recomputed.
        self._training_forward = False
        # [Note: prefetch order] Units in the order the forward needed them, and the order
        # the backward did (each recompute's units in forward order, then each unit's own
        # backward: a block's own unit before its children's, [Note: units]). The last
        # iteration's are the plan each prefetch reads ahead in, as DeepSpeed replays its
        # trace of submodules; ``_backward_cursor`` is where this backward is in it.
        self._forward_order: list[ShardedUnit] = []
        self._last_forward_order: list[ShardedUnit] = []
        self._forward_position: dict[ShardedUnit, int] = {}  # unit -> first index in the above
        # [Note: a unit used several times] Each unit's uses in the training forwards since
        # the last backward whose backward has not finished yet.
        self._uses_left: dict[ShardedUnit, int] = {}
        self._backward_needs: list[ShardedUnit] = []
        self._last_backward_needs: list[ShardedUnit] = []
        self._backward_cursor = -1
        self._kept_for_backward: set[ShardedUnit] = set()  # from the last forward's order
        # Gathered whenever they are used: never in a prefetch window.
        self._never_prefetched = {u for u in units if u is self.root or u.persistent}
        # Each prefetch window's units (``distinct_ahead``) by plan position, per plan
        # (forward, backward): kept while the plan an iteration leaves equals the last one.
        self._windows: dict[bool, dict[int, list[ShardedUnit]]] = {True: {}, False: {}}
        self._handles = []
        for unit in units:
            self._handles += [
                unit.module.register_forward_pre_hook(partial(self._pre_forward, unit),
                                                      with_kwargs=True),
                unit.module.register_forward_hook(partial(self._post_forward, unit)),
            ]
        # A parameter's post-accumulate-grad hooks are held from C++ (its autograd metadata),
        # where Python's collector cannot see them: a hook holding the model (or a unit, which
        # holds the process groups) would keep an engine that was never closed alive for
        # good, with its gloo groups' threads. The hooks hold their unit weakly.
        for unit in units:
            watched = weakref.ref(unit)
            for param in unit.params:
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(
                        partial(_grad_ready, watched)))

    def remove(self) -> None:
        """Take every hook off the modules and parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def begin_backward(self) -> None:
        self.phase = TrainingPhase.BACKWARD
        self._backward_needs, self._backward_cursor = [], -1

    def end_backward(self) -> None:
        self.phase = TrainingPhase.IDLE
        for unit in self.units:
            unit.backward_done = False
        self._backward_started.clear()
        self._recomputed.clear()
        self._uses_left.clear()  # uses whose backward never came: reduced at the end
        if self._backward_needs and self._backward_needs != self._last_backward_needs:
            self._windows[False].clear()
        self._last_backward_needs = self._backward_needs or self._last_backward_needs
        self._backward_needs = []  # the plan is not appended to by a backward outside these

    # ---- forward -------------------------------------------------------------------------
    def _pre_forward(self, unit: ShardedUnit, module, args, kwargs):
        if self.phase is TrainingPhase.BACKWARD:  # activation-checkpoint recompute
            self._release_recomputed()
            unit.start_gather("backward_all_gather")
            self._prefetch_backward(unit)
            unit.wait_gather()
            return self._watch_backward(unit, args, kwargs)
        if unit is self.root:
            self.phase = TrainingPhase.FORWARD
            self._training_forward = torch.is_grad_enabled()
            if self._forward_order:
                if self._forward_order != self._last_forward_order:
                    self._windows[True].clear()
                self._last_forward_order = self._forward_order
                self._forward_position = {u: i for i, u in
                                          reversed(list(enumerate(self._forward_order)))}
            self._forward_order = []
            self._kept_for_backward = self._blocks_to_keep(self._last_forward_order)
        elif self._training_forward:
            # Every use counts, also one under no_grad (a reentrant checkpoint: its recompute
            # makes the node) or one whose inputs need no gradient (no node: the unit is then
            # reduced when backward ends).
            self._uses_left[unit] = self._uses_left.get(unit, 0) + 1
        # Prefetch before waiting: the gathers queue behind this one at once (on the host
        # worker the next unit's transfer starts the moment this one's ends, not after the
        # compute thread has seen it end). A unit used again (released after its last use
        # at stage 3) is gathered again like any other.
        unit.start_gather("forward_all_gather")
        self._forward_order.append(unit)
        self._prefetch_forward(unit, len(self._forward_order) - 1)
        unit.wait_gather()
        return self._watch_backward(unit, args, kwargs)

    def _watch_backward(self, unit: ShardedUnit, args, kwargs):
        """Route the unit's inputs through a node whose backward marks the unit's backward done.

        Under ``no_grad`` (evaluation, the first pass of reentrant checkpointing) nothing is
        recorded; the recompute of a reentrant checkpoint records it instead.
        """
        if unit is self.root or not torch.is_grad_enabled():
            return None
        if not kwargs:  # the common call, tensors (or None) only: no pytree walk
            positions = []
            for i, arg in enumerate(args):
                if type(arg) is torch.Tensor:  # noqa: E721 (a subclass takes the walk)
                    if arg.requires_grad:
                        positions.append(i)
                elif arg is not None:
                    break
            else:
                if not positions:
                    return None
                outputs = _PostBackward.apply(partial(self._post_backward, unit),
                                              *[args[i] for i in positions])
                args = list(args)
                for i, tensor in zip(positions, outputs, strict=True):
                    args[i] = tensor
                return tuple(args), kwargs
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(leaves)
                     if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None
        outputs = _PostBackward.apply(partial(self._post_backward, unit),
                                      *(leaves[i] for i in positions))
        for i, tensor in zip(positions, outputs, strict=True):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def _post_forward(self, unit: ShardedUnit, module, args, output):
        if type(output) is torch.Tensor:  # noqa: E721 (the common case: no pytree walk)
            needs_backward = output.requires_grad
        else:
            needs_backward = any(isinstance(t, torch.Tensor) and t.requires_grad
                                 for t in tree_leaves(output))
        if self.phase is TrainingPhase.BACKWARD:
            if unit not in self._backward_started and not unit.persistent:
                self._recomputed[unit] = None
                self._watch_pre_backward(unit, output)  # reentrant: the first forward had none
            return output
        if unit is self.root:
            self.phase = TrainingPhase.IDLE
            if not needs_backward:
                release_all(self.units)
            return output
        if needs_backward:
            self._watch_pre_backward(unit, output)
        # A block run under no_grad inside a training forward is checkpointed: its backward
        # recomputes it, so with hpZ it needs its secondary shard like any other block.
        recomputed = self._training_forward and not torch.is_grad_enabled()
        if (needs_backward or recomputed) and unit in self._kept_for_backward:
            return output  # reused soon: its backward finds it gathered
        unit.release(keep_secondary=needs_backward or recomputed)
        return output

    def _blocks_to_keep(self, order: list[ShardedUnit]) -> set[ShardedUnit]:
        blocks = [u for u in order if u is not self.root]
        kept = blocks_kept_for_backward([u.layout.padded_numel for u in blocks],
                                        self.root.layout.padded_numel,
                                        self.options.max_reuse_distance)
        return {blocks[index] for index in kept}

    # ---- backward ------------------------------------------------------------------------
    def _watch_pre_backward(self, unit: ShardedUnit, output) -> None:
        if type(output) is torch.Tensor:  # noqa: E721
            output.register_hook(partial(self._pre_backward, unit))
            return
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(partial(self._pre_backward, unit))

    def _release_recomputed(self) -> None:
        """[Note: release in recompute] A checkpointed chunk recomputes all of its units before
        backward reaches any of them; a block split into units (or a chunk of several blocks)
        would then be gathered whole. Units recomputed whose backward has not begun are
        released when the next unit's recompute starts, oldest first (their backward comes
        last), while the gathered elements exceed ``stage3_max_live_parameters``; their
        backward gathers them again, from the hpZ secondary shard (kept here) where there
        is one. The last unit of a chunk is never released in between: its backward follows.
        """
        while self._recomputed:
            if self.comm.live.numel <= self.options.max_live_numel:
                return
            unit = next(iter(self._recomputed))
            del self._recomputed[unit]
            if unit not in self._backward_started:
                unit.release(keep_secondary=True)

    def _pre_backward(self, unit: ShardedUnit, grad):
        # A second output of the unit, or an earlier use of it ([Note: a unit used several
        # times]): gathered already, and held until its last use's backward is over.
        if unit in self._backward_started:
            return grad
        self._backward_started.add(unit)
        self._recomputed.pop(unit, None)
        unit.gather_now("backward_all_gather")
        if unit.num_grad_params and unit.gradient_buffer is None:
            self._make_room(unit.layout.padded_numel)  # its gradients arrive from now on
        self._prefetch_backward(unit)
        return grad

    def _post_backward(self, unit: ShardedUnit) -> None:
        """One use's backward is over (its inputs' gradient exists); after the unit's last
        use's ([Note: a unit used several times]), free the weights, then hand the unit to
        the gradient path.

        Autograd accumulates a parameter's gradient as soon as the node that computes it has
        run, before any other ready node, so every gradient of the unit is in by now. This
        point sits at the same place in the graph on every rank, which keeps the reductions
        in step with the gathers whatever parameters a rank left unused.
        """
        # A node no use counted (a unit run outside the model's forward) ends its backward.
        left = self._uses_left.pop(unit, 1) - 1
        if left > 0:
            self._uses_left[unit] = left
            return
        if unit.backward_done:
            return
        unit.backward_done = True
        unit.release(keep_secondary=False)
        unit.drop_secondary()
        self._backward_done(unit)

    # ---- prefetch ------------------------------------------------------------------------
    def _prefetch_backward(self, unit: ShardedUnit) -> None:
        """``unit`` is needed now in backward (its recompute or its own backward): note it and
        prefetch what the last backward needed next ([Note: prefetch order])."""
        self._backward_needs.append(unit)
        plan = self._last_backward_needs
        try:
            self._backward_cursor = plan.index(unit, self._backward_cursor + 1)
        except ValueError:  # a backward unlike the last one: no plan to read ahead in
            return
        self._prefetch(forward=False, plan=plan, start=self._backward_cursor + 1)

    def _prefetch_forward(self, unit: ShardedUnit, index: int) -> None:
        """``unit`` runs as the ``index``-th use of this forward: prefetch what followed that
        use in the last forward, or, in a forward unlike it, what followed its first use."""
        plan = self._last_forward_order
        if index < len(plan) and plan[index] is unit:
            start = index + 1
        else:
            position = self._forward_position.get(unit)
            if position is None:
                return
            start = position + 1
        self._prefetch(forward=True, plan=plan, start=start)

    def _prefetch(self, forward: bool, plan: list[ShardedUnit], start: int) -> None:
        """Start the gathers of the units of ``plan`` from ``start`` on that the
        prefetch rule allows. The work is the window's, not the model's ([Note: live
        count])."""
        phase = "forward_all_gather" if forward else "backward_all_gather"
        # Units gathered already (kept from forward, recomputed) fill the window ahead like
        # gathers in flight: prefetching past them would only hold more memory sooner.
        windows = self._windows[forward]
        window = windows.get(start)
        if window is None:
            window = windows[start] = distinct_ahead(plan, start, self._never_prefetched,
                                                     self.options.prefetch_bucket_numel)
        for index in units_to_prefetch(window, self.comm.live.numel,
                                       self.options.prefetch_bucket_numel,
                                       self.options.max_live_numel):
            window[index].start_gather(phase)
