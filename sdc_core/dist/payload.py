"""Objects sent between ranks in a form that cannot run code when read: one ``uint8`` buffer of a magic line, a JSON
header describing the object tree, and the raw bytes of its tensors and arrays. Reading it parses JSON and copies bytes
into tensors of listed dtypes; it never unpickles and never imports. What travels: ``None``, numbers, ``str``,
``bytes``, ``bytearray``; the builtin containers, ``deque``, ``OrderedDict``, a ``defaultdict`` of a builtin factory,
Hugging Face's ``BatchEncoding``; strided tensors of a plain dtype (``requires_grad`` and ``nn.Parameter`` kept; they
arrive on the CPU), ``torch.Size``/``dtype``/``device``, numeric NumPy arrays and scalars; named tuples and enums of
classes the receiver has already imported, and ``sdc_core``'s dataclasses (fields checked against their annotations).

Anything else raises ``NotEncodable`` naming where it sits, unless the SENDER passes ``allow_pickle``: then that object
alone is pickled, and the RECEIVER unpickles it only when its own ``allow_pickle`` is set. A sender cannot make a
receiver unpickle. ``decode`` raises ``PayloadError`` for any payload that is not well formed. Cost: one copy of every
tensor in and out."""

from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import json
import math
import os
import pickle
import re
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch

from sdc_core.schema import env_flag

MAGIC = b"SDCPAYLOAD1\n"
MAX_PAYLOAD_ENV = "SDC_MAX_PAYLOAD_MB"
ALLOW_PICKLE_ENV = "SDC_ALLOW_PICKLED_BATCHES"
DEFAULT_MAX_PAYLOAD_MB = 4096
MAX_DEPTH = 100
_ALIGN = 64

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "int64", "int32",
        "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)}
_NUMPY_DTYPE = re.compile(r"[<>|=]?(b1|[iu][1248]|f[248]|c(8|16))")
_FACTORIES: dict[str, Any] = {t.__name__: t for t in (list, dict, set, int, float, str, tuple, bytes)}
_CONTAINERS: dict[str, Any] = {t.__name__: t for t in (list, tuple, set, frozenset)}  # rebuilt from their items
_DICTS: dict[str, Any] = {"dict": dict, "odict": collections.OrderedDict}  # rebuilt from their (key, value) pairs
# Mapping classes rebuilt as ``cls(dict)``: their constructor takes the data and nothing else.
_MAPPINGS = {"transformers.tokenization_utils_base:BatchEncoding", "transformers.feature_extraction_utils:BatchFeature"}


class PayloadError(RuntimeError):
    """A payload between ranks was refused (malformed, too large, pickled without consent, of an
    unexpected shape); ``topology.exchange`` and ``all_gather_objects`` raise it on every rank alike."""


class NotEncodable(TypeError):
    """An object that cannot travel without pickling; the message says where it sits."""


def max_payload_bytes(max_bytes: int | None = None) -> int:
    """``max_bytes``, else ``SDC_MAX_PAYLOAD_MB`` (MiB), else 4096 MiB; ``ValueError`` unless positive."""
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        return max_bytes
    raw = os.environ.get(MAX_PAYLOAD_ENV, "").strip() or str(DEFAULT_MAX_PAYLOAD_MB)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MAX_PAYLOAD_ENV} must be a positive whole number of MiB, got {raw!r}")
    return int(raw) << 20


