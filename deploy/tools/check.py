"""The checks behind deploy/validate.sh, on manifests it has already rendered.

Every finding is collected; the run fails once, at the end, listing them all. Sections:

1. every YAML and JSON file under deploy/ parses;
2. every rendered core Kubernetes object validates against the Kubernetes schema (offline,
   the schemas shipped by kubernetes-validate); custom resources (Gateway API, Envoy
   Gateway, Istio) get their required fields checked;
3. the filter's schema (deploy/kong/kvaffine.meta.json) lists exactly the filter's
   configuration fields (GatewayConfig in filter/src/config.rs and RoutingConfig in
   core/src/config.rs); kvaffined's flags and endpoint file are read from
   daemon/src/config.rs;
4. the Kubernetes overlays agree with themselves and with those: vLLM flags, kvaffined
   flags and endpoint discovery (--discover-dns against the replicas' Service and the
   gateway's pool, or a --config file from a ConfigMap), mounts, unused volumes and
   ConfigMaps, the ECDS file, the module, Service names, every filter configuration;
5. Kong's settings and declarative files (decK format), their filter configurations;
6. real Envoy (`envoy --mode validate`) on every bootstrap, on each with the ECDS resource
   inlined, and on configurations assembled from the Envoy Gateway and Istio resources.
"""

import argparse
import base64
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

FAILURES = []
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
HCM_TYPE = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
            ".v3.HttpConnectionManager")
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
DEFAULT_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
DEFAULT_TOKEN_VARIABLE = "KVAFFINE_INDEX_TOKEN"


def fail(where, message):
    FAILURES.append(f"{where}: {message}")


def ok(message, since=None):
    """Reports a passed check; with `since` (a failure count), a failed one if failures grew."""
    failed = since is not None and len(FAILURES) > since
    print(f"  {'FAIL' if failed else 'ok'}  {message}")


def section(title):
    print(f"\n== {title}")


# ---------------------------------------------------------------------------------------
# Sources of truth in the Rust code.

def rust_struct_fields(path, struct):
    """(field name, has a serde default, clap long name) of `pub struct <struct>`."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.find(f"pub struct {struct} {{")
    if start < 0:
        raise SystemExit(f"{path}: no `pub struct {struct}`")
    body = text[start:text.index("\n}", start)]
    fields, attrs = [], []
    for line in body.splitlines()[1:]:
        line = line.strip()
        if line.startswith("#["):
            attrs.append(line)
            continue
        match = re.match(r"pub (\w+):", line)
        if match:
            name = match.group(1)
            joined = " ".join(attrs)
            long = re.search(r'long\s*=\s*"([^"]+)"', joined)
            fields.append({
                "name": name,
                "default": "serde(default" in joined,
                "long": long.group(1) if long else name.replace("_", "-"),
            })
            attrs = []
        elif line and not line.startswith("//"):
            attrs = []
    return fields


# ---------------------------------------------------------------------------------------
# Loading.

def load_yaml_docs(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def parse_everything(deploy):
    section("1. every YAML and JSON file parses")
    count = 0
    for path in sorted(deploy.rglob("*")):
        if not path.is_file():
            continue
        try:
            if path.suffix in (".yaml", ".yml"):
                load_yaml_docs(path)
            elif path.suffix == ".json":
                json.loads(path.read_text(encoding="utf-8"))
            else:
                continue
        except (yaml.YAMLError, json.JSONDecodeError) as err:
            fail(path.relative_to(deploy.parent), f"does not parse: {err}")
            continue
        count += 1
    ok(f"{count} files parse")


# ---------------------------------------------------------------------------------------
# 2. Kubernetes objects.

def require(obj, dotted, where, kinds=None):
    """The value at a dotted path (list indices as numbers), failing if absent."""
    node = obj
    for part in dotted.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            fail(where, f"missing {dotted}")
            return None
    if kinds and not isinstance(node, kinds):
        fail(where, f"{dotted} is a {type(node).__name__}")
        return None
    return node


def name_of(obj):
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('name')}"


def check_custom_resource(obj, where):
    """Required fields of the custom resources used here (no CRD schema ships offline)."""
    api, kind = obj.get("apiVersion", ""), obj.get("kind")
    where = f"{where} {name_of(obj)}"
    require(obj, "metadata.name", where, str)
    spec = require(obj, "spec", where, dict)
    if spec is None:
        return False
    group = api.split("/")[0]
    if group == "gateway.networking.k8s.io" and kind == "Gateway":
        require(obj, "spec.gatewayClassName", where, str)
        for i, listener in enumerate(require(obj, "spec.listeners", where, list) or []):
            for field in ("name", "protocol", "port"):
                require(listener, field, f"{where} listener {i}")
    elif group == "gateway.networking.k8s.io" and kind == "HTTPRoute":
        require(obj, "spec.parentRefs.0.name", where, str)
        for i, rule in enumerate(require(obj, "spec.rules", where, list) or []):
            for j, ref in enumerate(require(rule, "backendRefs", f"{where} rule {i}", list) or []):
                require(ref, "name", f"{where} rule {i} backendRef {j}", str)
                require(ref, "port", f"{where} rule {i} backendRef {j}", int)
    elif group == "gateway.envoyproxy.io":
        check_envoy_gateway_policy(obj, kind, spec, where)
    elif group == "networking.istio.io" and kind == "EnvoyFilter":
        check_envoy_filter(spec, where)
    else:
        fail(where, f"unknown custom resource {api} {kind}: add its checks to deploy/tools/check.py")
        return False
    return True


def target_refs(spec, where):
    refs = spec.get("targetRefs") or ([spec["targetRef"]] if "targetRef" in spec else [])
    if not refs:
        fail(where, "no targetRef or targetRefs")
    for ref in refs:
        for field in ("group", "kind", "name"):
            require(ref, field, f"{where} targetRef")
    return refs


def check_envoy_gateway_policy(obj, kind, spec, where):
    if kind == "EnvoyExtensionPolicy":
        target_refs(spec, where)
        for i, wasm in enumerate(require(obj, "spec.wasm", where, list) or []):
            w = f"{where} wasm {i}"
            code_type = require(wasm, "code.type", w, str)
            if code_type not in ("HTTP", "Image"):
                fail(w, f"code.type {code_type!r} is not HTTP or Image")
            elif code_type == "Image":
                require(wasm, "code.image.url", w, str)
            else:
                require(wasm, "code.http.url", w, str)
            require(wasm, "config", w, dict)
    elif kind == "EnvoyPatchPolicy":
        if spec.get("type") != "JSONPatch":
            fail(where, "spec.type must be JSONPatch")
        target_refs(spec, where)
        types = {"type.googleapis.com/envoy.config.listener.v3.Listener",
                 "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
                 "type.googleapis.com/envoy.config.cluster.v3.Cluster",
                 "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                 "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"}
        for i, patch in enumerate(require(obj, "spec.jsonPatches", where, list) or []):
            p = f"{where} jsonPatch {i}"
            if patch.get("type") not in types:
                fail(p, f"type {patch.get('type')!r} cannot be patched")
            require(patch, "name", p, str)
            op = require(patch, "operation.op", p, str)
            if op not in ("add", "remove", "replace", "move", "copy", "test"):
                fail(p, f"operation.op {op!r}")
    elif kind == "BackendTrafficPolicy":
        target_refs(spec, where)
        lb_type = require(obj, "spec.loadBalancer.type", where, str)
        if lb_type not in ("ConsistentHash", "LeastRequest", "Random", "RoundRobin", "BackendUtilization"):
            fail(where, f"loadBalancer.type {lb_type!r}")
        for source in require(obj, "spec.loadBalancer.endpointOverride.extractFrom", where, list) or []:
            require(source, "header", where, str)
    elif kind == "ClientTrafficPolicy":
        target_refs(spec, where)
        limit = spec.get("connection", {}).get("bufferLimit")
        if limit is not None and not re.fullmatch(r"[1-9]+[0-9]*([EPTGMK]i|[EPTGMk])?", str(limit)):
            fail(where, f"connection.bufferLimit {limit!r} is not a quantity Envoy Gateway accepts")
    else:
        fail(where, f"no checks for {kind}")


ENVOY_FILTER_APPLY_TO = {"LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "ROUTE_CONFIGURATION",
                         "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP",
                         "LISTENER_FILTER"}
ENVOY_FILTER_OPS = {"MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE"}


def check_envoy_filter(spec, where):
    for i, patch in enumerate(require({"spec": spec}, "spec.configPatches", where, list) or []):
        p = f"{where} configPatch {i}"
        if patch.get("applyTo") not in ENVOY_FILTER_APPLY_TO:
            fail(p, f"applyTo {patch.get('applyTo')!r}")
        op = require(patch, "patch.operation", p, str)
        if op not in ENVOY_FILTER_OPS:
            fail(p, f"patch.operation {op!r}")
        if op != "REMOVE":
            require(patch, "patch.value", p, dict)
        context = (patch.get("match") or {}).get("context")
        if context not in (None, "ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"):
            fail(p, f"match.context {context!r}")


def validate_kubernetes(files, versions):
    section("2. Kubernetes objects")
    core = custom = 0
    for label, path in files:
        for obj in load_yaml_docs(path):
            where = f"{label}"
            if not isinstance(obj, dict) or "apiVersion" not in obj or "kind" not in obj:
                fail(where, "a document without apiVersion and kind")
                continue
            try:
                for version in versions:
                    kubernetes_validate.validate(obj, version, strict=True)
                core += 1
            except kubernetes_validate.SchemaNotFoundError:
                if check_custom_resource(obj, where):
                    custom += 1
            except kubernetes_validate.ValidationError as err:
                fail(f"{where} {name_of(obj)}", f"Kubernetes {version} schema: {err.message} "
                     f"at {'.'.join(str(p) for p in err.path)}")
    ok(f"{core} core objects valid against the schemas of Kubernetes {', '.join(versions)} (strict)")
    ok(f"{custom} custom resources have their required fields")


# ---------------------------------------------------------------------------------------
# 3. The overlays' internal consistency.

def flag_value(args, flag):
    """`--flag=value` or `--flag value` in an argument list; None if absent."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


