"""Stream recompute (``cakeops.nn.recompute_mhc``; design.md §6): consecutive mHC layers form groups; only a
group's first layer keeps its input streams X for the backward, the others keep their branch output B and stats
record (which they keep anyway) and get X rebuilt in the backward by running the forward_finish kernel again --
never the branch. The same kernel on the same inputs gives the forward's bits, so gradients are bitwise those
without recompute.

Groups form at run time, in forward order: a layer joins the open group when its input is the very tensor the
group's last layer returned (same storage, offset, shape, strides, unmodified since), so anything between two
layers that is not the identity (a pipeline stage's receive, a user's op on the streams) starts a new group and
can never give a wrong rebuild. A layer inside a saved-tensor hook region (torch.utils.checkpoint, save_on_cpu)
keeps its X through those hooks and closes the group: the checkpoint already keeps only its region's input.

A layer's streams are rebuilt from X0 by one pass of the rebuild kernel through the group's earlier layers (X0 and
their B's read once, the streams written once) and dropped with its B and record after its prepare node's backward.
Where at least as many layers as the group has followed it in the forward, its last layer's backward (the group's
first to run) rebuilds every layer's streams in that one pass (``Rebuilt``: each written once, design.md §6): the
later layers' backward ran first and freed their activations. Nearer the backward's start, the step's peak, each
layer's streams are rebuilt when its backward needs them, one layer's at a time (DeepSeek's Eq. 20 assumes all), a
larger group costing longer passes (C elements per earlier layer). A second backward through the same graph
(``retain_graph=True``) finds them gone and raises, naming the way out.
"""
import math
import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef


