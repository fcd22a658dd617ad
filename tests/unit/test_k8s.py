"""k8s/ offline: every kustomization renders, built-in kinds validate strictly against the
Kubernetes schemas, RayJob/PyTorchJob against the schemas kept in k8s/schemas (their pod
templates against the core schema), every pod meets the policy, and every `plm` command
line in the manifests passes `plm ... --dry-run` on the configs it names."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import REPO

K8S = REPO / "k8s"
KUBECTL = shutil.which("kubectl")
K8S_VERSION = "1.32"  # the kubectl on the dev machines; the manifests use nothing newer
OVERLAYS = ["overlays/cpu-smoke", "overlays/gpu", "overlays/gpu-elastic"]
PARTS = ["base", "data", "training/pytorchjob", "training/indexed-job", "training/elastic",
         "tracking"]  # fmt: skip
CUSTOM = {("ray.io/v1", "RayJob"): "rayjob", ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob"}
SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|ACCESS_KEY|CREDENTIAL", re.I)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (needed to render)")


def kustomize(path: Path) -> list[dict]:
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"kubectl kustomize {path}:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def with_s3_component(tmp_path: Path) -> Path:
    """An overlay of gpu + components/mlflow-s3 (a component renders only inside one)."""
    root = tmp_path / "gpu-s3"
    root.mkdir()
    rel = os.path.relpath(K8S, root)
    (root / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel}/overlays/gpu]\ncomponents: [{rel}/components/mlflow-s3]\n"
    )
    return root


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: kustomize(K8S / name) for name in OVERLAYS}


def schema(name: str) -> dict:
    return json.loads((K8S / "schemas" / f"{name}.schema.json").read_text())


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(where, PodTemplateSpec) of every pod the resource creates."""
    spec, kind = doc.get("spec", {}), doc["kind"]
    if kind in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return [(kind, spec["template"])]
    if kind == "RayJob":
        rc = spec["rayClusterSpec"]
        found = [("head", rc["headGroupSpec"]["template"])]
        found += [(g["groupName"], g["template"]) for g in rc.get("workerGroupSpecs", [])]
        if "submitterPodTemplate" in spec:
            found.append(("submitter", spec["submitterPodTemplate"]))
        return found
    if kind == "PyTorchJob":
        return [(role, r["template"]) for role, r in spec["pytorchReplicaSpecs"].items()]
    return []