def flag_values(args, flag):
    """Every value of a repeatable flag, in order."""
    values = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1:])
    return values


def pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def containers_of(obj):
    spec = pod_spec(obj)
    return spec.get("containers", []) + spec.get("initContainers", [])


def volume_named(obj, name):
    for volume in pod_spec(obj).get("volumes", []):
        if volume["name"] == name:
            return volume
    return None


def volume_for_path(obj, container, path):
    """(volume, mount path) of the mount that holds `path` in this container."""
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return volume_named(obj, mount["name"]), mount["mountPath"]
    return None, None


def configmap_by_volume(objects, volume):
    if not volume or "configMap" not in volume:
        return None
    return objects.get(("ConfigMap", volume["configMap"]["name"]))


def check_overlay(label, objects, context):
    start = len(FAILURES)
    where = f"overlay {label}"
    vllm = objects.get(("StatefulSet", "vllm"))
    if not vllm:
        fail(where, "no StatefulSet vllm")
        return
    replica = next((c for c in vllm["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"), None)
    if not replica:
        fail(where, "the vllm StatefulSet has no container named vllm")
        return
    args = replica.get("command", []) + replica.get("args", [])
    for flag in ("--enable-prefix-caching",):
        if flag not in args:
            fail(where, f"vLLM lacks {flag}")
    if flag_value(args, "--prefix-caching-hash-algo") != "sha256_cbor":
        fail(where, "vLLM must run with --prefix-caching-hash-algo sha256_cbor")
    block_size = flag_value(args, "--block-size")
    events_config = flag_value(args, "--kv-events-config")
    try:
        events = json.loads(events_config or "")
    except json.JSONDecodeError as err:
        fail(where, f"--kv-events-config is not JSON: {err}")
        events = {}
    known = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
             "max_queue_size", "topic"}
    for key in set(events) - known:
        fail(where, f"--kv-events-config has {key!r}, which vLLM's KVEventsConfig does not")
    if events.get("enable_kv_cache_events") is not True or events.get("publisher") != "zmq":
        fail(where, "--kv-events-config must enable events with publisher zmq")
    ports = {p["containerPort"] for p in replica.get("ports", [])}
    for key in ("endpoint", "replay_endpoint"):
        url = events.get(key, "")
        match = re.fullmatch(r"tcp://\*:(\d+)", url)
        if not match:
            fail(where, f"--kv-events-config {key} {url!r} is not tcp://*:PORT")
        elif int(match.group(1)) not in ports:
            fail(where, f"vLLM does not declare the {key} port {match.group(1)}")
    probe = replica.get("readinessProbe", {}).get("httpGet", {})
    if probe.get("path") != "/health":
        fail(where, "vLLM readiness must be GET /health")
    if "nvidia.com/gpu" not in replica.get("resources", {}).get("limits", {}):
        fail(where, "vLLM requests no GPU")
    service = objects.get(("Service", "vllm"))
    if not service or service["spec"].get("clusterIP") != "None":
        fail(where, "the vllm Service must be headless")
    if vllm["spec"].get("serviceName") != "vllm":
        fail(where, "the StatefulSet's serviceName must be the headless Service")
    context["block_size"] = int(block_size) if block_size and block_size.isdigit() else None
    context["topic"] = events.get("topic", "")

    daemon_flags = {f["long"] for f in context["serve_args"]}
    daemons = [(obj, c) for (kind, _), obj in objects.items() if kind == "Deployment"
               for c in pod_spec(obj)["containers"] if c["name"] == "kvaffined"]
    dns_targets, sources, auth_secret = set(), [], None
    if len(daemons) != 1:
        fail(where, f"{len(daemons)} kvaffined containers (want 1)")
    for obj, daemon in daemons:
        dargs = daemon.get("args", [])
        if dargs[:1] != ["serve"]:
            fail(where, "kvaffined must run `serve`")
        for arg in dargs[1:]:
            if arg.startswith("--") and arg[2:].split("=")[0] not in daemon_flags:
                fail(where, f"kvaffined serve has no flag {arg.split('=')[0]} (daemon/src/config.rs)")
        if flag_value(dargs, "--block-size") != block_size:
            fail(where, f"kvaffined --block-size {flag_value(dargs, '--block-size')} != vLLM's {block_size}")
        if (flag_value(dargs, "--topic") or "") != context["topic"]:
            fail(where, f"kvaffined --topic {flag_value(dargs, '--topic')!r} != vLLM's {context['topic']!r}")
        listen = flag_value(dargs, "--listen")
        standalone = obj["metadata"]["name"] == "kvaffined"
        if standalone:
            svc = objects.get(("Service", "kvaffined"))
            if not listen or not listen.startswith("0.0.0.0:"):
                fail(where, "standalone kvaffined must listen on 0.0.0.0 explicitly (its default is loopback)")
            elif not svc or int(listen.rsplit(":", 1)[1]) not in {p["port"] for p in svc["spec"]["ports"]}:
                fail(where, "the kvaffined Service does not expose the daemon's port")
        else:
            peered = flag_values(dargs, "--peer-dns")
            if peered:
                if not flag_value(dargs, "--auth-token-file"):
                    fail(where, "a peered sidecar kvaffined is reachable in the cluster: it needs "
                         "--auth-token-file")
                check_peers(where, objects, obj, daemon, listen, peered)
            elif listen and not listen.startswith("127.0.0.1:"):
                fail(where, "a sidecar kvaffined must stay on loopback unless it is peered (--peer-dns)")
            aliases = {h for a in pod_spec(obj).get("hostAliases", []) if a.get("ip") == "127.0.0.1"
                       for h in a.get("hostnames", [])}
            if "kvaffined" not in aliases:
                fail(where, "the sidecar pod must alias kvaffined to 127.0.0.1 for the bootstrap's cluster")
        dns_targets = check_discovery(where, objects, obj, daemon, dargs, context)
        sources += [f for f in ("--discover-dns", "--config", "--discover", "--endpoint", "--peer-dns")
                    if flag_values(dargs, f)]
        token_file = flag_value(dargs, "--auth-token-file")
        if token_file:
            volume, _ = volume_for_path(obj, daemon, token_file)
            auth_secret = ((volume or {}).get("secret") or {}).get("secretName")
            if not auth_secret:
                fail(where, f"kvaffined --auth-token-file {token_file} is not in a mounted Secret")
            sources.append("--auth-token-file")
    check_unused(where, objects)
    gateway = objects.get(("Deployment", "kvaffine-gateway"))
    if gateway:
        check_gateway(where, objects, gateway, context, dns_targets, auth_secret)
    ok(f"overlay {label}: vLLM, kvaffined ({' '.join(sources)}){', gateway' if gateway else ''} consistent",
       start)


