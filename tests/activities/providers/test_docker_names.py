"""A Docker node's container and network names carry the execution's nonce (DECISIONS
82): two executions of one run id, or two deployments on one daemon, never share one."""

from activities.providers.docker import container_name, network_name


def test_names_carry_the_run_the_node_and_the_executions_nonce():
    assert container_name(7, 2, "0123456789abcdef") == "mvp-orchestrator-7-2-01234567"
    assert network_name(7, "0123456789abcdef") == "mvp-orchestrator-7-01234567"
    assert container_name(7, 2, "0123456789abcdef") != container_name(7, 2, "fedcba9876543210")
