"""The Kubernetes manifests of docs/k8s: what each pod would run, run as two processes on 127.0.0.1.

Each "pod" gets the variables Kubernetes gives it (an Indexed Job's JOB_COMPLETION_INDEX; a JobSet's
restart attempt through the downward API; Kubeflow Trainer's PET_* for torchrun) and runs the
manifest's own command; pod 0's DNS name, which the manifest derives from the JobSet's or the
Service's naming rules (checked here), becomes 127.0.0.1 and the port a free one. OUT_DIR, the
shared volume, is a folder both processes see. A restarted JobSet resumes from it, past the lock
its vanished predecessor left.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import yaml
from helpers import REPO, Started, assert_ok, clean_env, read_metrics

from distribuuuu.records import out_dir_lock
from distribuuuu.records.out_dir_lock import LOCK_NAME, Holder
from distribuuuu.runtime.launcher import find_free_port

K8S = REPO / "docs" / "k8s"
# Two epochs of a light model on the 361 val digits at 16 px: the training, not the model, is under test.
TINY = "MODEL.ARCH shufflenet_v2_x0_5 TRAIN.SPLIT val TRAIN.IM_SIZE 16 TEST.IM_SIZE 16 OPTIM.MAX_EPOCH 2 LOG.PLOT False"


def manifest(name: str) -> list[dict]:
    with open(K8S / name) as f:
        return list(yaml.safe_load_all(f))


def container_of(pod_spec: dict) -> dict:
    [container] = pod_spec["containers"]
    return container


def pod_env(container: dict, **given: str) -> dict[str, str]:
    """The container's variables as the pod sees them: values as written, downward-API ones from ``given``."""
    env = {}
    for var in container["env"]:
        env[var["name"]] = var.get("value", given.get(var["name"], ""))
    return env


def test_the_jobset_names_pod_0_by_its_rules_and_gives_each_pod_its_index_and_restart():
    [jobset] = manifest("jobset.yaml")
    name, [node] = jobset["metadata"]["name"], jobset["spec"]["replicatedJobs"]
    job = node["template"]["spec"]
    env = pod_env(container_of(job["template"]["spec"]))
    assert jobset["spec"]["network"]["enableDNSHostnames"] and node["replicas"] == 1
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == int(env["NNODES"])
    # JobSet's pod hostname <jobset>-<replicatedJob>-<job index>-<pod index>, subdomain <jobset>
    assert env["MASTER_ADDR"] == f"{name}-{node['name']}-0-0.{name}"
    downward = {
        v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"]
        for v in container_of(job["template"]["spec"])["env"]
        if "valueFrom" in v
    }
    assert downward == {"JOBSET_RESTART_ATTEMPT": "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"}
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] > 0 and job["backoffLimit"] == 0


def test_the_indexed_job_is_named_by_its_headless_service():
    service, job = manifest("indexed-job.yaml")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    env = pod_env(container_of(pod))
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {
        "job-name": job["metadata"]["name"]
    }
    assert pod["subdomain"] == service["metadata"]["name"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"] == int(env["NNODES"])
    assert (
        env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    )  # <job>-<index>.<subdomain>


def test_a_restarted_jobset_counts_as_a_restart_for_the_out_dir_lock(monkeypatch):
    for var in out_dir_lock.RESTART_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JOBSET_RESTART_ATTEMPT", "0")  # a first start: the annotation says 0
    assert not out_dir_lock.is_a_restart()
    monkeypatch.setenv("JOBSET_RESTART_ATTEMPT", "1")
    assert out_dir_lock.is_a_restart()


def run_pods(command: list[str], envs: list[dict], timeout: float = 300) -> list:
    """Every pod's command at once, each in a process of its own with its variables; their results."""
    with Started(command, envs[1]) as other:
        with Started(command, envs[0]) as first:
            return [first.result(timeout), other.result(timeout)]


def jobset_pods(out_dir: str, attempt: int, opts: str) -> tuple[list[str], list[dict]]:
    """The JobSet container's command, and the two pods' variables (pod 0's name -> 127.0.0.1, 1 process a pod)."""
    [jobset] = manifest("jobset.yaml")
    container = container_of(jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])
    port, envs = str(find_free_port()), []
    for index in range(2):
        env = pod_env(container, JOBSET_RESTART_ATTEMPT=str(attempt))
        env |= {"JOB_COMPLETION_INDEX": str(index), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env |= {"NPROC_PER_NODE": "1", "OUT_DIR": out_dir, "TRAIN_OPTS": opts}
        envs.append(clean_env(**env, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
    return [*container["command"], *container["args"]], envs


@pytest.mark.slow
def test_the_jobsets_pods_train_and_a_restarted_jobset_resumes_past_the_lock_a_vanished_pod_left(tmp_path):
    out = str(tmp_path / "out")
    results = run_pods(*jobset_pods(out, 0, f"{TINY} TRAIN.STOP_AFTER_EPOCHS 1"))
    for result in results:
        assert_ok(result)
    assert "2 process(es)" in results[0].stdout and "torchrun" in results[0].stdout
    assert [r["epoch"] for r in read_metrics(out) if r["split"] == "val" and r["weights"] == "model"] == [1]
    # Pod 0 was on a node that vanished: its lock names it and was touched a moment ago. The restarted
    # JobSet's pods wait for it to go stale (DIST.LOCK_STALE_S), then take OUT_DIR over and resume.
    vanished = Holder("distribuuuu-node-0-0", 7, time.time() - 60)
    (tmp_path / "out" / LOCK_NAME).write_text(json.dumps(vanished.__dict__))
    results = run_pods(*jobset_pods(out, 1, f"{TINY} DIST.LOCK_STALE_S 4"))
    for result in results:
        assert_ok(result)
    output = results[0].stdout + results[0].stderr
    assert "took over the lock of a run that is gone (host distribuuuu-node-0-0" in output
    assert "resumed from" in output and "ckpt_ep_001" in output
    assert [r["epoch"] for r in read_metrics(out) if r["split"] == "val" and r["weights"] == "model"] == [1, 2]


@pytest.mark.slow
def test_the_trainjobs_command_trains_on_two_pods_with_kubeflows_torchrun_variables(tmp_path):
    [trainjob] = manifest("trainjob.yaml")
    trainer = trainjob["spec"]["trainer"]
    command = trainer["command"]
    assert command[0] == "torchrun" and trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    command[command.index("OUT_DIR") + 1] = str(tmp_path)
    command += TINY.split() + ["OPTIM.MAX_EPOCH", "1"]
    # What the torch plugin sets (kubeflow/trainer pkg/runtime/framework/plugins/torch): the master is
    # <trainjob>-node-0-0.<trainjob>:29500 (pod 0 of its JobSet), here 127.0.0.1 and a free port.
    port, envs = str(find_free_port()), []
    for index in range(2):
        pet = {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(index)}
        envs.append(clean_env(**pet, PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port, JOBSET_RESTART_ATTEMPT="0"))
    results = run_pods(command, envs)
    for result in results:
        assert_ok(result)
    assert "2 process(es)" in results[0].stdout
    assert [r["epoch"] for r in read_metrics(tmp_path) if r["split"] == "val" and r["weights"] == "model"] == [1]
