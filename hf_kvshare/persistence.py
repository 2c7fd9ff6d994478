"""Saving and loading a method's cross-request state: the persistence half of the method contract.

:class:`StatePersistence` is a base of :class:`~hf_kvshare.method.Method`: ``save_state`` writes
``state.json`` (method name, options, model fingerprint, metadata, a sha256 ``checksum`` over all of
it and the tensors) and ``state.safetensors`` (tensors, the same checksum in its metadata), no pickle;
both are written to temporary files in the directory, fsynced and renamed over the old ones, so a
save that fails leaves the previous state as it was.

``load_state`` trusts nothing it reads: the checksum (an edited ``state.json`` or a corrupted tensor
is refused), finiteness of every tensor, the method and its options (each named, saved vs this
instance; a rank the model's K/V dimension clamped is compared clamped), the model fingerprint
(required for a non-empty state; checked against the model given and the bound one, which must be
the same object), and the shapes and ids of the state against each other and against that
fingerprint (the method's :meth:`~StatePersistence.stage_state`). Every check runs before anything
of the instance changes: ``stage_state`` builds the new state aside and returns the swap.
A method supplies its state through ``export_state`` / ``stage_state``; its options are its
dataclass fields (``state_options``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .bounded_read import InputFileError, read_input
from .identity import ModelFingerprint, model_fingerprint

if TYPE_CHECKING:
    from .identity import ModelBinding

#: layout version of what :meth:`StatePersistence.save_state` writes (2: with a checksum; format 1,
#: written before checksums existed, loads only when asked for: ``load_state(..., allow_legacy=True)``)
STATE_FORMAT = 2
STATE_FORMATS = (1, 2)
STATE_JSON = "state.json"
#: the largest ``state.json`` read (the header: options, fingerprint, metadata, the tensors' index)
MAX_STATE_JSON = 64 * 2**20
STATE_TENSORS = "state.safetensors"
#: the key of the checksum in ``state.json`` and in the safetensors file's metadata
CHECKSUM = "checksum"
#: the swap :meth:`StatePersistence.stage_state` returns (it cannot fail)
Commit = Callable[[], None]


def _nothing() -> None:
    return None


class StatePersistence:
    """Base of :class:`~hf_kvshare.method.Method`: a method instance's cross-request state saved to
    and loaded from a directory. Reads the method's ``name`` and ``binding`` (the model it serves)."""

    name: ClassVar[str] = ""
    if TYPE_CHECKING:

        @property
        def binding(self) -> ModelBinding: ...

    #: option fields the saved state itself carries (not compared on load)
    state_fields: ClassVar[tuple[str, ...]] = ()
    #: the keys the saved metadata may hold (``None``: not checked here; the method's ``stage_state``
    #: checks them): a key outside them is refused, not ignored
    state_keys: ClassVar[tuple[str, ...] | None] = None
    #: rank options clamped to the model's K/V feature dimension ``D`` when bound
    #: (:func:`~hf_kvshare.anchors.store.clamp_ranks`): compared clamped to the saved model's ``D``
    rank_options: ClassVar[tuple[str, ...]] = ()

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What the instance keeps across requests as ``(named tensors, JSON-able metadata)``.

        The default is nothing: the method keeps no state across requests (or only per-request
        state, such as the LR methods' per-session caches), and saves an empty state. Methods that
        learn across requests override this, :meth:`stage_state` and :meth:`state_model`.
        """
        return {}, {}

    def stage_state(
        self,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        model: ModelFingerprint | None = None,
    ) -> Commit:
        """Check an exported state and build it aside, changing nothing of the instance; return the
        swap that installs it (a function that cannot fail). Raise ``ValueError`` (naming what is
        wrong) for damaged metadata, shapes or ids that do not agree with each other or with
        ``model`` (the saved model's fingerprint, when known)."""
        if tensors or meta:
            raise ValueError(
                f"{type(self).__name__} keeps no state across requests, but the saved state holds "
                f"{len(tensors)} tensors and metadata keys {sorted(meta)}"
            )
        return _nothing

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Replace the instance's cross-request state by an exported one: :meth:`stage_state` (all
        checks; nothing changes when one fails), then its swap."""
        self.stage_state(tensors, meta)()

    def state_model(self) -> torch.nn.Module | None:
        """The model the cross-request state was built on (``None``: not bound to one yet)."""
        return self.binding.model

    def expect_model(self, fingerprint: ModelFingerprint | None) -> None:
        """Remember that the loaded state was built on ``fingerprint``: the first model this instance
        is bound to must have it (:class:`~hf_kvshare.identity.ModelBinding`)."""
        if self.binding.model is None:
            self.binding.expected = fingerprint

    def check_expected_model(self, model: torch.nn.Module) -> None:
        """Raise when ``model`` is not the model this instance is bound to or its loaded state was
        built on."""
        self.binding.check(model)

    #: options added after states were first saved -> the value a state saved without them was built
    #: with (such a state loads into an instance with that value)
    LEGACY_OPTIONS: ClassVar[dict[str, Any]] = {}

    def legacy_options(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The options a saved state that does not record them was built with (the header's own
        options override these): :attr:`LEGACY_OPTIONS` by default. ``meta`` is the state's metadata,
        for a method whose saved content tells them (FullShared's kept prefixes)."""
        return dict(self.LEGACY_OPTIONS)

    def state_options(self) -> dict[str, Any]:
        """The knobs (dataclass fields) that must match for a saved state to be loaded."""
        if not dataclasses.is_dataclass(self):
            return {}
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init and f.name not in self.state_fields
        }

    def record_clamp(self, clamped: dict[str, int | None]) -> None:
        """Remember the rank options as given before :meth:`attach` clamps them to ``clamped`` (saved
        in the header's ``"requested"``)."""
        requested = self.__dict__.setdefault("_requested_ranks", {})
        for knob, value in clamped.items():
            if getattr(self, knob) != value:
                requested.setdefault(knob, getattr(self, knob))

    def save_state(self, directory: str | os.PathLike, model: torch.nn.Module | None = None) -> Path:
        """Write the cross-request state to ``directory``: ``state.json`` (method, options, model
        fingerprint, metadata, checksum) and ``state.safetensors`` (tensors). No pickle. ``model`` is
        needed only when the instance holds state it was neither bound to a model for nor loaded
        with a model fingerprint.

        Atomic per file: each is written to a temporary file in ``directory``, fsynced, then renamed
        over the old one (tensors first, the header last); a save that fails midway (disk full)
        leaves the previous state loadable and no temporary file behind.

        >>> method.save_state("runs/state/kvcmas")  # doctest: +SKIP
        >>> fresh = KVCMAS(); fresh.load_state("runs/state/kvcmas", model)  # doctest: +SKIP
        """
        tensors, meta = self.export_state()
        bound = self.state_model()
        if model is not None and bound is not None and model is not bound:
            raise ValueError(
                f"{type(self).__name__}: its state was built on another model object than the model= given"
            )
        model = model if model is not None else bound
        if model is not None:
            fingerprint: ModelFingerprint | None = model_fingerprint(model)
            if bound is None and self.binding.expected is not None:
                _check_fingerprint(type(self).__name__, self.binding.expected, fingerprint, "given")
        else:
            fingerprint = self.binding.expected  # loaded, not bound yet: the model it was saved from
        if fingerprint is None and (tensors or meta):
            raise ValueError(
                f"{type(self).__name__} holds state but is bound to no model; pass model= (the model it was built on)"
            )
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        _check_finite(type(self).__name__, tensors, "refusing to save it")
        header = {
            "format": STATE_FORMAT,
            "method": self.name,
            "options": _json_options(self.state_options()),
            "requested": _json_options(self.__dict__.get("_requested_ranks", {})),
            "model": None if fingerprint is None else fingerprint.to_dict(),
            "meta": meta,
        }
        header = json.loads(json.dumps(header, allow_nan=False))  # raises on what JSON cannot hold
        header[CHECKSUM] = state_checksum(header, tensors)
        text = json.dumps(header, indent=1, allow_nan=False)
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise ValueError(
                f"cannot save method state to {str(directory)!r}: it exists and is not a directory"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"cannot save method state to {str(directory)!r}: the directory cannot be created ({error})"
            ) from error
        staged: list[Path] = []
        try:
            tensor_tmp = _temporary(directory, STATE_TENSORS, staged)
            _write_tensors(tensors, tensor_tmp, {CHECKSUM: header[CHECKSUM]})
            _fsync(tensor_tmp)
            header_tmp = _temporary(directory, STATE_JSON, staged)
            with open(header_tmp, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tensor_tmp, directory / STATE_TENSORS)
            os.replace(header_tmp, directory / STATE_JSON)
            staged.clear()
            _fsync_directory(directory)
        finally:
            for path in staged:
                path.unlink(missing_ok=True)
        return directory

    def load_state(
        self,
        directory: str | os.PathLike,
        model: torch.nn.Module | None = None,
        *,
        allow_legacy: bool = False,
    ) -> None:
        """Replace this instance's cross-request state by the one :meth:`save_state` wrote.

        ``allow_legacy=True`` also takes a state of format 1 (written before checksums existed, neither
        file carrying one): such a state is checked by content only, so an edited tensor would pass;
        without it a checksum-less state is refused (save it again once loaded to seal it).

        Refused with ``ValueError`` (nothing changes) when the files are missing or damaged (the
        checksum, a non-finite tensor, shapes or ids that disagree), the method or its options
        differ, a non-empty state names no model, ``model`` is not the model this instance is bound
        to, or the state was built on another model: the model given, the bound model, else the
        first model the instance is attached to afterwards must have the saved fingerprint.
        """
        owner = type(self).__name__
        directory = Path(directory)
        header_path, tensor_path = directory / STATE_JSON, directory / STATE_TENSORS
        if not header_path.is_file() or not tensor_path.is_file():
            raise ValueError(
                f"{str(directory)!r} holds no saved method state (expected {STATE_JSON} and {STATE_TENSORS} "
                "written by Method.save_state)"
            )
        if not isinstance(allow_legacy, bool):
            raise TypeError(f"{owner}.load_state: allow_legacy must be True or False, got {allow_legacy!r}")
        header, tensors = _read_state(header_path, tensor_path, allow_legacy)
        if header.get("method") != self.name:
            raise ValueError(
                f"{header_path} holds the state of method {header.get('method')!r}, not {self.name!r}"
            )
        meta = header.get("meta")
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise ValueError(
                f"{header_path}: the state's metadata must be an object, got {type(meta).__name__}"
            )
        unknown = [] if self.state_keys is None else sorted(set(meta) - set(self.state_keys))
        if unknown:
            raise ValueError(
                f"{header_path}: the state's metadata holds keys {self.name} does not save: {unknown[:5]} "
                f"(expected only {', '.join(self.state_keys)})"
            )
        if header.get("model") is None:
            fingerprint = None
            if tensors or meta:
                raise ValueError(
                    f"{header_path}: the state holds {len(tensors)} tensors and metadata {sorted(meta)} but "
                    "names no model (its 'model' fingerprint is missing): it cannot be checked against any "
                    "model, so it is not loaded"
                )
        else:
            try:
                fingerprint = ModelFingerprint.from_dict(header["model"])
            except (TypeError, ValueError) as error:
                raise ValueError(f"{header_path}: damaged model fingerprint ({error})") from error
        bound = self.state_model()
        if model is not None and bound is not None and model is not bound:
            raise ValueError(
                f"{owner}: this instance is bound to {self.binding.description or 'another model'}; "
                f"load_state(model=...) got {self.binding.describe(model)}, another model object. Load "
                "into a fresh instance (or one bound to that model), or call .clear() first"
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"{owner}.load_state: model= must be a torch.nn.Module, got {type(model).__name__}"
            )
        if fingerprint is not None:
            _check_dtypes(header_path, tensors, fingerprint)
        target = model if model is not None else bound
        if fingerprint is not None and target is not None:
            _check_fingerprint(owner, fingerprint, model_fingerprint(target), "given")
        self._check_options(header_path, header, meta, fingerprint or _fingerprint_of(target))
        device = _model_device(target)
        if device is not None and device.type != "cpu":
            tensors = {k: v.to(device) for k, v in tensors.items()}
        commit = self.stage_state(tensors, meta, fingerprint)
        commit()
        self.expect_model(fingerprint)

    def _check_options(
        self, header_path: Path, header: dict[str, Any], meta: dict[str, Any], model: ModelFingerprint | None
    ) -> None:
        options, requested = header.get("options") or {}, header.get("requested") or {}
        if not isinstance(options, dict) or not isinstance(requested, dict):
            raise ValueError(f"{header_path}: damaged options ({options!r}, requested {requested!r})")
        mine = _json_options(self.state_options())
        saved = {**_json_options(self.legacy_options(meta)), **options}
        dim = None if model is None else model.kv_heads * model.head_dim
        mine_requested = _json_options(self.__dict__.get("_requested_ranks", {}))

        def same(knob: str) -> bool:
            if saved.get(knob) == mine.get(knob):
                return True
            if knob not in self.rank_options:
                return False
            ours, theirs = mine_requested.get(knob, mine.get(knob)), requested.get(knob, saved.get(knob))
            return ours == theirs or (dim is not None and _clamp(ours, dim) == _clamp(theirs, dim))

        diff = [
            f"{k}: saved {saved.get(k)!r}, this instance {mine.get(k)!r}"
            for k in sorted({*saved, *mine})
            if not same(k)
        ]
        if diff:
            raise ValueError(f"{header_path}: the state was saved with other options ({'; '.join(diff)})")


