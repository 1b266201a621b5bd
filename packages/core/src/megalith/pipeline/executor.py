"""Run one rank's actions of any valid `Schedule`.

    F(s, i)   x = microbatch i (s = 0) or the activation received / handed over from stage s−1;
              y = stage_s(x); on the last stage ℓ_i = criterion(y, mb_i) / m is kept as the
              backward target and Σ_i ℓ_i is the step's loss
    B(s, i)   g_y = received from stage s+1 (or 1·loss_scale on the last stage). Without a W for
              (s, i): autograd.backward(y, g_y) — weight gradients accumulate in .grad, the input
              gradient g_x lands in x.grad. With a W (zero-bubble split): g_x = autograd.grad(y, x,
              g_y, retain_graph=True) only, and the graph is kept for W
    W(s, i)   autograd.backward(y, g_y, inputs=stage parameters): the weight gradients
    SEND/RECV consecutive communication actions are posted as one `batch_isend_irecv`

Adjacent stages on one rank (interleaved / V schedules) hand activations and gradients over in
memory. Gradients of microbatches accumulate in `.grad`; reducing them over dp is the caller's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megalith.common.errors import DistributedError
from megalith.pipeline.p2p import PipeP2P, Recv, Send
from megalith.pipeline.schedule import Action, Op, Schedule
from megalith.pipeline.stage import Microbatch, Stage

Criterion = Callable[[torch.Tensor, Microbatch], torch.Tensor]
_COMM = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})


@dataclass
class _Slot:
    """What backward needs of one (stage, microbatch): the input leaf, the output (or scaled
    loss) and, between a split B and its W, the output gradient."""

    x: torch.Tensor | None
    y: torch.Tensor
    grad: torch.Tensor | None = None


class PipelineExecutor:
    """Executes `schedule.actions[rank]` over the stages this rank holds."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, Stage], comm: PipeP2P | None) -> None:
        self.schedule, self.rank, self.stages, self.comm = schedule, rank, stages, comm
        self.last = schedule.num_stages - 1
        self.split = {(a.stage, a.microbatch) for a in schedule.actions[rank] if a.op is Op.W}

    def run(
        self, microbatches: Sequence[Microbatch], criterion: Criterion, loss_scale: float = 1.0
    ) -> torch.Tensor | None:
        """One step: every action of this rank. Returns Σ_i ℓ_i (detached) on the rank holding the
        last stage, None elsewhere."""
        self._mbs, self._criterion, self._scale = microbatches, criterion, loss_scale
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F"|"B", stage, mb) → tensor
        self._outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._loss: torch.Tensor | None = None
        actions = self.schedule.actions[self.rank]
        i = 0
        while i < len(actions):
            if actions[i].op in _COMM:
                j = i
                while j < len(actions) and actions[j].op in _COMM:
                    j += 1
                self._communicate(actions[i:j])
                i = j
                continue
            self._compute(actions[i])
            i += 1
        if self.comm is not None:
            self.comm.finish()
        if self._slots:
            raise DistributedError(f"schedule left {len(self._slots)} microbatch(es) without backward")
        return self._loss

    # -- compute ----------------------------------------------------------------------------------
    def _compute(self, a: Action) -> None:
        if a.op is Op.F:
            self._forward(a.stage, a.microbatch)
        elif a.op is Op.B:
            self._backward(a.stage, a.microbatch)
        else:
            self._weight_grad(a.stage, a.microbatch)

    def _forward(self, s: int, i: int) -> None:
        x = None
        if s > 0:
            x = self._inbox.pop(("F", s, i)).detach().requires_grad_(True)
        y = self.stages[s].forward(x, self._mbs[i])
        if s == self.last:
            loss = self._criterion(y, self._mbs[i]) / len(self._mbs)
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
            y = loss * self._scale if self._scale != 1.0 else loss
        elif self.schedule.stage_rank(s + 1) == self.rank:
            self._inbox[("F", s + 1, i)] = y.detach()
        else:
            self._outbox[("F", s, i)] = y.detach()
        self._slots[(s, i)] = _Slot(x, y)

    def _backward(self, s: int, i: int) -> None:
        slot = self._slots[(s, i)]
        grad = None if s == self.last else self._inbox.pop(("B", s, i))
        gx: torch.Tensor | None = None
        if (s, i) in self.split:
            slot.grad = grad
            if slot.x is not None:
                (gx,) = torch.autograd.grad(slot.y, slot.x, grad, retain_graph=True)
        else:
            torch.autograd.backward(slot.y, grad)
            gx = slot.x.grad if slot.x is not None else None
            del self._slots[(s, i)]
        if s > 0:
            if gx is None:
                raise DistributedError(f"stage {s} produced no gradient for its input (microbatch {i})")
            key = ("B", s - 1, i) if self.schedule.stage_rank(s - 1) == self.rank else None
            if key is not None:
                self._inbox[key] = gx
            else:
                self._outbox[("B", s, i)] = gx

    def _weight_grad(self, s: int, i: int) -> None:
        slot = self._slots.pop((s, i))
        params = self.stages[s].parameters()
        if params:
            torch.autograd.backward(slot.y, slot.grad, inputs=params)

    # -- communication ----------------------------------------------------------------------------
    def _communicate(self, actions: Sequence[Action]) -> None:
        if self.comm is None:
            raise DistributedError("the schedule sends between ranks but there is no pipeline group")
        sends, recvs, keys = [], [], []
        for a in actions:
            if a.op is Op.SEND_F:
                sends.append(Send(self._outbox.pop(("F", a.stage, a.microbatch)), _peer(a), ("F", a.stage)))
            elif a.op is Op.SEND_B:
                sends.append(Send(self._outbox.pop(("B", a.stage, a.microbatch)), _peer(a), ("B", a.stage)))
            elif a.op is Op.RECV_F:
                recvs.append(Recv(_peer(a), ("F", a.stage - 1)))
                keys.append(("F", a.stage, a.microbatch))
            else:
                recvs.append(Recv(_peer(a), ("B", a.stage + 1)))
                keys.append(("B", a.stage, a.microbatch))
        for key, tensor in zip(keys, self.comm.exchange(sends, recvs), strict=True):
            self._inbox[key] = tensor


def _peer(a: Action) -> int:
    if a.peer is None:
        raise DistributedError(f"{a} has no peer rank")
    return a.peer
