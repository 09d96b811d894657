"""Validates one rendered kustomize overlay (the output of `kubectl kustomize`).

Run by tests/deploy/check.sh with the virtualenv's python; prints what failed, one line each,
and exits 1 on any failure, 0 otherwise.

- Built-in kinds: kubernetes-validate, strict (unknown fields are errors), against each
  Kubernetes version given.
- ServiceMonitor (a CRD, which kubernetes-validate has no schema for): the JSON schema of the
  prometheus-operator models of cloudcoil-models-prometheus-operator (generated from the CRD),
  closed (unknown fields are errors), plus the models' own validation.
- Any other kind: a failure (nothing in an overlay goes unvalidated).
- Then what no schema sees: the kinds the overlay must hold, Services, PodDisruptionBudgets
  and the ServiceMonitor select the pods and ports that exist, the ServiceMonitor's samples get
  the job label the Prometheus rules in deploy/prometheus expect, the ConfigMap is mounted as a
  directory (no subPath: kvgate's reload on change needs the kubelet's symlink swap), the
  grace period covers the preStop pause and kvgate's drain, the config's listeners match the
  container's ports, the ServiceAccount and Role the pod and its RoleBinding name exist.
- With a kvgate binary: `kvgate check --config` on the kvgate.yaml of the ConfigMap.
"""

import argparse
import copy
import subprocess
import sys
import tempfile

import jsonschema
import kubernetes_validate
import yaml

CORE_GROUPS = {"v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"}