def check_peers(where, objects, obj, daemon, listen, names):
    """Each --peer-dns name is a headless Service of this very workload's pods, on the port
    the daemon listens on (on the pod's address), listing pods before they are ready."""
    if not listen or not listen.startswith(("0.0.0.0:", "[::]:")):
        fail(where, "a peered kvaffined must listen on 0.0.0.0 or [::] (its peers reach it at its pod's address)")
        return
    port = int(listen.rsplit(":", 1)[1])
    labels = pod_spec_labels(obj)
    for value in names:
        name, _, named_port = value.rpartition(":")
        parts = name.rstrip(".").split(".")
        namespace = parts[1] if len(parts) > 1 else obj["metadata"].get("namespace")
        svc = objects.get(("Service", parts[0]))
        if not svc or svc["metadata"].get("namespace") != namespace:
            fail(where, f"--peer-dns {name}: no Service {parts[0]} in namespace {namespace} in the overlay")
            continue
        spec = svc["spec"]
        if spec.get("clusterIP") != "None":
            fail(where, f"--peer-dns {name}: Service {parts[0]} is not headless (its name would be one "
                 "virtual IP: one peer at random, not every daemon)")
        selector = spec.get("selector") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            fail(where, f"--peer-dns {name}: Service {parts[0]} does not select the daemon's pods")
        if not named_port.isdigit() or int(named_port) not in {p["port"] for p in spec["ports"]}:
            fail(where, f"--peer-dns {value}: Service {parts[0]} has no port {named_port}")
        targets = {p.get("targetPort", p["port"]) for p in spec["ports"] if str(p["port"]) == named_port}
        named = {p["name"]: p["containerPort"] for p in daemon.get("ports", []) if "name" in p}
        if {named.get(t, t) for t in targets} != {port}:
            fail(where, f"--peer-dns {value}: Service {parts[0]} does not reach the daemon's port {port}")
        if not spec.get("publishNotReadyAddresses"):
            fail(where, f"--peer-dns {name}: Service {parts[0]} must publish not-ready addresses "
                 "(a starting gateway pod takes bookings before its Envoy is ready)")


def pod_spec_labels(obj):
    return obj["spec"]["template"].get("metadata", {}).get("labels", {})


