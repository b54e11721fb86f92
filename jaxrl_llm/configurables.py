"""Imports every module that registers gin configurables, so gin files can name them."""

import jaxrl_llm.data.arithmetic  # noqa: F401  (registers the demo's reward)
import jaxrl_llm.models.config  # noqa: F401
import jaxrl_llm.rollout.base  # noqa: F401
import jaxrl_llm.trainer.config  # noqa: F401
