"""The launchers in launch/ cannot run here (TPU VM, SLURM, GKE), so check what can be checked:
every shell script parses (`bash -n`), and the GKE manifest parses and agrees with itself."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import yaml

LAUNCH = Path(__file__).resolve().parent.parent / "launch"
SCRIPTS = sorted(p for p in LAUNCH.iterdir() if p.is_file() and p.read_text().startswith("#!") and
                 "bash" in p.read_text().splitlines()[0])


def test_the_shell_launchers_are_found():
    assert {p.name for p in SCRIPTS} >= {"tpu_vm.sh", "slurm.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_shell_launcher_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_gke_manifest_parses_and_its_service_job_and_process_count_agree():
    documents = [d for d in yaml.safe_load_all((LAUNCH / "gke.yaml").read_text()) if d is not None]
    by_kind = {d["kind"]: d for d in documents}
    assert sorted(by_kind) == ["Job", "Service"]
    service, job = by_kind["Service"], by_kind["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}

    # One JAX process per pod: the three counts must be one number.
    processes = int(env["VALEN_NUM_PROCESSES"]["value"])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == processes
    assert job["spec"]["completionMode"] == "Indexed"
    assert "job-completion-index" in env["VALEN_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    # Pod 0 is reached through the headless Service the pods are a subdomain of, on its port.
    host, port = env["VALEN_COORDINATOR"]["value"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    # The command names a module and a config that exist in this repository.
    _, dash_m, module, config, *_ = container["command"]
    assert (dash_m, importlib.util.find_spec(module) is not None) == ("-m", True)
    assert (LAUNCH.parent / config.removeprefix("--config=")).is_file()
