"""deploy/ as it runs, not only as it parses: the rendered manifests (`kubectl kustomize`), the Helm
values, the compose files and docs/deployment.md's commands agree on certificate names, probes,
the restricted Pod Security level, vLLM's KV connector and tokenizer, draining and the HF token:
what an audit on 2026-12-03 found wrong in files that parsed and validated."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from fnmatch import fnmatchcase
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
import yaml
from cryptography import x509

from kvswitch.certs import write_tls
from kvswitch.servers import free_port
from protocol.config import EtcdSettings
from router.service import RouterConfig
from router.tokenization import TokenizerError, resolve_tokenizer_path
from tests.deploy.commands import kv_endpoints, parse
from worker_shim.config import ShimConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCS = ROOT / "docs" / "deployment.md"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_VLLM = ROOT / "deploy" / "compose" / "vllm.yml"
OVERLAYS = ["sim", "vllm"]
VLLM_IMAGE = "vllm/vllm-openai:"
SHIM_DRAIN_S = float(next(f.default for f in msgspec.structs.fields(ShimConfig) if f.name == "drain_grace_s"))
ROUTER_DRAIN_S = RouterConfig().drain_s
CLOSE_S = 10.0  # after its drain, a shim or router closes its lease and its NATS connection
TEARDOWN_S = 10.0  # an engine, once its requests are done, frees the GPU and exits
KUBERNETES_DEFAULT_GRACE_S = 30


# --- rendering ----------------------------------------------------------------------------------


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the overlays' patches need `kubectl kustomize`)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return _render(str(request.param))


@pytest.fixture(scope="module")
def vllm_objects() -> list[dict[str, Any]]:
    return _render("vllm")


def _pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod template, by its workload's name."""
    kinds = ("Deployment", "StatefulSet", "DaemonSet", "Job")
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] in kinds}


def _engine_pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pods = {name: pod for name, pod in _pods(objects).items() if name.startswith("engine-")}
    assert len(pods) == 2
    return pods


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*pod.get("initContainers", []), *pod["containers"]]}


