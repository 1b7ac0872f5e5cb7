"""Validate Kubernetes objects against the OpenAPI-derived JSON schema of the API version the
pinned client targets (kubernetes 37.x = Kubernetes 1.37), strict: an unknown field is an error.
The schemas ship inside kubernetes-validate; nothing is downloaded."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
from kubernetes_validate import utils
from referencing import Registry, Resource

K8S_VERSION = "1.37"


def validate_object(obj: dict[str, Any]) -> None:
    """Raise kubernetes_validate.ValidationError unless `obj` is valid for Kubernetes 1.37.

    `Status` (apiVersion v1, the errors' and deletions' answer) is filed under meta/v1 in the
    schema set, where kubernetes-validate's name lookup does not find it; it is read directly.
    """
    if obj.get("kind") != "Status":
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return
    folder = f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict"
    schema = utils.schema_contents(f"{folder}/status-meta-v1.json", K8S_VERSION)
    definitions = utils.schema_contents(f"{folder}/_definitions.json", K8S_VERSION)
    registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(definitions) @ registry
    try:
        jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(obj)
    except jsonschema.ValidationError as exc:
        raise kubernetes_validate.ValidationError(exc, version=K8S_VERSION) from None
