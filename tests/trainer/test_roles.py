"""The embedded Ray cluster's settings: its workers (trainer processes, vLLM engines, reward workers) run at
the driver's priority, not Ray's default niceness 15, unless RAY_worker_niceness is set."""

from jaxrl_llm.ray_cluster import local_ray_config


def test_an_embedded_cluster_runs_its_workers_at_the_drivers_priority(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    assert local_ray_config() == {"worker_niceness": 0}
    monkeypatch.setenv("RAY_worker_niceness", "10")  # the user's own setting: Ray reads it, we pass nothing
    assert local_ray_config() == {}