def check_discovery(where, objects, obj, daemon, dargs, context):
    """kvaffined's endpoint sources; the (Service, port) pairs its --discover-dns names."""
    config = flag_value(dargs, "--config")
    dns = flag_values(dargs, "--discover-dns")
    if not (config or dns or flag_values(dargs, "--discover") or flag_values(dargs, "--endpoint")):
        fail(where, "kvaffined is given no endpoints (--config, --discover-dns, --discover or --endpoint)")
    if config and dns:
        fail(where, "kvaffined has both --config and --discover-dns: one discovery component, not two")
    targets = set()
    for value in dns:
        name, _, port = value.rpartition(":")
        if not name or not port.isdigit():
            fail(where, f"--discover-dns {value!r} is not NAME:PORT")
            continue
        # The headless Service as the daemon's pod resolves it: SERVICE, SERVICE.NAMESPACE,
        # SERVICE.NAMESPACE.svc or SERVICE.NAMESPACE.svc.cluster.local (trailing dot allowed).
        labels = name.rstrip(".").split(".")
        namespace = labels[1] if len(labels) > 1 else obj["metadata"].get("namespace")
        if len(labels) > 2 and labels[2:] not in (["svc"], ["svc", "cluster", "local"]):
            fail(where, f"--discover-dns {name} is not SERVICE.NAMESPACE.svc.cluster.local")
            continue
        svc = objects.get(("Service", labels[0]))
        if not svc or svc["metadata"].get("namespace") != namespace:
            fail(where, f"--discover-dns {name}: no Service {labels[0]} in namespace {namespace} in the overlay")
            continue
        if svc["spec"].get("clusterIP") != "None":
            fail(where, f"--discover-dns {name}: Service {labels[0]} is not headless (its DNS name would be "
                 "one virtual IP, not the replicas)")
        # The default is SingleStack only for a Service with a selector.
        default_policy = "SingleStack" if svc["spec"].get("selector") else None
        if svc["spec"].get("ipFamilyPolicy", default_policy) != "SingleStack":
            fail(where, f"--discover-dns {name}: Service {labels[0]} must be single-stack, so kvaffined "
                 "and Envoy's pool see the same addresses")
        if int(port) not in {p["port"] for p in svc["spec"]["ports"]}:
            fail(where, f"--discover-dns {value}: Service {labels[0]} has no port {port}")
        targets.add((labels[0], int(port)))
    if config:
        volume, _ = volume_for_path(obj, daemon, config)
        if not volume:
            fail(where, f"kvaffined's --config {config} is on no mounted volume")
            return targets
        cm = configmap_by_volume(objects, volume)
        if not cm:
            fail(where, f"kvaffined's --config {config} is not from a ConfigMap")
            return targets
        key = os.path.basename(config)
        if key not in cm.get("data", {}):
            fail(where, f"ConfigMap {cm['metadata']['name']} has no {key}")
            return targets
        errors = sorted(context["endpoints_validator"].iter_errors(json.loads(cm["data"][key])), key=str)
        for err in errors:
            fail(where, f"{key}: {err.message}")
    return targets


def check_unused(where, objects):
    """Every pod volume is mounted, every ConfigMap a volume, nothing local-config left."""
    used = set()
    for (kind, name), obj in objects.items():
        annotations = obj.get("metadata", {}).get("annotations") or {}
        if annotations.get("config.kubernetes.io/local-config") == "true":
            fail(where, f"{kind}/{name} is local-config: kustomize should have dropped it")
        if kind not in ("Deployment", "StatefulSet"):
            continue
        mounted = {m["name"] for c in containers_of(obj) for m in c.get("volumeMounts", [])}
        declared = {v["name"] for v in pod_spec(obj).get("volumes", [])}
        for missing in sorted(mounted - declared):
            fail(where, f"{kind}/{name}: a container mounts {missing}, which is no pod volume")
        for volume in pod_spec(obj).get("volumes", []):
            if volume["name"] not in mounted:
                fail(where, f"{kind}/{name}: volume {volume['name']} is mounted by no container")
            if "configMap" in volume:
                used.add(volume["configMap"]["name"])
    for (kind, name) in objects:
        if kind == "ConfigMap" and name not in used:
            fail(where, f"ConfigMap {name} is used by no volume")


def configured_filter(ecds, where):
    """The Wasm PluginConfig of an ECDS file's kvaffine resource, and its JSON configuration."""
    resources = (ecds or {}).get("resources") or []
    if len(resources) != 1 or resources[0].get("typed_config", {}).get("@type") != WASM_TYPE:
        fail(where, "the ECDS file must hold one TypedExtensionConfig of the Wasm filter")
        return None, None
    config = resources[0]["typed_config"].get("config", {})
    return resources[0], config


def check_plugin_config(config, where, context, clusters=None):
    """The Wasm PluginConfig around kvaffine: the flag, the failure policy, the JSON."""
    if config.get("allow_on_headers_stop_iteration") is not True:
        fail(where, "allow_on_headers_stop_iteration must be true")
    if config.get("failure_policy", "FAIL_OPEN" if config.get("fail_open") else None) != "FAIL_OPEN":
        fail(where, "the filter must fail open")
    value = (config.get("configuration") or {}).get("value")
    try:
        filter_json = json.loads(value or "")
    except json.JSONDecodeError as err:
        fail(where, f"the filter configuration is not JSON: {err}")
        return None
    check_filter_json(filter_json, where, context, clusters)
    return filter_json


def check_filter_json(filter_json, where, context, clusters=None):
    context["filter_configs"] += 1
    for err in sorted(context["filter_validator"].iter_errors(filter_json), key=str):
        fail(where, f"filter configuration: {err.message}")
    if context.get("block_size") and filter_json.get("block_size") != context["block_size"]:
        fail(where, f"filter block_size {filter_json.get('block_size')} != vLLM's {context['block_size']}")
    if clusters is not None:
        for key in ("tokenizer_cluster", "index_cluster"):
            if filter_json.get(key) not in clusters:
                fail(where, f"{key} {filter_json.get(key)!r} is not a cluster ({', '.join(sorted(clusters))})")


def check_gateway_token(where, envoy, config, filter_json, auth_secret):
    """Lookups carry a token exactly when kvaffined checks one, and from the same Secret."""
    variable = filter_json.get("index_token_env") or DEFAULT_TOKEN_VARIABLE
    env = {e["name"]: e for e in envoy.get("env", [])}
    host_keys = config.get("vm_config", {}).get("environment_variables", {}).get("host_env_keys", [])
    if not auth_secret:
        if variable in env or filter_json.get("index_token"):
            fail(where, "the gateway sends a lookup token but kvaffined checks none (--auth-token-file)")
        return
    if filter_json.get("index_token"):
        fail(where, "index_token in a ConfigMap: take the token from kvaffined's Secret (index_token_env)")
    source = env.get(variable, {}).get("valueFrom", {}).get("secretKeyRef", {})
    if source.get("name") != auth_secret:
        fail(where, f"kvaffined reads its tokens from Secret {auth_secret}, but Envoy's {variable} "
             f"does not come from it")
    if variable not in host_keys:
        fail(where, f"the filter VM is not given {variable} (vm_config.environment_variables.host_env_keys)")


