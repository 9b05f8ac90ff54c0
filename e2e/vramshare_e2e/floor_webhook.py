"""The admission benchmark's floors: TLS webhooks that do the least a design of vramshare's kind must.

- `one-write` (issue #31): per pod, one durable write (a `FloorBooking`, a copy of the GpuReservation
  kind under another group, so that vramshare does not act on it) and then allow, with each replica
  watching every booking: the floor of any design in which webhook replicas book in the API server
  and see each other's bookings.
- `pinned` (issue #45): the same, and the pod pinned to a GPU as vramshare pins it (the same JSON
  Patch: the GPU in every container's environment, the node affinity, the placement annotations and a
  label), with each replica watching the pods it labelled, as vramshare's replicas watch theirs to
  count a booking from its pod's start. What is left between it and vramshare is vramshare's own: the
  decision, its reads, the GPUs' tokens, the grants and the controller.

Run one with `python -m vramshare_e2e.floor_webhook MODE ...`; `start_floor_webhooks` does it on a
cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import secrets
import ssl
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from vramshare.kube.resources import LABEL_RESERVATION
from vramshare_e2e.admission_parts import start_part
from vramshare_e2e.cluster import CRDS_DIR, LocalCluster
from vramshare_e2e.components import POD_CREATE_RULES
from vramshare_e2e.ports import free_port
from vramshare_e2e.process import http_ok
from vramshare_webhook.pod import Placement
from vramshare_webhook.pod_patch import placement_patch

FLOOR_GROUP = "floor.bench.vramshare.io"
FLOOR_PLURAL = "floorbookings"
FLOOR_LABEL = f"{FLOOR_GROUP}/floor"
"""Which floor made a booking: each floor's replicas watch their own floor's, as vramshare's watch
vramshare's (not the other floor's as well, which cost each floor's phase the other's watch)."""
PINNED_LABEL = f"{FLOOR_GROUP}/reservation"
"""The pinned floor's label in place of vramshare's (whose pod watches would take its pods in)."""
MODES = ("one-write", "pinned")


def floor_crd(reservation_crd: dict[str, Any]) -> dict[str, Any]:
    """The GpuReservation CRD under another group and kind, its schema and validation unchanged: a
    booking as costly to store, validate and watch, which no vramshare component watches."""
    crd: dict[str, Any] = json.loads(json.dumps(reservation_crd))
    crd["metadata"] = {"name": f"{FLOOR_PLURAL}.{FLOOR_GROUP}"}
    crd["spec"]["group"] = FLOOR_GROUP
    crd["spec"]["names"] = {
        "plural": FLOOR_PLURAL,
        "singular": "floorbooking",
        "kind": "FloorBooking",
        "listKind": "FloorBookingList",
    }
    return crd


def pin_patch(pod: dict[str, Any], *, booking: str, node: str, gpu_uuid: str) -> list[dict[str, Any]]:
    """vramshare's placement patch for `pod` on that GPU, under the pinned floor's label."""
    ops = placement_patch(pod, Placement(reservation=booking, gpu_uuid=gpu_uuid, gpu_index=0, node=node))
    for op in ops:
        if op["path"] == "/metadata/labels":
            labels = dict(op["value"])
            labels[PINNED_LABEL] = labels.pop(LABEL_RESERVATION)
            op["value"] = labels
    return ops


def floor_app(*, kubeconfig: str, mode: str, nodes: list[str]) -> web.Application:
    """The `one-write` or `pinned` webhook (see the module docstring). `nodes`: where `pinned` pins
    pods, in turn (one fake GPU on each)."""
    from vramshare.kube.client import Connection, KubeClient
    from vramshare.kube.sightings import LabelledPod
    from vramshare.kube.watch import WatchCache

    app = web.Application()
    path = f"/apis/{FLOOR_GROUP}/v1alpha1"
    turn = 0

    async def client(app: web.Application) -> Any:
        async with KubeClient(Connection.load(kubeconfig=kubeconfig)) as kube:
            app["kube"] = kube
            bookings = WatchCache(
                kube,
                f"{path}/{FLOOR_PLURAL}",
                decode=lambda o: o,
                label_selector=f"{FLOOR_LABEL}={mode}",
                name=FLOOR_PLURAL,
            )
            running = [asyncio.create_task(bookings.run())]
            if mode == "pinned":
                # As vramshare's replicas keep their GPU pods: decoded into what the accounting needs.
                pods = WatchCache(
                    kube,
                    "/api/v1/pods",
                    decode=LabelledPod.from_wire,
                    label_selector=PINNED_LABEL,
                    name="pods",
                )
                running.append(asyncio.create_task(pods.run()))
            yield
            for task in running:
                task.cancel()

    async def mutate(request: web.Request) -> web.Response:
        nonlocal turn
        review = await request.json()
        req = review["request"]
        pod = req.get("object") or {}
        name = (pod.get("metadata") or {}).get("name") or "pod"
        booking = {
            "apiVersion": f"{FLOOR_GROUP}/v1alpha1",
            "kind": "FloorBooking",
            "metadata": {"generateName": f"{name}-", "labels": {FLOOR_LABEL: mode}},
            "spec": {"podName": name, "memoryMiB": 10},
        }
        if not req.get("dryRun"):  # registered NoneOnDryRun, as vramshare is: a dry run books nothing
            await app["kube"].create(f"{path}/namespaces/{req['namespace']}/{FLOOR_PLURAL}", booking)
        response: dict[str, Any] = {"uid": req["uid"], "allowed": True}
        if mode == "pinned":
            node = nodes[turn % len(nodes)]
            turn += 1
            # A label value as vramshare's (a booking's name: the pod's, and a random suffix).
            label = f"{name[:52].rstrip('-.')}-{secrets.token_hex(4)}"
            patch = pin_patch(pod, booking=label, node=node, gpu_uuid=f"GPU-floor-{node}")
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
        return web.json_response(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.cleanup_ctx.append(client)
    app.router.add_post("/mutate", mutate)
    app.router.add_get("/healthz", healthz)
    return app


def floor_components(mode: str, replicas: int = 2) -> tuple[str, ...]:
    """The names `start_floor_webhooks` gives its replicas."""
    prefix = "e2e-one-write" if mode == "one-write" else "e2e-pinned"
    return tuple(f"{prefix}-{i}" for i in range(replicas))


def namespace_label(mode: str) -> str:
    """The namespace label (value: the replica's index) that sends a namespace's pods to a replica."""
    return f"e2e.vramshare.io/{mode}"


def start_floor_webhooks(
    cluster: LocalCluster, *, mode: str, replicas: int = 2, kubeconfig: Path | None = None
) -> None:
    """Install the FloorBooking kind (once) and start `replicas` webhooks of `mode`, each registered for
    the namespaces labelled `namespace_label(mode)=<its index>` (each replica its own, as the
    benchmark's two vramshare replicas each have theirs); they book as `kubeconfig` (the admin's
    unless given). `pinned` pins pods to the cluster's nodes in turn."""
    if mode not in MODES:
        raise ValueError(f"floor webhook mode {mode!r}: accepted {', '.join(MODES)}")
    reservation_crd = next(
        d for d in yaml.safe_load_all((CRDS_DIR / "vramshare.io_gpureservations.yaml").read_text()) if d
    )
    cluster.apply_objects([floor_crd(reservation_crd)])
    cluster.wait_for(
        lambda: FLOOR_PLURAL in cluster.kubectl("api-resources", f"--api-group={FLOOR_GROUP}", "-o", "name"),
        what="the FloorBooking kind served",
        timeout_s=30,
    )
    nodes = [n.removeprefix("node/") for n in cluster.kubectl("get", "nodes", "-o", "name").split()]
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    hooks = []
    for index, name in enumerate(floor_components(mode, replicas)):
        port = free_port()
        pair = cluster.ca.issue(name, common_name=name, server_ips=("127.0.0.1",))
        start_part(
            cluster,
            name=name,
            module="vramshare_e2e.floor_webhook",
            args=[
                mode,
                f"--port={port}",
                f"--cert={pair.cert_path}",
                f"--key={pair.key_path}",
                f"--kubeconfig={kubeconfig or cluster.kubeconfig}",
                f"--nodes={','.join(nodes)}",
            ],
            ready=lambda port=port: http_ok(f"https://127.0.0.1:{port}/healthz", context=ctx),  # type: ignore[misc]
        )
        hooks.append(
            {
                "name": f"{mode}-{index}.e2e.vramshare.io",
                "admissionReviewVersions": ["v1"],
                # Its write is a side effect, as vramshare's booking is.
                "sideEffects": "NoneOnDryRun",
                "failurePolicy": "Fail",
                "reinvocationPolicy": "Never",
                "timeoutSeconds": 10,
                "clientConfig": {
                    "url": f"https://127.0.0.1:{port}/mutate",
                    "caBundle": base64.b64encode(cluster.ca.cert_pem).decode(),
                },
                "rules": POD_CREATE_RULES,
                "namespaceSelector": {"matchLabels": {namespace_label(mode): str(index)}},
            }
        )
    cluster.apply_objects(
        [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": f"zz-e2e-{mode}"},
                "webhooks": hooks,
            }
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vramshare_e2e.floor_webhook")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--kubeconfig", required=True, help="the API server to book in")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--nodes", default="", help="pinned: the nodes to pin pods to, comma-separated")
    args = parser.parse_args(argv)
    nodes = [n for n in args.nodes.split(",") if n]
    if args.mode == "pinned" and not nodes:
        parser.error("pinned needs --nodes")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.cert, args.key)
    app = floor_app(kubeconfig=args.kubeconfig, mode=args.mode, nodes=nodes)
    web.run_app(app, host="127.0.0.1", port=args.port, ssl_context=context, print=None)


if __name__ == "__main__":
    main()
