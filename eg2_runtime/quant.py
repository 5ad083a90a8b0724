"""4-bit weights: the compressed-tensors `pack-quantized` format, the packed linear, and the
side-stream unpack that keeps the matmuls plain BF16.

Format (int4, group-wise, symmetric), per Linear of out x in:
    weight_packed  int32 (out, in / 8)   element j of a row sits in word j // 8, bits 4 * (j % 8),
                                        stored as q + 8 so the nibble is unsigned
    weight_scale   bf16  (out, in / g)   one scale per group of g consecutive inputs
    weight_shape   int64 (2,)            (out, in)
    weight = q * scale, q in [-8, 7], rounded once to bf16.

`dequantize` is the pure-torch reference. `Unpacker` is the fast path: forward hooks unpack the
layers a group at a time (one launch each) into reused scratch buffers on a side CUDA stream, groups
ahead, ordered by CUDA events.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from eg2_runtime.streams import side_stream

log = logging.getLogger(__name__)

NUM_BITS = 4
PACK = 32 // NUM_BITS  # codes per int32 word
Q_MIN, Q_MAX = -(1 << (NUM_BITS - 1)), (1 << (NUM_BITS - 1)) - 1  # -8, 7
PACKED_TOWERS = ("vision_tower", "audio_tower")


# ---- reference quantize / pack / unpack ------------------------------------------------------


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (int32 packed (out, in/8), bf16 scale (out, in/g)).

    Symmetric min-max per group, as compressed-tensors computes it: scale = absmax / 7.5. The codes
    are rounded against the bf16-rounded scale, the one a reader multiplies by.
    """
    out_f, in_f = weight.shape
    if in_f % group_size or group_size % PACK:
        raise ValueError(f"in_features {in_f} is not a multiple of group size {group_size}")
    w = weight.float().reshape(out_f, in_f // group_size, group_size)
    scale = (w.abs().amax(dim=-1) / ((Q_MAX - Q_MIN) / 2)).to(torch.bfloat16)  # (out, groups)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()[..., None]
    q = torch.clamp(torch.round(w / safe), Q_MIN, Q_MAX).to(torch.int32).reshape(out_f, in_f)
    return pack(q), scale


def pack(q: torch.Tensor) -> torch.Tensor:
    """(out, in) int codes in [-8, 7] -> (out, in / 8) int32 words."""
    nibbles = (q.to(torch.int32) - Q_MIN).reshape(q.shape[0], -1, PACK)  # (out, in/8, 8) in [0, 15]
    shifts = torch.arange(PACK, dtype=torch.int32, device=q.device) * NUM_BITS
    # Disjoint bit ranges, so the sum is an OR; int32 wraps the top nibble into the sign bit.
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """(out, in / 8) int32 words -> (out, in) int8 codes in [-8, 7]."""
    shifts = torch.arange(PACK, dtype=torch.int32, device=packed.device) * NUM_BITS
    nibbles = (packed[..., None] >> shifts) & 0xF  # arithmetic shift; the mask drops the sign fill
    return (nibbles.reshape(packed.shape[0], -1) + Q_MIN).to(torch.int8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference dequantization: (out, in) bf16 weight = q * scale.

    The product is exact in fp32 (4-bit code times 8-bit mantissa) and rounded once to bf16, which is
    what compressed-tensors' bf16 multiply produces too.
    """
    q = unpack(packed).float()  # (out, in)
    out_f, in_f = q.shape
    g = in_f // scale.shape[-1]
    w = q.view(out_f, -1, g) * scale.float()[..., None]
    return w.view(out_f, in_f).to(torch.bfloat16)


# ---- the packed linear -----------------------------------------------------------------------


class PackedLinear(nn.Module):
    """A Linear whose weight is stored packed. `unpacked` holds the dense weight only while an
    Unpacker hook has provided it; without one, forward dequantizes on the fly (the reference)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.weight_packed = nn.Buffer(torch.empty(out_features, in_features // PACK, dtype=torch.int32))
        self.weight_scale = nn.Buffer(
            torch.empty(out_features, in_features // group_size, dtype=torch.bfloat16)
        )
        self.weight_shape = nn.Buffer(torch.tensor([out_features, in_features], dtype=torch.int64))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.unpacked: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> PackedLinear:
        out_f, in_f = linear.weight.shape
        m = cls(in_f, out_f, linear.bias is not None, group_size).to(linear.weight.device)
        packed, scale = quantize(linear.weight.detach(), group_size)
        m.weight_packed.copy_(packed)
        m.weight_scale.copy_(scale)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.weight_packed, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.unpacked if self.unpacked is not None else self.dequantize().to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, w, bias)

    def packed_bytes(self) -> int:
        return self.weight_packed.nbytes + self.weight_scale.nbytes

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 g={self.group_size}"


def packable_linears(model: nn.Module) -> list[str]:
    """Names of every nn.Linear inside the vision and audio towers: what hybrid-w4 packs."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.split(".", 1)[0] in PACKED_TOWERS
    ]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def pack_linears(model: nn.Module, group_size: int) -> int:
    """Quantize the towers' Linears in place (load-time packing of a BF16 checkpoint)."""
    names = packable_linears(model)
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        replace_module(model, name, PackedLinear.from_linear(linear, group_size))
    return len(names)


# ---- a group's codes and scales end to end ------------------------------------------------


def end_to_end_flat(
    parts: list[torch.Tensor], device: torch.device | str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Tensors of any shapes -> their elements end to end, flat, on `device`, and each part as a view
    of it: a group's codes (or scales) laid out so one launch reads them as one run; a module's
    merged weights (layers.end_to_end) are the 2-D view of one."""
    flat = torch.cat([p.reshape(-1) for p in parts]).to(device)
    views, start = [], 0
    for p in parts:
        views.append(flat[start : start + p.numel()].view(p.shape))
        start += p.numel()
    return flat, views


def lay_out_end_to_end(layers: list[PackedLinear]) -> None:
    """Give a group's layers codes and scales that lie end to end, on their device (a group packed
    after loading; the loader lays out a stored group's as it reads them)."""
    if len(layers) < 2:
        return
    for attr in ("weight_packed", "weight_scale"):
        _, views = end_to_end_flat([getattr(m, attr) for m in layers], getattr(layers[0], attr).device)
        for m, view in zip(layers, views, strict=True):
            setattr(m, attr, view)


def flat_run(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over `tensors` if they lie end to end, in order, in one storage (as the loader
    lays out a group's codes and scales); else None."""
    first = tensors[0]
    total = sum(t.numel() for t in tensors)
    base = first.untyped_storage().data_ptr()
    at = first.data_ptr()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != base
            or t.data_ptr() != at
        ):
            return None
        at += t.numel() * t.element_size()
    return first.as_strided((total,), (1,))


# ---- the side-stream unpacker ----------------------------------------------------------------


class Unpacker:
    """Provides each PackedLinear's dense weight just before it runs, from reused scratch buffers.

    Built with the packed layers it serves, in groups (unpack_groups); forward hooks on them do the
    work. The unit of unpacking is a group: its layers' weights land end to end in one scratch slot,
    by one kernel launch where the loader laid the group's codes and scales out end to end (else a
    launch a layer). On CUDA there are `ahead + 1` slots, each as large as the largest group, used as
    a ring: while group i runs from slot s, groups i + 1 .. i + ahead are unpacked (or being unpacked)
    into slots s + 1 .. s + ahead on a side stream. When group i starts (the first of its layers is
    called):
        main:  wait(ready[s]) -> record started -> matmuls of group i's layers
        side:  wait(started) -> unpack(i + ahead) into slot s + ahead (= s - 1) -> record ready[s - 1]
    `started` also means group i - 1, the last reader of slot s - 1, has finished (one main stream, in
    order), so a slot is never overwritten while read. A layer of the running group reads its slot
    with no further wait; any other layer starts its group again, so a group called out of its order
    is unpacked again, never read stale. Prefetching more than one group ahead hides the unpacks
    behind runs of short groups. Which group follows which is learned from the calls themselves
    (next_of), so it holds for any tower's execution order; a wrong guess costs time (the guessed
    unpacks still run, ahead of the one needed), never correctness. Prefetching stops at a group
    that began a forward (the first after a join or a capture's start): a captured graph would
    otherwise unpack, at its end, groups only the next forward reads, and join them before it returns.

    The CUDA events are made once and re-recorded: a wait binds to the record before it. The main
    stream is looked up by the first packed layer after construction, a `join` or the start of a
    capture (the capture stream), and kept until the next: the engine runs every eager forward on
    one stream and joins before each graph replay, and a capture's warm-up, on a stream of its own,
    runs inside `capturing` too (graphs.capture_graph).
    On CPU the unpack is synchronous, a layer at a time, and there is no scratch: the weight lives
    for one forward.
    """

    def __init__(self, groups: list[list[PackedLinear]], dtype: torch.dtype, ahead: int = 1) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be at least 1, not {ahead}")
        self.dtype = dtype
        self.groups = [list(g) for g in groups if g]
        self.layers = [m for g in self.groups for m in g]
        self.ahead = ahead
        self.group_of = {m: i for i, g in enumerate(self.groups) for m in g}
        self.offset: dict[PackedLinear, int] = {}  # a layer's first element in its group's slot
        for g in self.groups:
            at = 0
            for m in g:
                self.offset[m] = at
                at += m.in_features * m.out_features
        # Each group's codes and scales as one flat run each, where they lie end to end: one launch.
        self.runs: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for g in self.groups:
            words = flat_run([m.weight_packed for m in g])
            scales = flat_run([m.weight_scale for m in g])
            one_size = len({m.group_size for m in g}) == 1
            self.runs.append(
                (words, scales) if words is not None and scales is not None and one_size else None
            )
        self.next_of: dict[int, int] = {}
        self.starts: set[int] = set()  # groups that began a forward: prefetching stops there
        self.prev: int | None = None  # the group called last: next_of learns from it
        # The group whose unpack the main stream waited for, in `slot`: its layers read it as is. Set
        # only once that wait is queued, so a start that raised leaves no group reading a slot it
        # never filled.
        self.running: int | None = None
        self.handles = [h for m in self.layers for h in self._hook(m)]
        device = self.layers[0].weight_packed.device if self.layers else torch.device("cpu")
        self.cuda = device.type == "cuda"
        self.scratch_bytes = 0
        if self.cuda:
            numel = max(sum(m.in_features * m.out_features for m in g) for g in self.groups)
            self.scratch = [torch.empty(numel, dtype=dtype, device=device) for _ in range(ahead + 1)]
            self.scratch_bytes = len(self.scratch) * numel * self.scratch[0].element_size()
            self.stream = side_stream(device, "unpack")  # not from torch's pools: see streams.py
            self.main: torch.cuda.Stream | None = None  # the stream the towers run on
            self.ready = [torch.cuda.Event() for _ in self.scratch]  # scratch[slot] holds its group
            self.started = torch.cuda.Event()  # the main stream reached the group that started last
            self.any_started = False  # `started` was recorded since the last join
            # Groups unpacked ahead, oldest first, with their slots: always slot + 1, slot + 2, ...
            self.pending: deque[tuple[int, int]] = deque()
            self.slot = 0  # the slot of the group that started last
            # The fused Triton kernel writes BF16 in place; any other dtype takes the reference.
            self.fast = _triton_dequantize_run() if dtype == torch.bfloat16 else None

    @classmethod
    def attach(
        cls, model: nn.Module, dtype: torch.dtype, ahead: int = 1, groups: list[list[str]] | None = None
    ) -> Unpacker | None:
        """An Unpacker for every PackedLinear of `model`, or None if it has none. `groups`: the packed
        layers' names in unpack groups (loader.unpack_groups); None: a group a layer."""
        if groups is None:
            groups = [[n] for n, m in model.named_modules() if isinstance(m, PackedLinear)]
        layers = [[model.get_submodule(n) for n in g] for g in groups]
        packed = [[m for m in g if isinstance(m, PackedLinear)] for g in layers]
        return cls(packed, dtype, ahead) if any(packed) else None

    def _hook(self, m: PackedLinear) -> tuple[object, object]:
        return m.register_forward_pre_hook(self._before), m.register_forward_hook(self._after)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()  # type: ignore[attr-defined]

    def launches(self) -> int:
        """Kernel launches a pass over every group takes (one per group laid out end to end)."""
        return sum(1 if run is not None else len(g) for g, run in zip(self.groups, self.runs, strict=True))

    def _view(self, layer: PackedLinear, slot: int) -> torch.Tensor:
        at, n = self.offset[layer], layer.out_features * layer.in_features
        return self.scratch[slot][at : at + n].view(layer.out_features, layer.in_features)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Run the forward to capture in a CUDA graph inside this: the side stream's work joins the graph.

        A capture may record only work forked from its own stream and joined back to it: so the
        state of eager calls (prefetches, the last `started` record) is dropped on entry, the first
        unpack waits on the capture stream (see _unpack_async), and the prefetches the forward leaves
        pending are joined on exit. The state is dropped again after: its records belong to the graph.
        The graph keeps the scratch slots' addresses; replays and eager calls share one main stream,
        and an eager call's first unpack waits for it, so neither overwrites a slot the other reads.
        """
        if self.cuda:
            self.pending.clear()
        self.any_started = False
        try:
            yield
        finally:
            self.join()

    def join(self) -> None:
        """Make the current stream wait for the side stream's work in flight (the prefetches an eager
        forward leaves behind), and forget it: call before a captured graph replays, since its own
        unpacks write the same scratch slots."""
        if self.cuda and self.pending:
            # The side stream runs in order: the newest prefetch done means every earlier one is.
            torch.cuda.current_stream().wait_event(self.ready[self.pending[-1][1]])
        if self.cuda:
            self.pending.clear()
        self.any_started = False

    def _unpack_async(self, group: int, slot: int) -> None:
        """Enqueue the unpack of `group` into scratch[slot] on the side stream, then record
        ready[slot]; after `started` (or, with no group started since a capture or join, after
        everything the main stream has queued)."""
        assert self.main is not None
        try:
            self._enqueue_unpack(group, slot)
        except BaseException:
            # What the side stream queued that no wait will cover (this group's first layers, the
            # guesses just dropped) comes before the main stream's next work, a graph replay's too.
            self.main.wait_stream(self.stream)
            raise

    def _enqueue_unpack(self, group: int, slot: int) -> None:
        assert self.main is not None
        with torch.cuda.stream(self.stream):
            if self.any_started:
                self.stream.wait_event(self.started)
            else:
                self.stream.wait_stream(self.main)
            layers, run = self.groups[group], self.runs[group]
            if self.fast is not None:
                try:
                    if run is not None:  # (W,) int32 words, (W / words a scale group,) bf16 -> (8 W,) bf16
                        words, scales = run
                        self.fast(words, scales, self.scratch[slot][: words.numel() * PACK])
                    else:
                        for m in layers:
                            self.fast(
                                m.weight_packed.view(-1),
                                m.weight_scale.view(-1),
                                self._view(m, slot).view(-1),
                            )
                except Exception as e:  # e.g. no C compiler for Triton's launcher: keep serving
                    log.warning("fused unpack kernel unavailable (%s); using the reference unpack", e)
                    self.fast = None
            if self.fast is None:
                for m in layers:
                    self._view(m, slot).copy_(m.dequantize())
            self.ready[slot].record(self.stream)

    def _before(self, layer: nn.Module, args: object) -> None:
        assert isinstance(layer, PackedLinear)
        if not self.cuda:
            layer.unpacked = layer.dequantize().to(self.dtype)
            return
        group = self.group_of[layer]
        if self.any_started and group == self.running:  # its slot is ready: the main stream waited
            layer.unpacked = self._view(layer, self.slot)
            return
        if self.prev is not None and self.prev != group:
            self.next_of[self.prev] = group
        self.prev = group
        if not self.any_started:
            self.main = torch.cuda.current_stream()
            self.starts.add(group)
        ring = len(self.scratch)
        if self.pending and self.pending[0][0] == group:
            _, slot = self.pending.popleft()
        else:
            # First call, or a wrong guess: drop the guesses (their unpacks still run, earlier on the
            # side stream, so this one's write lands last) and unpack into the slot after the running
            # group's: after `started`, the running group is the only reader left on the main stream.
            self.pending.clear()
            slot = (self.slot + 1) % ring
            self._unpack_async(group, slot)
        main = self.main
        assert main is not None
        main.wait_event(self.ready[slot])
        self.started.record(main)
        self.any_started = True
        self.slot, self.running = slot, group
        layer.unpacked = self._view(layer, slot)
        last = self.pending[-1][0] if self.pending else group
        while len(self.pending) < self.ahead:
            nxt = self.next_of.get(last)
            if nxt is None or nxt in self.starts:
                break
            ahead_slot = (slot + len(self.pending) + 1) % ring
            self._unpack_async(nxt, ahead_slot)
            self.pending.append((nxt, ahead_slot))
            last = nxt

    def _after(self, layer: nn.Module, args: object, output: object) -> None:
        assert isinstance(layer, PackedLinear)
        layer.unpacked = None


def _triton_dequantize_run():
    """The fused unpack kernel, or None where Triton is missing (the reference path then runs)."""
    try:
        from eg2_runtime.unpack_triton import dequantize_run
    except ImportError:
        return None
    return dequantize_run