def _router(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _pods(objects)["router"]
    return pod, _containers(pod)["router"]


def _flags(argv: list[str]) -> dict[str, str]:
    """vLLM's `--name=value`, `--name value` and `--switch` (as "")."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value, i = argv[i + 1], i + 1
        out[name] = value
        i += 1
    return out


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _docs_commands() -> list[list[str]]:
    """The commands of docs/deployment.md's Kubernetes block, continuation lines joined."""
    section = DOCS.read_text().split("\n## Kubernetes\n", 1)[1]
    block = section.split("```\n", 2)[1]
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


# --- 1, 2: certificate names ----------------------------------------------------------------------


def _go_matches(pattern: str, host: str) -> bool:
    """Go's crypto/x509 name check (nats-server and etcd are Go): a `*` stands for exactly the
    leftmost label, and the label counts must be equal."""
    want, have = pattern.lower().split("."), host.lower().rstrip(".").split(".")
    return len(want) == len(have) and all(
        w == h or (i == 0 and w == "*") for i, (w, h) in enumerate(zip(want, have, strict=True))
    )


def _helm_release(chart: str) -> tuple[str, str]:
    """(release, namespace) of docs/deployment.md's `helm install RELEASE CHART -n NS`."""
    for argv in _docs_commands():
        if argv[:2] == ["helm", "install"] and argv[3].endswith(chart):
            return argv[2], argv[argv.index("-n") + 1]
    raise AssertionError(f"docs/deployment.md installs no {chart} chart")


def _names_the_charts_use() -> set[str]:
    """Host names the charts give their members, as their templates build them:
    nats/nats `files/config/cluster.yaml`: routes `tls://<release>-<i>.<release>-headless:<port>`
    (routeURLs.useFQDN off); bitnami/etcd `templates/statefulset.yaml`: peers and clients advertised
    as `<release>-<i>.<release>-headless.<ns>.svc.cluster.local`, and the Service as
    `<release>.<ns>.svc.cluster.local`."""
    nats_values = yaml.safe_load((K8S / "helm" / "nats-values.yaml").read_text())
    cluster = nats_values["config"]["cluster"]
    assert not cluster.get("routeURLs", {}).get("useFQDN", False)
    nats, _ = _helm_release("nats/nats")
    names = {f"{nats}-{i}.{nats}-headless" for i in range(cluster["replicas"])}
    etcd, ns = _helm_release("/etcd")
    etcd_values = yaml.safe_load((K8S / "helm" / "etcd-values.yaml").read_text())
    domain = etcd_values.get("clusterDomain", "cluster.local")
    names |= {f"{etcd}-{i}.{etcd}-headless.{ns}.svc.{domain}" for i in range(etcd_values["replicaCount"])}
    return names | {f"{etcd}.{ns}.svc.{domain}"}


def _names_kvswitch_dials(objects: list[dict[str, Any]]) -> set[str]:
    """The host of every TLS URL a router, shim or etcd-auth container is given."""
    names: set[str] = set()
    for pod in _pods(objects).values():
        for c in _containers(pod).values():
            if not c["image"].startswith("kvswitch:") or "args" not in c:
                continue
            for value in vars(parse(c["args"])[1]).values():
                for url in value if isinstance(value, list) else [value]:
                    if isinstance(url, str) and url.startswith(("tls://", "https://")):
                        names.add(str(urlsplit(url).hostname))
    return names


def test_the_documented_certificate_names_every_host_clients_and_peers_check(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    (secrets,) = [argv for argv in _docs_commands() if argv[:2] == ["kvswitch", "secrets"]]
    hosts = parse(secrets[1:])[1].tls_hosts
    tls = write_tls(tmp_path, hosts)
    dialled = _names_kvswitch_dials(objects)
    assert {"nats.kvswitch.svc", "etcd-0.etcd-headless.kvswitch.svc"} <= dialled
    for leaf in (tls.nats, tls.nats_route, tls.etcd, tls.etcd_peer):
        cert = x509.load_pem_x509_certificate(leaf.cert.read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for host in sorted(dialled | _names_the_charts_use()):
            assert any(_go_matches(san, host) for san in sans.get_values_for_type(x509.DNSName)), (
                f"{host} is not in --tls-hosts {hosts}"
            )


def test_every_etcd_endpoint_list_is_one_a_client_can_balance_over(objects: list[dict[str, Any]]) -> None:
    # the members' three DNS names were given: etcd3aio's ipv4: target never connects to a name
    lists = [
        c_args.etcd_endpoints
        for pod in _pods(objects).values()
        for c in _containers(pod).values()
        if c["image"].startswith("kvswitch:") and "args" in c
        for c_args in [parse(c["args"])[1]]
        if getattr(c_args, "etcd_endpoints", None)
    ]
    assert len(lists) >= 3  # the router and both kinds of engine pod
    for endpoints in lists:
        EtcdSettings(endpoints=endpoints).members()


def test_the_name_check_is_gos() -> None:
    assert _go_matches("*.nats-headless", "nats-0.nats-headless")
    assert not _go_matches("*.etcd-headless.kvswitch.svc", "etcd-0.etcd-headless.kvswitch.svc.cluster.local")
    assert not _go_matches("*.kvswitch.svc", "kvswitch.svc")


def test_the_docs_say_what_the_nats_chart_advertises() -> None:
    cluster = yaml.safe_load((K8S / "helm" / "nats-values.yaml").read_text())["config"]["cluster"]
    assert cluster.get("noAdvertise", True) is True  # the chart's default: no_advertise
    text = " ".join(DOCS.read_text().split())
    assert "gossip the others' URLs" not in text and "`no_advertise`" in text


# --- 3: probes ----------------------------------------------------------------------------------


def _listens(container: dict[str, Any]) -> tuple[str, int]:
    """(address, port) the container's HTTP server binds, from its own arguments."""
    if container["image"].startswith(VLLM_IMAGE):
        flags = _flags(container["args"])
        return flags.get("--host", "0.0.0.0"), int(flags.get("--port", "8000"))
    name, args = parse(container["args"])
    return (args.host, args.port) if name == "sim" else (args.http_host, args.http_port)


def _probes(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in container]


def test_every_probe_reaches_what_it_probes(objects: list[dict[str, Any]]) -> None:
    probed = 0
    for pod in _pods(objects).values():
        for c in pod["containers"]:
            for probe in _probes(c):
                probed += 1
                host, port = _listens(c)
                if "httpGet" in probe:
                    # Sent by the kubelet from the node to the pod's IP (`host` overrides it).
                    get = probe["httpGet"]
                    assert "host" not in get, f"{c['name']}: httpGet host {get['host']} is not the pod"
                    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                    assert ports.get(get["port"], get["port"]) == port and host == "0.0.0.0", c["name"]
                else:
                    # Run inside the container, where its loopback is the pod's.
                    url = re.search(r"http://([\d.]+):(\d+)/", " ".join(probe["exec"]["command"]))
                    assert url is not None and (url[1], int(url[2])) == (host, port), c["name"]
    assert probed >= 4


def test_the_engine_probe_passes_on_a_live_sim_and_fails_without_one(tmp_path: Path) -> None:
    (pod, *_) = _engine_pods(_render("sim")).values()
    command = _containers(pod)["engine"]["readinessProbe"]["exec"]["command"]
    assert command[0] == "python3"
    port = free_port()
    probe = [sys.executable, *command[1:-1], command[-1].replace(":8000/", f":{port}/")]
    assert subprocess.run(probe, capture_output=True, timeout=30).returncode != 0  # nothing listens
    sim = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "sim", "--host=127.0.0.1", f"--port={port}", "--role=prefill"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
            assert sim.poll() is None and time.monotonic() < deadline, "the probe never passed"
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as answer:
            assert answer.status == 200
    finally:
        sim.terminate()
        sim.wait(timeout=30)


# --- 4: Pod Security ----------------------------------------------------------------------------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim"}
RESTRICTED_VOLUMES |= {"projected", "secret"}


def _restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The Pod Security Standards' `restricted` checks (kubernetes.io/docs/concepts/security/
    pod-security-standards, v1.32) that a pod template can fail, baseline's included."""
    bad = [key for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    psc = pod.get("securityContext", {})
    for name, c in _containers(pod).items():
        sc = c.get("securityContext", {})
        caps = sc.get("capabilities", {})
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        checks = {
            "privileged": sc.get("privileged") is not True,
            "allowPrivilegeEscalation != false": sc.get("allowPrivilegeEscalation") is False,
            "capabilities.drop lacks ALL": "ALL" in caps.get("drop", []),
            "capabilities.add beyond NET_BIND_SERVICE": set(caps.get("add", [])) <= {"NET_BIND_SERVICE"},
            "runAsNonRoot != true": sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True,
            "runAsUser = 0": sc.get("runAsUser", psc.get("runAsUser")) != 0,
            "seccompProfile not RuntimeDefault or Localhost": seccomp in ("RuntimeDefault", "Localhost"),
            "hostPort": not any(p.get("hostPort") for p in c.get("ports", [])),
        }
        bad += [f"{name}: {what}" for what, ok in checks.items() if not ok]
    for volume in pod.get("volumes", []):
        kind = next(k for k in volume if k != "name")
        if kind not in RESTRICTED_VOLUMES:
            bad.append(f"volume {volume['name']}: {kind}")
    return bad


def test_every_pod_passes_the_namespaces_restricted_pod_security_level(objects: list[dict[str, Any]]) -> None:
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name, pod in _pods(objects).items():
        assert _restricted_violations(pod) == [], name


def test_the_check_refuses_a_root_container() -> None:
    pod = {"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False}}]}
    assert "c: runAsNonRoot != true" in _restricted_violations(pod)


def test_the_helm_charts_pods_pass_the_restricted_level_too() -> None:
    """The charts' pods as these values make them: the NATS chart sets no security context of its
    own (its `merge` values add ours to the pod and to each container); bitnami/etcd's defaults pass
    (pod fsGroup 1001, seccomp RuntimeDefault; container uid 1001, runAsNonRoot, no escalation,
    drop ALL), as long as the values leave them on."""
    nats = yaml.safe_load((K8S / "helm" / "nats-values.yaml").read_text())
    pod = {
        **nats["podTemplate"]["merge"]["spec"],
        "containers": [
            {"name": "nats", **nats["container"]["merge"]},
            {"name": "reloader", **nats["reloader"]["merge"]},
        ],
        "volumes": [{"name": "config", "configMap": {}}, {"name": "pid", "emptyDir": {}}],
    }
    assert _restricted_violations(pod) == []
    assert nats["natsBox"]["enabled"] is False  # a pod of its own with no security context
    etcd = yaml.safe_load((K8S / "helm" / "etcd-values.yaml").read_text())
    for key in ("podSecurityContext", "containerSecurityContext"):
        assert etcd.get(key, {}).get("enabled", True) is True
        assert set(etcd.get(key, {})) <= {"enabled"}
    # Before the charts, so their pods are admitted under the level too.
    commands = [" ".join(argv) for argv in _docs_commands()]
    first_helm = next(i for i, c in enumerate(commands) if c.startswith("helm install"))
    assert "kubectl apply -f deploy/k8s/base/namespace.yaml" in commands[:first_helm]


def test_the_etcd_chart_is_pinned_and_its_image_still_pulls() -> None:
    """Bitnami took its versioned images off docker.io/bitnami in 2025: until 2026-12-07 the docs
    installed whichever chart was newest, with its default image, which no longer pulls."""
    (install,) = [a for a in _docs_commands() if a[:2] == ["helm", "install"] and a[3].endswith("/etcd")]
    version = install[install.index("--version") + 1]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version  # a release, not a range
    etcd = yaml.safe_load((K8S / "helm" / "etcd-values.yaml").read_text())
    image = etcd["image"]
    assert image["registry"] == "docker.io" and image["repository"] == "bitnamilegacy/etcd"
    assert re.fullmatch(r"\d+\.\d+\.\d+-debian-\d+-r\d+", image["tag"]), image["tag"]  # an immutable tag
    # the chart refuses an image that is not its own without this
    assert etcd["global"]["security"]["allowInsecureImages"] is True
    values_file = (K8S / "helm" / "etcd-values.yaml").read_text()  # its own comment says the same install
    assert f"helm install etcd oci://registry-1.docker.io/bitnamicharts/etcd --version {version}" in values_file


def test_the_etcd_charts_probes_need_no_credentials() -> None:
    """bitnami/etcd's own readiness and startup probes run `etcdctl endpoint health` with no user
    when the chart's auth is off, as here; once the etcd-auth Job turns etcd's on, etcd refuses that
    read ("user name is empty") and every member stays NotReady. Its /readyz needs no credentials."""
    etcd = yaml.safe_load((K8S / "helm" / "etcd-values.yaml").read_text())
    assert etcd["auth"]["client"]["enableAuthentication"] is False  # why the chart's probes carry no user
    for key in ("customReadinessProbe", "customStartupProbe"):
        assert etcd[key]["httpGet"] == {"path": "/readyz", "port": "client", "scheme": "HTTPS"}, key


# --- 5, 6: vLLM's KV connector and the routers' tokenizer ----------------------------------------


def _vllm_engines(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    engines = [
        c for pod in _engine_pods(objects).values() for c in pod["containers"] if c["image"].startswith(VLLM_IMAGE)
    ]
    assert len(engines) == 2
    return engines


def test_vllm_engines_transfer_kv_when_the_routers_disaggregate(vllm_objects: list[dict[str, Any]]) -> None:
    _, router = _router(vllm_objects)
    assert parse(router["args"])[1].conditional_disagg
    for engine in _vllm_engines(vllm_objects):
        transfer = json.loads(_flags(engine["args"])["--kv-transfer-config"])
        assert transfer["kv_connector"] == "NixlConnector" and transfer["kv_role"] == "kv_both"
        side_channel = _env(engine)["VLLM_NIXL_SIDE_CHANNEL_HOST"]
        assert side_channel["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_vllm_routers_tokenize_with_the_served_models_tokenizer(vllm_objects: list[dict[str, Any]]) -> None:
    pod, router = _router(vllm_objects)
    path = parse(router["args"])[1].tokenizer
    assert path is not None
    mount = next(m for m in router["volumeMounts"] if path.startswith(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume
    (fill,) = [c for c in pod["initContainers"] if any(m["name"] == mount["name"] for m in c["volumeMounts"])]
    command = fill["command"]
    assert command[:2] == ["hf", "download"] and f"--local-dir={mount['mountPath']}" in command
    models = {_flags(e["args"])["--model"] for e in _vllm_engines(vllm_objects)}
    models |= {parse(_containers(p)["shim"]["args"])[1].model for p in _engine_pods(vllm_objects).values()}
    assert models == {command[2]}
    # `hf` comes with huggingface_hub, which the image gets through tokenizers.
    assert any(ep.name == "hf" for ep in entry_points(group="console_scripts"))
    text = DOCS.read_text()
    assert "--tokenizer=/etc/kvswitch/tokenizer" in text and "router-tokenizer.yaml" in text


# Every file the router's --tokenizer loading reads from the tokenizer's folder, with a name a repo
# may give it: router/tokenization.py (tokenizer.json, tokenizer_config.json, chat_template.jinja,
# additional_chat_templates/NAME.jinja, chat_template.json), router/special_tokens.py
# (special_tokens_map.json, added_tokens.json), router/tokenizer_class.py (config.json).
ROUTER_TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "config.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/tool_use.jinja",
]


def _router_download_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The arguments after MODEL of the `hf download` the router advises for a model it lacks."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(TokenizerError) as refused:
        resolve_tokenizer_path("no-such-org/no-such-model")
    advice = re.search(r"`hf download MODEL ([^`]*)`", str(refused.value))
    assert advice is not None, str(refused.value)
    return shlex.split(advice[1])


def _hf_includes(argv: list[str]) -> list[str]:
    """The --include patterns of an `hf download` command line (both spellings)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--include":
            out.append(argv[i + 1])
        elif arg.startswith("--include="):
            out.append(arg.split("=", 1)[1])
    return out


def test_the_router_tokenizer_download_fetches_every_file_the_router_reads(
    vllm_objects: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until 2026-12-07 the init container fetched tokenizer.json, tokenizer_config.json and
    chat_template.jinja by name: a model whose special tokens (special_tokens_map.json,
    added_tokens.json), tokenizer class (config.json) or chat template (chat_template.json,
    additional_chat_templates/) come from the others gave the router a tokenizer unlike vLLM's."""
    pod, _ = _router(vllm_objects)
    (fill,) = [c for c in pod["initContainers"] if c["command"][:2] == ["hf", "download"]]
    command = fill["command"]
    # no file names: with some, `hf download` ignores --include and fetches those alone
    assert [a for a in command[3:] if not a.startswith("--")] == _hf_includes(command[3:])
    includes = _hf_includes(command)
    # what the router tells an operator to run, so the two cannot drift apart
    assert sorted(includes) == sorted(_hf_includes(_router_download_advice(tmp_path, monkeypatch)))
    # as `hf download` filters a repo's paths (huggingface_hub's filter_repo_objects: fnmatchcase,
    # a `*` matching across `/`)
    missed = [f for f in ROUTER_TOKENIZER_FILES if not any(fnmatchcase(f, p) for p in includes)]
    assert missed == [], f"{missed}: the router reads them, the init container does not fetch them"
    weights = ["model-00001-of-00004.safetensors", "original/consolidated.00.pth", "pytorch_model.bin"]
    assert [w for w in weights if any(fnmatchcase(w, p) for p in includes)] == []


# --- 7: draining --------------------------------------------------------------------------------


def _pre_stop_sleep(container: dict[str, Any]) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


def test_engines_outlive_their_shims_drain(objects: list[dict[str, Any]]) -> None:
    """The kubelet SIGTERMs every container at once; an engine that stops then cuts the legs its
    shim drains. Its preStop holds its SIGTERM past the drain, and the grace period covers all."""
    for name, pod in _engine_pods(objects).items():
        containers = _containers(pod)
        engine = containers["engine"]
        drain = parse(containers["shim"]["args"])[1].drain_grace_s or SHIM_DRAIN_S
        hold = _pre_stop_sleep(engine)
        assert hold > drain, f"{name}: the engine gets SIGTERM {hold} s in, the shim drains {drain} s"
        finish = 0.0
        if engine["image"].startswith(VLLM_IMAGE):
            finish = float(_flags(engine["args"]).get("--shutdown-timeout", "0"))
            assert finish > 0, f"{name}: vLLM aborts what is left (--shutdown-timeout 0)"
        grace = pod.get("terminationGracePeriodSeconds", KUBERNETES_DEFAULT_GRACE_S)
        assert grace >= hold + finish + TEARDOWN_S and grace >= drain + CLOSE_S, name
    router, container = _router(objects)
    # its preStop holds SIGTERM while the Service drops its endpoint; then the drain and the close
    hold = _pre_stop_sleep(container)
    assert hold > 0, "router: no preStop, so connections the Service still sends it are refused"
    grace = router.get("terminationGracePeriodSeconds", KUBERNETES_DEFAULT_GRACE_S)
    assert grace >= hold + ROUTER_DRAIN_S + CLOSE_S


def _seconds(duration: str) -> float:
    """A compose duration: `45s`, `1m30s`, `500ms`."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def _compose(*files: Path) -> dict[str, dict[str, Any]]:
    """The services of `docker compose -f A -f B ...` as compose merges them: mappings key by key,
    `volumes` and `ports` added up, any other list or value replaced."""

    def merge(base: Any, over: Any, key: str = "") -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            return {**base, **{k: merge(base[k], v, k) if k in base else v for k, v in over.items()}}
        if key in ("volumes", "ports") and isinstance(base, list) and isinstance(over, list):
            return [*base, *(v for v in over if v not in base)]
        return over

    services: dict[str, dict[str, Any]] = {}
    for file in files:
        services = merge(services, yaml.safe_load(file.read_text())["services"])
    return services


HOLD_SIGTERM = ["sh", "/opt/kvswitch/hold-sigterm.sh"]


def _hold_s(service: dict[str, Any]) -> float:
    """How long a compose service's deploy/compose/hold-sigterm.sh holds its SIGTERM (0: none)."""
    entrypoint = service.get("entrypoint", [])
    if entrypoint[:2] != HOLD_SIGTERM:
        return 0.0
    mount = f"./deploy/compose/hold-sigterm.sh:{HOLD_SIGTERM[1]}:ro"
    assert mount in service["volumes"], "the entrypoint runs a script that is not mounted"
    return float(entrypoint[2])


def _drain_s(service: dict[str, Any]) -> float | None:
    """What a service needs between SIGTERM and its exit, None for what is not kvswitch's or vLLM's."""
    command = service.get("command", [])
    if str(service.get("image", "")).startswith(VLLM_IMAGE):
        return _hold_s(service) + float(_flags(command).get("--shutdown-timeout", "0")) + TEARDOWN_S
    if command[:1] == ["sim"]:
        return _hold_s(service) + TEARDOWN_S
    if command[:1] == ["shim"]:
        return float(parse(command)[1].drain_grace_s or SHIM_DRAIN_S) + CLOSE_S
    if command[:1] == ["router"]:
        return ROUTER_DRAIN_S + CLOSE_S
    return None


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_VLLM]], ids=["sim", "vllm"])
def test_compose_gives_every_drain_its_time(files: list[Path]) -> None:
    checked = 0
    for name, service in _compose(*files).items():
        need = _drain_s(service)
        if need is None:
            continue
        checked += 1
        grace = _seconds(service.get("stop_grace_period", "10s"))  # Docker's default
        assert grace >= need, f"{name}: stop_grace_period {grace} s, its drain needs {need} s"
    assert checked >= 4


def _engines(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        n: s
        for n, s in services.items()
        if str(s.get("image", "")).startswith(VLLM_IMAGE) or s.get("command", [None])[0] == "sim"
    }


def _started(files: list[Path]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _compose(*files).items() if not s.get("profiles")}


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_VLLM]], ids=["sim", "vllm"])
def test_no_service_joins_the_network_namespace_of_one_that_can_restart(files: list[Path]) -> None:
    """Docker gives a restarted container a new network namespace; a container that joined the old
    one stays there with a loopback only. Until 2026-12-07 each shim joined its engine's, and the
    engine had `restart: unless-stopped`: after an engine crash its shim waited for it forever."""
    started = _started(files)
    owners = set()
    for name, service in started.items():
        mode = str(service.get("network_mode", ""))
        if not mode.startswith("service:"):
            continue
        owner = started[mode.removeprefix("service:")]
        # Docker restarts a container whose process exits: the owner's never does (sleep infinity),
        # so its restart policy acts only as the daemon starts, with every container of the worker
        assert owner["entrypoint"] == ["sleep", "infinity"] and owner.get("init") is True, f"{name} joins {mode}"
        assert "network_mode" not in owner and "command" not in owner, mode
        # and it starts with the daemon, so that a reboot brings its engine and shim back (8b2053a)
        assert owner.get("restart") == "unless-stopped", mode
        owners.add(mode)
    # every engine and its shim share a namespace of that kind, one per worker
    shims = [s for s in started.values() if s.get("command", [None])[0] == "shim"]
    assert sorted(str(e.get("network_mode")) for e in _engines(started).values()) == sorted(owners)
    assert sorted(str(s.get("network_mode")) for s in shims) == sorted(owners) and len(owners) == 2


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_VLLM]], ids=["sim", "vllm"])
def test_compose_engines_outlive_their_shims_drain(files: list[Path]) -> None:
    """Compose stops an engine and its shim at once (neither joins the other's namespace, so
    neither depends on the other): the engine holds its SIGTERM past the shim's drain, as a pod's
    preStop does on Kubernetes (test_engines_outlive_their_shims_drain)."""
    started = _started(files)
    shims = [s for s in started.values() if s.get("command", [None])[0] == "shim"]
    assert len(shims) == 2
    for shim in shims:
        (engine,) = [e for e in _engines(started).values() if e["network_mode"] == shim["network_mode"]]
        drain = parse(shim["command"])[1].drain_grace_s or SHIM_DRAIN_S
        assert _hold_s(engine) > drain, f"{shim['network_mode']}: the engine stops during its shim's drain"


