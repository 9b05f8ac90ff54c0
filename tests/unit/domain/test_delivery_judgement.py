"""The delivery preflight: what each mode's result is, from what the cluster publishes."""

from __future__ import annotations

from vramshare.domain.delivery_judgement import (
    GpuOperatorView,
    NodeRuntimeView,
    Result,
    RuntimeClassView,
    check_node,
)

NVIDIA = RuntimeClassView(name="nvidia", handler="nvidia")
OPERATOR_2510 = GpuOperatorView(name="cluster-policy", cdi_enabled=True, nri_plugin_enabled=None)


def results(node: NodeRuntimeView, **kw: object) -> dict[str, Result]:
    args: dict[str, object] = {"runtime_class": "nvidia", "runtime_classes": [NVIDIA], "gpu_operator": None}
    args.update(kw)
    return {c.mode: c.result for c in check_node(node=node, **args)}  # type: ignore[arg-type]


def test_gpu_operator_25_10_defaults_env_cannot_runtime_class_delivers() -> None:
    node = NodeRuntimeView(name="n", runtime_handlers=("", "runc", "nvidia"))
    checks = {
        c.mode: c
        for c in check_node(
            node=node, runtime_class="nvidia", runtime_classes=[NVIDIA], gpu_operator=OPERATOR_2510
        )
    }
    assert checks["env"].result is Result.CANNOT
    assert "spec.cdi.enabled: true" in checks["env"].message
    assert "use delivery mode runtime-class" in checks["env"].message
    assert checks["runtime-class"].result is Result.DELIVERS
    assert checks["cdi"].result is Result.CANNOT  # the NRI plugin is off by default
    assert checks["volume-mounts"].result is Result.UNKNOWN


def test_an_older_gpu_operator_with_cdi_off_makes_nvidia_the_default() -> None:
    old = GpuOperatorView(name="cluster-policy", cdi_enabled=False, nri_plugin_enabled=None)
    assert results(NodeRuntimeView(name="n"), gpu_operator=old)["env"] is Result.DELIVERS


def test_the_nri_plugin_enabled_delivers_cdi() -> None:
    nri = GpuOperatorView(name="cp", cdi_enabled=True, nri_plugin_enabled=True)
    assert results(NodeRuntimeView(name="n"), gpu_operator=nri)["cdi"] is Result.DELIVERS


def test_labels_decide_where_nothing_else_tells() -> None:
    bare = results(NodeRuntimeView(name="n"))
    assert bare["env"] is Result.UNKNOWN
    assert bare["cdi"] is Result.UNKNOWN
    assert bare["runtime-class"] is Result.UNKNOWN  # the class exists, the handlers are not reported
    labelled = results(
        NodeRuntimeView(
            name="n",
            labels={
                "vramshare.io/default-runtime": "nvidia",
                "vramshare.io/nri-plugin": "true",
                "vramshare.io/device-list-mounts": "true",
            },
        )
    )
    assert set(labelled.values()) == {Result.DELIVERS, Result.UNKNOWN}
    assert labelled["env"] is labelled["cdi"] is labelled["volume-mounts"] is Result.DELIVERS
    # The label wins over the ClusterPolicy: an operator who set it knows the node.
    runc = NodeRuntimeView(name="n", labels={"vramshare.io/default-runtime": "runc"})
    assert (
        results(runc, gpu_operator=GpuOperatorView(name="cp", cdi_enabled=False, nri_plugin_enabled=None))[
            "env"
        ]
        is Result.CANNOT
    )


def test_runtime_class_missing_off_node_or_without_its_handler_cannot() -> None:
    node = NodeRuntimeView(name="n", labels={"pool": "cpu"}, runtime_handlers=("", "runc"))
    checks = {
        c.mode: c
        for c in check_node(node=node, runtime_class="nvidia", runtime_classes=[], gpu_operator=None)
    }
    assert checks["runtime-class"].result is Result.CANNOT
    assert 'RuntimeClass "nvidia" does not exist' in checks["runtime-class"].message
    gpu_only = RuntimeClassView(name="nvidia", handler="nvidia", node_selector={"pool": "gpu"})
    (_, off, _, _) = check_node(
        node=node, runtime_class="nvidia", runtime_classes=[gpu_only], gpu_operator=None
    )
    assert off.result is Result.CANNOT
    assert "pool=gpu" in off.message
    (_, missing, _, _) = check_node(
        node=node, runtime_class="nvidia", runtime_classes=[NVIDIA], gpu_operator=None
    )
    assert missing.result is Result.CANNOT
    assert missing.message == (
        'the node\'s container runtime has no handler "nvidia" (RuntimeClass "nvidia"), only "" (the '
        "default), runc: pods naming the class fail to start"
    )
