"""The Unpacker's CUDA ordering, checked on a CPU: the real Unpacker runs against fake streams and
events, its reference unpacks write real CPU scratch slots, and every write and read of a slot is
checked against the order those streams and events give.

The model: each stream keeps a vector clock (for each stream, how many of its ops this stream's next
op comes after). An op ticks its own stream's entry; an event record keeps the stream's clock, and a
wait joins the event's (or another stream's) clock into the waiter's, so a wait binds to the record
before it, as CUDA's does. Op a happens-before op b iff b's clock covers a. As each access is queued:
  - a read of a layer's weights: every earlier write of its range happens-before it, and the last of
    them wrote exactly this layer's weights to exactly this range (and the slot holds them);
  - a write: every earlier read or write of its range happens-before it;
  - while a capture is open, no wait on an event recorded outside it, and at its end every unpack
    queued in it joined back to the capture's stream (CUDA refuses both otherwise).
Writes land at once here, so the clocks, not the values, say what a GPU could have read.

Only CUDA is fake, and only as quant.py sees it: its `torch` (monkeypatched) has this `cuda` and puts
CUDA allocations on the CPU, its side stream is a fake one, and the first layer's codes report a CUDA
device while the Unpacker is built. The Unpacker, its groups and its unpacks are the real ones.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eg2_runtime import quant
from eg2_runtime.loader import unpack_groups
from eg2_runtime.quant import PackedLinear, Unpacker

# ---- fake CUDA: streams, events and scratch memory ----------------------------------------------

Clock = dict["Stream", int]


class Stream:
    """A CUDA stream: ops run in the order queued, after whatever its waits joined into `clock`."""

    def __init__(self, name: str, gpu: FakeGpu) -> None:
        self.name, self.gpu = name, gpu
        self.clock: Clock = {}  # never mutated, only replaced: events and accesses keep old ones

    def tick(self) -> Clock:
        self.clock = {**self.clock, self: self.clock.get(self, 0) + 1}
        return self.clock

    def wait_event(self, event: Event) -> None:
        if self.gpu.capture is not event.capture and event.clock:  # CUDA refuses it while capturing
            self.gpu.violations.append(f"{self.name} waits on an event recorded across a capture's edge")
        self.wait_stream(event)

    def wait_stream(self, other: Stream | Event) -> None:
        self.clock = {s: max(self.clock.get(s, 0), other.clock.get(s, 0)) for s in self.clock | other.clock}


class Event:
    """A CUDA event: a record keeps the stream's clock (and the capture open then); a wait joins it."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.clock: Clock = {}
        self.capture: Stream | None = None

    def record(self, stream: Stream) -> None:
        self.clock, self.capture = stream.clock, self.gpu.capture


@dataclass(eq=False)
class Access:
    kind: str  # "read" or "write"
    what: str  # the layer read, or whose weights a write holds
    stream: Stream
    clock: Clock
    slot: int
    lo: int
    hi: int

    def before(self, other: Access) -> bool:
        return other.clock.get(self.stream, 0) >= self.clock[self.stream]

    def overlaps(self, other: Access) -> bool:
        return self.slot == other.slot and self.lo < other.hi and other.lo < self.hi

    def __str__(self) -> str:
        return f"{self.kind} of {self.what} at slot {self.slot}[{self.lo}:{self.hi}] on {self.stream.name}"