def pickle_allowed(allow_pickle: bool | None = None) -> bool:
    return bool(allow_pickle) if allow_pickle is not None else env_flag(ALLOW_PICKLE_ENV)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _uint8(data: bytes) -> torch.Tensor:
    """``data`` as a CPU ``uint8`` tensor of its own (``torch.frombuffer`` refuses an empty buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _resolve(name: Any, what: str) -> Any:
    """The class ``module:qualname`` from a module this process already imported (no import)."""
    if not isinstance(name, str) or ":" not in name:
        raise PayloadError(f"{what} class {name!r} is not a 'module:qualname' name")
    module, _, qual = name.partition(":")
    obj: Any = sys.modules.get(module)
    if obj is None:
        raise PayloadError(f"{what} class {name} is of a module this rank has not imported")
    for part in qual.split("."):
        if not part.isidentifier() or part.startswith("__"):
            raise PayloadError(f"{what} class {name!r} is not a plain class name")
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise PayloadError(f"{what} class {name} does not exist on this rank")
    return obj


class _Encoder:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.blobs: list[tuple[list[Any], torch.Tensor]] = []  # (header entry, uint8 CPU bytes)

    def blob(self, entry: list[Any], data: torch.Tensor) -> int:
        self.blobs.append((entry, data))
        return len(self.blobs) - 1

    def tensor(self, t: torch.Tensor, where: str) -> dict[str, Any]:
        name = str(t.dtype).removeprefix("torch.")
        if t.layout != torch.strided or t.is_quantized or name not in _DTYPES:
            raise NotEncodable(f"{where}: a {t.layout} tensor of {t.dtype} does not travel")
        if t.device.type == "meta":
            raise NotEncodable(f"{where}: a tensor on the meta device holds no data")
        param = isinstance(t, torch.nn.Parameter)
        if type(t) is not torch.Tensor and not param:
            raise NotEncodable(f"{where}: a {type(t).__name__} (a tensor subclass) does not travel")
        flat = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        node = {"t": "tensor", "i": self.blob(["tensor", name, list(t.shape)], raw)}
        if t.requires_grad:
            node["grad"] = True
        if param:
            node["param"] = True
        return node

    def encode(self, obj: Any, where: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise NotEncodable(f"{where}: nested more than {MAX_DEPTH} levels deep")
        kind = type(obj)
        if obj is None or kind in (bool, int, float, str):
            return obj
        try:
            return self._encode(obj, kind, where, depth)
        except NotEncodable:
            if not self.allow_pickle:
                raise
            try:
                data = pickle.dumps(obj)
            except Exception as err:
                raise NotEncodable(f"{where}: a {kind.__name__} cannot be pickled either ({err})") from None
            return {"t": "pickle", "i": self.blob(["pickle"], _uint8(data))}

    def _seq(self, items: Any, where: str, depth: int) -> list[Any]:
        return [self.encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(items)]

    def _encode(self, obj: Any, kind: type, where: str, depth: int) -> Any:
        np = sys.modules.get("numpy")
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, where)
        if kind is complex:
            return {"t": "complex", "re": obj.real, "im": obj.imag}
        if kind in (bytes, bytearray):
            return {"t": kind.__name__, "b64": base64.b64encode(obj).decode()}
        if kind in (list, tuple, set, frozenset):
            return {"t": kind.__name__, "v": self._seq(obj, where, depth)}
        if kind is collections.deque:
            return {"t": "deque", "v": self._seq(obj, where, depth), "maxlen": obj.maxlen}
        if kind is torch.Size:
            return {"t": "size", "v": [int(n) for n in obj]}
        if kind is torch.dtype:
            return {"t": "dtype", "name": str(obj).removeprefix("torch.")}
        if kind is torch.device:
            return {"t": "device", "name": str(obj)}
        if kind in (dict, collections.OrderedDict, collections.defaultdict) or (
            isinstance(obj, Mapping) and _qualname(kind) in _MAPPINGS
        ):
            items = list(obj.items())
            node: dict[str, Any] = {
                "t": "dict",
                "k": [self.encode(k, f"{where} key {i}", depth + 1) for i, (k, _) in enumerate(items)],
                "v": [self.encode(v, f"{where}[{k!r}]", depth + 1) for k, v in items],
            }
            if kind is collections.OrderedDict:
                node["t"] = "odict"
            elif kind is collections.defaultdict:
                factory = obj.default_factory
                if factory is not None and factory not in _FACTORIES.values():
                    raise NotEncodable(f"{where}: a defaultdict whose factory is {factory!r}")
                node |= {"t": "ddict", "factory": None if factory is None else factory.__name__}
            elif kind is not dict:
                node |= {"t": "mapping", "cls": _qualname(kind)}
            return node
        if np is not None and isinstance(obj, np.ndarray | np.generic):
            if not _NUMPY_DTYPE.fullmatch(obj.dtype.str):
                raise NotEncodable(f"{where}: a NumPy value of dtype {obj.dtype} does not travel")
            arr = np.asarray(obj)  # a scalar stays 0-d (ascontiguousarray would make it 1-d)
            arr = arr if arr.flags.c_contiguous else arr.copy(order="C")
            i = self.blob(["numpy", obj.dtype.str, list(arr.shape)], _uint8(arr.tobytes()))
            return {"t": "ndarray" if isinstance(obj, np.ndarray) else "npscalar", "i": i}
        if isinstance(obj, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_make"):
            return {"t": "ntuple", "cls": _qualname(kind), "v": self._seq(obj, where, depth)}
        if isinstance(obj, enum.Enum):
            return {"t": "enum", "cls": _qualname(kind), "v": self.encode(obj.value, f"{where}.value", depth + 1)}
        if dataclasses.is_dataclass(obj) and kind.__module__.startswith("sdc_core."):
            fields = {
                f.name: self.encode(getattr(obj, f.name), f"{where}.{f.name}", depth + 1)
                for f in dataclasses.fields(obj)
                if f.init}
            return {"t": "dataclass", "cls": _qualname(kind), "f": fields}
        raise NotEncodable(f"{where}: a {kind.__module__}.{kind.__qualname__} does not travel without pickling")


def encode(obj: Any, allow_pickle: bool = False, where: str = "payload") -> torch.Tensor:
    """``obj`` as one CPU ``uint8`` tensor; ``NotEncodable`` names the first object that cannot travel."""
    enc = _Encoder(allow_pickle)
    tree = enc.encode(obj, where)
    entries, offset = [], 0
    for entry, data in enc.blobs:
        entries.append([*entry, offset, data.numel()])
        offset += -(-data.numel() // _ALIGN) * _ALIGN
    header = json.dumps({"tree": tree, "blobs": entries}, separators=(",", ":")).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
    out = torch.zeros(start + offset, dtype=torch.uint8)
    head = MAGIC + len(header).to_bytes(8, "little") + header
    out[: len(head)] = _uint8(head)
    for (_, data), entry in zip(enc.blobs, entries, strict=True):
        if data.numel():
            out[start + entry[-2] : start + entry[-2] + data.numel()] = data
    return out


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 62:
        raise PayloadError(f"{what} is {value!r}, not a size")
    return value


def _conforms(value: Any, hint: Any, depth: int = 0) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (one this does not read fits)."""
    if hint is Any or depth > 4:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a, depth + 1) for a in typing.get_args(hint))
    if hint is float:
        return isinstance(value, int | float)
    if isinstance(hint, type):
        return isinstance(value, hint)
    if origin in (list, set, frozenset, tuple, dict):
        if not isinstance(value, origin):
            return False
        args = typing.get_args(hint)
        if origin is dict and len(args) == 2:
            return all(_conforms(k, args[0], depth + 1) and _conforms(v, args[1], depth + 1) for k, v in value.items())
        homogeneous = origin in (list, set, frozenset) and len(args) == 1
        if homogeneous or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
            return all(_conforms(v, args[0], depth + 1) for v in value)
        if origin is tuple and args and args != ((),):
            return len(args) == len(value) and all(_conforms(v, a, depth + 1) for v, a in zip(value, args, strict=True))
    return True  # a container's items this check does not read, or an annotation it does not read