def validate_builtin(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def validate_custom(doc: dict) -> None:
    jsonschema.Draft202012Validator(schema(CUSTOM[(doc["apiVersion"], doc["kind"])])).validate(doc)
    for _, template in pod_templates(doc):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        validate_builtin({**wrapped, "template": template})


def validate(doc: dict) -> None:
    if (doc["apiVersion"], doc["kind"]) in CUSTOM:
        validate_custom(doc)
    else:
        validate_builtin(doc)


# ---------------------------------------------------------------------------
# Rendering and schemas


@pytest.mark.parametrize("name", OVERLAYS + PARTS)
def test_every_kustomization_renders_and_validates_strictly(name):
    docs = kustomize(K8S / name)
    assert docs
    for doc in docs:
        validate(doc)


def mlflow_env(docs: list[dict]) -> dict[str, dict]:
    """The MLflow Deployment's container environment, by variable name."""
    mlflow = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "plm-mlflow"
    )
    return {e["name"]: e for e in mlflow["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_s3_artifact_component_renders_and_validates(tmp_path):
    docs = kustomize(with_s3_component(tmp_path))
    for doc in docs:
        validate(doc)
    env = mlflow_env(docs)
    assert env["MLFLOW_ARTIFACTS_DESTINATION"]["value"].startswith("s3://")
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "plm-s3"
    assert not any(d["metadata"]["name"] == "plm-mlflow-artifacts" for d in docs)


def test_overlays_hold_what_the_issue_asks(rendered):
    for name, docs in rendered.items():
        kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
        assert {("Namespace", "plm"), ("ServiceAccount", "plm"), ("ConfigMap", "plm-config"),
                ("PersistentVolumeClaim", "plm-data"), ("PersistentVolumeClaim", "plm-checkpoints"),
                ("RayJob", "plm-data"), ("Deployment", "plm-mlflow"), ("Service", "plm-mlflow"),
                ("StatefulSet", "plm-postgres")} <= kinds, name  # fmt: skip
        assert all(d["metadata"].get("namespace", "plm") == "plm" for d in docs)
        job_execution = mlflow_env(docs)["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]
        assert job_execution["value"] == "false", name  # see mlflow.yaml
        assert mlflow_env(docs)["MLFLOW_DISABLE_TELEMETRY"]["value"] == "true", name
        rayjob = next(d for d in docs if d["kind"] == "RayJob")
        assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
        assert rayjob["spec"]["rayClusterSpec"]["authOptions"]["mode"] == "token"
    smoke = {(d["kind"], d["metadata"]["name"]): d for d in rendered["overlays/cpu-smoke"]}
    job = smoke[("Job", "plm-train")]
    assert job["spec"]["completionMode"] == "Indexed"
    assert smoke[("Service", "plm-train")]["spec"]["clusterIP"] == "None"
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (
        int(env["WORLD_SIZE"]["value"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    )
    assert "job-completion-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert (
        env["MASTER_ADDR"]["value"] == f"plm-train-0.{job['spec']['template']['spec']['subdomain']}"
    )
    gpu = {(d["kind"], d["metadata"]["name"]): d for d in rendered["overlays/gpu"]}
    ptj = gpu[("PyTorchJob", "plm-train")]
    for role, template in pod_templates(ptj):
        c = template["spec"]["containers"][0]
        assert c["name"] == "pytorch", role  # the operator looks for this name
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= {
            e["name"] for e in c["env"]
        }
        shm = [v for v in template["spec"]["volumes"] if v["name"] == "shm"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory"


def test_a_misspelled_key_fails_validation(rendered):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered["overlays/gpu"]}
    bad = copy.deepcopy(docs[("RayJob", "plm-data")])
    bad["spec"]["shutdownAfterJobFinish"] = bad["spec"].pop("shutdownAfterJobFinishes")
    with pytest.raises(jsonschema.ValidationError, match="shutdownAfterJobFinish"):
        validate(bad)
    bad = copy.deepcopy(docs[("RayJob", "plm-data")])
    bad["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 4  # not a str
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = copy.deepcopy(docs[("PyTorchJob", "plm-train")])
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        validate(bad)
    bad = copy.deepcopy(docs[("PyTorchJob", "plm-train")])  # inside a pod template: core schema
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "resource"
    ] = {}
    with pytest.raises(jsonschema.ValidationError, match="resource"):
        validate(bad)
    bad = copy.deepcopy(docs[("Deployment", "plm-mlflow")])
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(jsonschema.ValidationError, match="imagePullPolicyy"):
        validate(bad)


# ---------------------------------------------------------------------------
# Pod policy


def all_pods(docs: list[dict]):
    for doc in docs:
        for where, template in pod_templates(doc):
            yield f"{doc['kind']}/{doc['metadata']['name']}:{where}", template["spec"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_pod_is_non_root_limited_and_holds_no_credentials(rendered, name):
    docs = rendered[name]
    assert not [d for d in docs if d["kind"] == "Secret"], "Secrets are created, never committed"
    pods = list(all_pods(docs))
    assert len(pods) >= 5
    for where, spec in pods:
        sc = spec.get("securityContext", {})
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0, where
        assert spec.get("serviceAccountName") == "plm", where
        assert spec.get("automountServiceAccountToken") is False, where
        for c in spec.get("initContainers", []) + spec["containers"]:
            who = f"{where}/{c['name']}"
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{who}: {kind}"
            csc = c.get("securityContext", {})
            assert csc.get("allowPrivilegeEscalation") is False, who
            assert csc.get("capabilities", {}).get("drop") == ["ALL"], who
            assert not c.get("securityContext", {}).get("privileged"), who
            for env in c.get("env", []):
                # A *_FILE variable names a path (a mounted Secret: its own test, below).
                if SECRET_NAME.search(env["name"]) and not env["name"].endswith("_FILE"):
                    assert "value" not in env, f"{who}: {env['name']} inline"
                    assert "secretKeyRef" in env["valueFrom"], f"{who}: {env['name']}"
            text = json.dumps(c)
            assert not re.search(r"://[^:/\s\"]+:[^@$\s\"]+@", text), f"{who}: a password in a URI"


# ---------------------------------------------------------------------------
# Every plm command line is real


def plm_commands(docs: list[dict]) -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, argv after `plm`, env) for every `plm` the manifests run."""
    found = []
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "RayJob":
            for part in doc["spec"]["entrypoint"].split("&&"):
                argv = shlex.split(part)
                assert argv[0] == "plm", f"{name}: entrypoint part {part!r} is not a plm command"
                found.append((name, argv[1:], {}))
        for where, spec in dict(pod_templates(doc)).items():
            for c in spec["spec"]["containers"]:
                argv = [*c.get("command", []), *c.get("args", [])]
                env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
                if argv and argv[0] == "plm":
                    found.append((f"{name}:{where}", argv[1:], env))
                elif argv[:2] == ["python", "launch/elastic_train.py"]:  # runs `plm train`
                    policy = doc["spec"]["elasticPolicy"]
                    world = policy["maxReplicas"] * policy.get("nProcPerNode", 1)
                    env = {**env, "WORLD_SIZE": str(world)}
                    found.append((f"{name}:{where}", ["train", *argv[2:]], env))
    return found


def test_k8s_commands_name_real_plm_subcommands(rendered):
    cmds = [c for docs in rendered.values() for c in plm_commands(docs)]
    heads = {tuple(argv[:2]) if argv[0] == "data" else (argv[0],) for _, argv, _ in cmds}
    assert heads == {("data", "tokenizer"), ("data", "prepare"), ("train",)}


_CONTAINER_PATH = re.compile(r"(?<![\w./-])/(data|checkpoints|etc/plm)(?=/|\b)")


@pytest.mark.slow
def test_every_plm_command_passes_its_dry_run(rendered, tiny_data, tmp_path, monkeypatch, capsys):
    """Each overlay's pod paths mapped under tmp_path: /etc/plm holds the rendered ConfigMap's
    files, /data a corpus, the tokenizer and a prepared data dir, /checkpoints is empty.
    In-process (`pipeline.cli.main`, as the `plm` script calls it): one import of torch."""
    from pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    for name, docs in rendered.items():
        root = tmp_path / name.replace("/", "-")

        def mapped(text: str, root: Path = root) -> str:
            return _CONTAINER_PATH.sub(lambda m: f"{root}/{m.group(1)}", text)

        config = next(
            d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "plm-config"
        )
        (root / "etc/plm").mkdir(parents=True)
        for key, text in config["data"].items():
            (root / "etc/plm" / key).write_text(mapped(text))
        (root / "data/corpus").mkdir(parents=True)
        (root / "data/corpus/part-0.txt").write_text("A short document for the dry run.\n")
        shutil.copytree(tiny_data / "tokenizer", root / "data/tokenizer")
        (root / "data/prepared").symlink_to(tiny_data)
        (root / "checkpoints").mkdir()
        seen = set()
        for where, argv, env in plm_commands(docs):
            argv = [mapped(a) for a in argv]
            if tuple(argv) in seen:  # Master and Worker run the same command
                continue
            seen.add(tuple(argv))
            world = env.get("WORLD_SIZE") or str(world_size(docs))
            monkeypatch.setenv("WORLD_SIZE", world)  # what the operator / the Job sets
            if argv[:1] == ["train"]:
                # The stand-in data dir's valid split (32 documents) is smaller than these
                # configs' eval batch; that check has its own test (test_eval_split_checks).
                argv = [*argv, "train.eval_every=0"]
            code = main([*argv, "--dry-run"])
            out = capsys.readouterr()
            assert code == 0, f"{name} {where}: plm {shlex.join(argv)}\n{out.err[-3000:]}"
            assert "dry run:" in out.out and "nothing started" in out.out, out.out


def world_size(docs: list[dict]) -> int:
    for d in docs:
        if d["kind"] == "PyTorchJob":
            return sum(r.get("replicas", 1) for r in d["spec"]["pytorchReplicaSpecs"].values())
        if d["kind"] == "Job" and d["metadata"]["name"] == "plm-train":
            return d["spec"]["completions"]
    raise AssertionError("no training job found")


def test_the_elastic_overlay_runs_the_elastic_launch_on_every_pod_count(rendered, tmp_path,
                                                                       monkeypatch, capsys):  # fmt: skip
    """Worker pods only, MIN < MAX; each runs launch/elastic_train.py, which takes its
    settings from the operator's PET_* variables and refuses a global batch that one of
    the pod counts MIN..MAX cannot keep."""
    import importlib.util

    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered["overlays/gpu-elastic"]}
    job = docs[("PyTorchJob", "plm-train")]
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and 1 <= policy["minReplicas"] < policy["maxReplicas"]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "OnFailure"
    assert worker["replicas"] == policy["maxReplicas"]
    container = worker["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "launch/elastic_train.py"]
    config = docs[("ConfigMap", "plm-config")]["data"]["experiment.yaml"]
    (tmp_path / "experiment.yaml").write_text(config)
    args = [str(tmp_path / "experiment.yaml"), *container["args"][1:]]
    spec = importlib.util.spec_from_file_location("elastic_train", REPO / "launch/elastic_train.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    nnodes = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    monkeypatch.setenv("PET_NNODES", nnodes)
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "plm-train-worker-0:29400")
    monkeypatch.setenv("PET_NPROC_PER_NODE", str(policy["nProcPerNode"]))
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    assert launch.main([*args, "--print-only"]) == 0
    printed = capsys.readouterr().out
    assert f"--nnodes={nnodes}" in printed and "--rdzv-endpoint=plm-train-worker-0:29400" in printed
    # One pod more than the batch allows: refused before anything starts.
    monkeypatch.setenv("PET_NNODES", f"{policy['minReplicas']}:{policy['maxReplicas'] + 1}")
    assert launch.main([*args, "--print-only"]) == 2
    assert "cannot be kept" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Pod Security Standards "restricted", network policies, RBAC

# The volume types the restricted profile allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}  # fmt: skip


def restricted_violations(spec: dict) -> list[str]:
    """What in a pod spec breaks the "restricted" Pod Security Standard (v1.32)."""
    bad = [f"{k}: true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {sorted(kinds)}")
    psc = spec.get("securityContext", {})
    if psc.get("sysctls"):
        bad.append("sysctls")
    for c in spec.get("initContainers", []) + spec["containers"]:
        csc = c.get("securityContext", {})
        name = c["name"]
        if csc.get("privileged"):
            bad.append(f"{name}: privileged")
        if csc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = csc.get("capabilities", {})
        if caps.get("drop") != ["ALL"] or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities {caps}")
        if (csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True
                or csc.get("runAsUser", psc.get("runAsUser")) == 0):  # fmt: skip
            bad.append(f"{name}: may run as root")
        seccomp = csc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
        if csc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
    return bad


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_pod_meets_the_restricted_pod_security_standard(rendered, name):
    pods = list(all_pods(rendered[name]))
    assert len(pods) >= 5
    for where, spec in pods:
        assert restricted_violations(spec) == [], where
    ns = next(d for d in rendered[name] if d["kind"] == "Namespace")["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/warn"] == "restricted"  # what KubeRay adds: warned
    assert ns["pod-security.kubernetes.io/enforce"] in ("baseline", "restricted")


def test_the_restricted_check_finds_what_it_should():
    ok = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                              "seccompProfile": {"type": "RuntimeDefault"}},
          "volumes": [{"name": "d", "emptyDir": {}}],
          "containers": [{"name": "c", "securityContext": {
              "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}  # fmt: skip
    assert restricted_violations(ok) == []
    for change, words in [
        ({"hostNetwork": True}, "hostNetwork"),
        ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "hostPath"),
        ({"securityContext": {"runAsNonRoot": True, "runAsUser": 0,
                              "seccompProfile": {"type": "RuntimeDefault"}}}, "root"),
        ({"securityContext": {"runAsNonRoot": True, "runAsUser": 1000}}, "seccomp"),
    ]:  # fmt: skip
        assert any(words in v for v in restricted_violations({**ok, **change})), change
    caps = copy.deepcopy(ok)
    caps["containers"][0]["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
    assert restricted_violations(caps)


def _matches(selector: dict | None, labels: dict) -> bool:
    """A label selector (matchLabels and matchExpressions' In / Exists) against labels."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
        if e["operator"] not in ("In", "Exists"):
            raise AssertionError(f"operator {e['operator']} not modelled here")
    return True


def ingress_allowed(policies: list[dict], namespace: str, src: dict, dst: dict, port: int) -> bool:
    """NetworkPolicy's ingress semantics: traffic to a pod that no policy selects is
    allowed; otherwise it is allowed when a rule of one selecting policy admits the
    source (``src``: {"namespace", "ns_labels", "labels"}) on the port. ``dst``: the
    destination pod's labels (in ``namespace``, where the policies live)."""
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], dst)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]  # fmt: skip
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(q.get("port") == port and q.get("protocol", "TCP") == "TCP"
                                 for q in ports):  # fmt: skip
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                assert "ipBlock" not in peer, "ipBlock not modelled here"
                if "namespaceSelector" in peer:
                    if not _matches(peer["namespaceSelector"], src["ns_labels"]):
                        continue
                elif src["namespace"] != namespace:
                    continue
                if "podSelector" in peer and not _matches(peer["podSelector"], src["labels"]):
                    continue
                return True
    return False


def _pod(component: str, namespace: str = "plm") -> dict:
    labels = {"app.kubernetes.io/part-of": "plm-pipeline", "app.kubernetes.io/component": component}
    return {"namespace": namespace, "ns_labels": {"kubernetes.io/metadata.name": namespace},
            "labels": labels}  # fmt: skip


STRANGER = {"namespace": "default", "ns_labels": {"kubernetes.io/metadata.name": "default"},
            "labels": {}}  # fmt: skip
NEIGHBOUR = {"namespace": "plm", "ns_labels": {"kubernetes.io/metadata.name": "plm"},
             "labels": {"app": "debug"}}  # a pod in our namespace that is not ours  # fmt: skip
OPERATOR = {"namespace": "kuberay-operator",
            "ns_labels": {"kubernetes.io/metadata.name": "kuberay-operator"},
            "labels": {"app.kubernetes.io/name": "kuberay-operator"}}  # fmt: skip


@pytest.mark.parametrize("name", OVERLAYS)
def test_only_the_pipelines_own_pods_reach_mlflow_postgres_ray_and_the_ranks(rendered, name):
    docs = rendered[name]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    namespace = next(d for d in docs if d["kind"] == "Namespace")["metadata"]["name"]
    pods = {}  # component -> the labels of its pods, from the rendered templates
    for _, template in (t for d in docs for t in pod_templates(d)):
        labels = template["metadata"]["labels"]
        pods[labels["app.kubernetes.io/component"]] = labels
    assert {"tracking", "tracking-db", "training", "data"} <= set(pods)
    ports = {"tracking": [5000], "tracking-db": [5432], "training": [29500, 29400, 40000],
             "data": [6379, 8265, 10001, 20000]}  # fmt: skip

    def can(src: dict, dst: str, port: int) -> bool:
        return ingress_allowed(policies, namespace, src, pods[dst], port)

    for dst, dst_ports in ports.items():  # no one from outside, nor a pod that is not ours
        for port in dst_ports:
            assert not can(STRANGER, dst, port), (dst, port)
            assert not can(NEIGHBOUR, dst, port), (dst, port)
    for src in ("training", "data", "tracking"):
        assert can(_pod(src), "tracking", 5000), src
    assert can(_pod("tracking"), "tracking-db", 5432)
    assert not can(_pod("training"), "tracking-db", 5432)  # only MLflow reads its database
    assert not can(_pod("training"), "tracking", 5432)
    for port in ports["training"]:  # the ranks, on any port; nobody else
        assert can(_pod("training"), "training", port)
        assert not can(_pod("data"), "training", port)
    for port in ports["data"]:  # the Ray cluster's own pods, on any port
        assert can(_pod("data"), "data", port)
        assert not can(_pod("training"), "data", port)
    assert can(OPERATOR, "data", 8265)  # KubeRay submits the job (HTTPMode) ...
    assert not can(OPERATOR, "data", 6379)  # ... and reaches nothing else
    assert not can(_pod("training", namespace="other"), "tracking", 5000)  # labels alone: no
    assert next(d for d in docs if d["kind"] == "RayJob")["spec"]["submissionMode"] == "HTTPMode"


def test_the_policy_model_is_the_kubernetes_semantics():
    """ingress_allowed on hand-made policies: unselected pods are open, a selecting
    policy without rules shuts, peers and ports narrow."""
    dst = {"app": "db"}
    me = {
        "namespace": "ns",
        "ns_labels": {"kubernetes.io/metadata.name": "ns"},
        "labels": {"app": "web"},
    }
    deny = {"spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    allow = {"spec": {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"],
                      "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                                   "ports": [{"port": 5432}]}]}}  # fmt: skip
    assert ingress_allowed([], "ns", me, dst, 5432)
    assert not ingress_allowed([deny], "ns", me, dst, 5432)
    assert ingress_allowed([deny, allow], "ns", me, dst, 5432)
    assert not ingress_allowed([deny, allow], "ns", me, dst, 80)
    assert not ingress_allowed([deny, allow], "ns", {**me, "labels": {"app": "x"}}, dst, 5432)
    assert not ingress_allowed([deny, allow], "ns", {**me, "namespace": "other"}, dst, 5432)


@pytest.mark.parametrize("name", OVERLAYS)
def test_no_pod_may_call_the_kubernetes_api(rendered, name):
    """The least RBAC every job needs is none: the data job, training (its rendezvous is
    torch's c10d store over TCP, elastic included) and MLflow never call the API, so no
    Role or binding is made and no service-account token is mounted."""
    docs = rendered[name]
    assert not [d["kind"] for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding",
                                                          "ClusterRoleBinding")]  # fmt: skip
    accounts = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert [a["metadata"]["name"] for a in accounts] == ["plm"]
    assert accounts[0]["automountServiceAccountToken"] is False
    for where, spec in all_pods(docs):
        assert spec.get("automountServiceAccountToken") is False, where
    job = next(d for d in docs if d["kind"] == "PyTorchJob" or d["kind"] == "Job")
    if job["kind"] == "PyTorchJob" and "elasticPolicy" in job["spec"]:
        assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"


# ---------------------------------------------------------------------------
# MLflow with authentication (issue 49.1)


def mlflow_container(docs: list[dict]) -> tuple[dict, dict]:
    """(the MLflow Deployment's pod spec, its container)."""
    mlflow = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "plm-mlflow"
    )
    spec = mlflow["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def auth_ini(docs: list[dict], spec: dict, container: dict) -> str:
    """The basic-auth app's config, followed from MLFLOW_AUTH_CONFIG_PATH to its ConfigMap."""
    path = Path(mlflow_env(docs)["MLFLOW_AUTH_CONFIG_PATH"]["value"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    name = volume["configMap"]["name"]
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)
    return cm["data"][path.name]


@pytest.mark.parametrize("name", OVERLAYS + ["gpu+mlflow-s3"])
def test_mlflow_runs_the_auth_app_with_its_secrets_from_a_secret(rendered, name, tmp_path):
    import configparser

    docs = kustomize(with_s3_component(tmp_path)) if name == "gpu+mlflow-s3" else rendered[name]
    spec, container = mlflow_container(docs)
    args = container["args"]
    assert container["command"] == ["mlflow"] and args[0] == "server"
    assert "--app-name=basic-auth" in args
    assert any(a.startswith("--allowed-hosts=plm-mlflow,") for a in args)
    env = mlflow_env(docs)
    for var, key in (("MLFLOW_AUTH_ADMIN_PASSWORD", "admin-password"),
                     ("MLFLOW_FLASK_SERVER_SECRET_KEY", "flask-secret-key")):  # fmt: skip
        assert "value" not in env[var], var
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "plm-mlflow-auth", "key": key}
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]["value"] == "false"
    ini = configparser.ConfigParser()
    ini.read_string(auth_ini(docs, spec, container))
    auth = ini["mlflow"]
    assert auth["default_permission"] in ("READ", "NO_PERMISSIONS")  # never EDIT / MANAGE
    assert "admin_password" not in auth  # the Secret's, through the environment
    assert "@" not in auth["database_uri"] and "@" not in " ".join(args)  # libpq: PGPASSWORD
    assert "password1234" not in json.dumps(docs)  # MLflow's old default