class FakeGpu:
    """`torch.cuda` as quant.py uses it (Event, current_stream, stream), the scratch slots the
    Unpacker allocates, and the checker of every access to them (the rules in the module docstring)."""

    def __init__(self) -> None:
        self.main = self.current = Stream("main", self)
        self.capture: Stream | None = None  # the stream capturing a graph, while one does
        self.slots: list[torch.Tensor] = []
        self.weights: dict[str, torch.Tensor] = {}  # name -> reference weights, flat FP32
        self.accesses: list[Access] = []
        self.violations: list[str] = []
        self.lead = 0  # the most groups a read's last write was queued ahead of it

    def Event(self) -> Event:  # torch.cuda.Event
        return Event(self)

    def current_stream(self) -> Stream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def _access(self, kind: str, what: str, view: torch.Tensor) -> Access:
        for slot, buf in enumerate(self.slots):
            at = (view.data_ptr() - buf.data_ptr()) // buf.element_size()
            if 0 <= at < buf.numel():
                return Access(kind, what, self.current, self.current.tick(), slot, at, at + view.numel())
        raise AssertionError(f"a {kind} of {what} outside every scratch slot")

    def write(self, view: torch.Tensor, values: torch.Tensor) -> None:
        flat = values.float().flatten()
        whose = next(
            (f"{n}'s weights" for n, w in self.weights.items() if torch.equal(flat, w)), "other values"
        )
        w = self._access("write", whose, view)
        self.violations += [
            f"{w} is not ordered after the {a}" for a in self.accesses if a.overlaps(w) and not a.before(w)
        ]
        self.accesses.append(w)

    def read(self, name: str, layer: PackedLinear) -> None:
        if not isinstance(layer.unpacked, Scratch):
            self.violations.append(f"{name} was given no scratch weight but {type(layer.unpacked).__name__}")
            return
        r = self._access("read", name, layer.unpacked)
        writes = [a for a in self.accesses if a.kind == "write" and a.overlaps(r)]
        self.violations += [f"{r} is not ordered after the {a}" for a in writes if not a.before(r)]
        ordered = [a for a in writes if a.before(r)]
        last = [a for a in ordered if not any(a.before(b) for b in ordered if b is not a)]
        if not last:
            self.violations.append(f"{r}: nothing wrote that range before it")
        for w in last:
            if (w.what, w.lo, w.hi) != (f"{name}'s weights", r.lo, r.hi):
                self.violations.append(f"{r}: the last write before it is the {w}")
            at = next(i for i, a in enumerate(self.accesses) if a is w)
            owners = {a.what.rpartition(".")[0] for a in self.accesses[at:] if a.kind == "read"}
            self.lead = max(self.lead, len(owners - {name.rpartition(".")[0]}))
        if not torch.equal(self.slots[r.slot][r.lo : r.hi], self.weights[name]):
            self.violations.append(f"{r}: the slot does not hold {name}'s weights")
        self.accesses.append(r)


class Scratch(torch.Tensor):
    """A scratch slot, or a view of one: a copy into it is reported to the fake GPU as a write."""

    gpu: FakeGpu

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_:
            cls.gpu.write(args[0], args[1])
        if func in (torch.Tensor.__getitem__, torch.Tensor.view):  # a slot's views stay Scratch
            return super().__torch_function__(func, types, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class FakeTorch:
    """`torch` as quant.py sees it: the real one, but `cuda` is the fake GPU and a CUDA allocation is
    a NaN-filled Scratch on the CPU (a slot read before any write shows)."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.cuda = gpu

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: int, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is None or torch.device(device).type != "cuda":
            return torch.empty(*size, device=device, **kwargs)
        slot = torch.full(size, math.nan, dtype=kwargs["dtype"]).as_subclass(Scratch)
        self.cuda.slots.append(slot)
        return slot


class _SaysCuda(torch.Tensor):
    """Codes that report a CUDA device: what sends Unpacker.__init__ down its CUDA branch."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda")


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    gpu = FakeGpu()
    monkeypatch.setattr(quant, "torch", FakeTorch(gpu))
    monkeypatch.setattr(quant, "side_stream", lambda device, purpose: Stream(purpose, gpu))
    monkeypatch.setattr(Scratch, "gpu", gpu, raising=False)
    return gpu


# ---- the model and the calls ----------------------------------------------------------------------


