"""prefect.yaml against the flows it names: every entrypoint loads, its parameters are the flow's, and every
`prefect deployment run 'FLOW/DEPLOYMENT'` the docs print names a flow and a deployment that exist."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
RUN_COMMAND = re.compile(r"prefect deployment run '([\w-]+)/([\w-]+)'((?: *\\?\n? *--param [\w.]+=\S+)*)")


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_each_deployment_loads_its_flow_with_its_parameters(deployment: dict, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    flow = load_flow_from_entrypoint(deployment["entrypoint"])
    signature = inspect.signature(flow.fn)
    given = set(deployment.get("parameters") or {})
    assert given <= set(signature.parameters), given - set(signature.parameters)
    signature.bind_partial(**deployment.get("parameters") or {})


def test_the_run_commands_in_the_docs_name_real_deployments_and_parameters(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    flows = {}
    for deployment in DEPLOYMENTS:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])
        flows[(flow.name, deployment["name"])] = inspect.signature(flow.fn)
    commands = []
    for path in (ROOT / "README.md", ROOT / "prefect.yaml", *sorted((ROOT / "docs").glob("*.md"))):
        commands += [(path.name, *match) for match in RUN_COMMAND.findall(path.read_text())]
    assert commands
    for where, flow_name, deployment_name, params in commands:
        assert (flow_name, deployment_name) in flows, f"{where}: no deployment {flow_name}/{deployment_name}"
        names = {param.split("=")[0].split(".")[0] for param in re.findall(r"--param (\S+)", params)}
        assert names <= set(flows[(flow_name, deployment_name)].parameters), (where, names)
