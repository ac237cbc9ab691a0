"""How much one unpickling may allocate beyond what its opcodes build: an allowance for the whole pickle.

The pickle machine builds each object from bytes of the pickle (a string from its characters, a list from its
items), so that part costs a bounded multiple of the file. What does not is work done on objects the pickle
already holds: its memo hands the same object out again for two bytes, so a 49 KB pickle can call
`bytearray(49 KB)` 8,327 times, `_codecs.encode` one long string thousands of times, or BUILD a thousand
objects from one large state dict. A bound per call lets the total grow with the square of the file; this one
is shared by every call of the pickle:

- a constructor that allocates by a size (bytes(n), bytearray(n), torch storages and legacy tensor types,
  quantized tensors) is charged the bytes it asks for, before it runs;
- any other allowed callable the pickle calls is charged the size of the containers, strings and bytes it is
  handed (what a copy of them costs), before it runs;
- BUILD of an allowed plain class (DCP's metadata dataclasses) is charged the size of its state.

The total may not exceed `FACTOR` times the pickle's size (plus `FLOOR`): a real checkpoint's pickles copy
little (their data is in the file), so more than that is a crafted one, refused (`OversizedAllocation`) before
the charge is spent.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

# A real DCP .metadata charges ~2-5x its size (every dataclass is BUILT from a small state dict), objects and the
# Lightning blob far less; 16x leaves room and still bounds what a crafted file can make us allocate.
FACTOR = 16
FLOOR = 1 << 20  # tiny pickles (a 12-byte object record) may still copy a little

_COPIED = (bytes, bytearray, str, list, tuple, dict, set, frozenset)
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python, whose instances may change __class__


class BlockedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside the allow-list; `name` is its `module.qualname`."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} is not allowed")
        self.name = name


class OversizedAllocation(BlockedGlobal):
    """The pickle's calls asked to allocate or copy more, together, than its allowance."""

    def __init__(self, name: str, requested: int, size: int, spent: int, budget: int, *, elements: bool = True) -> None:
        super().__init__(f"{name}({requested})")
        asked = f"{requested} elements" if elements else f"a copy of {requested} bytes"
        self.args = (
            f"{name} asks for {asked} from a {size}-byte pickle, which with the {spent} bytes its calls already "
            f"allocated or copied is over the {budget} bytes it may ({FACTOR}x its size)",
        )
        self.requested, self.size, self.spent, self.budget = requested, size, spent, budget


class Allowance:
    """What the calls of one pickle of `size` bytes may allocate together (None: no bound)."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.budget = None if size is None else FACTOR * size + FLOOR
        self.spent = 0
        self.rebuilt: list[tuple[list[Any], type]] = []  # per guarded class: the instances made as its stand-in

    def charge(self, name: str, nbytes: int, requested: int | None = None) -> None:
        if self.budget is None or nbytes <= 0:
            return
        if self.spent + nbytes > self.budget:
            asked = nbytes if requested is None else requested
            raise OversizedAllocation(
                name, asked, self.size or 0, self.spent, self.budget, elements=requested is not None
            )
        self.spent += nbytes

    def restore_classes(self) -> None:
        """Every instance made through a guarded class gets its real class back (BUILD did that for most)."""
        for made, real in self.rebuilt:
            for instance in made:
                if type(instance) is not real:
                    object.__setattr__(instance, "__class__", real)
        self.rebuilt.clear()


# bytes per item a copy of each kind costs (a pointer, a hash-table entry; a byte or an ASCII character)
_PER_ITEM: dict[type, int] = {bytes: 1, bytearray: 1, str: 1, list: 8, tuple: 8, dict: 48, set: 32, frozenset: 32}
_WIDE_CHARACTER = 4  # a str with any non-ASCII character: up to 4 bytes a character, in memory or encoded


def copy_cost(values: Any) -> int:
    """Bytes a copy of these arguments costs, about: their items (or characters) times what each takes. Called once
    per allowed call of a pickle (600,000 times for a large .metadata), so kept to a dict lookup and a len() per
    argument (`str.isascii` reads a flag: O(1)). With `sys.getsizeof` here and a tuple per built object, a bounded
    .metadata load took ~2.5x the allow-list alone; now ~1.35x (benchmarks/open_bounds.py)."""
    cost = 0
    for value in values:
        kind = type(value)
        per = _PER_ITEM.get(kind)
        if per is None:
            if not isinstance(value, _COPIED):
                continue
            per = 48  # a subclass (OrderedDict, defaultdict, ...): charged as a dict's entries
        elif kind is str and not value.isascii():
            per = _WIDE_CHARACTER
        cost += per * len(value)
    return cost


def is_sized_constructor(key: str) -> bool:
    """bytes(n), bytearray(n), torch.FloatStorage(n), torch.LongTensor(n, m), UntypedStorage(n): callables on
    an allow-list that allocate by a size argument. A pickle of real data never calls them with a size: it
    passes the bytes themselves (or, for tensors, a storage loaded from bytes it holds)."""
    if key in ("builtins.bytes", "builtins.bytearray", "torch.Tensor"):
        return True
    module, _, name = key.rpartition(".")
    return module in ("torch", "torch.cuda", "torch.sparse", "torch.storage") and name.endswith(("Storage", "Tensor"))


QTENSOR = "torch._utils._rebuild_qtensor"  # (storage, offset, size, stride, ...): allocates `size` before the set_


def requested_elements(args: tuple[Any, ...]) -> int:
    """Elements a constructor called with `args` allocates: an int, or the product of a shape's ints."""
    sizes = [arg for arg in args if isinstance(arg, int) and not isinstance(arg, bool)]
    shapes = [arg for arg in args if isinstance(arg, (tuple, list)) and arg and all(isinstance(a, int) for a in arg)]
    requested = 1 if sizes else 0
    for size in sizes:  # torch.FloatTensor(2, 3): every int is a dimension
        requested *= max(size, 0)
    for shape in shapes:
        count = 1
        for size in shape:
            count *= max(size, 0)
        requested = max(requested, count)
    return requested