class Owner(nn.Module):
    """An attention or MLP: two packed layers of unlike sizes, one unpack group at two a slot."""

    def __init__(self) -> None:
        super().__init__()
        self.a = PackedLinear.from_linear(nn.Linear(32, 64, bias=False), 32)  # slot [0:2048]
        self.b = PackedLinear.from_linear(nn.Linear(64, 96, bias=False), 32)  # slot [2048:8192]


class Towers(nn.Module):
    def __init__(self, vision: int = 4, audio: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vision = nn.ModuleList(Owner() for _ in range(vision))
        self.audio = nn.ModuleList(Owner() for _ in range(audio))


def forward(tower: str, owners: int, order: str = "ab") -> list[str]:
    return [f"{tower}.{i}.{x}" for i in range(owners) for x in order]


V, A = forward("vision", 4), forward("audio", 3)


def traced(gpu: FakeGpu, model: Towers, ahead: int, monkeypatch: pytest.MonkeyPatch) -> Unpacker:
    groups = unpack_groups(model, per_slot=2)  # an owner a group, two ranges a slot
    first = model.get_submodule(groups[0][0])
    with monkeypatch.context() as mp:
        mp.setitem(first._buffers, "weight_packed", first.weight_packed.as_subclass(_SaysCuda))
        u = Unpacker.attach(model, torch.float32, ahead, groups)
    assert u is not None and u.cuda and u.fast is None, "not the CUDA ring with the reference unpack"
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):
            gpu.weights[name] = m.dequantize().float().flatten()
            # Registered after the Unpacker's hook: it sees the weight the Unpacker gave.
            m.register_forward_pre_hook(lambda layer, args, name=name: gpu.read(name, layer))
    return u


def run(gpu: FakeGpu, u: Unpacker, model: Towers, steps: list[str]) -> None:
    """A layer's name calls it; "join"; "replay": a join, then a captured graph's unpacks rewrite
    every slot, one op on the current stream; "(" ... ")": a capture, the calls between inside
    capturing() on a stream of their own. They run, as a capture's warm-up does, and a capture's
    rules hold: no wait on an event recorded outside it, and its unpacks joined back to its stream."""
    capture, side = contextlib.ExitStack(), u.stream
    for step in steps:
        if step == "join":
            u.join()
        elif step == "replay":
            u.join()
            for slot in u.scratch:
                slot.copy_(torch.full_like(slot, math.nan))
        elif step == "(":
            cap = gpu.capture = Stream("capture", gpu)
            cap.wait_stream(gpu.current)
            side_before = side.clock.get(side, 0)
            capture.enter_context(gpu.stream(cap))
            capture.enter_context(u.capturing())
        elif step == ")":
            capture.close()
            if side_before < side.clock.get(side, 0) > cap.clock.get(side, 0):
                gpu.violations.append("a capture ends with unpacks not joined back to its stream")
            gpu.capture = None
            gpu.current.wait_stream(cap)
        else:
            layer = model.get_submodule(step)
            x = torch.randn(2, layer.in_features)
            if not torch.equal(layer(x), F.linear(x, gpu.weights[step].view(layer.out_features, -1))):
                gpu.violations.append(f"{step}'s output differs from F.linear with its weights")


def assert_ordered(gpu: FakeGpu) -> None:
    assert gpu.accesses, "no scratch slot was written or read"
    assert not gpu.violations, f"{len(gpu.violations)} violations:\n" + "\n".join(gpu.violations[:10])


# ---- the scenarios ----------------------------------------------------------------------------------

AHEADS = [1, 2, 3]
SCENARIOS = {
    "out-of-order-and-twice": forward("vision", 4, "bab") * 3 + V,
    "revisit-ABAB": V[:4] * 3 + V * 2,
    "towers-alternate": (V + A) * 3 + V,
    "towers-alternate-joined": [*V, "join", *A, "join"] * 2 + V + A + V,
    "tower-order-changes": (V + A) * 2 + V * 2 + A * 2 + V,  # guessed prefetches dropped
    "replay-with-prefetches-in-flight": [*V, *A, *V, "replay", *A, *V],
    "capture-join-replay-eager": [*V, *A, *V, "(", *A, ")", *V, "replay", *A, "(", *V, ")", "replay", *V],
}


