"""deploy/kubernetes renders, validates, and says what the code does.

No cluster: `kubectl kustomize` renders the base and each overlay (skipped, saying so,
where kubectl is missing); the core resources are validated with kubernetes-validate's
strict schemas; the KEDA resources against the fields KEDA documents (KEDA_* below, from
keda.sh/docs: the ScaledObject and TriggerAuthentication specifications and the redis,
rabbitmq, prometheus, cpu and metrics-api scalers). The rest ties the manifests to agentq:
its worker kinds and their queues, its settings, its health file, its metrics, its limits.
"""

from __future__ import annotations

import copy
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, get_args

import kubernetes_validate
import pytest
import yaml
from pydantic import SecretStr

from agentq.cli.main import WORKER_KINDS, build_parser, worker_argv
from agentq.config import Settings
from agentq.constants import QUEUE_IO, QUEUE_LLM, QUEUE_TOOLS, QUEUE_TURNS
from agentq.fleet.health import HEALTH_EVERY_S, HEALTHY_WITHIN_S
from agentq.fleet.roles import Role, role_of
from agentq.gateway.metrics import GatewayMetrics
from agentq.llm.limits import parse_limits

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
TARGETS = {
    "base": KUBE / "base",
    "demo": KUBE / "overlays" / "demo",
    "production": KUBE / "overlays" / "production",
}
# A current release; kubernetes-validate ships its schemas, so this needs no network.
KUBERNETES_VERSION = "1.34"
QUEUES: dict[str, str] = {
    "turns": QUEUE_TURNS,
    "llm": QUEUE_LLM,
    "tools": QUEUE_TOOLS,
    "io": QUEUE_IO,
}
SECRET_NAME = "agentq-secrets"
# The namespace the base's cross-namespace addresses name; overlays put theirs in.
DEFAULT_NAMESPACE = "agentq"

Doc = dict[str, Any]


# -- rendering ---------------------------------------------------------------------------