def test_hold_sigterm_passes_sigterm_on_after_its_hold_and_exits_as_its_command(tmp_path: Path) -> None:
    log = tmp_path / "log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_sleep = bin_dir / "sleep"  # records the hold instead of waiting it out
    fake_sleep.write_text(f'#!/bin/sh\necho "held $1" >> {log}\n')
    fake_sleep.chmod(0o755)
    child = (
        "import signal, sys, time\n"
        f"def term(*_): open({str(log)!r}, 'a').write('term\\n'); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        f"open({str(log)!r}, 'a').write('ready\\n')\n"
        "while True: time.sleep(1)\n"
    )
    script = ROOT / "deploy" / "compose" / "hold-sigterm.sh"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    held = subprocess.Popen(["sh", str(script), "35", sys.executable, "-c", child], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and "ready" in log.read_text()):
            assert held.poll() is None and time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        held.terminate()
        assert held.wait(timeout=30) == 7
    finally:
        held.kill()
    assert log.read_text().split("\n") == ["ready", "held 35", "term", ""]
    crashed = subprocess.run(["sh", str(script), "35", "sh", "-c", "exit 3"], timeout=30)
    assert crashed.returncode == 3  # no SIGTERM, no hold: restart policies see the engine's own exit


def test_hold_sigterm_lets_the_engines_shutdown_run_whole_through_a_second_signal(tmp_path: Path) -> None:
    """A second SIGTERM while the engine shuts down (vLLM's --shutdown-timeout, finishing the KV a
    decode engine pulls) is not passed on and does not end the script, which as a container's PID 1
    would take the engine with it (review of 3cb90a3)."""
    log = tmp_path / "log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sleep").write_text(f'#!/bin/sh\necho "held $1" >> {log}\n')
    (bin_dir / "sleep").chmod(0o755)
    child = (
        "import signal, sys, time\n"
        f"def note(what): open({str(log)!r}, 'a').write(what + '\\n')\n"
        "def term(*_):\n"
        "    signal.signal(signal.SIGTERM, lambda *_: note('second term'))\n"
        "    note('term'); time.sleep(1.0); note('shut down'); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "note('ready')\n"
        "while True: time.sleep(1)\n"
    )
    script = ROOT / "deploy" / "compose" / "hold-sigterm.sh"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    held = subprocess.Popen(["sh", str(script), "35", sys.executable, "-c", child], env=env)
    try:
        for awaited in ("ready", "term"):
            deadline = time.monotonic() + 30
            while not (log.exists() and awaited in log.read_text().split("\n")):
                assert held.poll() is None and time.monotonic() < deadline, f"never {awaited}"
                time.sleep(0.02)
            held.terminate()  # the first starts the shutdown; the second comes during it
        assert held.wait(timeout=30) == 7
    finally:
        held.kill()
    assert log.read_text().split("\n") == ["ready", "held 35", "term", "shut down", ""]