def check_gateway(where, objects, gateway, context, dns_targets, auth_secret):
    envoy = next((c for c in pod_spec(gateway)["containers"] if c["name"] == "envoy"), None)
    if not envoy:
        fail(where, "the gateway Deployment has no container named envoy")
        return
    eargs = envoy.get("command", []) + envoy.get("args", [])
    bootstrap_path = flag_value(eargs, "-c")
    bvol, _ = volume_for_path(gateway, envoy, bootstrap_path or "")
    bootstrap_cm = configmap_by_volume(objects, bvol)
    if not bootstrap_cm or os.path.basename(bootstrap_path) not in bootstrap_cm.get("data", {}):
        fail(where, f"Envoy's -c {bootstrap_path} is not in a mounted ConfigMap")
        return
    bootstrap = yaml.safe_load(bootstrap_cm["data"][os.path.basename(bootstrap_path)])
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    kvaffine = [f for l in bootstrap["static_resources"]["listeners"]
                for fc in l["filter_chains"] for nf in fc["filters"]
                for f in nf.get("typed_config", {}).get("http_filters", []) if f["name"] == "kvaffine"]
    if len(kvaffine) != 1:
        fail(where, "the bootstrap must name the kvaffine filter once")
        return
    source = kvaffine[0]["config_discovery"]["config_source"]["path_config_source"]
    ecds_path, watched = source["path"], source.get("watched_directory", {}).get("path")
    fvol = volume_named(gateway, next((m["name"] for m in envoy.get("volumeMounts", [])
                                       if m["mountPath"] == watched), ""))
    filter_cm = configmap_by_volume(objects, fvol)
    if not filter_cm:
        fail(where, f"the watched directory {watched} is not a mounted ConfigMap")
        return
    if os.path.dirname(ecds_path) != watched:
        fail(where, f"the ECDS file {ecds_path} is not in the watched directory {watched}")
    if filter_cm["metadata"]["name"] != fvol["configMap"]["name"] or re.search(r"-[a-z0-9]{10}$",
                                                                               filter_cm["metadata"]["name"]):
        fail(where, "the filter ConfigMap must keep its name (no hash suffix) to update in place")
    ecds = yaml.safe_load(filter_cm.get("data", {}).get(os.path.basename(ecds_path), "null"))
    resource, config = configured_filter(ecds, where)
    if not resource:
        return
    if resource.get("name") != "kvaffine":
        fail(where, "the ECDS resource must be named like the HCM filter (kvaffine)")
    module = config.get("vm_config", {}).get("code", {}).get("local", {}).get("filename", "")
    if os.path.dirname(module) != watched or os.path.basename(module) not in filter_cm.get("binaryData", {}):
        fail(where, f"the module {module} is not a file of the filter ConfigMap "
             f"(keys: {', '.join(sorted(filter_cm.get('binaryData', {})))})")
    filter_json = check_plugin_config(config, where, context, set(clusters))
    check_gateway_token(where, envoy, config, filter_json or {}, auth_secret)
    header = (filter_json or {}).get("endpoint_header", DEFAULT_ENDPOINT_HEADER)
    pool_sources = [s.get("header") for p in clusters.get("pool", {}).get("load_balancing_policy", {})
                    .get("policies", []) for s in p["typed_extension_config"]["typed_config"]
                    .get("override_host_sources", [])]
    if header not in pool_sources:
        fail(where, f"the pool cluster does not read the filter's {header} (override_host)")
    pool_targets = {(e["endpoint"]["address"]["socket_address"]["address"],
                     e["endpoint"]["address"]["socket_address"]["port_value"])
                    for group in clusters.get("pool", {}).get("load_assignment", {}).get("endpoints", [])
                    for e in group["lb_endpoints"]}
    if dns_targets and dns_targets != pool_targets:
        fail(where, f"kvaffined --discover-dns follows {sorted(dns_targets)} but the pool resolves "
             f"{sorted(pool_targets)}: the addresses it pins to must be the pool's")
    aliases = {h for a in pod_spec(gateway).get("hostAliases", []) for h in a.get("hostnames", [])}
    for cluster in clusters.values():
        for group in cluster.get("load_assignment", {}).get("endpoints", []):
            for endpoint in group["lb_endpoints"]:
                address = endpoint["endpoint"]["address"]["socket_address"]
                host = address["address"]
                if re.fullmatch(r"[0-9.]+", host) or host in aliases:
                    continue
                svc = objects.get(("Service", host))
                if not svc:
                    fail(where, f"cluster {cluster['name']}: {host} is no Service of the overlay")
                elif address["port_value"] not in {p["port"] for p in svc["spec"]["ports"]}:
                    fail(where, f"cluster {cluster['name']}: Service {host} has no port {address['port_value']}")
    ports = {p["containerPort"] for p in envoy.get("ports", [])}
    for listener in bootstrap["static_resources"]["listeners"]:
        if listener["address"]["socket_address"]["port_value"] not in ports:
            fail(where, f"listener {listener['name']}'s port is not a container port")
    context["gateways"].append((where, bootstrap, bootstrap_path, filter_cm, watched, ecds_path))


# ---------------------------------------------------------------------------------------
# 5. Envoy.

def run_envoy(envoy, config_path, label):
    out = subprocess.run([envoy, "--mode", "validate", "--use-dynamic-base-id", "-l", "warning",
                          "-c", str(config_path)], capture_output=True, text=True, timeout=120)
    log = (out.stdout + out.stderr).strip()
    if out.returncode != 0 or not re.search(r"^configuration '.*' OK$", out.stdout, re.MULTILINE):
        lines = [l for l in log.splitlines() if "critical" in l or "error" in l] or log.splitlines()[-5:]
        fail(f"envoy --mode validate ({label})", "\n    " + "\n    ".join(lines))
        return False
    ok(f"envoy --mode validate: {label}")
    return True


def write_yaml(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def inline_filter(bootstrap, typed_config):
    """The bootstrap with the kvaffine config_discovery filter replaced by its config."""
    doc = copy.deepcopy(bootstrap)
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network in chain["filters"]:
                filters = network.get("typed_config", {}).get("http_filters", [])
                for i, f in enumerate(filters):
                    if f["name"] == "kvaffine":
                        filters[i] = {"name": "kvaffine", "typed_config": typed_config}
    return doc


def validate_gateways_with_envoy(envoy, context, work, wasm):
    for where, bootstrap, bootstrap_path, filter_cm, watched, ecds_path in context["gateways"]:
        label = where.replace("overlay ", "")
        root = work / label
        # The mounted directory, materialized: the ECDS file and the module.
        fdir = root / "filter"
        fdir.mkdir(parents=True, exist_ok=True)
        for key, value in filter_cm.get("data", {}).items():
            (fdir / key).write_text(value.replace(watched, str(fdir)), encoding="utf-8")
        for key, value in filter_cm.get("binaryData", {}).items():
            (fdir / key).write_bytes(base64.b64decode(value))
        text = yaml.safe_dump(bootstrap, sort_keys=False).replace(watched, str(fdir))
        path = root / os.path.basename(bootstrap_path)
        path.write_text(text, encoding="utf-8")
        run_envoy(envoy, path, f"{label} bootstrap")
        # Envoy's validate mode does not read ECDS files: check the resource inline.
        ecds = yaml.safe_load((fdir / os.path.basename(ecds_path)).read_text(encoding="utf-8"))
        inlined = inline_filter(yaml.safe_load(text), ecds["resources"][0]["typed_config"])
        run_envoy(envoy, write_yaml(root / "inline.yaml", inlined), f"{label} bootstrap + ECDS filter ({wasm.name})")


def envoy_bootstrap(listeners, clusters):
    return {"node": {"id": "validate", "cluster": "validate"},
            "static_resources": {"listeners": listeners, "clusters": clusters}}


def hcm_listener(name, port, http_filters, cluster, extra_hcm=None, extra_listener=None):
    hcm = {"@type": HCM_TYPE, "stat_prefix": name,
           "route_config": {"name": name, "virtual_hosts": [{"name": name, "domains": ["*"], "routes": [
               {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "300s"}}]}]},
           "http_filters": http_filters + [ROUTER]}
    hcm.update(extra_hcm or {})
    listener = {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}]}
    listener.update(extra_listener or {})
    return listener


