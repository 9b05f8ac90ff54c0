"""The Helm chart rendered by the real helm: lint, every TLS mode, the hide-GPUs switch, schema errors,
settings named as the components name them, hardened pods, CRDs identical to crds/."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramshare.controller.metrics import ControllerMetrics
from vramshare.controller.settings import ControllerSettings
from vramshare.domain import Accounting
from vramshare.settings import variables
from vramshare_e2e import chart_docs
from vramshare_e2e.tools import tools_bin_dir
from vramshare_webhook.metrics import WebhookMetrics
from vramshare_webhook.settings import WebhookSettings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "vramshare"
KUBE_VERSION = "1.37.2"
VARIANTS = {
    "default": [],
    "secret-tls": [
        "--set",
        "webhook.tls.mode=secret",
        "--set",
        "webhook.tls.existingSecret=my-tls",
        "--set",
        "webhook.tls.caBundle=Q0E=",
    ],
    "cert-manager": ["--set", "webhook.tls.mode=cert-manager"],
    "no-hide": ["--set", "webhook.hideGpus.enabled=false"],
    "everything": [
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "grafanaDashboard.enabled=true",
        "--set",
        "webhook.replicas=3",
        "--set",
        "global.settings.policy=binpack",
        "--set",
        "webhook.settings.queue_by_default=true",
        "--set",
        "webhook.settings.denial_code=429",
        "--set",
        "controller.airflowPool.enabled=true",
        "--set",
        "controller.airflowPool.url=https://airflow-api-server.airflow.svc:8080",
        "--set",
        "controller.airflowPool.credentialsSecret=airflow-pool-sync",
        "--set",
        "controller.airflowPool.caFile=/var/run/secrets/vramshare/airflow/ca.crt",
        "--set",
        "controller.airflowPool.basis=memory",
        "--set-string",
        "webhook.clientAuth.caBundle=-----BEGIN CERTIFICATE-----",
        "--set",
        "webhook.clientAuth.names[0]=kube-apiserver",
    ],
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(tools_bin_dir() / "helm"), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def render(*values: str) -> list[dict[str, Any]]:
    out = helm("template", "t", str(CHART), "-n", "vramshare", "--kube-version", KUBE_VERSION, *values).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


def env(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lint_strict(variant: str) -> None:
    result = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *VARIANTS[variant])
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_crds_in_the_chart_are_the_ones_in_crds() -> None:
    chart_crds = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    source = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    assert chart_crds == source


def test_settings_are_named_as_the_components_name_them() -> None:
    docs = render(*VARIANTS["everything"])
    webhook = env(find(docs, "Deployment", "-webhook"))
    controller = env(find(docs, "Deployment", "-controller"))
    webhook_fields = variables(WebhookSettings())
    controller_fields = variables(ControllerSettings())
    assert set(webhook) <= webhook_fields, set(webhook) - webhook_fields
    assert set(controller) <= controller_fields, set(controller) - controller_fields
    # Every setting is reachable from values, but the few the chart decides itself.
    assert webhook_fields - set(webhook) == {
        "VRAMSHARE_HOST",
        "VRAMSHARE_KUBECONFIG",
        "VRAMSHARE_TLS_CERT_FILE",
        "VRAMSHARE_TLS_KEY_FILE",
        "VRAMSHARE_TLS_SYNC_INTERVAL_S",
    }
    # The holders' API server address comes from global.apiServer, where it is set.
    assert controller_fields - set(controller) == {
        "VRAMSHARE_KUBECONFIG",
        "VRAMSHARE_METRICS_HOST",
        "VRAMSHARE_HOLDER_API_SERVER",
    }
    with_api = env(
        find(
            render("--set", "global.apiServer.host=10.0.0.1", "--set", "global.apiServer.port=6443"),
            "Deployment",
            "-controller",
        )
    )
    assert with_api["VRAMSHARE_HOLDER_API_SERVER"] == "10.0.0.1:6443"
    assert webhook["VRAMSHARE_POLICY"] == controller["VRAMSHARE_POLICY"] == "binpack"  # queued pods too
    assert webhook["VRAMSHARE_QUEUE_BY_DEFAULT"] == "true"
    assert webhook["VRAMSHARE_DENIAL_CODE"] == "429"
    assert webhook["VRAMSHARE_EXECUTOR_REFUSAL"] == "requeue"
    assert controller["VRAMSHARE_AIRFLOW_POOL_BASIS"] == "memory"
    assert controller["VRAMSHARE_AIRFLOW_USERNAME"] == {
        "secretKeyRef": {"name": "airflow-pool-sync", "key": "username"}
    }
    # The password is a file from the mounted Secret, not an environment variable.
    assert controller["VRAMSHARE_AIRFLOW_PASSWORD_FILE"] == "/var/run/secrets/vramshare/airflow/password"
    pod = find(docs, "Deployment", "-controller")["spec"]["template"]["spec"]
    assert {"name": "airflow", "secret": {"secretName": "airflow-pool-sync"}} in pod["volumes"]
    # Shared settings reach both components with one value.
    for key in [*variables(Accounting()), "VRAMSHARE_HOLD_LIMIT_S"]:
        assert webhook[key] == controller[key]


def test_settings_from_the_chart_are_accepted_by_the_components() -> None:
    docs = render()
    values = {k: v for k, v in env(find(docs, "Deployment", "-webhook")).items() if isinstance(v, str)}
    WebhookSettings.from_env(values)  # raises SettingsError on a value the component refuses
    values = {k: v for k, v in env(find(docs, "Deployment", "-controller")).items() if isinstance(v, str)}
    ControllerSettings.from_env(values)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pods_are_hardened(variant: str) -> None:
    for deployment in [d for d in render(*VARIANTS[variant]) if d["kind"] == "Deployment"]:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert container["resources"]["requests"]
        assert container["resources"]["limits"]["memory"]
        assert (
            pod["serviceAccountName"].endswith(deployment["metadata"]["name"][-len("-webhook") :])
            or pod["serviceAccountName"] == deployment["metadata"]["name"]
        )


def test_webhook_configuration() -> None:
    docs = render()
    config = find(docs, "MutatingWebhookConfiguration")
    gpu, hide = config["webhooks"]
    for hook in (gpu, hide):
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["matchPolicy"] == "Equivalent"
        assert hook["sideEffects"] == "NoneOnDryRun"
        assert hook["reinvocationPolicy"] == "IfNeeded"
        excluded = next(
            e
            for e in hook["namespaceSelector"]["matchExpressions"]
            if e["key"] == "kubernetes.io/metadata.name"
        )
        assert excluded == {
            "key": "kubernetes.io/metadata.name",
            "operator": "NotIn",
            "values": ["vramshare", "kube-system"],
        }
    assert gpu["failurePolicy"] == "Fail"
    assert gpu["timeoutSeconds"] == 10
    assert gpu["matchConditions"][0]["expression"] == (
        "has(object.metadata.annotations) && 'gpu-mem-mb' in object.metadata.annotations"
    )
    assert hide["namespaceSelector"]["matchLabels"] == {"vramshare.io/managed": "true"}
    assert env(find(docs, "Deployment", "-webhook"))["VRAMSHARE_HIDE_GPUS"] == "true"

    for hook in (gpu, hide):  # kubectl debug containers are pinned or hidden too
        assert [r["resources"] for r in hook["rules"]] == [["pods"], ["pods/ephemeralcontainers"]]
        assert [r["operations"] for r in hook["rules"]] == [["CREATE"], ["UPDATE"]]
    # A rolling update drains: preStop sleep, then the in-process delay, within the grace period.
    pod = find(docs, "Deployment", "-webhook")["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert pod["terminationGracePeriodSeconds"] == 30
    assert env(find(docs, "Deployment", "-webhook"))["VRAMSHARE_SHUTDOWN_DELAY_S"] == "3"
    no_sleep = find(render("--set", "webhook.preStopSleepSeconds=0"), "Deployment", "-webhook")
    assert "lifecycle" not in no_sleep["spec"]["template"]["spec"]["containers"][0]

    no_hide = render(*VARIANTS["no-hide"])
    assert len(find(no_hide, "MutatingWebhookConfiguration")["webhooks"]) == 1
    assert env(find(no_hide, "Deployment", "-webhook"))["VRAMSHARE_HIDE_GPUS"] == "false"


def test_tls_modes() -> None:
    managed = render()
    webhook = find(managed, "Deployment", "-webhook")
    assert env(webhook)["VRAMSHARE_TLS_MODE"] == "self-managed"
    assert env(webhook)["VRAMSHARE_TLS_NAMES"] == (
        "t-vramshare-webhook.vramshare.svc,t-vramshare-webhook.vramshare.svc.cluster.local"
    )
    assert (
        env(webhook)["VRAMSHARE_WEBHOOK_CONFIGURATION"]
        == find(managed, "MutatingWebhookConfiguration")["metadata"]["name"]
    )
    role = find(managed, "ClusterRole", "-webhook")
    assert {
        "apiGroups": ["admissionregistration.k8s.io"],
        "resources": ["mutatingwebhookconfigurations"],
        "resourceNames": ["t-vramshare"],
        "verbs": ["get", "patch"],
    } in role["rules"]

    secret = render(*VARIANTS["secret-tls"])
    webhook = find(secret, "Deployment", "-webhook")
    assert env(webhook)["VRAMSHARE_TLS_CERT_FILE"] == "/tls/tls.crt"
    assert {"name": "tls", "secret": {"secretName": "my-tls"}} in webhook["spec"]["template"]["spec"][
        "volumes"
    ]
    assert find(secret, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"] == "Q0E="
    assert not any(
        r["resources"] == ["mutatingwebhookconfigurations"]
        for r in find(secret, "ClusterRole", "-webhook")["rules"]
    )

    cm = render(*VARIANTS["cert-manager"])
    assert find(cm, "Certificate", "webhook")["spec"]["secretName"] == "t-vramshare-webhook-tls"
    assert find(cm, "MutatingWebhookConfiguration")["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "vramshare/t-vramshare-webhook"
    }
    # A CA chain: self-signed -> a 10-year CA -> a CA Issuer that signs the serving certificate, so
    # the injected caBundle does not change at every serving-certificate renewal.
    issuers = {d["metadata"]["name"]: d["spec"] for d in cm if d["kind"] == "Issuer"}
    assert issuers == {
        "t-vramshare-webhook-selfsigned": {"selfSigned": {}},
        "t-vramshare-webhook": {"ca": {"secretName": "t-vramshare-webhook-ca"}},
    }
    ca = find(cm, "Certificate", "-webhook-ca")["spec"]
    assert (ca["isCA"], ca["issuerRef"]["name"]) == (True, "t-vramshare-webhook-selfsigned")
    assert find(cm, "Certificate", "webhook")["spec"]["issuerRef"] == {
        "kind": "Issuer",
        "name": "t-vramshare-webhook",
    }


def test_replicas_are_known_from_their_endpoints_by_default_and_leases_are_opt_in() -> None:
    def rules(docs: list[dict[str, Any]], resource: str) -> list[dict[str, Any]]:
        (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "t-vramshare-webhook"]
        return [r for r in role["rules"] if resource in r["resources"]]

    def lease_writes(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rules(docs, "leases") if "patch" in r["verbs"]]

    # By default: the pods ready behind the webhook's own Service, read-only.
    default = render()
    webhook_env = env(find(default, "Deployment", "-webhook"))
    assert (
        webhook_env["VRAMSHARE_REPLICA_SERVICE"] == find(default, "Service", "-webhook")["metadata"]["name"]
    )
    assert webhook_env["VRAMSHARE_REPLICA_LEASE_S"] == "0"
    (read,) = rules(default, "endpointslices")
    assert set(read["verbs"]) == {"list", "watch"}
    assert lease_writes(default) == []  # it only reads the controller's Lease, by name
    off = render("--set", "webhook.replicaEndpoints=false")
    assert "VRAMSHARE_REPLICA_SERVICE" not in env(find(off, "Deployment", "-webhook"))
    assert rules(off, "endpointslices") == []
    # Leases instead (replicas not behind the Service): their write rights, and no endpoints.
    dealt = render("--set", "webhook.settings.replica_lease_s=15")
    assert env(find(dealt, "Deployment", "-webhook"))["VRAMSHARE_REPLICA_LEASE_S"] == "15"
    assert "VRAMSHARE_REPLICA_SERVICE" not in env(find(dealt, "Deployment", "-webhook"))
    assert rules(dealt, "endpointslices") == []
    (rule,) = lease_writes(dealt)
    assert "resourceNames" not in rule
    assert {"list", "watch", "create", "delete"} <= set(rule["verbs"])


def test_optional_objects_and_pdb() -> None:
    docs = render(*VARIANTS["everything"])
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "NetworkPolicy", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert find(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    dashboard = find(docs, "ConfigMap", "-dashboard")
    assert '"title": "vramshare"' in dashboard["data"]["vramshare.json"]
    single = render("--set", "webhook.replicas=1")
    assert "PodDisruptionBudget" not in {d["kind"] for d in single}
    # The webhook port: open by default, or only to the API server's addresses; metrics on a port of
    # their own, which Prometheus reaches without reaching /mutate (issue #42, 2).
    mutate, metrics = find(docs, "NetworkPolicy", "-webhook")["spec"]["ingress"]
    assert "from" not in mutate
    assert metrics["ports"] == [{"port": 8081, "protocol": "TCP"}]
    limit = [
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "networkPolicy.webhookFrom[0].ipBlock.cidr=172.16.0.0/28",
        "--set",
        "networkPolicy.prometheusSelector.app=prometheus",
    ]
    mutate, metrics = find(render(*limit), "NetworkPolicy", "-webhook")["spec"]["ingress"]
    assert mutate == {
        "ports": [{"port": 8443, "protocol": "TCP"}],
        "from": [{"ipBlock": {"cidr": "172.16.0.0/28"}}],
    }
    assert metrics["from"] == [{"namespaceSelector": {}, "podSelector": {"app": "prometheus"}}]
    # With metrics on the HTTPS port (metricsPort 0), Prometheus must reach that port: the old way.
    (shared,) = find(render(*limit, "--set", "webhook.metricsPort=0"), "NetworkPolicy", "-webhook")["spec"][
        "ingress"
    ]
    assert shared["from"] == [
        {"ipBlock": {"cidr": "172.16.0.0/28"}},
        {"namespaceSelector": {}, "podSelector": {"app": "prometheus"}},
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            ["--set", "global.settings.policy=pack"],
            "at '/global/settings/policy': value must be one of 'spread', 'binpack'",
        ),
        (["--set", "webhook.replicas=two"], "at '/webhook/replicas': got string, want integer"),
        (["--set", "webhook.colour=blue"], "at '/webhook': additional properties 'colour' not allowed"),
        (["--set", "webhook.timeoutSeconds=45"], "at '/webhook/timeoutSeconds': maximum: got 45, want 30"),
        (
            ["--set", "controller.settings.prometheus_url=prometheus:9090"],
            "/controller/settings/prometheus_url",
        ),
        (
            ["--set", "webhook.settings.decision_deadline_s=12"],
            "decision_deadline_s must be below webhook.timeoutSeconds",
        ),
        (
            ["--set", "webhook.tls.mode=secret"],
            "webhook.tls.existingSecret is required in the secret TLS mode",
        ),
        (
            ["--set", "controller.airflowPool.enabled=true"],
            "controller.airflowPool.url is required when the pool sync is enabled",
        ),
        (
            ["--set", "controller.airflowPool.basis=gpus"],
            "at '/controller/airflowPool/basis': value must be one of 'ready-gpus', 'memory'",
        ),
    ],
)
def test_bad_values_are_refused_with_a_readable_message(values: list[str], message: str) -> None:
    result = helm("template", "t", str(CHART), "--kube-version", KUBE_VERSION, *values, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_as_a_subchart_with_a_parents_global_values(tmp_path: Path) -> None:
    """A parent chart (as a platform's umbrella chart would) with its own global keys and overrides."""
    parent = tmp_path / "platform"
    (parent / "charts").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / "vramshare")
    (parent / "Chart.yaml").write_text(
        "apiVersion: v2\nname: platform\nversion: 1.0.0\n"
        "dependencies:\n  - name: vramshare\n    version: '>=0.0.0-0'\n"
    )
    (parent / "values.yaml").write_text(
        yaml.safe_dump(
            {
                "global": {
                    "imageRegistry": "registry.example",
                    "storageClass": "fast",
                    "labels": {"team": "ml"},
                },
                "vramshare": {"nameOverride": "gpushare", "webhook": {"replicas": 1}},
            }
        )
    )
    helm("lint", str(parent))
    out = helm("template", "p", str(parent), "-n", "platform", "--kube-version", KUBE_VERSION).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    webhook = find(docs, "Deployment", "-webhook")
    assert webhook["metadata"]["name"] == "p-gpushare-webhook"
    assert webhook["metadata"]["labels"]["app.kubernetes.io/name"] == "gpushare"
    assert webhook["metadata"]["labels"]["team"] == "ml"  # the parent's global.labels reach the subchart
    assert webhook["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "gpushare"


def test_names_security_context_port_and_host_network_are_values() -> None:
    docs = render(
        "--set",
        "fullnameOverride=gpu",
        "--set",
        "securityContext.runAsUser=null",
        "--set",
        "securityContext.runAsGroup=null",
        "--set",
        "webhook.port=10250",
        "--set",
        "webhook.hostNetwork=true",
        "--set",
        "networkPolicy.enabled=true",
    )
    webhook = find(docs, "Deployment", "gpu-webhook")
    pod = webhook["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # OpenShift assigns the user from the namespace's range: none is set, the rest stays restricted.
    assert "runAsUser" not in container["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert container["ports"] == [
        {"name": "https", "containerPort": 10250},
        {"name": "metrics", "containerPort": 8081},
    ]
    assert env(webhook)["VRAMSHARE_PORT"] == "10250"
    ingress, metrics = find(docs, "NetworkPolicy", "gpu-webhook")["spec"]["ingress"]
    assert ingress["ports"] == [{"port": 10250, "protocol": "TCP"}]
    assert metrics["ports"] == [{"port": 8081, "protocol": "TCP"}]
    assert find(docs, "Service", "gpu-webhook")["spec"]["ports"][0]["targetPort"] == "https"
    plain = find(render(), "Deployment", "-webhook")["spec"]["template"]["spec"]
    assert "hostNetwork" not in plain
    assert plain["containers"][0]["securityContext"]["runAsUser"] == 65532


def test_on_the_node_network_each_pod_listens_on_its_ip_and_rolls_one_at_a_time() -> None:
    docs = render(
        *("--set", "webhook.hostNetwork=true", "--set", "controller.hostNetwork=true"),
        *("--set", "global.apiServer.host=10.1.2.3", "--set", "global.apiServer.port=6443"),
    )
    on_pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    one_at_a_time = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    for name, listen in (("-webhook", "VRAMSHARE_HOST"), ("-controller", "VRAMSHARE_METRICS_HOST")):
        deployment = find(docs, "Deployment", name)
        assert deployment["spec"]["template"]["spec"]["hostNetwork"] is True
        # A surge pod would find its port taken on every node: the rollout would stall.
        assert deployment["spec"]["strategy"] == one_at_a_time
        variables = env(deployment)
        assert variables[listen] == on_pod_ip
        assert (variables["KUBERNETES_SERVICE_HOST"], variables["KUBERNETES_SERVICE_PORT"]) == (
            "10.1.2.3",
            "6443",
        )
    (test_pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert test_pod["spec"]["hostNetwork"] is True
    assert {e["name"]: e["value"] for e in test_pod["spec"]["containers"][0]["env"]} == {
        "KUBERNETES_SERVICE_HOST": "10.1.2.3",
        "KUBERNETES_SERVICE_PORT": "6443",
    }
    for deployment in (find(render(), "Deployment", "-webhook"), find(render(), "Deployment", "-controller")):
        assert "strategy" not in deployment["spec"]
        assert not {"KUBERNETES_SERVICE_HOST", "VRAMSHARE_HOST", "VRAMSHARE_METRICS_HOST"} & set(
            env(deployment)
        )
    refused = helm("template", "t", str(CHART), "--set", "global.apiServer.host=x", check=False)
    assert "global.apiServer.port is required with global.apiServer.host" in refused.stderr


def test_alerts_read_metrics_vramshare_exports_and_helm_test_checks_the_webhook() -> None:
    docs = render("--set", "prometheusRule.enabled=true")
    rules = find(docs, "PrometheusRule")["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} >= {
        "VramshareWebhookErrors",
        "VramshareNoLeader",
        "VramshareInventoryStale",
        "VramshareGpuOverused",
        "VramshareDcgmSeriesUnusable",
    }
    exported = set()
    for registry in (ControllerMetrics().registry, WebhookMetrics().registry):
        for family in registry.collect():
            exported |= {family.name, f"{family.name}_total"}
    for rule in rules:
        used = set(re.findall(r"\bvramshare_[a-z_]+", rule["expr"]))
        assert used, rule
        assert used <= exported, (rule["alert"], used - exported)
        assert rule["labels"]["severity"] in ("warning", "critical")
    assert "PrometheusRule" not in {d["kind"] for d in render()}
    hooks = [d for d in render() if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    assert sorted(d["kind"] for d in hooks) == ["Pod", "Role", "RoleBinding", "ServiceAccount"]
    (test_pod,) = [d for d in hooks if d["kind"] == "Pod"]
    script = test_pod["spec"]["containers"][0]["args"][0]
    # Every endpoint of the Service, verified for the Service's name (run for real by test_real_node_e2e).
    assert '"vramshare", "t-vramshare-webhook", "https"' in script
    assert test_pod["spec"]["serviceAccountName"] == "t-vramshare-test-webhook"
    assert test_pod["spec"]["volumes"][0]["secret"]["secretName"] == "t-vramshare-webhook-tls"
    (role,) = [d for d in hooks if d["kind"] == "Role"]
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}
    ]
    assert all(
        int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0 for d in hooks if d["kind"] != "Pod"
    )


def test_the_chart_readme_is_generated_from_the_values_and_current() -> None:
    documented = dict(chart_docs.documented_values((CHART / "values.yaml").read_text()))
    assert "webhook.settings.max_pending_per_namespace" in documented
    assert "networkPolicy.webhookFrom" in documented
    assert (CHART / "README.md").read_text() == chart_docs.render(), (
        "charts/vramshare/README.md is not current: run python -m vramshare_e2e.chart_docs"
    )


def test_templated_crds_are_the_ones_in_crds_and_kept_on_uninstall() -> None:
    assert "CustomResourceDefinition" not in {d["kind"] for d in render()}  # crds/ by default
    templated = [d for d in render("--set", "crds.templated=true") if d["kind"] == "CustomResourceDefinition"]
    files = {
        d["metadata"]["name"]: d
        for d in (yaml.safe_load(p.read_text()) for p in (CHART / "crds").glob("*.yaml"))
    }
    assert sorted(d["metadata"]["name"] for d in templated) == sorted(files)
    for crd in templated:
        assert crd["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
        assert crd == files[crd["metadata"]["name"]]
    unkept = render("--set", "crds.templated=true", "--set", "crds.keep=false")
    assert all(
        not d["metadata"].get("annotations") for d in unkept if d["kind"] == "CustomResourceDefinition"
    )