@cache
def _render(path: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: deploy/kubernetes is not rendered or checked")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return out.stdout


def render(target: str) -> list[Doc]:
    """A fresh copy of the target's resources (tests may change theirs)."""
    return [d for d in yaml.safe_load_all(_render(TARGETS[target])) if d]


@pytest.fixture(params=sorted(TARGETS))
def target(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def agentq_containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(Deployment, container) for every container that runs the `agentq` command."""
    for dep in of_kind(docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c.get("command", [""])[0] == "agentq":
                yield dep, c


def worker_deployment(docs: list[Doc], kind: str) -> tuple[Doc, Doc]:
    found = [
        (dep, c) for dep, c in agentq_containers(docs) if c["command"][1:3] == ["worker", kind]
    ]
    assert len(found) == 1, f"`agentq worker {kind}`: {len(found)} Deployments run it"
    return found[0]


def effective_env(docs: list[Doc], container: Doc) -> dict[str, str | None]:
    """The container's environment: its ConfigMaps', then its own entries (which win); a
    value from a Secret is None (unknown here)."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref:
            env.update(named(docs, "ConfigMap", ref["name"]).get("data", {}))
    for e in container.get("env", []):
        env[e["name"]] = e.get("value") if "valueFrom" not in e else None
    return env


def settings_for(env: dict[str, str | None], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """agentq's Settings as the container would read them (Secret values left out)."""
    import os

    for name in list(os.environ):
        if name.startswith("AGENTQ_") or name == "OPENAI_API_KEY":
            monkeypatch.delenv(name)
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    return Settings()


def settings_names() -> set[str]:
    """Every environment variable Settings reads."""
    names = set()
    for field, info in Settings.model_fields.items():
        names.add(f"AGENTQ_{field.upper()}")
        alias = info.validation_alias
        for choice in getattr(alias, "choices", []):
            if isinstance(choice, str) and choice.startswith("AGENTQ_"):
                names.add(choice)
    return names


def secret_settings() -> set[str]:
    return {
        f"AGENTQ_{field.upper()}"
        for field, info in Settings.model_fields.items()
        if SecretStr in get_args(info.annotation) or info.annotation is SecretStr
    }


def pod_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels selectors are used here"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


# -- rendering and core validation -------------------------------------------------------


def test_each_target_renders_the_whole_fleet(target: str) -> None:
    docs = render(target)
    commands = sorted(" ".join(c["command"][1:3]) for _, c in agentq_containers(docs))
    assert commands == [
        "beat",
        "flower",
        "serve",
        "worker io",
        "worker llm",
        "worker tools",
        "worker turns",
    ]
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "a resource is rendered twice"
    if target != "base":
        namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
        assert len(namespaces) == 1 and None not in namespaces


def test_core_resources_validate_strictly(target: str) -> None:
    problems = []
    checked = 0
    for doc in render(target):
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            checked += 1
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message}")
    assert not problems, "\n".join(problems)
    assert checked >= 14


def test_the_validation_is_strict() -> None:
    """An unknown field and a wrong type are refused: the check above can fail."""
    dep, _ = worker_deployment(render("base"), "tools")
    typo = copy.deepcopy(dep)
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 135
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, KUBERNETES_VERSION, strict=True)
    wrong = copy.deepcopy(dep)
    wrong["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "135"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)


# -- KEDA --------------------------------------------------------------------------------


def words(text: str) -> set[str]:
    return set(text.split())


# keda.sh/docs/2.18/reference/scaledobject-spec
KEDA_SCALED_OBJECT_SPEC = words(
    "scaleTargetRef pollingInterval cooldownPeriod initialCooldownPeriod idleReplicaCount "
    "minReplicaCount maxReplicaCount fallback advanced triggers"
)
KEDA_SCALE_TARGET_REF = words("apiVersion kind name envSourceContainerName")
KEDA_ADVANCED = words(
    "restoreToOriginalReplicaCount horizontalPodAutoscalerConfig scalingModifiers"
)
KEDA_HPA_CONFIG = words("name behavior")
KEDA_TRIGGER = words("type name metadata useCachedMetrics authenticationRef metricType")
KEDA_METRIC_TYPES = words("AverageValue Value Utilization")
# Per scaler (keda.sh/docs/2.18/scalers/...): required metadata, optional metadata, and the
# parameters a TriggerAuthentication may give it.
KEDA_SCALERS: dict[str, tuple[set[str], set[str], set[str]]] = {
    "redis": (
        words("listName listLength"),
        words(
            "address host port addressFromEnv hostFromEnv portFromEnv usernameFromEnv "
            "passwordFromEnv activationListLength enableTLS unsafeSsl databaseIndex"
        ),
        words("address host port username password tls ca cert key"),
    ),
    "rabbitmq": (
        words("queueName mode value"),
        words(
            "host hostFromEnv protocol activationValue vhostName usernameFromEnv passwordFromEnv "
            "unsafeSsl timeout useRegex pageSize operation excludeUnacknowledged"
        ),
        words("host username password vhostName tls ca cert key"),
    ),
    "prometheus": (
        words("serverAddress query threshold"),
        words(
            "activationThreshold namespace customHeaders ignoreNullValues queryParameters "
            "unsafeSsl timeout authModes"
        ),
        words("bearerToken username password ca cert key customAuthHeader customAuthValue"),
    ),
    "cpu": (words("value"), words("containerName"), set()),
    "metrics-api": (
        words("url targetValue"),
        words(
            "format valueLocation activationTargetValue unsafeSsl "
            "aggregateFromKubeServiceEndpoints aggregationType authMode method keyParamName"
        ),
        words("apiKey username password ca cert key token"),
    ),
}
KEDA_NUMBERS = words(
    "listLength activationListLength databaseIndex value activationValue threshold "
    "activationThreshold targetValue activationTargetValue"
)
RABBITMQ_MODES = words(
    "QueueLength MessageRate DeliverGetRate PublishedToDeliveredRatio ExpectedQueueConsumptionTime"
)
# keda.sh/docs/2.18/reference/triggerauthentication-spec
KEDA_TRIGGER_AUTH_SPEC = words(
    "secretTargetRef env configMapTargetRef podIdentity hashiCorpVault azureKeyVault "
    "awsSecretManager gcpSecretManager boundServiceAccountToken"
)


def keda_problems(docs: list[Doc]) -> list[str]:
    """What KEDA would refuse, or do otherwise than meant, in these resources."""
    problems: list[str] = []
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    auths = {d["metadata"]["name"]: d for d in of_kind(docs, "TriggerAuthentication")}
    for auth in auths.values():
        name = auth["metadata"]["name"]
        if auth["apiVersion"] != "keda.sh/v1alpha1":
            problems.append(f"TriggerAuthentication/{name}: apiVersion {auth['apiVersion']}")
        if unknown := set(auth["spec"]) - KEDA_TRIGGER_AUTH_SPEC:
            problems.append(f"TriggerAuthentication/{name}: unknown {sorted(unknown)}")
        for ref in auth["spec"].get("secretTargetRef", []):
            if set(ref) != {"parameter", "name", "key"}:
                problems.append(f"TriggerAuthentication/{name}: secretTargetRef {ref}")
    for so in of_kind(docs, "ScaledObject"):
        where = f"ScaledObject/{so['metadata']['name']}"
        spec = so["spec"]
        if so["apiVersion"] != "keda.sh/v1alpha1":
            problems.append(f"{where}: apiVersion {so['apiVersion']}")
        if unknown := set(spec) - KEDA_SCALED_OBJECT_SPEC:
            problems.append(f"{where}: unknown spec fields {sorted(unknown)}")
        ref = spec.get("scaleTargetRef", {})
        if set(ref) - KEDA_SCALE_TARGET_REF or "name" not in ref:
            problems.append(f"{where}: scaleTargetRef {ref}")
        if ref.get("kind", "Deployment") != "Deployment" or ref.get("name") not in deployments:
            problems.append(f"{where}: scales {ref}, not a Deployment of this render")
        low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            # Zero would stop the turn workers' sweeps, and every deadline with them.
            problems.append(f"{where}: replicas {low}..{high}")
        for field in ("pollingInterval", "cooldownPeriod"):
            if field in spec and not (isinstance(spec[field], int) and spec[field] > 0):
                problems.append(f"{where}: {field} {spec[field]!r}")
        advanced = spec.get("advanced", {})
        if unknown := set(advanced) - KEDA_ADVANCED:
            problems.append(f"{where}: unknown advanced fields {sorted(unknown)}")
        hpa = advanced.get("horizontalPodAutoscalerConfig", {})
        if unknown := set(hpa) - KEDA_HPA_CONFIG:
            problems.append(f"{where}: unknown horizontalPodAutoscalerConfig {sorted(unknown)}")
        if "behavior" in hpa:
            # KEDA hands `behavior` to the HPA it makes: Kubernetes' own schema judges it.
            as_hpa = {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": so["metadata"]["name"]},
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                    "minReplicas": low,
                    "maxReplicas": high,
                    "behavior": hpa["behavior"],
                },
            }
            try:
                kubernetes_validate.validate(as_hpa, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{where}: behavior: {exc.message}")
        triggers = spec.get("triggers") or []
        if not triggers:
            problems.append(f"{where}: no triggers")
        names = [t.get("name") for t in triggers]
        if len(names) != len(set(names)):
            problems.append(f"{where}: trigger names repeat: {names}")
        for t in triggers:
            problems += [f"{where}: {p}" for p in trigger_problems(t, auths, deployments, ref)]
    return problems


def trigger_problems(
    t: Doc, auths: dict[str, Doc], deployments: dict[str, Doc], ref: dict[str, Any]
) -> list[str]:
    problems = []
    kind = t.get("type")
    if unknown := set(t) - KEDA_TRIGGER:
        problems.append(f"trigger {kind}: unknown fields {sorted(unknown)}")
    if kind not in KEDA_SCALERS:
        return [*problems, f"trigger type {kind!r} is not one checked here"]
    required, optional, auth_params = KEDA_SCALERS[kind]
    meta = t.get("metadata", {})
    if missing := required - set(meta):
        problems.append(f"{kind}: missing {sorted(missing)}")
    if unknown := set(meta) - required - optional:
        problems.append(f"{kind}: unknown metadata {sorted(unknown)}")
    for key, value in meta.items():
        # The CRD's metadata is map[string]string: a YAML number is refused.
        if not isinstance(value, str):
            problems.append(f"{kind}: {key} is {type(value).__name__}, not a string")
        elif key in KEDA_NUMBERS:
            try:
                if float(value) < 0:
                    problems.append(f"{kind}: {key} {value} < 0")
            except ValueError:
                problems.append(f"{kind}: {key} {value!r} is not a number")
    metric_type = t.get("metricType", "AverageValue")
    if metric_type not in KEDA_METRIC_TYPES:
        problems.append(f"{kind}: metricType {metric_type}")
    if (kind == "cpu") != (metric_type == "Utilization"):
        problems.append(f"{kind}: metricType {metric_type} (Utilization is for cpu alone)")
    auth_given: set[str] = set()
    if "authenticationRef" in t:
        auth = auths.get(t["authenticationRef"].get("name"))
        if auth is None:
            problems.append(f"{kind}: authenticationRef {t['authenticationRef']} not rendered")
        else:
            auth_given = {r["parameter"] for r in auth["spec"].get("secretTargetRef", [])}
            if unknown := auth_given - auth_params:
                problems.append(f"{kind}: {sorted(unknown)} are no parameters of {kind}")
    if kind == "redis" and not ({"address", "host", "addressFromEnv", "hostFromEnv"} & set(meta)):
        problems.append("redis: no address")
    if kind == "rabbitmq":
        if not ({"host", "hostFromEnv"} & set(meta)) and "host" not in auth_given:
            problems.append("rabbitmq: no host, in metadata or TriggerAuthentication")
        if meta.get("mode") not in RABBITMQ_MODES:
            problems.append(f"rabbitmq: mode {meta.get('mode')}")
        if meta.get("protocol", "auto") not in ("auto", "http", "amqp"):
            problems.append(f"rabbitmq: protocol {meta.get('protocol')}")
    if kind == "cpu":
        dep = deployments.get(ref.get("name", ""), {})
        pods = dep.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        if not all(c.get("resources", {}).get("requests", {}).get("cpu") for c in pods):
            problems.append("cpu: the target's containers request no CPU to be utilized")
    return problems


def test_keda_resources_use_the_fields_keda_documents(target: str) -> None:
    docs = render(target)
    assert of_kind(docs, "ScaledObject")
    assert keda_problems(docs) == []


def test_the_keda_check_finds_what_keda_refuses() -> None:
    docs = render("production")
    so = named(docs, "ScaledObject", "worker-tools")
    so["spec"]["minReplicas"] = 2
    so["spec"]["triggers"][0]["metadata"]["value"] = 4
    so["spec"]["triggers"][0]["metadata"]["queueLength"] = "4"
    so["spec"]["triggers"][0]["authenticationRef"]["name"] = "nobody"
    turns = named(docs, "ScaledObject", "worker-turns")
    turns["spec"]["minReplicaCount"] = 0
    turns["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindow"
    ] = 300
    found = "\n".join(keda_problems(docs))
    for wanted in (
        "unknown spec fields ['minReplicas']",
        "value is int",
        "unknown metadata ['queueLength']",
        "not rendered",
        "worker-turns: replicas 0..10",
        "worker-turns: behavior",
    ):
        assert wanted in found, found


# -- the manifests and the code ----------------------------------------------------------


def test_the_worker_kinds_are_the_roles() -> None:
    assert set(WORKER_KINDS) == set(get_args(Role)) == set(QUEUES)


def test_every_worker_kind_has_a_deployment_pdb_and_scaler_on_its_queue(target: str) -> None:
    docs = render(target)
    deployments = of_kind(docs, "Deployment")
    for kind, queue in QUEUES.items():
        dep, container = worker_deployment(docs, kind)
        name = dep["metadata"]["name"]
        # The command agentq would run: its default queues, no -Q of its own.
        argv = worker_argv(kind, list(container["command"][3:]), [QUEUE_TOOLS], [QUEUE_IO])
        consumed = argv[argv.index("-Q") + 1].split(",")
        assert consumed == [queue], (kind, argv)
        assert role_of(consumed, [QUEUE_TOOLS], [QUEUE_IO]) == kind
        labels = dep["spec"]["template"]["metadata"]["labels"]
        pdbs = [
            p
            for p in of_kind(docs, "PodDisruptionBudget")
            if pod_matches(p["spec"]["selector"], labels)
        ]
        assert len(pdbs) == 1, f"{name}: {len(pdbs)} PodDisruptionBudgets"
        others = [
            d
            for d in deployments
            if d is not dep
            and pod_matches(
                pdbs[0]["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"]
            )
        ]
        assert not others, f"{name}'s PDB also selects {[d['metadata']['name'] for d in others]}"
        assert pdbs[0]["spec"].get("maxUnavailable") == 1
        scalers = [
            s for s in of_kind(docs, "ScaledObject") if s["spec"]["scaleTargetRef"]["name"] == name
        ]
        assert len(scalers) == 1, f"{name}: {len(scalers)} ScaledObjects"
        named_queues = {
            t["metadata"].get("listName") or t["metadata"].get("queueName")
            for t in scalers[0]["spec"]["triggers"]
        } - {None}
        assert queue in named_queues, f"{name} scales on {named_queues}, not {queue}"
        for q in named_queues:
            assert role_of([q], [QUEUE_TOOLS], [QUEUE_IO]) == kind, f"{name} scales on {q}"
        assert "replicas" not in dep["spec"], f"{name}: the ScaledObject owns the replica count"


def test_the_broker_decides_the_queue_scaler(target: str) -> None:
    docs = render(target)
    types = {t["type"] for so in of_kind(docs, "ScaledObject") for t in so["spec"]["triggers"]}
    if target == "production":
        assert "rabbitmq" in types and "redis" not in types
        for _, c in agentq_containers(docs):
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["AGENTQ_BROKER_URL"]["valueFrom"]["secretKeyRef"]["name"] == SECRET_NAME
    else:
        assert "redis" in types and "rabbitmq" not in types
        for _, c in agentq_containers(docs):
            url = effective_env(docs, c)["AGENTQ_REDIS_URL"]
            assert url is not None
            host, port = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
            db = url.rsplit("/", 1)[1]
            for so in of_kind(docs, "ScaledObject"):
                # KEDA's operator resolves names from its own namespace: the pods' Redis,
                # named with theirs.
                namespace = so["metadata"].get("namespace", DEFAULT_NAMESPACE)
                for t in so["spec"]["triggers"]:
                    if t["type"] == "redis":
                        assert t["metadata"]["address"] == f"{host}.{namespace}.svc:{port}"
                        assert t["metadata"]["databaseIndex"] == db


def test_a_drain_never_takes_a_whole_kind(target: str) -> None:
    if target == "demo":
        pytest.skip("the demo runs one replica of each kind, to fit a laptop")
    docs = render(target)
    for so in of_kind(docs, "ScaledObject"):
        assert so["spec"]["minReplicaCount"] >= 2, so["metadata"]["name"]
    gateway = named(docs, "Deployment", "gateway")
    assert gateway["spec"]["replicas"] >= 2


def grace_problems(docs: list[Doc], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    problems = []
    for kind in QUEUES:
        dep, container = worker_deployment(docs, kind)
        s = settings_for(effective_env(docs, container), monkeypatch)
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        if kind in ("tools", "io"):
            if not s.tool_timeout_s:
                problems.append(f"{kind}: AGENTQ_TOOL_TIMEOUT_S=0, no grace period covers it")
            elif grace < s.tool_timeout_s + s.tool_grace_s:
                problems.append(
                    f"{kind}: grace {grace} s < hard limit {s.tool_timeout_s:g} s "
                    f"+ grace {s.tool_grace_s:g} s"
                )
        if kind == "llm" and grace < s.stream_duration_s:
            problems.append(f"llm: grace {grace} s < a round's {s.stream_duration_s:g} s")
        if kind == "turns" and grace < 10:
            problems.append(f"turns: grace {grace} s")
    return problems


def test_grace_periods_cover_the_configured_limits(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert grace_problems(render(target), monkeypatch) == []


def test_a_longer_hard_limit_needs_a_longer_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render("production")
    config = next(d for d in of_kind(docs, "ConfigMap") if "AGENTQ_TOOL_TIMEOUT_S" in d["data"])
    config["data"]["AGENTQ_TOOL_TIMEOUT_S"] = "600"
    found = grace_problems(docs, monkeypatch)
    assert len(found) == 2 and all("hard limit 600 s" in p for p in found), found


def test_every_agentq_variable_is_a_setting_and_valid(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(target)
    known = settings_names()
    seen: set[str] = set()
    for dep, c in agentq_containers(docs):
        env = effective_env(docs, c)
        names = {n for n in env if n.startswith("AGENTQ_")}
        assert names <= known, f"{dep['metadata']['name']}: not settings: {sorted(names - known)}"
        seen |= names
        # Bad values would stop the process at start: they stop the test here.
        s = settings_for(env, monkeypatch)
        parse_limits(s.llm_limits)
    assert {"AGENTQ_REDIS_URL", "AGENTQ_HEALTH_FILE", "AGENTQ_TOOL_TIMEOUT_S"} <= seen
    for cm in of_kind(docs, "ConfigMap"):
        if cm["metadata"]["name"].startswith("agentq-config"):
            assert set(cm["data"]) <= known


def test_no_secret_is_written_in_the_manifests(target: str) -> None:
    docs = render(target)
    assert not of_kind(docs, "Secret"), "the operator creates agentq-secrets; none is shipped"
    secrets = secret_settings()
    assert {"AGENTQ_API_KEYS", "AGENTQ_LLM_API_KEY", "AGENTQ_FLOWER_BASIC_AUTH"} <= secrets
    credentials = re.compile(r"://[^/@\s]*:[^/@\s]+@")
    from_secret = set()
    for dep, c in agentq_containers(docs):
        for e in c.get("env", []):
            if "valueFrom" in e:
                ref = e["valueFrom"]["secretKeyRef"]
                assert ref["name"] == SECRET_NAME and ref["key"] == e["name"]
                from_secret.add(e["name"])
            else:
                assert e["name"] not in secrets, f"{dep['metadata']['name']}: {e['name']} literal"
                assert not credentials.search(e["value"]), e["name"]
    assert {"AGENTQ_API_KEYS", "AGENTQ_ADMIN_KEYS", "AGENTQ_LLM_API_KEY"} <= from_secret
    for cm in of_kind(docs, "ConfigMap"):
        for key, value in cm.get("data", {}).items():
            assert key not in secrets, f"{cm['metadata']['name']}: {key}"
            assert not credentials.search(value), f"{cm['metadata']['name']}: {key}"
    for so in of_kind(docs, "ScaledObject"):
        for t in so["spec"]["triggers"]:
            for key, value in t["metadata"].items():
                assert not credentials.search(value), f"{so['metadata']['name']}: {key}"
                assert "password" not in key.lower() or key.endswith("FromEnv")


def memory_bytes(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 1e3, "M": 1e6, "G": 1e9}
    for unit, factor in units.items():
        if q.endswith(unit):
            return float(q[: -len(unit)]) * factor
    return float(q)


def cpu_cores(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_every_pod_is_hardened_probed_and_sized(target: str) -> None:
    docs = render(target)
    for dep in of_kind(docs, "Deployment"):
        name = dep["metadata"]["name"]
        pod = dep["spec"]["template"]["spec"]
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True, name
        # A number: the kubelet cannot check runAsNonRoot against a user name.
        assert isinstance(ctx["runAsUser"], int) and ctx["runAsUser"] > 0, name
        assert ctx["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False, name
        empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for c in pod["containers"]:
            where = f"{name}/{c['name']}"
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert c.get("readinessProbe") and c.get("livenessProbe"), where
            req, lim = c["resources"]["requests"], c["resources"]["limits"]
            assert cpu_cores(req["cpu"]) <= cpu_cores(lim["cpu"]), where
            assert memory_bytes(req["memory"]) <= memory_bytes(lim["memory"]), where
            if c.get("command", [""])[0] == "agentq":
                writable = {
                    m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] in empty_dirs
                }
                assert "/tmp" in writable, f"{where}: no writable /tmp"
                health = effective_env(docs, c)["AGENTQ_HEALTH_FILE"]
                assert health and any(health.startswith(p + "/") for p in writable), where


def probe_command(probe: Doc) -> str:
    return " ".join(probe["exec"]["command"])


def test_workers_are_probed_by_their_health_file(target: str) -> None:
    docs = render(target)
    assert HEALTH_EVERY_S * 3 <= HEALTHY_WITHIN_S
    for kind in QUEUES:
        _, c = worker_deployment(docs, kind)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = probe_command(c[probe])
            assert '"$AGENTQ_HEALTH_FILE"' in command, (kind, probe)
            assert f"-newermt '-{HEALTHY_WITHIN_S} seconds'" in command, (kind, probe)
            assert c[probe]["exec"]["command"][:2] == ["sh", "-c"], (kind, probe)
        # Liveness outlasts a broker outage that Celery rides out by reconnecting.
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 120, kind


def test_the_gateway_is_probed_on_healthz_and_served(target: str) -> None:
    docs = render(target)
    dep = named(docs, "Deployment", "gateway")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = effective_env(docs, c)
    port = int(env["AGENTQ_GATEWAY_PORT"] or 0)
    assert env["AGENTQ_GATEWAY_HOST"] == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # Liveness needs no Redis: a Redis outage makes gateways unready, not restarted.
    assert c["livenessProbe"]["httpGet"]["path"] != "/healthz"
    svc = named(docs, "Service", "gateway")
    assert pod_matches(
        {"matchLabels": svc["spec"]["selector"]}, dep["spec"]["template"]["metadata"]["labels"]
    )
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert env["AGENTQ_API_KEYS"] is None, "the gateway's keys come from the Secret"


def test_the_commands_are_agentqs(target: str) -> None:
    parser = build_parser()
    for _, c in agentq_containers(render(target)):
        if c["command"][1] != "worker":
            parser.parse_args(c["command"][1:])


def _repository(image: str) -> str:
    """`registry.example.com/agentq-worker:0.1.0` -> `agentq-worker`."""
    return image.rsplit(":", 1)[0].rsplit("/", 1)[-1]


def test_each_process_runs_an_image_with_its_extras(target: str) -> None:
    # compose/Dockerfile's AGENTQ_EXTRAS: the gateway and Flower need theirs, the workers
    # and the beat none of them (docs/kubernetes.md builds both images).
    wanted = {"serve": "agentq", "flower": "agentq", "worker": "agentq-worker"}
    wanted["beat"] = "agentq-worker"
    seen = set()
    for _, c in agentq_containers(render(target)):
        assert _repository(c["image"]) == wanted[c["command"][1]], (c["command"], c["image"])
        seen.add(c["command"][1])
    assert seen == set(wanted)
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "--build-arg AGENTQ_EXTRAS=mcp,otel -t agentq-worker:local" in doc


def test_one_beat_and_never_two(target: str) -> None:
    docs = render(target)
    beats = [dep for dep, c in agentq_containers(docs) if c["command"][1:] == ["beat"]]
    assert len(beats) == 1
    beat = beats[0]
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    name = beat["metadata"]["name"]
    assert all(so["spec"]["scaleTargetRef"]["name"] != name for so in of_kind(docs, "ScaledObject"))
    assert not of_kind(docs, "HorizontalPodAutoscaler")


def metric_families() -> set[str]:
    """The metric families the gateway's /metrics exposes."""
    m = GatewayMetrics()
    text = m.render().decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def family_of(name: str) -> str:
    return re.sub(r"_(total|count|sum|bucket)$", "", name)


def test_metric_triggers_query_what_the_gateway_exports(target: str) -> None:
    docs = render(target)
    families = {family_of(f) for f in metric_families()}
    queried = set()
    for so in of_kind(docs, "ScaledObject"):
        for t in so["spec"]["triggers"]:
            if t["type"] == "prometheus":
                names = set(re.findall(r"\bagentq_[a-z_]+", t["metadata"]["query"]))
                assert names, t["metadata"]["query"]
                assert {family_of(n) for n in names} <= families, names
                queried |= names
                # The provider's limit, not the workers': scaling out would not help.
                assert "agentq_llm_queued" not in names
    assert {"agentq_step_duration_seconds_count", "agentq_llm_streams_in_use"} <= queried


def llm_streams(docs: list[Doc], monkeypatch: pytest.MonkeyPatch) -> int:
    _, c = worker_deployment(docs, "llm")
    s = settings_for(effective_env(docs, c), monkeypatch)
    total = 0
    for entry in parse_limits(s.llm_limits).values():
        total += entry.streams or sum(d.streams or 0 for d in entry.deployments)
    return total


def test_stream_workers_stop_at_the_providers_streams(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(target)
    dep, _ = worker_deployment(docs, "llm")
    so = next(
        s
        for s in of_kind(docs, "ScaledObject")
        if s["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    )
    (per_replica,) = [
        float(t["metadata"]["threshold"])
        for t in so["spec"]["triggers"]
        if "agentq_llm_streams_in_use" in t["metadata"].get("query", "")
    ]
    streams = llm_streams(docs, monkeypatch)
    if target == "base":
        assert streams == 0, "the base knows no model"
        return
    assert streams, f"{target}: AGENTQ_LLM_LIMITS sets no streams"
    assert so["spec"]["maxReplicaCount"] == math.ceil(streams / per_replica), (
        streams,
        per_replica,
    )
    assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]


def test_the_demo_runs_its_dependencies_in_the_cluster() -> None:
    docs = render("demo")
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    assert {"redis", "model", "prometheus", "gateway", "flower"} <= set(services)
    _, c = worker_deployment(docs, "llm")
    env = effective_env(docs, c)
    assert (
        env["AGENTQ_LLM_BASE_URL"]
        == f"http://model:{services['model']['spec']['ports'][0]['port']}/v1"
    )
    assert env["AGENTQ_TOOLS"] == "agentq.testing.tools"
    model = named(docs, "Deployment", "model")["spec"]["template"]["spec"]["containers"][0]
    assert model["command"][:3] == ["python", "-m", "agentq.testing.openai_server"]
    # The scripted model server runs on uvicorn, which the gateway's image has.
    assert _repository(model["image"]) == "agentq"
    prometheus = named(
        docs,
        "ConfigMap",
        next(
            d["metadata"]["name"]
            for d in of_kind(docs, "ConfigMap")
            if d["metadata"]["name"].startswith("prometheus-config")
        ),
    )
    scrape = yaml.safe_load(prometheus["data"]["prometheus.yml"])["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["gateway:8000"]
    for so in of_kind(docs, "ScaledObject"):
        for t in so["spec"]["triggers"]:
            if t["type"] == "prometheus":
                namespace = so["metadata"]["namespace"]
                assert t["metadata"]["serverAddress"] == f"http://prometheus.{namespace}.svc:9090"


# -- the documentation -------------------------------------------------------------------


def test_the_docs_size_each_kind_as_the_manifests_do() -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "docs/kubernetes.md" in (ROOT / "README.md").read_text()
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\| `([a-z-]+)` \|.*$", doc, flags=re.MULTILINE)
    }
    for dep in of_kind(render("base"), "Deployment"):
        name = dep["metadata"]["name"]
        assert name in rows, f"docs/kubernetes.md: no sizing row for `{name}`"
        res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
        for part in ("requests", "limits"):
            for key in ("cpu", "memory"):
                assert res[part][key] in rows[name], (name, part, key, rows[name])


def test_docs_commands_name_the_overlays() -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    for path in TARGETS.values():
        if path.name != "base":
            assert str(path.relative_to(ROOT)) in doc


def test_targets_fit_what_one_replica_holds(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue's target per replica is what a replica runs at once: the tool worker's pool
    processes; the stream worker's target is within its loops' capacity."""
    docs = render(target)
    scalers = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(docs, "ScaledObject")}
    dep, c = worker_deployment(docs, "tools")
    command = c["command"]
    concurrency = command[command.index("--concurrency") + 1]
    (trigger,) = scalers[dep["metadata"]["name"]]["spec"]["triggers"]
    assert trigger["metadata"].get("listLength", trigger["metadata"].get("value")) == concurrency
    dep, c = worker_deployment(docs, "llm")
    s = settings_for(effective_env(docs, c), monkeypatch)
    (per_replica,) = [
        float(t["metadata"]["threshold"])
        for t in scalers[dep["metadata"]["name"]]["spec"]["triggers"]
        if t["type"] == "prometheus"
    ]
    assert s.llm_processes >= 1, "AGENTQ_LLM_PROCESSES: the default counts the node's cores"
    assert per_replica <= s.llm_processes * s.io_capacity
    cpu = c["resources"]["limits"]["cpu"]
    assert cpu_cores(cpu) >= s.llm_processes, "one event loop a core"
