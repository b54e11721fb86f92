"""The config error lives one floor down (jaxrl_llm/errors.py): the agent's config raises the trainer's error
class without importing the trainer's config, which imports the agent's (the old import circle)."""

import subprocess
import sys

from jaxrl_llm.errors import ConfigValueError
from jaxrl_llm.trainer import config as trainer_config
from jaxrl_llm.trainer.config import check as config_check

PROBE = """
import sys
from jaxrl_llm.agent.config import MultiTurnConfig
from jaxrl_llm.errors import ConfigValueError
try:
    MultiTurnConfig(enable=True, max_parallel_calls=0).validate()
except ConfigValueError as e:
    print("raised:", e)
print("trainer imported:", any(m.startswith("jaxrl_llm.trainer") for m in sys.modules))
"""


def test_the_agent_config_raises_the_shared_error_without_importing_the_trainer():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "raised: rollout.multi_turn.max_parallel_calls" in out.stdout
    assert "trainer imported: False" in out.stdout


def test_the_trainer_names_the_same_class():
    assert trainer_config.ConfigValueError is ConfigValueError is config_check.ConfigValueError