def static_cluster(name, port, **extra):
    cluster = {"name": name, "type": "STATIC", "connect_timeout": "1s",
               "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                   {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}
    cluster.update(extra)
    return cluster


def override_host(headers):
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": h} for h in headers],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies"
                                          ".least_request.v3.LeastRequest"}}}]}}}}]}


def json_path_targets(doc, expression):
    """The objects an EnvoyPatchPolicy jsonPath of the form `$..key[?(@.f=='v')].a.b` selects."""
    match = re.fullmatch(r"\$\.\.(\w+)\[\?\(@\.(\w+)==(['\"])(.*?)\3\)\]((?:\.\w+)*)", expression)
    if not match:
        raise ValueError(f"unsupported jsonPath {expression!r} (extend deploy/tools/check.py)")
    key, field, _, value, rest = match.groups()
    found = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == key and isinstance(v, list):
                    found.extend(e for e in v if isinstance(e, dict) and e.get(field) == value)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    targets = []
    for element in found:
        for part in [p for p in rest.split(".") if p]:
            element = element.get(part) if isinstance(element, dict) else None
        if isinstance(element, dict):
            targets.append(element)
    return targets


def check_envoy_gateway(rendered, envoy, context, work, wasm):
    section("6b. Envoy Gateway resources, assembled into the Envoy config Envoy Gateway generates")
    objects = {(o["kind"], o["metadata"]["name"]): o for o in load_yaml_docs(rendered)}
    eep = next((o for (k, _), o in objects.items() if k == "EnvoyExtensionPolicy"), None)
    epp = next((o for (k, _), o in objects.items() if k == "EnvoyPatchPolicy"), None)
    btp = next((o for (k, _), o in objects.items() if k == "BackendTrafficPolicy"), None)
    ctp = next((o for (k, _), o in objects.items() if k == "ClientTrafficPolicy"), None)
    where = "envoy-gateway"
    if not (eep and epp and btp and ctp):
        fail(where, "needs an EnvoyExtensionPolicy, an EnvoyPatchPolicy, a BackendTrafficPolicy and a "
             "ClientTrafficPolicy")
        return
    ns = eep["metadata"].get("namespace", "default")
    wasm_spec = eep["spec"]["wasm"][0]
    # What Envoy Gateway generates for the policy (internal/xds/translator/wasm.go): the
    # filter's name, the PluginConfig, the code fetched from its own server (a local file here).
    filter_name = f"envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{eep['metadata']['name']}/wasm/0"
    plugin = {"name": wasm_spec.get("name", filter_name), "root_id": wasm_spec.get("rootID", ""),
              "vm_config": {"vm_id": filter_name, "runtime": "envoy.wasm.runtime.v8",
                            "code": {"local": {"filename": str(wasm)}}},
              "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                "value": json.dumps(wasm_spec.get("config", {}))},
              "fail_open": bool(wasm_spec.get("failOpen"))}
    gw_name = epp["spec"]["targetRef"]["name"]
    gateway = objects.get(("Gateway", gw_name))
    if not gateway:
        fail(where, f"the EnvoyPatchPolicy targets Gateway {gw_name}, which is not defined here")
        return
    listener_names = {f"{gateway['metadata'].get('namespace', ns)}/{gw_name}/{l['name']}"
                      for l in gateway["spec"]["listeners"]}
    routes = [o for (k, _), o in objects.items() if k == "HTTPRoute"]
    targeted = {r["name"] for r in eep["spec"].get("targetRefs", []) if r["kind"] == "HTTPRoute"}
    for route in routes:
        if route["metadata"]["name"] not in targeted:
            fail(where, f"HTTPRoute {route['metadata']['name']} does not run the filter (it strips client pins)")
    btp_targets = {r["name"] for r in btp["spec"].get("targetRefs", []) if r["kind"] == "HTTPRoute"}
    if btp_targets != targeted:
        fail(where, "the BackendTrafficPolicy and the EnvoyExtensionPolicy must target the same routes")
    headers = [s["header"] for s in btp["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"]]
    filter_json = wasm_spec.get("config", {})
    if filter_json.get("endpoint_header", DEFAULT_ENDPOINT_HEADER) not in headers:
        fail(where, "the BackendTrafficPolicy's endpointOverride does not read the filter's header")
    limit = str(ctp["spec"].get("connection", {}).get("bufferLimit", "32768"))
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", limit).groups()
    if int(number) * units.get(unit, 1) < filter_json.get("max_body_bytes", 16 * 2**20):
        fail(where, f"ClientTrafficPolicy bufferLimit {limit} is below the filter's max_body_bytes")

    listener = hcm_listener("eg", 10080, [{"name": filter_name, "typed_config": {
        "@type": WASM_TYPE, "config": plugin}}], "pool")
    added, patched = [], 0
    for patch in epp["spec"]["jsonPatches"]:
        operation = patch["operation"]
        if patch["type"].endswith("Cluster") and operation["op"] == "add" and not operation.get("path") \
                and not operation.get("jsonPath"):
            if operation["value"].get("name") != patch["name"]:
                fail(where, f"patch {patch['name']}: the added cluster is named {operation['value'].get('name')}")
            added.append(operation["value"])
        elif patch["type"].endswith("Listener") and operation.get("jsonPath"):
            if patch["name"] not in listener_names:
                fail(where, f"the patch targets listener {patch['name']}, not one of {sorted(listener_names)}")
            try:
                targets = json_path_targets(listener, operation["jsonPath"])
            except ValueError as err:
                fail(where, str(err))
                continue
            if not targets:
                fail(where, f"jsonPath {operation['jsonPath']} selects nothing: Envoy Gateway names the filter "
                     f"{filter_name}")
            pointer = operation.get("path", "")
            if operation["op"] != "add" or not re.fullmatch(r"/\w+", pointer):
                fail(where, "the listener patch must add one field")
                continue
            for target in targets:
                target[pointer[1:]] = operation["value"]
                patched += 1
        else:
            fail(where, f"patch {patch['name']}: not a form this check knows")
    check_plugin_config(listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
                        ["typed_config"]["config"], where, context, {c["name"] for c in added})
    clusters = added + [static_cluster("pool", 8000, load_balancing_policy=override_host(headers))]
    path = write_yaml(work / "envoy-gateway" / "envoy.yaml", envoy_bootstrap([listener], clusters))
    if patched:
        run_envoy(envoy, path, f"envoy-gateway: patched filter + {len(added)} added clusters ({wasm.name})")