def servicemonitor_validator():
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    schema = ServiceMonitor.model_json_schema(by_alias=True)

    def close(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    validator = jsonschema.Draft202012Validator(schema)

    def validate(doc):
        errors = [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]
        if not errors:
            try:
                ServiceMonitor.model_validate(copy.deepcopy(doc))
            except Exception as e:  # pydantic's ValidationError, whatever its version
                errors.append(str(e).replace("\n", " "))
        return errors

    return validate


def name_of(doc):
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rendered")
    ap.add_argument("--versions", required=True, help="Kubernetes versions, space-separated")
    ap.add_argument("--expect", default="", help="Kind/name entries that must be present, space-separated")
    ap.add_argument("--kvgate", default="", help="a kvgate binary for `kvgate check`")
    args = ap.parse_args()

    with open(args.rendered) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    failures = []
    fail = failures.append
    if not docs:
        print("the render is empty")
        return 1

    sm_validate = None
    for doc in docs:
        kind, api = doc.get("kind"), doc.get("apiVersion")
        if not kind or not api:
            fail(f"{name_of(doc)}: no kind or apiVersion")
            continue
        if kind == "ServiceMonitor" and api == "monitoring.coreos.com/v1":
            sm_validate = sm_validate or servicemonitor_validator()
            for err in sm_validate(doc):
                fail(f"{name_of(doc)}: {err}")
        elif api in CORE_GROUPS:
            for version in args.versions.split():
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    path = ".".join(str(p) for p in e.path)
                    fail(f"{name_of(doc)} (Kubernetes {version}): {path}: {e.message}")
                except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.VersionNotSupportedError) as e:
                    fail(f"{name_of(doc)} (Kubernetes {version}): {e.message}")
        else:
            fail(f"{name_of(doc)}: {api} has no schema here; add one to tests/deploy/validate.py")

    present = {name_of(d) for d in docs}
    for want in args.expect.split():
        if want not in present:
            fail(f"{want}: missing from the render")

    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    deployments = by_kind.get("Deployment", [])

    def pods_of(selector):
        return [d for d in deployments if matches(selector, d["spec"]["template"]["metadata"].get("labels", {}))]

    def ports_of(deployment):
        return {p.get("name") for c in deployment["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}

    for svc in by_kind.get("Service", []):
        targets = pods_of(svc["spec"].get("selector"))
        if not targets:
            fail(f"{name_of(svc)}: its selector matches no Deployment's pods")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort")
            if isinstance(target, str) and not all(target in ports_of(d) for d in targets):
                fail(f"{name_of(svc)}: targetPort {target} is no container port of its pods")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        if not pods_of(pdb["spec"]["selector"].get("matchLabels")):
            fail(f"{name_of(pdb)}: its selector matches no Deployment's pods")
    for sm in by_kind.get("ServiceMonitor", []):
        services = [s for s in by_kind.get("Service", []) if matches(sm["spec"]["selector"].get("matchLabels"), s["metadata"].get("labels", {}))]
        if not services:
            fail(f"{name_of(sm)}: its selector matches no Service")
        # The job label Prometheus gives the samples: the Service's jobLabel label, else its
        # name. deploy/prometheus/kvgate-rules.yml reads up{job="kvgate"}.
        for s in services:
            job = s["metadata"].get("labels", {}).get(sm["spec"].get("jobLabel", ""), s["metadata"]["name"])
            if job != "kvgate":
                fail(f"{name_of(sm)}: the samples of {name_of(s)} would get job={job!r}, the rules expect job='kvgate'")
        for ep in sm["spec"]["endpoints"]:
            if not all(ep.get("port") in {p.get("name") for p in s["spec"]["ports"]} for s in services):
                fail(f"{name_of(sm)}: port {ep.get('port')} is not a port of the Services it selects")

    configmaps = {d["metadata"]["name"]: d for d in by_kind.get("ConfigMap", [])}
    accounts = {d["metadata"]["name"] for d in by_kind.get("ServiceAccount", [])}
    roles = {d["metadata"]["name"] for d in by_kind.get("Role", [])}
    for rb in by_kind.get("RoleBinding", []):
        if rb["roleRef"]["kind"] == "Role" and rb["roleRef"]["name"] not in roles:
            fail(f"{name_of(rb)}: Role {rb['roleRef']['name']} is not in the render")
        for subject in rb.get("subjects", []):
            if subject["kind"] == "ServiceAccount" and subject["name"] not in accounts:
                fail(f"{name_of(rb)}: ServiceAccount {subject['name']} is not in the render")

    gateway = next((d for d in deployments if d["metadata"]["name"] == "kvgate"), None)
    config_text = None
    if gateway is not None:
        pod = gateway["spec"]["template"]["spec"]
        if pod.get("serviceAccountName") and pod["serviceAccountName"] not in accounts:
            fail(f"{name_of(gateway)}: ServiceAccount {pod['serviceAccountName']} is not in the render")
        container = next(c for c in pod["containers"] if c["name"] == "kvgate")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        config_dir = None
        for mount in container.get("volumeMounts", []):
            cm = volumes.get(mount["name"], {}).get("configMap")
            if not cm:
                continue
            if cm["name"] not in configmaps:
                fail(f"{name_of(gateway)}: ConfigMap {cm['name']} is not in the render")
                continue
            if "subPath" in mount:
                fail(f"{name_of(gateway)}: ConfigMap {cm['name']} mounted with subPath: its changes would never reach the pod")
            if mount["mountPath"] == "/etc/kvgate":
                config_dir = cm["name"]
        args_ = container.get("args", [])
        if args_[:2] != ["--config", "/etc/kvgate/kvgate.yaml"]:
            fail(f"{name_of(gateway)}: args {args_} are not --config /etc/kvgate/kvgate.yaml")
        if config_dir is None:
            fail(f"{name_of(gateway)}: no ConfigMap mounted at /etc/kvgate")
        else:
            config_text = configmaps[config_dir].get("data", {}).get("kvgate.yaml")
            if config_text is None:
                fail(f"ConfigMap/{config_dir}: no kvgate.yaml")
        if config_text is not None:
            config = yaml.safe_load(config_text)
            drain = config.get("shutdown", {}).get("drain_timeout_s", 300)
            pause = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            grace = pod.get("terminationGracePeriodSeconds", 30)
            if grace < pause + drain:
                fail(f"{name_of(gateway)}: terminationGracePeriodSeconds {grace} < preStop {pause} s + drain_timeout_s {drain} s")
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            for key, port_name in (("listen", "http"), ("admin_listen", "admin")):
                addr = str(config.get(key, ""))
                if not addr.endswith(f":{ports.get(port_name)}"):
                    fail(f"{name_of(gateway)}: config {key} {addr!r} is not on container port {port_name} ({ports.get(port_name)})")
                if addr.startswith("127.") or addr.startswith("[::1]") or addr.startswith("localhost"):
                    fail(f"{name_of(gateway)}: config {key} {addr!r} is loopback: probes and Services cannot reach it")
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in container:
                    fail(f"{name_of(gateway)}: no {probe}")
            if container.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/health":
                fail(f"{name_of(gateway)}: the readiness probe is not kvgate's /health")
            if not container.get("securityContext", {}).get("readOnlyRootFilesystem"):
                fail(f"{name_of(gateway)}: the root filesystem is writable")
            if not pod.get("securityContext", {}).get("runAsNonRoot"):
                fail(f"{name_of(gateway)}: runAsNonRoot is not set")
    elif "Deployment/kvgate" in args.expect.split():
        pass  # reported as missing above

    if config_text is not None and args.kvgate:
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/kvgate.yaml"
            with open(path, "w") as f:
                f.write(config_text)
            # The pod gets its admin token from a Secret; say there is one, as the pod would.
            env = {"KVGATE_ADMIN_TOKEN": "check", "PATH": "/usr/bin:/bin"}
            run = subprocess.run([args.kvgate, "check", "--config", path], capture_output=True, text=True, env=env, timeout=60)
            if run.returncode != 0:
                fail(f"kvgate check of the ConfigMap's kvgate.yaml: {(run.stdout + run.stderr).strip()}")

    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