def state_checksum(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the header (its canonical JSON, less the checksum itself) and every tensor (name,
    dtype, shape, bytes; in name order): what ``state.json`` and the safetensors metadata record."""
    digest = hashlib.sha256()
    body = {k: v for k, v in header.items() if k != CHECKSUM}
    digest.update(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"\0{name}\0{str(tensor.dtype)}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _write_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """The tensor writer (safetensors, no pickle)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)


def _read_state(
    header_path: Path, tensor_path: Path, allow_legacy: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and the tensors (on the CPU), verified: format, checksum (in both files, equal, and
    equal to the content's; none only for format 1 with ``allow_legacy``), every tensor finite."""
    from safetensors import safe_open

    try:
        header = json.loads(read_input(header_path, "a saved state's header", MAX_STATE_JSON).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, RecursionError, InputFileError) as error:
        raise ValueError(f"{header_path}: not a saved method state ({error})") from error
    if not isinstance(header, dict) or header.get("format") not in STATE_FORMATS:
        got = header.get("format") if isinstance(header, dict) else header
        raise ValueError(f"{header_path}: state format {STATE_FORMAT} expected, got {got!r}")
    try:
        with safe_open(str(tensor_path), framework="pt", device="cpu") as stored:
            written = (stored.metadata() or {}).get(CHECKSUM)
            tensors = {name: stored.get_tensor(name) for name in stored.keys()}
    except Exception as error:  # safetensors raises its own error type for a damaged file
        raise ValueError(f"{tensor_path}: not a readable safetensors file ({error})") from error
    recorded = header.get(CHECKSUM)
    if recorded is None and written is None and header.get("format") == 1:
        if not allow_legacy:
            raise ValueError(
                f"{header_path.parent}: a state of format 1, without checksums (written before they "
                "existed, or with them removed): its content cannot be verified, so it is not loaded. "
                "If you trust it, load it with load_state(..., allow_legacy=True) and save it again"
            )
    elif recorded is None and written is None:
        raise ValueError(
            f"{header_path.parent}: neither {STATE_JSON} nor {STATE_TENSORS} carries a checksum (state format "
            f"{header.get('format')} has them): its content cannot be verified, so it is not loaded"
        )
    elif recorded is None or written is None or recorded != written:
        raise ValueError(
            f"{header_path.parent}: the checksums of {STATE_JSON} ({recorded!r}) and {STATE_TENSORS} "
            f"({written!r}) do not match: the files are not from one save (or one was edited)"
        )
    else:
        try:
            actual = state_checksum(header, tensors)
        except (RecursionError, ValueError) as error:  # nested past what JSON writes back, NaN
            raise ValueError(f"{header_path}: not a saved method state ({error})") from error
        if actual != recorded:
            raise ValueError(
                f"{header_path.parent}: the saved state does not match its checksum (recorded "
                f"{recorded[:16]}..., content {actual[:16]}...): {STATE_JSON} or {STATE_TENSORS} was "
                "edited or corrupted after it was saved; it is not loaded"
            )
    _check_finite(str(tensor_path), tensors, "it is not loaded")
    return header, tensors


def _check_finite(owner: str, tensors: dict[str, torch.Tensor], then: str) -> None:
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{owner}: saved tensor {name!r} holds NaN or inf; {then}")


def _check_dtypes(header_path: Path, tensors: dict[str, torch.Tensor], model: ModelFingerprint) -> None:
    """A saved state's floating tensors are in the saved model's dtype (K/V) or float32 (statistics)."""
    allowed = {model.dtype, "float32"}
    named = {
        name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items() if t.is_floating_point()
    }
    other = sorted((name, dtype) for name, dtype in named.items() if dtype not in allowed)
    if other:
        raise ValueError(
            f"{header_path}: saved tensors must be {' or '.join(sorted(allowed))} (the saved model's dtype, or "
            f"float32); got {', '.join(f'{n!r} in {d}' for n, d in other[:3])}"
        )


def _temporary(directory: Path, name: str, staged: list[Path]) -> Path:
    handle, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(handle)
    staged.append(Path(path))
    return Path(path)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(directory: Path) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _clamp(rank: Any, dim: int) -> Any:
    return min(rank, dim) if isinstance(rank, int) and not isinstance(rank, bool) else rank


def _fingerprint_of(model: torch.nn.Module | None) -> ModelFingerprint | None:
    return None if model is None else model_fingerprint(model)


def _json_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON would give them back (tuples become lists, paths strings)."""
    return json.loads(json.dumps(options, default=str))


def _model_device(model: torch.nn.Module | None) -> torch.device | None:
    if model is None:
        return None
    param = next(model.parameters(), None)
    return None if param is None else param.device


def _check_fingerprint(owner: str, saved: ModelFingerprint, model: ModelFingerprint, how: str) -> None:
    differences = saved.differences(model)
    if differences:
        raise ValueError(
            f"{owner}: the loaded state was built on another model than the one {how} "
            f"({'; '.join(differences)}; saved model: {saved}, this model: {model}). "
            "Load it only with the model it was saved from"
        )


def state_dims(model: ModelFingerprint | None) -> tuple[int, int, int] | None:
    """``(layers, kv heads, head dim)`` of a saved model fingerprint (``None``: unknown)."""
    return None if model is None else (model.layers, model.kv_heads, model.head_dim)


def check_segment_kv(
    owner: str,
    what: str,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    length: int,
    dims: tuple[int, int, int] | None,
) -> None:
    """Saved per-layer K/V ``[batch, kv_heads, length, head_dim]`` agree with each other, with
    ``length`` (the token ids they are for) and with ``dims`` (the saved model's shape)."""
    if not keys or len(keys) != len(values):
        raise ValueError(f"{owner}: {what} has {len(keys)} key and {len(values)} value layers")
    if dims is not None and len(keys) != dims[0]:
        raise ValueError(f"{owner}: {what} has {len(keys)} layers, the saved model {dims[0]}")
    first = tuple(keys[0].shape)
    for layer, (k, v) in enumerate(zip(keys, values)):
        for kind, t in (("keys", k), ("values", v)):
            shape = tuple(t.shape)
            if len(shape) != 4 or shape != first or shape[-2] != length:
                raise ValueError(
                    f"{owner}: {what} layer {layer} {kind} have shape {shape}; expected "
                    f"[batch, kv_heads, {length}, head_dim] like layer 0's {first} ({length} token ids)"
                )
            if dims is not None and (shape[1], shape[3]) != (dims[1], dims[2]):
                raise ValueError(
                    f"{owner}: {what} layer {layer} {kind} have {shape[1]} kv heads x {shape[3]}; the saved "
                    f"model has {dims[1]} x {dims[2]}"
                )