def check_istio(rendered, envoy, context, work, wasm, services):
    section("6c. Istio EnvoyFilter, assembled into the gateway's Envoy config")
    where = "istio"
    filters = [o for o in load_yaml_docs(rendered) if o["kind"] == "EnvoyFilter"]
    patches = [p for f in filters for p in f["spec"]["configPatches"]]
    by = {}
    for patch in patches:
        by.setdefault(patch["applyTo"], []).append(patch)
    ext = [p["patch"]["value"] for p in by.get("EXTENSION_CONFIG", [])]
    http = [p for p in by.get("HTTP_FILTER", [])]
    if len(ext) != 1 or len(http) != 1:
        fail(where, "needs one EXTENSION_CONFIG and one HTTP_FILTER patch")
        return
    value = http[0]["patch"]["value"]
    if value.get("name") != ext[0].get("name"):
        fail(where, f"the HTTP filter {value.get('name')} does not name the extension config {ext[0].get('name')}")
    discovery = value.get("config_discovery", {})
    if WASM_TYPE not in discovery.get("type_urls", []) or "ads" not in discovery.get("config_source", {}):
        fail(where, "the HTTP filter must take the Wasm config from ADS (config_discovery)")
    if http[0]["patch"]["operation"] != "INSERT_BEFORE" or \
            http[0].get("match", {}).get("listener", {}).get("filterChain", {}).get("filter", {}) \
            .get("subFilter", {}).get("name") != "envoy.filters.http.router":
        fail(where, "the filter must be inserted before the router")
    typed = copy.deepcopy(ext[0]["typed_config"])
    code = typed["config"]["vm_config"]["code"]
    uri = code.get("remote", {}).get("http_uri", {}).get("uri", "")
    if not re.match(r"(oci|https?)://", uri):
        fail(where, f"the module URI {uri!r} is not one istio-agent fetches (oci://, http(s)://)")
    # istio-agent replaces the remote code by the downloaded file before Envoy sees it.
    typed["config"]["vm_config"]["code"] = {"local": {"filename": str(wasm)}}
    clusters = []
    for patch in by.get("CLUSTER", []):
        match = patch["match"]["cluster"]
        name = f"outbound|{match['portNumber']}||{match['service']}"
        cluster = static_cluster(name, match["portNumber"], lb_policy="LEAST_REQUEST")
        cluster.update(patch["patch"]["value"])
        clusters.append(cluster)
    filter_json = check_plugin_config(typed["config"], where, context)
    for key in ("tokenizer_cluster", "index_cluster"):
        name = (filter_json or {}).get(key, "")
        match = re.fullmatch(r"outbound\|(\d+)\|\|([\w.-]+)\.(\w[\w-]*)\.svc\.cluster\.local", name)
        if not match:
            fail(where, f"{key} {name!r} is not an Istio outbound cluster name")
            continue
        port, svc, ns = int(match.group(1)), match.group(2), match.group(3)
        if port not in services.get((ns, svc), set()):
            fail(where, f"{key}: no Service {svc} with port {port} in namespace {ns} (overlay without-gateway)")
        if name not in {c["name"] for c in clusters}:
            clusters.append(static_cluster(name, port))
    pool = [c for c in clusters if "load_balancing_policy" in c]
    header = (filter_json or {}).get("endpoint_header", DEFAULT_ENDPOINT_HEADER)
    if not pool or header not in json.dumps(pool[0]["load_balancing_policy"]):
        fail(where, "no cluster patch gives the replicas override_host on the filter's header")
        return
    extra_listener = {}
    for patch in by.get("LISTENER", []):
        extra_listener.update(patch["patch"]["value"])
    if extra_listener.get("per_connection_buffer_limit_bytes", 0) < (filter_json or {}).get("max_body_bytes", 2**24):
        fail(where, "the listener buffer is below the filter's max_body_bytes")
    extra_hcm = {}
    for patch in by.get("NETWORK_FILTER", []):
        extra_hcm.update({k: v for k, v in patch["patch"]["value"]["typed_config"].items() if k != "@type"})
    listener = hcm_listener("istio", 8080, [{"name": ext[0]["name"], "typed_config": typed}], pool[0]["name"],
                            extra_hcm, extra_listener)
    path = write_yaml(work / "istio" / "envoy.yaml", envoy_bootstrap([listener], clusters))
    run_envoy(envoy, path, f"istio: extension config + cluster, listener and HCM patches ({wasm.name})")


# ---------------------------------------------------------------------------------------
# 4. Kong, and the filter schema against the Rust source.

def check_filter_schema(meta, filter_fields):
    start = len(FAILURES)
    section("3. the filter's schema matches FilterConfig; kvaffined's flags and files match its parser")
    schema = meta.get("config_schema", {})
    extra = set(meta) - {"config_schema", "metrics"}
    if extra:
        fail("kong/kvaffine.meta.json", f"keys Kong does not accept: {sorted(extra)}")
    jsonschema.Draft4Validator.check_schema(schema)
    props = set(schema.get("properties", {}))
    fields = {f["name"] for f in filter_fields}
    required = {f["name"] for f in filter_fields if not f["default"]}
    if props != fields:
        fail("kong/kvaffine.meta.json", f"properties differ from the filter's configuration fields: "
             f"missing {sorted(fields - props)}, unknown {sorted(props - fields)}")
    if set(schema.get("required", [])) != required:
        fail("kong/kvaffine.meta.json", f"required {sorted(schema.get('required', []))} != FilterConfig's "
             f"fields without a default {sorted(required)}")
    if schema.get("additionalProperties") is not False:
        fail("kong/kvaffine.meta.json", "FilterConfig denies unknown fields: additionalProperties must be false")
    ok(f"kvaffine.meta.json lists FilterConfig's {len(fields)} fields ({len(required)} required)", start)
    return jsonschema.Draft4Validator(schema)