@pytest.mark.parametrize("ahead", AHEADS)
def test_forwards_in_order_prefetch_ahead_groups_deep(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, ahead: int
) -> None:
    u = traced(gpu, model := Towers(), ahead, monkeypatch)
    run(gpu, u, model, V * 4)
    assert_ordered(gpu)
    assert gpu.lead == min(ahead, 3), f"reads were unpacked up to {gpu.lead} groups ahead, not {ahead}"


@pytest.mark.parametrize("ahead", AHEADS)
@pytest.mark.parametrize("steps", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_every_read_sees_its_own_unpack_and_no_write_races_it(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, steps: list[str], ahead: int
) -> None:
    u = traced(gpu, model := Towers(), ahead, monkeypatch)
    run(gpu, u, model, steps)
    assert_ordered(gpu)


@pytest.mark.parametrize("ahead", AHEADS)
def test_a_model_of_one_group(gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, ahead: int) -> None:
    u = traced(gpu, model := Towers(vision=1, audio=0), ahead, monkeypatch)
    one = forward("vision", 1)
    run(gpu, u, model, one * 3 + ["join", *one, "(", *one, ")", "replay", *one, *one])
    assert len(u.groups) == 1
    assert_ordered(gpu)


FAILURES = {  # (before the failing forward, after it)
    "then-retried": (V, V * 2),
    "then-replayed": (V, ["replay", *V]),  # a partial write of the failed group's first layer
    "guesses-dropped-then-replayed": (V + A + V, ["replay", *V]),
}


@pytest.mark.parametrize("ahead", AHEADS)
@pytest.mark.parametrize(
    "failing", ["vision.0.a", "vision.0.b", "vision.2.b"], ids=["on-demand", "mid-group", "prefetched"]
)
@pytest.mark.parametrize(("before", "after"), FAILURES.values(), ids=FAILURES.keys())
def test_a_group_whose_unpack_raised_is_unpacked_again(
    gpu: FakeGpu,
    monkeypatch: pytest.MonkeyPatch,
    failing: str,
    ahead: int,
    before: list[str],
    after: list[str],
) -> None:
    """An exception in a group's unpack (an out-of-memory in the reference's temporaries), the one a
    forward starts with, partway through a group, or one prefetched, must not leave a group reading a
    slot it never filled when the forward is retried, nor leave side-stream writes that a graph
    replay's own unpacks race."""
    u = traced(gpu, model := Towers(), ahead, monkeypatch)
    run(gpu, u, model, before)
    layer = model.get_submodule(failing)
    real, calls = layer.dequantize, iter(range(2))

    def fails_once() -> torch.Tensor:
        if next(calls, 1) == 0:
            raise torch.OutOfMemoryError("simulated: the reference unpack's temporaries")
        return real()

    monkeypatch.setattr(layer, "dequantize", fails_once)
    with pytest.raises(torch.OutOfMemoryError):
        run(gpu, u, model, V)
    run(gpu, u, model, after)
    assert_ordered(gpu)


@pytest.mark.parametrize(("waiter", "missed"), [("unpack", "read"), ("main", "write")])
def test_the_checker_reports_a_dropped_wait(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, waiter: str, missed: str
) -> None:
    """Without the unpack stream's waits an unpack overwrites a slot still read; without the main
    stream's a read races its unpack: the checker must say so, or its passes above mean nothing."""
    u = traced(gpu, model := Towers(), 1, monkeypatch)
    monkeypatch.setattr(u.stream if waiter == "unpack" else gpu.main, "wait_event", lambda event: None)
    run(gpu, u, model, V * 2)
    caught = [v for v in gpu.violations if f"is not ordered after the {missed}" in v]
    assert caught, f"dropping the {waiter} stream's waits went unreported: {gpu.violations[:3]}"
