"""AdmissionReview v1 on the wire: decoding with guards, and the few answers a webhook gives.

The vocabulary follows controller-runtime: `allowed`, `denied`, `patched`, `errored`; every answer
echoes the request UID.
"""

from __future__ import annotations

import array
import base64
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict

MAX_BODY_BYTES = 7 * 1024 * 1024  # the API server's own limit on an admission request

Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]


class StatusDetails(TypedDict, total=False):
    retryAfterSeconds: int


class Status(TypedDict, total=False):
    code: int
    message: str
    reason: str
    details: StatusDetails


class Response(TypedDict):
    uid: str
    allowed: bool
    status: NotRequired[Status]
    patchType: NotRequired[Literal["JSONPatch"]]
    patch: NotRequired[str]
    warnings: NotRequired[list[str]]


class Review(TypedDict):
    apiVersion: Literal["admission.k8s.io/v1"]
    kind: Literal["AdmissionReview"]
    response: Response


class BadRequestError(ValueError):
    """The HTTP request is not an AdmissionReview we can read; answered with HTTP 400."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """The parts of an AdmissionRequest vramshare looks at."""

    uid: str
    operation: Operation
    namespace: str
    name: str
    kind: str
    object: dict[str, Any]
    old_object: dict[str, Any] | None
    dry_run: bool
    username: str
    sub_resource: str = ""
    """`ephemeralcontainers` for `kubectl debug` adding a container to a running pod."""


def decode(body: bytes, *, content_type: str) -> Request:
    """Parse an AdmissionReview body, or raise `BadRequestError` with a reason a human can act on."""
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise BadRequestError(f"content type must be application/json, got {content_type!r}")
    if not body:
        raise BadRequestError("empty body: expected an AdmissionReview")
    if len(body) > MAX_BODY_BYTES:
        raise BadRequestError(f"body of {len(body)} bytes exceeds the {MAX_BODY_BYTES} byte limit")
    if nests_deeper_than(body, MAX_DEPTH):  # before parsing: Python's parser recurses
        raise BadRequestError(f"body nests more than {MAX_DEPTH} levels deep")
    try:
        review = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"body is not valid JSON: {exc}") from None
    except RecursionError:  # not reached after the depth check; kept so it can never be a 500
        raise BadRequestError(f"body nests more than {MAX_DEPTH} levels deep") from None
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise BadRequestError("body is not an AdmissionReview")
    if review.get("apiVersion") != "admission.k8s.io/v1":
        raise BadRequestError(f"apiVersion must be admission.k8s.io/v1, got {review.get('apiVersion')!r}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadRequestError("AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadRequestError("AdmissionReview request has no uid")
    operation = request.get("operation")
    if operation not in ("CREATE", "UPDATE", "DELETE", "CONNECT"):
        raise BadRequestError(f"unknown operation {operation!r}")
    obj = request.get("object")
    old = request.get("oldObject")
    kind = request.get("kind") if isinstance(request.get("kind"), dict) else {}
    user = request.get("userInfo") if isinstance(request.get("userInfo"), dict) else {}
    return Request(
        uid=uid,
        operation=operation,
        namespace=str(request.get("namespace") or ""),
        name=str(request.get("name") or ""),
        kind=str(kind.get("kind", "")),  # type: ignore[union-attr]
        object=obj if isinstance(obj, dict) else {},
        old_object=old if isinstance(old, dict) else None,
        dry_run=request.get("dryRun") is True,
        username=str(user.get("username", "")),  # type: ignore[union-attr]
        sub_resource=str(request.get("subResource") or ""),
    )


MAX_DEPTH = 100
"""Real AdmissionReviews of pods nest a few dozen levels at most; deeper bodies are refused before any
code walks them (and before Python's recursion limit turns one into an internal error)."""


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def nests_deeper_than(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests deeper than `limit`. No deeper than it has brackets that open: most
    pods' reviews have fewer than the limit, and counting them is a tenth of `nesting_depth`'s cost."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    return nesting_depth(body) > limit


def nesting_depth(body: bytes) -> int:
    """How deep the JSON text's arrays and objects nest (brackets inside strings do not count), counted
    at C speed: strings are cut out, the brackets left become +1/-1 and the deepest running sum is the
    depth. A malformed body gets some number; the parser refuses it afterwards."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS).translate(_BRACKETS)
    return max(itertools.accumulate(array.array("b", brackets)), default=0)


def _review(response: Response) -> Review:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def allowed(uid: str, *, warnings: list[str] | None = None) -> Review:
    response: Response = {"uid": uid, "allowed": True}
    if warnings:
        response["warnings"] = warnings
    return _review(response)


def patched(uid: str, operations: list[dict[str, Any]], *, warnings: list[str] | None = None) -> Review:
    review = allowed(uid, warnings=warnings)
    if operations:
        review["response"]["patchType"] = "JSONPatch"
        review["response"]["patch"] = base64.b64encode(
            json.dumps(operations, separators=(",", ":")).encode()
        ).decode()
    return review


def denied(
    uid: str, message: str, *, code: int = 403, reason: str = "Forbidden", retry_after_s: int | None = None
) -> Review:
    status: Status = {"code": code, "message": message, "reason": reason}
    if retry_after_s:
        status["details"] = {"retryAfterSeconds": retry_after_s}
    return _review({"uid": uid, "allowed": False, "status": status})


def errored(uid: str, message: str, *, code: int = 500) -> Review:
    """An internal failure, still a well-formed answer; the API server applies the failurePolicy."""
    return denied(uid, message, code=code, reason="InternalError")
