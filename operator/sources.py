"""sources: where the weights a pod loads come from — the model (``model.uri``) and the heads a
speculative method drafts with (``speculative.mtpPath``, ``speculative.eagle3Path``).

Every source is a pvc://claim/path, file:///path or hf://org/name (the model may also be a packaged
alias) and comes into the pod the same way, under a volume, mount and init container of its own:
a claim is mounted read-only, an hf:// repository is fetched by the init container into the cache
claim (or an emptyDir), a file:// path is used as written. resolve checks the URIs and keeps
``spec.pod`` off these names; render mounts them and hands the runtime the path inside the pod.

A head source belongs to one method: ``SpeculativeConfig`` refuses its field under any other, so a
spec names at most one. Pure and torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdecode.operator import names
from specdecode.operator.spec import ModelLocation, ModelScheme, SpecDecodeDeploymentSpec, in_crd_spelling
from specdecode.runtime.config import SpeculativeConfig


@dataclass(frozen=True)
class Source:
    """How one source comes into the pod."""

    volume: str
    mount: str
    fetch_container: str
    field: str  # where the spec names it, as the CRD spells it
    what: str  # e.g. "the model"

    @property
    def described(self) -> str:
        return f"{self.what} ({self.field})"


@dataclass(frozen=True)
class HeadSource(Source):
    """A speculative field naming heads; ``config_field`` is the runtime's (snake_case) name of it."""

    config_field: str
    folder: str  # what the URI points at, for messages
    when_unset: str | None  # what leaving it unset does; None: its method needs it

    def uri(self, speculative: SpeculativeConfig) -> str | None:
        return getattr(speculative, self.config_field)


def _head(config_field: str, what: str, volume: str, mount: str, fetch_container: str, folder: str,
          when_unset: str | None = None) -> HeadSource:
    field = f"spec.speculative.{in_crd_spelling(config_field)}"
    return HeadSource(volume, mount, fetch_container, field, what, config_field, folder, when_unset)


MODEL = Source(names.MODEL_VOLUME, names.MODEL_MOUNT, names.FETCH_CONTAINER, "spec.model.uri", "the model")
MTP_HEADS = _head("mtp_path", "the MTP heads", names.MTP_VOLUME, names.MTP_MOUNT, names.FETCH_MTP_CONTAINER,
                  "the folder `specdecode train-mtp` wrote",
                  when_unset="draft with the MTP layers of the model's own checkpoint")
EAGLE3_HEAD = _head("eagle3_path", "the EAGLE-3 head", names.EAGLE3_VOLUME, names.EAGLE3_MOUNT,
                    names.FETCH_EAGLE3_CONTAINER, "the folder of an EAGLE-3 head: config.json and its weights, in "
                    "the original release's layout or speculators' format")
HEAD_SOURCES = (MTP_HEADS, EAGLE3_HEAD)
SOURCES = (MODEL, *HEAD_SOURCES)


def heads(speculative: SpeculativeConfig) -> tuple[ModelLocation, HeadSource] | None:
    """The heads this config drafts with, if it names any."""
    for source in HEAD_SOURCES:
        uri = source.uri(speculative)
        if uri:
            return ModelLocation.parse(uri), source
    return None


def brought_in(spec: SpecDecodeDeploymentSpec) -> list[tuple[ModelLocation, Source]]:
    """Every source the pods load: the model, then the heads if given."""
    head = heads(spec.speculative)
    return [(spec.model.location, MODEL), *([head] if head else [])]


def local_path(location: ModelLocation, source: Source) -> str:
    """Where ``location`` is inside the pod."""
    if location.scheme in (ModelScheme.PVC, ModelScheme.HF):
        return f"{source.mount}/{location.path}"
    return location.path  # an absolute path (file://) or a packaged alias