def default_group_size(n_streams: int, n_layers: Optional[int] = None) -> int:
    """n + 2 layers (6 at n = 4); where ``n_layers`` is known, the groups that asks for share the layers evenly (8
    layers at n = 4: two groups of 4, not 6 and 2: as many X0's kept, fewer layers rebuilt layer by layer). A layer
    keeps its B (C values per token) and a share n * C / g of its group's first input, so a larger group keeps less;
    a group followed by as many layers rebuilds all its streams in one pass (``Rebuilt``), whose cost per layer
    hardly depends on g, while the last groups rebuild layer by layer (a layer k deep reads k earlier B's) and an
    at-once group's streams are alive together. On the H100 (2026-12-06, 16 blocks of C = 2048, compiled): 6 keeps
    1.19x plain's peak against 4's 1.22x, the step within a point of it; DeepSeek's Eq. 20, sqrt(n * L / (n + 2)),
    assumes every group rebuilt at once (design.md §6)."""
    size = n_streams + 2
    if n_layers is None:
        return size
    layers = max(1, n_layers)
    groups = -(-layers // size)
    return -(-layers // groups)


class _Expanded:
    """The streams StreamExpand made from a hidden state h (each stream a copy of h) -> h: a group whose first input
    they are keeps h (C values per token) instead of the n streams, and rebuilds its first layer's streams too
    (design.md §6). Keyed by the streams tensor's identity, weakly; the versions of both at the copy say whether
    either was modified since (then the streams are not h's copies any more, or h not what was copied)."""

    def __init__(self):
        from torch.utils.weak import WeakIdKeyDictionary

        self._roots = WeakIdKeyDictionary()

    def note(self, X: Tensor, h: Tensor) -> None:
        # h held as long as X lives (the value of a weak key): it is C values per token to X's n * C, and a traced
        # graph frees h right after the copy
        self._roots[X] = (h, X._version, h._version)

    def root(self, X: Tensor) -> Optional[Tensor]:
        """h where X is StreamExpand's output of h (or a whole view of it: FSDP2 hands a module its inputs through an
        autograd Function, as views), both unmodified since, else None."""
        entry = self._roots.get(X)
        base = X._base
        if entry is None and base is not None and (X.shape, X.stride(), X.storage_offset()) == (
                base.shape, base.stride(), base.storage_offset()):
            entry = self._roots.get(base)
        if entry is None:
            return None
        h, X_version, h_version = entry
        return h if (X._version, h._version) == (X_version, h_version) else None


expanded = _Expanded()


def stream_copies(h: Tensor, n: int) -> Tensor:
    """h [..., C] as n streams [..., n, C], each h itself: a view, stride 0 across the streams (StreamExpand's
    output is its contiguous copy)."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1])


def root_streams(h: Tensor, n: int) -> Tensor:
    """h [..., C] seen as the n streams StreamExpand copied from it, [T, n, C] (stride 0 across the streams)."""
    return stream_copies(h, n).reshape(-1, n, h.shape[-1])


class _Signature:
    """What identifies a layer's output without keeping it alive: its storage (weakly), offset, shape, strides
    and version."""

    def __init__(self, t: Tensor):
        self.storage = StorageWeakRef(t.untyped_storage())
        self.where = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        self.version = t._version

    def matches(self, t: Tensor) -> bool:
        return (not self.storage.expired() and self.storage == StorageWeakRef(t.untyped_storage())
                and self.where == (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
                and self.version == t._version)


class LayerCount:
    """Layers that entered stream recompute so far (a plan's or the op chain's): a group's position in the forward."""

    def __init__(self):
        self.value = 0


class Rebuilt:
    """What a group's layers share for the backward: ``streams`` {k: layer k's streams}, made by the first of its
    layers' backward to run and taken by each layer's; ``at_once``: whether that pass rebuilds all of them. A group
    does so once at least as many layers as its own followed it in the forward: their backward ran first and freed
    their activations, room for its streams beside what it keeps. Nearer the end (the backward's start, the step's
    peak) one layer's streams are rebuilt at a time, as each layer's backward needs them."""

    def __init__(self, count: LayerCount):
        # made when its first layer entered, which the count holds already
        self._count, self.start, self.size = count, count.value - 1, 0
        self.streams = {}

    def joined(self) -> None:
        self.size += 1

    def at_once(self, k: int) -> bool:
        """Layer k's backward (the group's first to run) rebuilds layers 1..k in one pass: two or more of them, and
        as many layers as the group's own followed it."""
        return k >= 2 and self._count.value - self.start - self.size >= self.size


class StreamGroup:
    """One group: its first layer's input X0 [T, n, C] and, per layer so far, (B, stats) -- what forward_finish
    read -- so that layer k's input is k finishes of X0. ``rebuilt.streams[k]``: layer k's streams while its
    backward needs them."""

    def __init__(self, X0: Tensor, count: LayerCount, root: Optional[Tensor] = None):
        self.X0 = X0
        self.root = root  # h where X0 is StreamExpand's copy of it: X0 is then h's stride-0 view, layer 0 rebuilds
        self.root_version = None if root is None else root._version
        self.links: List[Optional[Tuple[Tensor, Tensor]]] = []
        self.rebuilt = Rebuilt(count)
        self.table = None  # the rebuild kernel's table of the group's layers, made at the first chained rebuild

    def streams(self, k: int) -> Tensor:
        if k not in self.rebuilt.streams:
            if self.root is not None and self.root._version != self.root_version:
                raise RuntimeError(
                    "cakeops.nn.recompute_mhc: the hidden state given to StreamExpand was modified in place after "
                    "StreamExpand copied it into the streams; the backward rebuilds the first mHC layers' streams "
                    "from it. Modify a clone, or turn recompute off: cakeops.nn.recompute_mhc(model, group_size=1)")
            if self.X0 is None or any(link is None for link in self.links[:k]):
                raise RuntimeError(
                    "cakeops.nn.recompute_mhc: a backward needs an mHC layer's residual streams, which its group "
                    "released after the first backward through it; a second backward through the same graph "
                    "(retain_graph=True) needs stream recompute off: cakeops.nn.recompute_mhc(model, group_size=1)")
            from ._ops import mhc as ops

            if self.rebuilt.at_once(k):  # layers 1..k in one pass (layer 0 keeps X0 or is h's copy)
                self.rebuilt.streams.update(enumerate(ops.rebuild_impl(self.X0, self.links[:k], every=True), 1))
            else:
                if self.table is None or self.table.shape[1] < k:
                    self.table = ops.rebuild_table(self.X0, self.links[:k])
                self.rebuilt.streams[k] = ops.rebuild_impl(self.X0, self.links[:k], self.table)
        return self.rebuilt.streams[k]

    def release(self, k: int) -> None:
        """Layer k's backward is done: its rebuilt streams, B and record go; after the first layer's, X0."""
        self.rebuilt.streams.pop(k, None)
        if k < len(self.links):
            self.links[k] = None  # no later rebuild reads layer k's column of the table: earlier layers' remain
        if k == 0:
            self.X0, self.root, self.table = None, None, None


class StreamLink:
    """A layer's place in its group: ``k`` = 0 keeps X (the group's first layer) unless the group has a root (then
    its X is rebuilt from h as well), k > 0 has it rebuilt."""

    def __init__(self, group: StreamGroup, k: int):
        self.group, self.k = group, k

    @property
    def rebuilds(self) -> bool:
        return self.k > 0 or self.group.root is not None

    def streams(self) -> Tensor:
        return self.group.streams(self.k)

    def finished(self, B: Tensor, stats: Tensor) -> None:
        """The layer's forward_finish ran on (B, stats): the next layer's input is one more finish."""
        from ._ops import mhc as ops

        self.group.links.append(ops.rebuild_link(B, stats))

    def release(self) -> None:
        self.group.release(self.k)


class RecomputePlan:
    """Shared by the MHC layers of one ``recompute_mhc`` call: the group size and the group open in the current
    forward."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self._open: Optional[StreamGroup] = None
        self._last: Optional[_Signature] = None
        self._count = LayerCount()

    def enter(self, X: Tensor, X3: Tensor) -> Optional[StreamLink]:
        """At a layer's eager forward with X as given and X3 its [T, n, C] form: its link (joining the open
        group or starting one), or None where the layer keeps X as without recompute (no grad; inside
        saved-tensor hooks)."""
        if not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            self.close()
            return None
        self._count.value += 1
        group = self._open
        if group is None or len(group.links) >= self.group_size or not self._last.matches(X):
            root = expanded.root(X)
            X0 = X3 if root is None else root_streams(root, X3.shape[1])
            group = self._open = StreamGroup(X0, self._count, root)
        group.rebuilt.joined()
        return StreamLink(group, len(group.links))

    def leave(self, link: Optional[StreamLink], Y: Tensor) -> None:
        """After the layer's forward: Y [..., n, C] is what the next layer of the group must take (a layer
        nested in another's branch closes the outer one's group)."""
        if link is None or link.group is not self._open:
            self.close()
        else:
            self._last = _Signature(Y)

    def close(self) -> None:
        self._open, self._last = None, None

    def __getstate__(self):  # copies and pickles of a model take the setting, not a forward's open group
        return {"group_size": self.group_size}

    def __setstate__(self, state):
        self.__init__(state["group_size"])


class OpChain:
    """The groups of the custom-op path (torch.compile, dispatch modes; _ops/mhc_recompute.py), formed where the
    finish ops' autograd is set up: in forward order, once per trace (AOTAutograd's, under torch.compile) or per
    eager call. A layer joins the open group when its X is the very tensor object the group's last layer returned,
    unmodified since (a traced graph is functional: any op between two layers gives a new object, so only a direct
    chain joins, and a rebuild reads exactly the tensors the forward's finishes read). A group whose first input is
    StreamExpand's output (``expanded``, noted by the ``stream_expand`` op) is rooted at its h. Held weakly: a
    group's tensors live where its layers saved them."""

    def __init__(self):
        self._last = None  # (weakref to the last layer's output, its version)
        self._X0 = None  # the group's first input, or its root h
        self._rooted = False
        self._links: List[Tuple["weakref.ref", "weakref.ref"]] = []
        self._rebuilt: Optional[Rebuilt] = None  # the open group's
        self._count = LayerCount()

    def enter(self, X: Tensor, group_size: int
              ) -> Optional[Tuple[Tensor, List[Tuple[Tensor, Tensor]], bool, Rebuilt]]:
        """(X0 or the root h, the earlier layers' (B, stats), rooted, the group's ``Rebuilt``) for a layer whose X
        the backward rebuilds -- one that joins the open group, or the first of a rooted group -- else None: the
        layer starts a group and keeps X. Inside saved-tensor hooks (checkpointing, save_on_cpu) a layer keeps X and
        closes the group, as on the eager path."""
        last, self._last = self._last, None
        self._count.value += 1
        if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            self.close()
            return None
        joined = (last is not None and last[0]() is X and last[1] == X._version and len(self._links) < group_size)
        if joined:
            X0 = self._X0()
            links = [(B(), stats()) for B, stats in self._links]
            if X0 is not None and all(B is not None and s is not None for B, s in links):
                self._rebuilt.joined()
                return X0, links, self._rooted, self._rebuilt
        root = expanded.root(X)
        self._X0, self._rooted, self._links = weakref.ref(X if root is None else root), root is not None, []
        self._rebuilt = Rebuilt(self._count)
        self._rebuilt.joined()
        return None if root is None else (root, [], True, self._rebuilt)

    def leave(self, Y: Tensor, B: Tensor, stats: Tensor) -> None:
        """The layer's finish returned Y from (B, stats): the next layer of the group must take Y itself."""
        if self._X0 is None:
            return
        self._links.append((weakref.ref(B), weakref.ref(stats)))
        self._last = (weakref.ref(Y), Y._version)

    def close(self) -> None:
        self._last, self._X0, self._rooted, self._links, self._rebuilt = None, None, False, [], None


op_chain = OpChain()
