"""`python -m jaxrl_llm.report RUN_DIR [--out DIR]`: see jaxrl_llm.report."""

import sys

from jaxrl_llm.report import main

sys.exit(main())
