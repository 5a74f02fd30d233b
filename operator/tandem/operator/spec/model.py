"""``spec.model``: the model to serve and where its weights come from."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .rules import Rule, SpecModel

MODEL_URI_SCHEMES = ("hf://", "pvc://", "/")


class ModelCache(SpecModel):
    """Where an ``hf://`` model is downloaded to: a PVC the operator creates, or an existing one."""

    claim_name: str | None = Field(
        None, description="Use this existing PVC as the cache instead of creating one"
    )
    size: str = Field("100Gi", description="Size of the cache PVC the operator creates")
    storage_class_name: str | None = Field(
        None, description="StorageClass of the cache PVC the operator creates"
    )
    access_modes: list[str] = Field(
        default_factory=lambda: ["ReadWriteMany"],
        description="Access modes of the cache PVC (engines on many nodes read it)",
    )
    retain: bool = Field(
        True,
        description="Keep the cache PVC when the InferenceService is deleted; a new one of the "
        "same name and model adopts it without downloading again",
    )


def _uri_ok(uri: str) -> bool:
    if uri.startswith("hf://"):
        return len([p for p in uri[5:].split("/") if p]) == 2
    if uri.startswith("pvc://"):
        return bool(uri[6:].split("/", 1)[0])
    return uri.startswith("/")


class ModelSpec(SpecModel):
    """The model to serve and where its weights come from."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=256,
        description="The model name clients send in 'model' (--served-model-name)",
    )
    uri: str = Field(
        ...,
        min_length=1,
        max_length=1024,
        description="hf://org/repo, pvc://claim/path, or an absolute path in the image",
    )
    revision: str | None = Field(
        None, description="Hugging Face revision (branch, tag or commit) for hf:// models"
    )
    credentials_secret: str | None = Field(
        None, description="Secret with key HF_TOKEN, used to download gated hf:// models"
    )
    cache: ModelCache | None = Field(
        None, description="Download cache for hf:// models (default: a new PVC)"
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.uri.startsWith('/') || self.uri.matches('^hf://[^/]+/[^/]+$')"
            " || self.uri.matches('^pvc://[^/]+(/.*)?$')",
            "model.uri must be hf://org/repo, pvc://claim/path or an absolute path",
            lambda m: _uri_ok(m.uri),
            field=".uri",
        ),
        Rule(
            "self.uri.startsWith('hf://') || (!has(self.revision) && !has(self.cache)"
            " && !has(self.credentialsSecret))",
            "model.revision, model.cache and model.credentialsSecret apply only to hf:// models",
            lambda m: (
                m.uri.startswith("hf://")
                or (m.revision is None and m.cache is None and m.credentials_secret is None)
            ),
        ),
    )


LORA_NAME = r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$"


def _pvc_path(uri: str) -> tuple[str, str] | None:
    """``pvc://CLAIM/PATH`` as (claim, path), None when either is empty."""
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    ok = uri.startswith("pvc://") and claim and path.strip("/")
    return (claim, path) if ok else None


def lora_on_model_claim(uri: str, model_uri: str) -> bool:
    """A ``pvc://`` adapter is on the claim the model is mounted from (so the engines see
    it without a new volume, which would roll them); other URIs pass."""
    parts = _pvc_path(uri)
    if parts is None:
        return True
    return model_uri.startswith("pvc://") and model_uri[6:].split("/")[0] == parts[0]


class LoraSpec(SpecModel):
    """One LoRA adapter of the model (PEFT's format), served as ``model`` = its name."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=128,
        pattern=LORA_NAME,
        description="The name clients send in 'model' to run through this adapter",
    )
    uri: str = Field(
        ...,
        min_length=1,
        max_length=1024,
        description="The adapter's PEFT directory: an absolute path in the engine pods (the "
        "image, or a volume of podTemplate), or pvc://claim/path on the model's own claim",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "self.uri.startsWith('/') || self.uri.matches('^pvc://[^/]+/.*[^/].*$')",
            "loras[].uri must be an absolute path or pvc://claim/path",
            lambda a: a.uri.startswith("/") or _pvc_path(a.uri) is not None,
            field=".uri",
        ),
    )
