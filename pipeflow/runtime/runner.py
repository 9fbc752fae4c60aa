"""One stage's instruction list for one batch: a small handler per instruction.

The runner is an interpreter: `run` walks the program and dispatches each instruction to its
handler (`OP -> method`), all per-step state lives in one `StepState`, and one routing helper
says where a message goes (peer, the receiving chunk, tag). Messages carry any structure of
tensors; the structure and shapes (`tree.Header`) travel only when they change, and every
message is checked against them on arrival: over MPI the receiver probes and learns a new
header from the message; where it cannot probe (torch.distributed, strict), each link's
header is agreed once per batch shape (`LinkShapes`), so the steady state sends no control
message. Receives whose sizes are known are posted one compute instruction ahead, so a
transfer overlaps the compute before it: on an agreed link, and over MPI for the link's last
header (a sender that announces new shapes sends them on another tag, and the posted receive
is withdrawn); gradients always (their sizes are those of the activation this rank sent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Protocol

import torch
from torch import nn

from pipeflow import schedules as sched
from pipeflow import tree
from pipeflow.aux_loss import collect_aux_losses
from pipeflow.comm.base import Communicator, ProtocolError
from pipeflow.comm.strict import no_device_sync
from pipeflow.comm.topology import Topology
from pipeflow.runtime.batch import StepBatches
from pipeflow.runtime.data_parallel import GradReducer
from pipeflow.runtime.precision import Precision
from pipeflow.runtime.recompute import SavedTensorMeter, auto_policy, stage_forward
from pipeflow.runtime.stage import StepSettings
from pipeflow.schedules.links import posting_order
from pipeflow.schedules.plan import Plan
from pipeflow.schedules.split_backward import backward_input, backward_weight
from pipeflow.tree import Header

__all__ = ["Runner", "StepState", "LinkShapes"]

Key = tuple[int, int]          # (micro-batch, chunk)


@dataclasses.dataclass
class StepState:
    """Everything one batch's run holds between its instructions."""

    train: bool
    batches: StepBatches
    loss_multiplier: float            # on each micro-batch loss: 1/(m·d) or 1/items, x scale
    aux_multiplier: float = 0.0       # on each micro-batch's auxiliary losses: 1/(m·d) x scale
    keep_outputs: bool = False
    received: dict[Key, tuple[Any, list[torch.Tensor]]] = dataclasses.field(default_factory=dict)
    stash: dict[Key, tuple[list[torch.Tensor], Any]] = dataclasses.field(default_factory=dict)
    to_send: dict[Key, Any] = dataclasses.field(default_factory=dict)
    sent: dict[Key, Header] = dataclasses.field(default_factory=dict)
    grads_in: dict[Key, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    grads_out: dict[Key, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    pending_w: dict[Key, Any] = dataclasses.field(default_factory=dict)   # B done, W not
    local: dict[int, tuple[Header, list[torch.Tensor]]] = dataclasses.field(
        default_factory=dict)        # messages from this rank to itself (ZBV's bottom), by tag
    sends: list[Any] = dataclasses.field(default_factory=list)
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # This rank's auxiliary losses (`pf.add_aux_loss`), one sum a micro-batch and chunk.
    aux: list[torch.Tensor] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    peak_stash: int = 0


class HostClock:
    """A traced step's times on the CPU: the host's own clock."""

    def start(self) -> None:
        pass

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, mark: Any) -> float:
        return mark


class CudaClock:
    """A traced step's times on a GPU: a CUDA event recorded on the compute stream at each
    instruction's start and end (device time, not the host's enqueue time), converted to
    seconds only when read, after the step. Never a device synchronize inside the step: one
    after a send waits for the peer's receive, and two stages each syncing after a send
    (1F1B's `SA1, RG0` against `SG0, RA1`) wait for each other once NCCL stops buffering."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._origin: Any = None
        self._host0 = 0.0

    def start(self) -> None:
        self._origin = self._event()
        self._host0 = time.perf_counter()

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self) -> Any:
        return self._event()

    def seconds(self, mark: Any) -> float:
        if isinstance(mark, float):
            return mark
        mark.synchronize()             # after the step: waits for this event alone
        return self._host0 + self._origin.elapsed_time(mark) / 1e3


def clock_for(device: torch.device) -> HostClock | CudaClock:
    return CudaClock(device) if device.type == "cuda" else HostClock()


class RunnerStage(Protocol):
    """What the runner reads of a rank's stage (`runtime.stage.Stage` is one)."""

    plan: Plan                          # programs, routes, layout (pure, alike on every rank)
    index: int                          # this rank's pipeline stage
    step_settings: StepSettings
    topo: Topology
    device: torch.device
    backend: str
    chunk_layers: list[list[nn.Module]]
    precision: Precision
    pipe_comm: Communicator
    reducer: GradReducer | None
    recompute: str                      # this stage's policy ("auto" resolved on first use)
    post_ahead: int                     # receives posted this many computes early (0, 1)

    def describe(self) -> str: ...


class Runner:
    """Interprets a stage's instructions. Headers per link persist across steps, so a
    message's structure is announced only when it changes."""

    def __init__(self, stage: RunnerStage, loss_fn: Callable[[Any, Any], torch.Tensor],
                 on_instruction: Callable[[sched.Action], None]) -> None:
        self.stage = stage
        self.loss_fn = loss_fn
        self.on_instruction = on_instruction   # the instruction running, for reports
        self.measure_activations = False
        self.activation_meter = SavedTensorMeter()
        self.trace = False
        self.clock = clock_for(stage.device)
        self._timeline: list[tuple[str, Any, Any]] = []
        self.pending_sends: list = []
        # Megatron-Core's deallocate_output_tensor: once an activation is sent, its storage
        # goes; the stash keeps only its graph (grad_fn) for the backward.
        self.free_sent_outputs = stage.step_settings.free_sent_outputs
        self._announced: dict[tuple[int, int], Header] = {}   # (peer, chunk) -> last sent
        self._heard: dict[tuple[int, int], Header] = {}       # (peer, chunk) -> last received
        # Receivers that cannot probe: headers agreed per batch shape, receives posted ahead.
        self._agreed = LinkShapes() if stage.pipe_comm.always_header else None
        self._ahead: dict[sched.Action, tuple[Header | None, Any]] = {}
        self._windows: dict[int, tuple[list, dict[int, list[sched.Action]]]] = {}
        # What each instruction needs from the plan, looked up once (O(1) an instruction):
        # its route, whether its chunk is the pipeline's first or last virtual stage, and
        # which parameters' buckets arm after it (each parameter at the last gradient action
        # of the last of its chunks, for a parameter two chunks of this rank share).
        plan, rank = stage.plan, stage.index
        self._routes = {a: plan.route(a, rank)
                        for prog in (plan.programs[rank], plan.eval_programs[rank]) for a in prog
                        if a.op in sched.SENDS or a.op in sched.RECVS}
        self._first_chunk = {c for c, v in enumerate(plan.programs.layout[rank]) if v == 0}
        self._last_chunk = {c for c, v in enumerate(plan.programs.layout[rank])
                            if v == plan.last_virtual}
        self._arm_at = _arming(plan, rank, stage.chunk_layers)
        # The class's functions, not bound methods: a runner holding its own methods is a
        # cycle, which keeps a dropped engine's stage alive until the garbage collector runs.
        cls = type(self)
        self._handlers = {sched.RECV_ACT: cls.recv_activation, sched.FORWARD: cls.forward,
                          sched.SEND_ACT: cls.send_activation,
                          sched.RECV_GRAD: cls.recv_gradient, sched.BACKWARD: cls.backward,
                          sched.SEND_GRAD: cls.send_gradient, sched.WEIGHT: cls.weight}

    # -- the loop -------------------------------------------------------------------------
    @property
    def timeline(self) -> list[tuple[str, float, float]]:
        """The last step's (instruction, start, end) in seconds; on a GPU read from the
        instructions' CUDA events, here, once a step: reading them waits for the step's
        kernels, so nothing inside the step ever does."""
        self._timeline = [(name, self.clock.seconds(a), self.clock.seconds(b))
                          for name, a, b in self._timeline]
        return self._timeline

    def note(self, what: str, start: Any, end: Any) -> None:
        """A span of the engine's own (the optimizer step) in the timeline."""
        self._timeline.append((what, start, end))

    def run(self, program: list[sched.Action], st: StepState) -> StepState:
        if self.stage.backend == "strict":        # NCCL's rules: no device sync in a step
            with no_device_sync(self.stage.describe):
                return self._run(program, st)
        return self._run(program, st)

    def _run(self, program: list[sched.Action], st: StepState) -> StepState:
        self._timeline = []
        self.pending_sends = st.sends      # for hang reports
        if self.trace:
            self.clock.start()
        agreed = self._agreed
        self._ahead = {}
        if agreed is not None:
            agreed.begin(st.batches.shapes)
        windows = self._windows_of(program)
        for i, act in enumerate(program):
            self.on_instruction(act)     # described only if a report needs it
            t0 = self.clock.mark() if self.trace else None
            if i in windows:
                self._post_ahead(windows[i], st)
            self._handlers[act.op](self, act, st)
            # Let finished sends go and reductions in flight progress, without blocking (and
            # the sharded optimizer's all-gathers, in flight from the last step's end).
            st.sends[:] = [s for s in st.sends if not _finished(s)]
            reducer = self.stage.reducer
            if reducer is not None and (reducer.armed or reducer.gathering):
                reducer.poll()
            if self.trace:
                self._timeline.append((repr(act), t0, self.clock.mark()))
        for s in st.sends:
            s.wait()
            _finished(s)
        if agreed is not None:
            agreed.end()
        return st

    def _windows_of(self, program: list[sched.Action]) -> dict[int, list[sched.Action]]:
        """Instruction position -> the receives to post before it runs (`posting_order`,
        `stage.post_ahead` computes early: 1, the receives between a compute and the next;
        0 under NCCL's single hardware queue, see `torch_dist.nccl_post_ahead`), computed
        once a program."""
        known = self._windows.get(id(program))
        if known is not None and known[0] is program:
            return known[1]
        windows = dict(posting_order(program, self.stage.pipe_comm.rank,
                                     self.stage.plan.programs.layout, self.stage.post_ahead))
        self._windows[id(program)] = (program, windows)
        return windows

    def _post_ahead(self, receives: list[sched.Action], st: StepState) -> None:
        """Post these receives now where their sizes are known (an agreed header; over MPI,
        which probes, the link's last header; the gradients of a sent activation), in program
        order: the first that cannot be posted ends the window, so every link's receives are
        still posted in the order sent. Over MPI an activation is posted only while its link
        has no other receive in the window: the last header is known only once the message
        before it is in (a sender that announces new shapes instead sends them on another
        tag, and `recv_posted` withdraws the posted receive)."""
        comm, device = self.stage.pipe_comm, self.stage.device
        posted_links: set[tuple[int, int]] = set()     # MPI: one activation a link
        for act in receives:
            r = self.route(act)
            if act.op == sched.RECV_ACT:
                link = (r.peer, r.chunk)
                if self._agreed is not None:
                    header = self._agreed.known(link)
                elif link in posted_links:
                    return
                else:
                    posted_links.add(link)
                    header = self._heard.get(link)
                    if header is not None and not header.metas:
                        return          # a header alone: nothing to post, it is probed
                if header is None:
                    return
                metas = header.metas
            else:
                sent = st.sent.get((act.mb, act.chunk))
                if sent is None:
                    return
                header, metas = None, sent.grad_metas()
            if metas or header is not None:
                request = comm.irecv_message([(m.shape, m.dtype) for m in metas], r.peer,
                                             r.tag, device) if metas else None
                self._ahead[act] = (header, request)

    def route(self, act: sched.Action) -> sched.Route:
        """Peer, receiving chunk and tag of the message `act` sends or receives (the plan's
        `route`: one function for the engine, the simulator and the link order)."""
        return self._routes[act]

    def describe(self, act: sched.Action, probe: bool = False) -> str:
        """The instruction, and for a message the rank it waits on, for reports. With `probe`
        (a hang report, from the watchdog's thread) also what has arrived from that rank and
        how many of this rank's sends are unfinished, so that a peer that never sent and a
        message that arrived but was never matched are told apart."""
        if act.op not in sched.SENDS and act.op not in sched.RECVS:
            return repr(act)
        r = self.route(act)
        peer = self.stage.topo.rank_of(r.peer)
        verb = "to" if act.op in sched.SENDS else "from"
        text = f"{act!r} ({verb} rank {peer}"
        if probe and act.op in sched.RECVS and r.peer != self.stage.pipe_comm.rank:
            seen = self.stage.pipe_comm.arrived_from(r.peer)
            if seen is not None:
                text += f", expecting message {r.tag}; {seen}"
            text += f"; {len(self.pending_sends)} of this rank's sends unfinished"
        return text + ")"

    # -- handlers -------------------------------------------------------------------------
    def recv_activation(self, act: sched.Action, st: StepState) -> None:
        r = self.route(act)
        comm = self.stage.pipe_comm
        if r.peer == comm.rank:
            header, ts = st.local.pop(r.tag)
        elif act in self._ahead:
            header, request = self._ahead.pop(act)
            # Over MPI posted for the link's last header, which the sender may have changed.
            header, ts = comm.recv_posted(request, r.peer, r.tag, header, self.stage.device) \
                if request is not None else (header, [])
            self._heard[(r.peer, r.chunk)] = header
        elif self._agreed is not None:
            link = (r.peer, r.chunk)
            header, ts = comm.recv_message(r.peer, r.tag, self._agreed.known(link),
                                           self.stage.device)
            self._agreed.seen(link, header)
        else:
            header, ts = comm.recv_message(r.peer, r.tag, self._heard.get((r.peer, r.chunk)),
                                           self.stage.device)
            self._heard[(r.peer, r.chunk)] = header
        needs_grad = [t for t, meta in zip(ts, header.metas) if meta.requires_grad]
        if st.train:
            for t in needs_grad:
                t.requires_grad_(True)
        st.received[(act.mb, act.chunk)] = (header.rebuild(ts), needs_grad)

    def forward(self, act: sched.Action, st: StepState) -> None:
        stage, key = self.stage, (act.mb, act.chunk)
        mb = st.batches.micro[act.mb]
        if act.chunk in self._first_chunk:
            x, needs_grad = stage.precision.cast_input(mb.inputs), []
        else:
            x, needs_grad = st.received.pop(key)
        layers = stage.chunk_layers[act.chunk]
        last = act.chunk in self._last_chunk
        if st.train and stage.recompute == "auto":
            self._resolve_auto(layers, x, mb.targets if last else None)
        meter = self.activation_meter if st.train and self.measure_activations \
            else contextlib.nullcontext()
        with torch.set_grad_enabled(st.train), meter, collect_aux_losses() as aux:
            out = stage_forward(layers, x, stage.recompute if st.train else "none", mb.side)
            if last:
                out = self._finish(out, mb, st)
            else:
                st.to_send[key] = out
        # What the layers added (`pf.add_aux_loss`) joins this micro-batch's backward here,
        # and the reported loss. A recomputation in backward collects nothing: no sink then.
        extra = torch.stack([a.float() for a in aux]).sum() if aux else None
        if extra is not None:
            st.aux.append(extra.detach())
        if st.train:
            st.stash[key] = (needs_grad, out, extra)
            st.peak_stash = max(st.peak_stash, len(st.stash))

    def _finish(self, out: Any, mb, st: StepState) -> Any:
        """The last virtual stage: keep the outputs if asked, and the loss (in fp32, whatever
        the working precision) when there are targets."""
        if st.keep_outputs:
            st.outputs.append(tree.detach(out))
        if mb.targets is None:
            return None
        loss = self.loss_fn(tree.cast_floating(out, torch.float32), mb.targets)
        st.losses.append(loss.detach())
        return loss

    def send_activation(self, act: sched.Action, st: StepState) -> None:
        r = self.route(act)
        header, ts = tree.header_of(st.to_send.pop((act.mb, act.chunk)))
        link = (r.peer, r.chunk)
        comm = self.stage.pipe_comm
        st.sent[(act.mb, act.chunk)] = header
        if r.peer == comm.rank:                 # to this rank's other chunk: no message
            st.local[r.tag] = (header, [t.detach().clone() for t in ts])
            return
        if self._agreed is not None:
            known = self._agreed.known(link)
            if known is None:
                self._agreed.seen(link, header)
            elif known != header:
                raise _shape_changed(self.stage.describe(), act, r.peer, header, known)
            elif not ts:                  # agreed and empty: nothing to send at all
                return
            announce = known is None
        else:
            # A message without tensors is its header alone: always sent, or nothing would
            # reach the receiver, whose probe waits for the next message on the link.
            announce = not ts or self._announced.get(link) != header
            self._announced[link] = header
        request = comm.send_message(header if announce else None, ts, r.peer, r.tag)
        # An auxiliary loss may have used the output (its graph holds it): never freed then.
        aux_used = st.train and st.stash[(act.mb, act.chunk)][2] is not None
        st.sends.append(_FreeAfter(request, _freeable(ts)) if self.free_sent_outputs
                        and st.train and not self.stage.plan.spec.split_backward and not aux_used
                        else request)

    def recv_gradient(self, act: sched.Action, st: StepState) -> None:
        # Gradients come back for the leaves that were sent requiring one: no header needed,
        # and no message at all when there were none.
        metas = st.sent[(act.mb, act.chunk)].grad_metas()
        grads: list[torch.Tensor] = []
        if metas:
            r = self.route(act)
            expected = Header(None, (None,) * len(metas), metas)
            if r.peer == self.stage.pipe_comm.rank:
                _, grads = st.local.pop(r.tag)
            elif act in self._ahead:
                grads = self._ahead.pop(act)[1].wait()
            else:
                _, grads = self.stage.pipe_comm.recv_message(r.peer, r.tag, expected,
                                                             self.stage.device)
        st.grads_in[(act.mb, act.chunk)] = grads

    def backward(self, act: sched.Action, st: StepState) -> None:
        """B: the gradient of this chunk's inputs, which the previous stage waits for. Under a
        split-backward schedule the weight gradients wait for this chunk's W."""
        stage, key = self.stage, (act.mb, act.chunk)
        needs_grad, out, extra = st.stash.pop(key)
        if act.chunk in self._last_chunk:
            outs, grads = [out * st.loss_multiplier], None
            if extra is not None and extra.requires_grad:
                outs = [outs[0] + extra * st.aux_multiplier]
        else:
            outs = [t for t in tree.tensors(out) if t.requires_grad and t.is_floating_point()]
            grads = st.grads_in.pop(key)
            if len(outs) != len(grads):
                raise RuntimeError(f"{len(outs)} outputs need a gradient but {len(grads)} came "
                                   f"back for {act!r}")
            if extra is not None and extra.requires_grad:
                outs, grads = outs + [extra * st.aux_multiplier], \
                    list(grads) + [torch.ones((), device=extra.device)]
        if stage.plan.spec.split_backward:
            params = [p for layer in stage.chunk_layers[act.chunk] for p in layer.parameters()]
            got, st.pending_w[key] = backward_input(outs, grads, needs_grad, params)
            st.grads_out[key] = [g if g is not None else torch.zeros_like(t)
                                 for t, g in zip(needs_grad, got)]
            return
        if stage.reducer is not None and act in self._arm_at:
            stage.reducer.arm(self._arm_at[act])
        if outs:
            _backward(outs, grads)
        st.grads_out[key] = [t.grad if t.grad is not None else torch.zeros_like(t)
                             for t in needs_grad]

    def weight(self, act: sched.Action, st: StepState) -> None:
        """W: this chunk's weight gradients, into `.grad` (the hooks of mixed precision and
        of the data-parallel buckets fire as in a full backward)."""
        reducer = self.stage.reducer
        if reducer is not None and act in self._arm_at:
            reducer.arm(self._arm_at[act])
        backward_weight(st.pending_w.pop((act.mb, act.chunk)))

    def send_gradient(self, act: sched.Action, st: StepState) -> None:
        grads = st.grads_out.pop((act.mb, act.chunk))
        if grads:
            r = self.route(act)
            if r.peer == self.stage.pipe_comm.rank:
                st.local[r.tag] = (None, grads)
            else:
                st.sends.append(self.stage.pipe_comm.send_message(None, grads, r.peer, r.tag))

    def _resolve_auto(self, layers: list, x: Any, target: Any) -> None:
        """Measure this chunk on a real micro-batch and pick the cheapest policy whose stash
        (depth from the simulator) fits the budget."""
        stage = self.stage
        budget = int(stage.step_settings.activation_budget_mb * 2**20)
        tail = ((lambda out: self.loss_fn(tree.cast_floating(out, torch.float32), target))
                if target is not None else None)
        stage.recompute = auto_policy(layers, x, stage.plan.peak_stash[stage.index],
                                      budget, where=stage.describe(), tail=tail)


class LinkShapes:
    """Each link's header agreed without a message, for receivers that cannot probe.

    A step's messages have the shapes its batch's shapes give them (`StepBatches.shapes`,
    the same text on every rank). The first step of a batch shape announces every message's
    header; both ends of a link see the same headers, so both know at its end whether they
    were all one (agreed: later steps of that batch shape send tensors alone, or nothing for
    a message without tensors) or not (that batch shape announces every message, always). A
    sender whose header differs from the agreed one raises `ProtocolError`: the receiver,
    which knows no better, has posted the agreed sizes. The last `LIMIT` batch shapes of a
    link are remembered (the same on both ends: they agree at the same steps).
    """

    LIMIT = 64
    _MIXED = object()             # headers differed within the step: announce, always

    def __init__(self) -> None:
        self._agreed: dict[tuple[int, int], dict[str, Any]] = {}
        self._step: dict[tuple[int, int], Any] = {}    # this step's header on each new link
        self._shapes: str | None = None

    def begin(self, shapes: str | None) -> None:
        """A step whose batch has `shapes` (None: never agree, announce every message)."""
        self._shapes, self._step = shapes, {}

    def known(self, link: tuple[int, int]) -> Header | None:
        """The agreed header of `link` for this step's batch shape, or None: announced."""
        found = self._agreed.get(link, {}).get(self._shapes)
        return None if found is None or found is self._MIXED else found

    def seen(self, link: tuple[int, int], header: Header) -> None:
        """A header announced on `link` in this step."""
        first = self._step.setdefault(link, header)
        if first is not self._MIXED and first != header:
            self._step[link] = self._MIXED

    def end(self) -> None:
        """The step is done: links of a new batch shape agree on what they saw."""
        if self._shapes is None:
            return
        for link, header in self._step.items():
            shapes = self._agreed.setdefault(link, {})
            if self._shapes not in shapes:
                shapes[self._shapes] = header
                if len(shapes) > self.LIMIT:
                    del shapes[next(iter(shapes))]
        self._step = {}


def _shape_changed(where: str, act: sched.Action, peer: int, header: Header,
                   agreed: Header) -> ProtocolError:
    what = (f"tensors {tree.describe(header.metas)}, agreed {tree.describe(agreed.metas)}"
            if header.metas != agreed.metas else
            f"a structure {header.spec} with constants {header.slots}, agreed {agreed.spec} "
            f"with {agreed.slots}")
    return ProtocolError(
        f"{where}: {act!r} sends to pipeline stage {peer} {what} for the same batch shapes. "
        f"Where a receiver cannot probe a message (torch.distributed, NCCL's rules), a link's "
        f"shapes are agreed once per batch shape, so a stage's outputs must follow from the "
        f"batch's shapes: pad data-dependent shapes to a fixed size, or train with "
        f"backend='mpi', whose receivers learn a changed shape from the message")


def _arming(plan: Plan, rank: int, chunk_layers: list[list[nn.Module]]
            ) -> dict[sched.Action, list[nn.Parameter]]:
    """Instruction -> the parameters whose gradients are final once it has run: each
    parameter at the last (in program order) of the last gradient actions of the chunks that
    hold it."""
    last = plan.last_gradient_actions(rank)
    position = {a: i for i, a in enumerate(plan.programs[rank])}
    final: dict[int, tuple[int, sched.Action, nn.Parameter]] = {}
    for chunk, act in last.items():
        for layer in chunk_layers[chunk]:
            for p in layer.parameters():
                if id(p) not in final or final[id(p)][0] < position[act]:
                    final[id(p)] = (position[act], act, p)
    out: dict[sched.Action, list[nn.Parameter]] = {act: [] for act in last.values()}
    for _, act, p in final.values():
        out[act].append(p)
    return out


class _FreeAfter:
    """A send whose source tensor is freed once the send is done (see `_freeable`)."""

    def __init__(self, request: Any, tensor: torch.Tensor | None) -> None:
        self.request, self.tensor = request, tensor

    def test(self) -> bool:
        return self.request.test()

    def wait(self) -> None:
        self.request.wait()


def _finished(send: Any) -> bool:
    """Whether a send is done; a done send's freeable source loses its storage."""
    if not send.test():
        return False
    if isinstance(send, _FreeAfter) and send.tensor is not None:
        t = send.tensor
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        send.tensor = None
    return True


def _freeable(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The one sent tensor whose storage nothing but the send needs after the forward.

    Only the simple, provable case: exactly one leaf of the message needs a gradient, and it
    is the result of an op (not a leaf, not a view of another tensor), so no other tensor
    of the stage shares its storage and nothing in the stage consumed it. (An op that saved
    its own result for backward keeps its own reference, so the backward stays exact.)
    """
    grads = [t for t in ts if t.requires_grad]
    if len(grads) != 1:
        return None
    t = grads[0]
    if t.grad_fn is None or t._base is not None or t.untyped_storage().nbytes() != \
            t.numel() * t.element_size():
        return None
    return t


def _backward(outs: list[torch.Tensor], grads: list[torch.Tensor] | None) -> None:
    """`torch.autograd.backward`, also for outputs whose storage was freed after their send
    (the shape check is against the gradient; autograd needs only their graph)."""
    if grads is None or all(o.shape == g.shape for o, g in zip(outs, grads)):
        torch.autograd.backward(outs, grads)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tuple(outs), tuple(grads), False, False, (), True, True)