def _bytes_of(t: torch.Tensor) -> bytes:
    """The bytes of a 1-D uint8 CPU tensor (one copy, without NumPy)."""
    buf = bytearray(t.numel())
    if buf:
        torch.frombuffer(buf, dtype=torch.uint8).copy_(t)
    return bytes(buf)


class _Decoder:
    def __init__(self, data: torch.Tensor, start: int, blobs: list[Any], allow_pickle: bool) -> None:
        self.data, self.start, self.blobs, self.allow_pickle = data, start, blobs, allow_pickle
        self.used: set[int] = set()

    def blob(self, node: dict[str, Any], kind: str) -> tuple[list[Any], torch.Tensor]:
        i = node.get("i")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.blobs):
            raise PayloadError(f"a {kind} refers to data entry {i!r}, which does not exist")
        if i in self.used:
            raise PayloadError(f"data entry {i} is referred to twice")
        self.used.add(i)
        entry = self.blobs[i]
        if not isinstance(entry, list) or len(entry) < 3 or entry[0] != kind:
            raise PayloadError(f"data entry {i} is not a {kind}")
        offset, size = _int(entry[-2], "a data offset"), _int(entry[-1], "a data size")
        if self.start + offset + size > self.data.numel():
            raise PayloadError(f"data entry {i} ({size} bytes at {offset}) runs past the end of the payload")
        return entry, self.data[self.start + offset : self.start + offset + size]

    def shape(self, shape: Any, itemsize: int, size: int, what: str) -> list[int]:
        if not isinstance(shape, list) or len(shape) > 64:
            raise PayloadError(f"{what} has shape {shape!r}")
        numel = math.prod(_int(n, f"a dimension of {what}") for n in shape)
        if numel * itemsize != size:
            raise PayloadError(f"{what} of shape {shape} needs {numel * itemsize} bytes, the payload has {size}")
        return shape

    def decode(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise PayloadError(f"the payload nests more than {MAX_DEPTH} levels deep")
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise PayloadError(f"a node of the payload is {type(node).__name__}, not a tagged value")
        tag = node["t"]
        if tag in _CONTAINERS:
            return _CONTAINERS[tag](self._items(node, depth))
        if tag in _DICTS:
            return _DICTS[tag](self._pairs(node, depth))
        method = _TAGS.get(tag)
        if method is None:
            raise PayloadError(f"a node of the payload has the unknown tag {node['t']!r}")
        return method(self, node, depth)

    def _items(self, node: dict[str, Any], depth: int, key: str = "v") -> list[Any]:
        items = node.get(key)
        if not isinstance(items, list):
            raise PayloadError(f"a {node['t']} holds {type(items).__name__}, not a list")
        return [self.decode(v, depth + 1) for v in items]

    def _deque(self, node: dict[str, Any], depth: int) -> collections.deque[Any]:
        maxlen = node.get("maxlen")
        return collections.deque(self._items(node, depth), None if maxlen is None else _int(maxlen, "a maxlen"))

    def _size(self, node: dict[str, Any], depth: int) -> torch.Size:
        return torch.Size([_int(n, "a dimension") for n in self._items(node, depth)])

    def _dtype(self, node: dict[str, Any], depth: int) -> torch.dtype:
        if node.get("name") not in _DTYPES:
            raise PayloadError(f"unknown dtype {node.get('name')!r}")
        return _DTYPES[node["name"]]

    def _device(self, node: dict[str, Any], depth: int) -> torch.device:
        name = node.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z_]{1,16}(:[0-9]{1,6})?", name):
            raise PayloadError(f"a device is named {name!r}")
        return torch.device(name)

    def _complex(self, node: dict[str, Any], depth: int) -> complex:
        re_, im = node.get("re"), node.get("im")
        if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (re_, im)):
            raise PayloadError("a complex number is not two numbers")
        return complex(re_, im)

    def _bytes(self, node: dict[str, Any], depth: int) -> bytes:
        try:
            return base64.b64decode(node.get("b64", ""), validate=True)
        except (ValueError, TypeError):
            raise PayloadError("a bytes value is not base64") from None

    def _bytearray(self, node: dict[str, Any], depth: int) -> bytearray:
        return bytearray(self._bytes(node, depth))

    def _pairs(self, node: dict[str, Any], depth: int) -> list[tuple[Any, Any]]:
        keys, values = self._items(node, depth, "k"), self._items(node, depth, "v")
        if len(keys) != len(values):
            raise PayloadError(f"a mapping has {len(keys)} keys and {len(values)} values")
        return list(zip(keys, values, strict=True))

    def _ddict(self, node: dict[str, Any], depth: int) -> collections.defaultdict[Any, Any]:
        factory = node.get("factory")
        if factory is not None and factory not in _FACTORIES:
            raise PayloadError(f"a defaultdict factory {factory!r} is not a builtin type")
        return collections.defaultdict(_FACTORIES.get(factory), self._pairs(node, depth))  # type: ignore[arg-type]

    def _mapping(self, node: dict[str, Any], depth: int) -> Any:
        if node.get("cls") not in _MAPPINGS:
            raise PayloadError(f"mapping class {node.get('cls')!r} is not one that travels")
        cls = _resolve(node["cls"], "mapping")
        if not issubclass(cls, Mapping):
            raise PayloadError(f"{node['cls']} is not a mapping")
        return cls(dict(self._pairs(node, depth)))

    def _tensor(self, node: dict[str, Any], depth: int) -> torch.Tensor:
        entry, raw = self.blob(node, "tensor")
        if len(entry) != 5 or entry[1] not in _DTYPES:
            raise PayloadError(f"a tensor has dtype {entry[1]!r}, not one that travels")
        dtype = _DTYPES[entry[1]]
        itemsize = torch.empty((), dtype=dtype).element_size()
        shape = self.shape(entry[2], itemsize, raw.numel(), "a tensor")
        t = raw.clone().view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
        if node.get("param"):
            return torch.nn.Parameter(t, requires_grad=bool(node.get("grad")))
        if node.get("grad"):
            if not (t.is_floating_point() or t.is_complex()):
                raise PayloadError(f"a {dtype} tensor cannot require a gradient")
            t.requires_grad_(True)
        return t

    def _ndarray(self, node: dict[str, Any], depth: int) -> Any:
        np = sys.modules.get("numpy")
        if np is None:
            raise PayloadError("the payload holds a NumPy value and NumPy is not imported on this rank")
        entry, raw = self.blob(node, "numpy")
        if len(entry) != 5 or not isinstance(entry[1], str) or not _NUMPY_DTYPE.fullmatch(entry[1]):
            raise PayloadError(f"a NumPy value has dtype {entry[1]!r}, not one that travels")
        dtype = np.dtype(entry[1])
        shape = self.shape(entry[2], dtype.itemsize, raw.numel(), "a NumPy value")
        return np.frombuffer(_bytes_of(raw), dtype=dtype).reshape(shape).copy()

    def _npscalar(self, node: dict[str, Any], depth: int) -> Any:
        arr = self._ndarray(node, depth)
        if arr.shape != ():
            raise PayloadError(f"a NumPy scalar has shape {arr.shape}")
        return arr[()]

    def _pickle(self, node: dict[str, Any], depth: int) -> Any:
        if not self.allow_pickle:
            raise PayloadError(
                "it holds a pickled object, which could run code when read, and this rank does not accept pickled "
                f"batches (allow_pickled_batches, {ALLOW_PICKLE_ENV}=1 on every rank, only if you trust every rank)")
        _, raw = self.blob(node, "pickle")
        try:
            return pickle.loads(_bytes_of(raw))
        except Exception as err:
            raise PayloadError(f"a pickled object cannot be read: {type(err).__name__}: {err}") from None

    def _ntuple(self, node: dict[str, Any], depth: int) -> Any:
        cls = _resolve(node.get("cls"), "named tuple")
        if not (issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make")):
            raise PayloadError(f"{node['cls']} is not a named tuple")
        values = self._items(node, depth)
        if len(values) != len(cls._fields):
            raise PayloadError(f"{node['cls']} has {len(cls._fields)} fields, the payload {len(values)}")
        return cls._make(values)

    def _enum(self, node: dict[str, Any], depth: int) -> Any:
        cls = _resolve(node.get("cls"), "enum")
        if not issubclass(cls, enum.Enum):
            raise PayloadError(f"{node['cls']} is not an enum")
        try:
            return cls(self.decode(node.get("v"), depth + 1))
        except ValueError as err:
            raise PayloadError(f"{node['cls']}: {err}") from None

    def _dataclass(self, node: dict[str, Any], depth: int) -> Any:
        name = node.get("cls")
        if not isinstance(name, str) or not name.startswith("sdc_core."):
            raise PayloadError(f"dataclass {name!r} is not one of sdc_core's")
        cls = _resolve(name, "dataclass")
        if not dataclasses.is_dataclass(cls):
            raise PayloadError(f"{name} is not a dataclass")
        fields = node.get("f")
        init = {f.name: f for f in dataclasses.fields(cls) if f.init}
        if not isinstance(fields, dict) or set(fields) != set(init):
            got = sorted(fields) if isinstance(fields, dict) else fields
            raise PayloadError(f"{name} has fields {sorted(init)}, the payload {got}")
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an annotation this rank cannot evaluate: checked by type only
            hints = {}
        values = {}
        for key, raw in fields.items():
            value = self.decode(raw, depth + 1)
            if key in hints and not _conforms(value, hints[key]):
                raise PayloadError(f"{name}.{key} is a {type(value).__name__}, not {hints[key]}")
            values[key] = value
        return cls(**values)


_TAGS = {  # the tag of a node -> the method that rebuilds it
    tag: getattr(_Decoder, f"_{tag}")
    for tag in ("deque", "size", "dtype", "device", "complex", "bytes", "bytearray", "ddict", "mapping", "tensor",
                "ndarray", "npscalar", "pickle", "ntuple", "enum", "dataclass")
}  # fmt: skip


def decode(data: torch.Tensor, allow_pickle: bool = False) -> Any:
    """The object ``encode`` wrote into ``data`` (a ``uint8`` tensor, on any device); ``PayloadError``
    saying what is wrong for anything else (a pickled object too, unless ``allow_pickle``)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise PayloadError("a payload must be a 1-D uint8 tensor")
    data = data.cpu()
    head = len(MAGIC) + 8
    if data.numel() < head or bytes(data[: len(MAGIC)].tolist()) != MAGIC:
        raise PayloadError("it is not an sdc-checks payload (no header)")
    size = int.from_bytes(bytes(data[len(MAGIC) : head].tolist()), "little")
    if size > data.numel() - head:
        raise PayloadError(f"its header claims {size} bytes, the payload has {data.numel() - head}")
    try:
        header = json.loads(_bytes_of(data[head : head + size]).decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise PayloadError(f"its header is not JSON ({type(err).__name__})") from None
    if not isinstance(header, dict) or not isinstance(header.get("blobs"), list) or "tree" not in header:
        raise PayloadError("its header lacks the object tree or the data list")
    start = -(-(head + size) // _ALIGN) * _ALIGN
    decoder = _Decoder(data, start, header["blobs"], allow_pickle)
    try:
        return decoder.decode(header["tree"])
    except PayloadError:
        raise
    except RecursionError:
        raise PayloadError("the payload nests too deeply") from None
    except (TypeError, ValueError, RuntimeError, OverflowError, MemoryError) as err:
        raise PayloadError(f"it cannot be rebuilt: {type(err).__name__}: {err}") from None


__all__ = ["NotEncodable", "PayloadError", "decode", "encode", "max_payload_bytes", "pickle_allowed"]
