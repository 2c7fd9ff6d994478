"""Saving and loading a method's cross-request state: the persistence half of the method contract.

:class:`StatePersistence` is a base of :class:`~hf_kvshare.method.Method`: ``save_state`` writes
``state.json`` (method name, options, model fingerprint, metadata) and ``state.safetensors``
(tensors), no pickle; ``load_state`` refuses (changing nothing) a damaged state, another method's,
one saved with other options (each named, saved vs this instance) or one built on another model.
A method supplies its state through ``export_state`` / ``import_state``; its options are its
dataclass fields (``state_options``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .identity import ModelFingerprint, model_fingerprint

if TYPE_CHECKING:
    from .identity import ModelBinding

#: layout version of what :meth:`StatePersistence.save_state` writes
STATE_FORMAT = 1
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"


class StatePersistence:
    """Base of :class:`~hf_kvshare.method.Method`: a method instance's cross-request state saved to
    and loaded from a directory. Reads the method's ``name`` and ``binding`` (the model it serves)."""

    name: ClassVar[str] = ""
    if TYPE_CHECKING:

        @property
        def binding(self) -> ModelBinding: ...

    #: option fields the saved state itself carries (not compared on load)
    state_fields: ClassVar[tuple[str, ...]] = ()

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What the instance keeps across requests as ``(named tensors, JSON-able metadata)``.

        The default is nothing: the method keeps no state across requests (or only per-request
        state, such as the LR methods' per-session caches), and saves an empty state. Methods that
        learn across requests override this, :meth:`import_state` and :meth:`state_model`.
        """
        return {}, {}

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Replace the instance's cross-request state by an exported one (already validated)."""
        if tensors or meta:
            raise ValueError(
                f"{type(self).__name__} keeps no state across requests, but the saved state holds "
                f"{len(tensors)} tensors and metadata keys {sorted(meta)}"
            )

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

    def save_state(self, directory: str | os.PathLike, model: torch.nn.Module | None = None) -> Path:
        """Write the cross-request state to ``directory``: ``state.json`` (method, options, model
        fingerprint, metadata) and ``state.safetensors`` (tensors). No pickle. ``model`` is needed
        only when the instance holds state it was not bound to a model for.

        >>> method.save_state("runs/state/kvcmas")  # doctest: +SKIP
        >>> fresh = KVCMAS(); fresh.load_state("runs/state/kvcmas", model)  # doctest: +SKIP
        """
        from safetensors.torch import save_file

        tensors, meta = self.export_state()
        bound = self.state_model()
        if model is not None and bound is not None and model is not bound:
            raise ValueError(
                f"{type(self).__name__}: its state was built on another model object than the model= given"
            )
        model = model if model is not None else bound
        if model is None and (tensors or meta):
            raise ValueError(
                f"{type(self).__name__} holds state but is bound to no model; pass model= (the model it was built on)"
            )
        header = {
            "format": STATE_FORMAT,
            "method": self.name,
            "options": _json_options(self.state_options()),
            "model": None if model is None else model_fingerprint(model).to_dict(),
            "meta": meta,
        }
        text = json.dumps(header, indent=1, allow_nan=False)  # raises on what JSON cannot hold
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / STATE_TENSORS))
        (directory / STATE_JSON).write_text(text)
        return directory

    def load_state(self, directory: str | os.PathLike, model: torch.nn.Module | None = None) -> None:
        """Replace this instance's cross-request state by the one :meth:`save_state` wrote.

        Refused (nothing changes) when the files are missing or damaged, the method or its options
        differ, or the state was built on another model: the model given, the model the instance is
        bound to, else the first model it is attached to afterwards must have the saved fingerprint.
        """
        from safetensors.torch import load_file

        directory = Path(directory)
        header_path, tensor_path = directory / STATE_JSON, directory / STATE_TENSORS
        if not header_path.is_file() or not tensor_path.is_file():
            raise ValueError(
                f"{str(directory)!r} holds no saved method state (expected {STATE_JSON} and {STATE_TENSORS} "
                "written by Method.save_state)"
            )
        try:
            header = json.loads(header_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{header_path}: not a saved method state ({error})") from error
        if not isinstance(header, dict) or header.get("format") != STATE_FORMAT:
            got = header.get("format") if isinstance(header, dict) else header
            raise ValueError(f"{header_path}: state format {STATE_FORMAT} expected, got {got!r}")
        if header.get("method") != self.name:
            raise ValueError(
                f"{header_path} holds the state of method {header.get('method')!r}, not {self.name!r}"
            )
        mine = _json_options(self.state_options())
        saved = {
            **_json_options(self.legacy_options(header.get("meta") or {})),
            **(header.get("options") or {}),
        }
        if saved != mine:
            diff = [
                f"{k}: saved {saved.get(k)!r}, this instance {mine.get(k)!r}"
                for k in sorted({*saved, *mine})
                if saved.get(k) != mine.get(k)
            ]
            raise ValueError(f"{header_path}: the state was saved with other options ({'; '.join(diff)})")
        fingerprint = None if header.get("model") is None else ModelFingerprint.from_dict(header["model"])
        target = model if model is not None else self.state_model()
        if fingerprint is not None and target is not None:
            _check_fingerprint(type(self).__name__, fingerprint, model_fingerprint(target), "given")
        device = _model_device(target)
        tensors = load_file(str(tensor_path), device="cpu" if device is None else str(device))
        self.import_state(tensors, header.get("meta") or {})
        self.expect_model(fingerprint)


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