# --- the compose vLLM variant and the HF token ------------------------------------------------------


def test_the_compose_vllm_variant_is_consistent() -> None:
    services = _compose(COMPOSE, COMPOSE_VLLM)
    started = {n: s for n, s in services.items() if not s.get("profiles")}
    assert not any(n.startswith("sim-") for n in started)
    shims = {n: s for n, s in started.items() if s.get("command", [None])[0] == "shim"}
    routers = [parse(s["command"])[1] for s in started.values() if s.get("command", [None])[0] == "router"]
    assert len(shims) == 2 and len(routers) == 2
    models, gpus = set(), []
    for shim in shims.values():
        (engine,) = [e for e in _engines(started).values() if e["network_mode"] == shim["network_mode"]]
        assert engine["image"].startswith(VLLM_IMAGE)
        flags, args = _flags(engine["command"]), parse(shim["command"])[1]
        assert kv_endpoints(flags["--kv-events-config"]) == (args.kv_events, args.kv_replay)
        assert f"http://{flags['--host']}:{flags['--port']}" == args.engine_url
        transfer = json.loads(flags["--kv-transfer-config"])
        assert transfer["kv_connector"] == "NixlConnector" and transfer["kv_role"] == "kv_both"
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST=$$(hostname -i" in " ".join(engine["entrypoint"])
        assert engine["environment"]["HF_TOKEN"].startswith("${HF_TOKEN")  # from the operator
        models |= {flags["--model"], args.model}
        gpus += engine["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        assert "hf-cache:/root/.cache/huggingface" in engine["volumes"]
    assert len(set(gpus)) == 2  # count: 1 would give both engines the first GPU
    for router in routers:
        assert router.conditional_disagg and {router.model, router.tokenizer} == models
    assert len(models) == 1
    # The routers find the tokenizer in the Hugging Face cache the engines fill.
    for service in (s for s in started.values() if s.get("command", [None])[0] == "router"):
        (cache,) = [v for v in service["volumes"] if v.startswith("hf-cache:")]
        assert cache.split(":")[1] == service["environment"]["HF_HOME"]
        engines = [n for n in started if n.startswith("vllm-")]
        assert all(service["depends_on"][n]["condition"] == "service_healthy" for n in engines)


def test_the_compose_vllm_variant_validates() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed")
    passwords = {f"KVSWITCH_ETCD_{r}_PASSWORD": "test" for r in ("ROOT", "ROUTER", "WORKER")}
    out = subprocess.run(
        [compose, "-f", str(COMPOSE), "-f", str(COMPOSE_VLLM), "config", "--quiet"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **passwords},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_the_hf_token_comes_from_a_documented_secret(vllm_objects: list[dict[str, Any]]) -> None:
    pod, _ = _router(vllm_objects)
    needs_token = [*_vllm_engines(vllm_objects), *pod["initContainers"]]
    secrets = {json.dumps(_env(c)["HF_TOKEN"]["valueFrom"]["secretKeyRef"], sort_keys=True) for c in needs_token}
    (ref,) = [json.loads(s) for s in secrets]
    created = [
        argv for argv in _docs_commands() if argv[:6] == ["kubectl", "-n", "kvswitch", "create", "secret", "generic"]
    ]
    (hf,) = [argv for argv in created if argv[6] == ref["name"]]
    assert f"--from-literal={ref['key']}=$HF_TOKEN" in hf


# --- Prometheus reaches every shim where it runs (observability audit, 2026-12-04) ---------------


def _prometheus_config(services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The config the compose `prometheus` service loads: its --config.file, read from the host
    file mounted there (compose mounts the last file given for a container path)."""
    prometheus = services["prometheus"]
    (path,) = [a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--config.file=")]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    return dict(yaml.safe_load((ROOT / mounts[path]).read_text()))


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_VLLM]], ids=["sim", "vllm"])
def test_prometheus_scrapes_each_shim_in_the_network_namespace_it_runs_in(files: list[Path]) -> None:
    # Until 2026-12-04 the vLLM variant kept scraping sim-prefill and sim-decode, which it never starts.
    services = _compose(*files)
    started = {n: s for n, s in services.items() if not s.get("profiles")}
    shims = [parse(s["command"])[1] for s in started.values() if s.get("command", [None])[0] == "shim"]
    shim_at = {
        (s["network_mode"].removeprefix("service:"), parse(s["command"])[1].http_port): parse(s["command"])[1]
        for s in started.values()
        if s.get("command", [None])[0] == "shim"
    }
    jobs = {job["job_name"]: job["static_configs"] for job in _prometheus_config(services)["scrape_configs"]}
    scraped = {}
    for config in jobs["kvswitch-shim"]:
        for target in config["targets"]:
            host, port = target.rsplit(":", 1)
            assert host in started, f"{target}: {host} is not started"
            assert (host, int(port)) in shim_at, f"{target}: no shim serves /metrics there"
            scraped[shim_at[host, int(port)].worker_name] = config["labels"]["worker"]
    assert len(shims) == 2 and scraped == {s.worker_name: s.worker_name for s in shims}, scraped
    routers = {f"{n}:{parse(s['command'])[1].http_port}" for n, s in started.items() if n.startswith("router")}
    assert {t for c in jobs["kvswitch-router"] for t in c["targets"]} == routers


def test_every_shim_pod_is_scraped_on_its_http_port(objects: list[dict[str, Any]]) -> None:
    kinds = ("Deployment", "StatefulSet", "DaemonSet")
    templates = [o["spec"]["template"] for o in objects if o["kind"] in kinds]
    shim_pods = [t for t in templates if "shim" in _containers(t["spec"])]
    assert len(shim_pods) == 2
    for template in shim_pods:
        port = _flags(_containers(template["spec"])["shim"]["args"])["--http-port"]
        annotations = template["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true" and annotations.get("prometheus.io/port") == port
        ports = {p["containerPort"] for p in _containers(template["spec"])["shim"].get("ports", [])}
        assert int(port) in ports


def test_the_dashboard_names_no_scrape_job() -> None:
    # compose names its jobs kvswitch-router and kvswitch-shim; annotation-based discovery on
    # Kubernetes has a job of its own: a `job=` matcher would leave one of them empty.
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvswitch.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert [e for e in exprs if re.search(r"\bjob\s*=", e)] == []
    assert any(re.match(r"up\b", e) for e in exprs)  # the shims' scrape health is still charted
