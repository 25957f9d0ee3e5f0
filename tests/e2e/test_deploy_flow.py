"""The deploy flow end to end (flows/deploy.py) on a Prefect test server: the champion is
packaged, infra-validated with the real `bentoml serve`, marked deployed and reported in an
artifact; a version that is not the champion is never marked deployed. Its steps one by one:
tests/integration/test_packaging.py."""

from __future__ import annotations

import pytest

from tests.support.packaging import registry_with_champion
from tuneloop.packaging import deployment
from tuneloop.registry import TAG_DEPLOYED_BENTO

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_deploy_flow_deploys_and_writes_an_artifact(tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.testing.utilities import prefect_test_harness

    from flows.deploy import DeploymentFailed, deploy_champion_flow

    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry attempts
    s = registry_with_champion(tmp_path)
    with prefect_test_harness(server_startup_timeout=180):
        result = deploy_champion_flow(str(s["config"]), version=s["v1"])
        assert result["deployed"] and result["bento_tag"] == deployment.deployed_bento(s["cfg"])
        assert s["registry"].version(s["v1"]).tags[TAG_DEPLOYED_BENTO] == result["bento_tag"]
        with get_client(sync_client=True) as client:
            artifact = next(a for a in client.read_artifacts() if a.key == "deployment")
        assert "**deployed**" in artifact.data and "bentoml containerize" in artifact.data

        # A version that is not (or no longer) the champion is never marked deployed.
        run = s["client"].create_run(s["experiment"])
        v2 = s["registry"].register(run.info.run_id, s["model_dir"])
        with pytest.raises(DeploymentFailed, match="not the champion"):
            deploy_champion_flow(str(s["config"]), version=v2)
        assert TAG_DEPLOYED_BENTO not in s["registry"].version(v2).tags
        assert deployment.deployed_bento(s["cfg"]) == result["bento_tag"]