def endpoints_schema(config_fields, spec_fields):
    """kvaffined's --config file (ConfigFile and EndpointSpec in daemon/src/config.rs)."""
    hostport = {"type": "string", "pattern": r"^(\[[0-9a-fA-F:.]+\]|[^:\[\]]+):[0-9]{1,5}$"}
    zmq = {"type": "string", "pattern": r"^(tcp|ipc|inproc)://"}
    spec_props = {"endpoint": hostport, "events": zmq, "replay": {"anyOf": [zmq, {"type": "null"}]},
                  "rank": {"type": "integer", "minimum": 0}}
    names = {f["name"] for f in spec_fields}
    if names != set(spec_props):
        fail("daemon/src/config.rs", f"EndpointSpec's fields changed ({sorted(names)}): update deploy/tools/check.py")
    top = {"endpoints": {"type": "array", "items": {
               "type": "object", "properties": spec_props, "additionalProperties": False,
               "required": sorted(f["name"] for f in spec_fields if not f["default"])}},
           "discover": {"type": "array", "items": hostport},
           "peers": {"type": "array", "items": hostport}}
    if {f["name"] for f in config_fields} != set(top):
        fail("daemon/src/config.rs", "ConfigFile's fields changed: update deploy/tools/check.py")
    return jsonschema.Draft7Validator({"type": "object", "properties": top, "additionalProperties": False})


def parse_size(text):
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", text.strip())
    if not match:
        return None
    return int(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2).lower()]


def check_kong(kong_dir, context):
    start = len(FAILURES)
    section("5. Kong")
    where = "kong"
    conf = {}
    for line in (kong_dir / "kong.conf").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            conf[key.strip()] = value.strip()
    env = {}
    for line in (kong_dir / "kong.env").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    if conf.get("wasm") != "on":
        fail(where, "kong.conf must set wasm = on")
    if not conf.get("wasm_filters_path"):
        fail(where, "kong.conf must set wasm_filters_path")
    size = parse_size(conf.get("nginx_http_client_body_buffer_size", "8k"))
    if size is None or size < 16 * 2**20:
        fail(where, "nginx_http_client_body_buffer_size must hold a whole prompt (16m)")
    for key, value in conf.items():
        if env.get("KONG_" + key.upper()) != value:
            fail(where, f"kong.env does not set KONG_{key.upper()}={value} like kong.conf")
    metas = sorted(kong_dir.glob("*.meta.json"))
    names = {m.name[: -len(".meta.json")] for m in metas}
    for file in ("kong.yml", "kong-plugins.yml"):
        doc = load_yaml_docs(kong_dir / file)[0]
        w = f"{where}/{file}"
        if doc.get("_format_version") != "3.0":
            fail(w, '_format_version must be "3.0"')
        attached = 0
        for service in doc.get("services", []):
            require(service, "name", w, str)
            if not (service.get("url") or service.get("host")):
                fail(w, f"service {service.get('name')} has no url or host")
            for route in service.get("routes", []):
                require(route, "name", w, str)
                require(route, "paths", w, list)
            configs = [f for chain in service.get("filter_chains", []) for f in chain.get("filters", [])]
            configs += service.get("plugins", [])
            for item in configs:
                attached += 1
                if item.get("name") not in names:
                    fail(w, f"filter {item.get('name')!r} has no {item.get('name')}.meta.json beside it here; "
                         f"Kong names a filter after its file ({sorted(names)})")
                config = item.get("config")
                if not isinstance(config, dict):
                    fail(w, "the filter config must be an object (its schema is in the .meta.json)")
                    continue
                check_filter_json(config, w, context)
                if config.get("host") != "kong":
                    fail(w, 'the filter must be told "host": "kong"')
                for key in ("tokenizer_cluster", "index_cluster"):
                    if not re.fullmatch(r"[\w.-]+:\d+", str(config.get(key))):
                        fail(w, f"{key} must be host:port on Kong")
        if attached != 1:
            fail(w, f"the filter is attached {attached} times (want once)")
    ok("kong.conf, kong.env, kong.yml, kong-plugins.yml", start)


# ---------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--deploy", type=Path, required=True, help="the deploy/ tree (the temporary copy)")
    parser.add_argument("--rendered", type=Path, required=True)
    parser.add_argument("--envoy", required=True)
    parser.add_argument("--wasm", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--kubernetes-versions", default="1.29.0,1.32.0")
    args = parser.parse_args()

    parse_everything(args.deploy)

    overlays = sorted(p for p in args.rendered.glob("overlay-*.yaml"))
    extra = [("envoy-gateway", args.rendered / "envoy-gateway.yaml"), ("istio", args.rendered / "istio.yaml")]
    files = [(p.stem, p) for p in overlays] + extra
    validate_kubernetes(files, args.kubernetes_versions.split(","))

    filter_fields = (rust_struct_fields(args.repo / "filter/src/config.rs", "GatewayConfig")
                     + rust_struct_fields(args.repo / "core/src/config.rs", "RoutingConfig"))
    context = {
        "serve_args": rust_struct_fields(args.repo / "daemon/src/config.rs", "ServeArgs"),
        "filter_configs": 0,
        "gateways": [],
    }
    meta = json.loads((args.deploy / "kong/kvaffine.meta.json").read_text(encoding="utf-8"))
    context["filter_validator"] = check_filter_schema(meta, filter_fields)
    start = len(FAILURES)
    context["endpoints_validator"] = endpoints_schema(
        rust_struct_fields(args.repo / "daemon/src/config.rs", "ConfigFile"),
        rust_struct_fields(args.repo / "daemon/src/config.rs", "EndpointSpec"))
    ok("kvaffined's flags and endpoint file format read from daemon/src/config.rs", start)

    section("4. the Kubernetes overlays agree with themselves")
    services = {}
    for path in overlays:
        objects = {(o["kind"], o["metadata"]["name"]): o for o in load_yaml_docs(path)}
        check_overlay(path.stem.replace("overlay-", ""), objects, context)
        if path.stem == "overlay-without-gateway":
            for (kind, name), o in objects.items():
                if kind == "Service":
                    services[(o["metadata"]["namespace"], name)] = {p["port"] for p in o["spec"]["ports"]}

    check_kong(args.deploy / "kong", context)

    section(f"6. Envoy ({args.envoy}) validates every Envoy configuration")
    validate_gateways_with_envoy(args.envoy, context, args.work, args.wasm)
    check_envoy_gateway(args.rendered / "envoy-gateway.yaml", args.envoy, context, args.work, args.wasm)
    check_istio(args.rendered / "istio.yaml", args.envoy, context, args.work, args.wasm, services)

    print()
    if FAILURES:
        print(f"FAILED: {len(FAILURES)} problem(s)")
        for failure in FAILURES:
            print(f"  - {failure}")
        return 1
    print(f"all checks passed ({context['filter_configs']} filter configurations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