# ---------------------------------------------------------------------------
# Training signs in to MLflow as its job's user (issue 49.1)

# The stages that talk to MLflow (pipeline/tracking_uri.py's check_access callers).
MLFLOW_STAGES = {"train", "finetune", "eval", "predict"}
# Variables that would carry an MLflow secret itself: never inline in a manifest.
MLFLOW_SECRET_VARS = {"MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                      "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"}  # fmt: skip
CREDENTIALS_IN_URI = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s\"'@:]+:[^/\s\"'@]+@", re.I)


def all_containers(docs: list[dict]):
    """(where, pod spec, container) of every container, init containers included."""
    for where, spec in all_pods(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield f"{where}/{c['name']}", spec, c


def talks_to_mlflow(c: dict) -> bool:
    """A container pointed at a tracking server, or running a stage that logs to one."""
    argv = [*c.get("command", []), *c.get("args", [])]
    runs_stage = argv[:1] == ["plm"] and argv[1:2] and argv[1] in MLFLOW_STAGES
    elastic = argv[:2] == ["python", "launch/elastic_train.py"]  # runs `plm train`
    told = any(e["name"] == "MLFLOW_TRACKING_URI" for e in c.get("env", []))
    return bool(runs_stage or elastic or told)


def secret_file_of(spec: dict, c: dict, path: str) -> tuple[str, str] | None:
    """(Secret, key) behind the file ``path`` in container ``c``, if a read-only mount of a
    secret volume (or a projected one's secret source) puts it there; else None."""
    for m in c.get("volumeMounts", []):
        base = m["mountPath"].rstrip("/")
        if not path.startswith(base + "/") or not m.get("readOnly"):
            continue
        rel = path[len(base) + 1 :] if not m.get("subPath") else None
        volume = next(v for v in spec["volumes"] if v["name"] == m["name"])
        sources = [volume["secret"]] if "secret" in volume else [
            s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s
        ]  # fmt: skip
        for s in sources:
            name = s.get("secretName") or s.get("name")
            for item in s.get("items") or []:
                if item["path"] == rel:
                    return name, item["key"]
    return None


def mlflow_credential_violations(docs: list[dict]) -> list[str]:
    """What keeps a manifest's MLflow clients from signing in as their job's user, or puts
    an MLflow secret in the manifest itself."""
    bad = []
    for who, spec, c in all_containers(docs):
        env = {e["name"]: e for e in c.get("env", [])}
        for var in MLFLOW_SECRET_VARS & set(env):
            if "value" in env[var]:
                bad.append(f"{who}: {var} inline")
        if not talks_to_mlflow(c):
            continue
        user = env.get("MLFLOW_TRACKING_USERNAME", {}).get("valueFrom", {}).get("secretKeyRef")
        if not user:
            bad.append(f"{who}: MLFLOW_TRACKING_USERNAME not from a Secret")
        if "MLFLOW_TRACKING_PASSWORD" in env or "MLFLOW_TRACKING_TOKEN" in env:
            bad.append(f"{who}: an MLflow password or token in the env (use a file)")
        path = env.get("MLFLOW_TRACKING_PASSWORD_FILE", {}).get("value", "")
        source = secret_file_of(spec, c, path) if path else None
        if source is None:
            bad.append(f"{who}: MLFLOW_TRACKING_PASSWORD_FILE {path!r} is no mounted Secret file")
        elif user and source[0] != user["name"]:
            bad.append(f"{who}: user from Secret {user['name']}, password from {source[0]}")
        elif source[0] == "plm-mlflow-auth":
            bad.append(f"{who}: signs in with the admin's Secret")
    for doc in docs:
        if doc["kind"] == "RayJob":  # the Ray job's own environment
            runtime = yaml.safe_load(doc["spec"].get("runtimeEnvYAML") or "{}") or {}
            for var in MLFLOW_SECRET_VARS & set(runtime.get("env_vars", {})):
                bad.append(f"RayJob/{doc['metadata']['name']}: {var} in runtimeEnvYAML")
    text = json.dumps(docs)
    bad += [f"credentials in a URI: {m}" for m in CREDENTIALS_IN_URI.findall(text)]
    if "password1234" in text:  # MLflow's old default
        bad.append("MLflow's default admin password")
    return bad


@pytest.mark.parametrize("name", OVERLAYS + ["gpu+mlflow-s3"])
def test_every_mlflow_client_signs_in_from_secrets(rendered, name, tmp_path):
    """Every training container is an MLflow client with its user from the job's Secret
    (secretKeyRef) and its password a file of that Secret (MLFLOW_TRACKING_PASSWORD_FILE),
    never in the pod spec's env; no MLflow secret or user:pass@ URI anywhere."""
    docs = kustomize(with_s3_component(tmp_path)) if name == "gpu+mlflow-s3" else rendered[name]
    assert mlflow_credential_violations(docs) == []
    clients = {who for who, _, c in all_containers(docs) if talks_to_mlflow(c)}
    training = {who for who, _, c in all_containers(docs)
                if who.split(":")[0].endswith("/plm-train") and c["name"] != "wait-for-data"}  # fmt: skip
    assert training and training <= clients, (training, clients)
    assert not [who for who in clients if who.startswith("RayJob/")]  # the data job: no MLflow


def test_the_mlflow_credential_check_finds_what_it_should(rendered):
    docs = rendered["overlays/cpu-smoke"]
    assert mlflow_credential_violations(docs) == []

    def train_container(d: list[dict]) -> tuple[dict, dict]:
        job = next(x for x in d if x["kind"] == "Job" and x["metadata"]["name"] == "plm-train")
        spec = job["spec"]["template"]["spec"]
        return spec, spec["containers"][0]

    def broken(change) -> list[str]:
        d = copy.deepcopy(docs)
        change(*train_container(d), d)
        return mlflow_credential_violations(d)

    def env_of(c: dict, var: str) -> dict:
        return next(e for e in c["env"] if e["name"] == var)

    def inline_password(spec, c, d):
        c["env"].append({"name": "MLFLOW_TRACKING_PASSWORD", "value": "hunter2hunter2"})

    def inline_user(spec, c, d):
        env_of(c, "MLFLOW_TRACKING_USERNAME").update(value="bert-job")
        env_of(c, "MLFLOW_TRACKING_USERNAME").pop("valueFrom")

    def file_from_configmap(spec, c, d):
        env_of(c, "MLFLOW_TRACKING_PASSWORD_FILE")["value"] = "/etc/plm/experiment.yaml"

    def unmounted(spec, c, d):
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "mlflow-credentials"]

    def uri_with_password(spec, c, d):
        env_of(c, "MLFLOW_TRACKING_URI")["value"] = "http://bert-job:s3cret@plm-mlflow:5000"

    def other_secret(spec, c, d):
        env_of(c, "MLFLOW_TRACKING_USERNAME")["valueFrom"]["secretKeyRef"]["name"] = "other"

    for change, words in [(inline_password, "MLFLOW_TRACKING_PASSWORD inline"),
                          (inline_user, "MLFLOW_TRACKING_USERNAME not from a Secret"),
                          (file_from_configmap, "no mounted Secret file"),
                          (unmounted, "no mounted Secret file"),
                          (uri_with_password, "credentials in a URI"),
                          (other_secret, "password from plm-train-mlflow")]:  # fmt: skip
        found = broken(change)
        assert any(words in v for v in found), (change.__name__, found)
