"""The concept → verl metric-name table."""

from hybridflow.metric_names import METRIC_NAMES, NODE_TIME, node_time_metric

# what each built-in node's wall time was logged as before the table (verl's names): unchanged
LOGGED_AS = {"rollout": "gen", "reward": "reward", "reference": "ref", "values": "values", "advantage": "adv",
             "update_policy": "update_actor", "update_critic": "update_critic", "validate": "testing",
             "checkpoint": "save_checkpoint",
             "publish_weights": "weight_sync"}  # a node since issue 36: its time keeps the name it had inside the update


def test_node_times_keep_the_names_the_nodes_logged():
    for node, verl in LOGGED_AS.items():
        assert node_time_metric(node) == f"timing_s/{verl}"
    assert set(NODE_TIME) == set(LOGGED_AS)
    assert node_time_metric("keep_informative_groups") == "timing_s/keep_informative_groups"


def test_an_iteration_is_verls_step_and_the_rollout_its_gen():
    assert METRIC_NAMES["iteration_time_s"] == "timing_s/step"
    assert METRIC_NAMES["rollout_time_s"] == "timing_s/gen"
    assert METRIC_NAMES["update_policy_time_s"] == "timing_s/update_actor"
    assert len(set(METRIC_NAMES.values())) == len(METRIC_NAMES)  # one concept per metric name