def _element_size(found: Any) -> int:
    """Bytes per element of a sized constructor (a typed storage or legacy tensor type's dtype), else 1."""
    dtype = getattr(found, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return 1


def guard_call(key: str, found: Any, allowance: Allowance, *, copies: bool) -> Any:
    """`found` as the unpickler hands it out: calls charged to `allowance` (sizes asked for; with `copies`, the
    size of what the call is handed)."""
    sized = is_sized_constructor(key)
    if allowance.budget is None or not (sized or key == QTENSOR or copies):
        return found
    element = _element_size(found) if sized else 1
    if not (sized or key == QTENSOR):  # the common case (torch.Size, _codecs.encode): one charge per call

        def copying(*args: Any, **kwargs: Any) -> Any:
            allowance.charge(key, copy_cost(args) + (copy_cost(kwargs.values()) if kwargs else 0))
            return found(*args, **kwargs)

        return copying

    def call(*args: Any, **kwargs: Any) -> Any:
        values = (*args, *kwargs.values())
        requested = requested_elements(values if sized else args[2:3])
        allowance.charge(key, requested * element, requested)
        if copies:
            allowance.charge(key, copy_cost(values))
        return found(*args, **kwargs)

    return call


def charge_storages(persistent_load: Any, allowance: Allowance) -> Any:
    """torch.load's `persistent_load`, each storage it is asked for charged first: the legacy format (a tensor in
    a plain pickle) allocates a storage of the size the pickle names before reading its bytes."""

    def load(saved_id: Any) -> Any:
        # ("storage", storage_type, key, location, numel[, view_metadata]): zip and legacy formats alike
        if isinstance(saved_id, tuple) and len(saved_id) >= 5 and saved_id[0] in ("storage", b"storage"):
            numel = saved_id[4]
            if isinstance(numel, int):
                allowance.charge("a torch storage", numel * _element_size(saved_id[1]), numel)
        return persistent_load(saved_id)

    return load


def guard_class(key: str, cls: type, allowance: Allowance) -> type:
    """A stand-in for a plain Python class the pickle builds with NEWOBJ and BUILD: its BUILD is charged the
    size of the state, and every instance gets `cls` back as its class (at BUILD, or when the load ends).
    Other classes (builtins, torch types, classes with their own metaclass or layout) are handed out as they are."""
    if (
        allowance.budget is None
        or type(cls) is not type
        or not cls.__flags__ & _HEAP_TYPE
        or not cls.__dictoffset__
        or cls.__new__ not in (object.__new__, dict.__new__)  # storages, tensors: built by their own __new__
        or issubclass(cls, BaseException)
        or "__init_subclass__" in vars(cls)
    ):
        return cls
    real_setstate = getattr(cls, "__setstate__", None)
    plain_new = cls.__new__ is object.__new__
    made: list[Any] = []  # every instance of the stand-in; BUILD gives most of them `cls` back, the load's end the rest
    allowance.rebuilt.append((made, cls))

    # both run once per object of the pickle (600,000 for a large .metadata): kept to the fewest calls
    def __new__(stand_in: type, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # NEWOBJ of a dataclass passes none
            allowance.charge(key, copy_cost((*args, *kwargs.values())))
        instance: Any = object.__new__(stand_in) if plain_new else cls.__new__(stand_in, *args, **kwargs)
        made.append(instance)
        return instance

    def __setstate__(self: Any, state: Any) -> None:
        allowance.charge(
            key, 48 * len(state) if type(state) is dict else copy_cost(state if type(state) is tuple else (state,))
        )
        object.__setattr__(self, "__class__", cls)
        if real_setstate is not None:
            real_setstate(self, state)
            return
        # what the pickle machine's BUILD does for a class without __setstate__
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        if state:
            self.__dict__.update(state)
        for name, value in (slots or {}).items():
            object.__setattr__(self, name, value)

    # __slots__ = (): the same layout as `cls`, so an instance can take `cls` back as its class
    return type(cls.__name__, (cls,), {"__slots__": (), "__new__": __new__, "__setstate__": __setstate__})
