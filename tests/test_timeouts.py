"""The suite's guard against hangs: pytest-timeout is loaded with a global deadline (pyproject.toml), so a test
that waits forever (a dead stream, a lost actor) fails instead of holding CI until its own limit."""


def test_every_test_has_a_deadline(request):
    assert request.config.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed: pip install -e .[test]"
    timeout = float(request.config.getini("timeout") or 0)
    assert 0 < timeout <= 1800, f"pyproject.toml [tool.pytest.ini_options] timeout = {timeout}"

