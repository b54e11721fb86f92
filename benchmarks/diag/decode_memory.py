"""Diagnostics: the paged decode program's memory at Qwen3.5-9B's shapes on the GPU (compiled, not run): XLA's
memory analysis and the largest values of its buffer assignment, at two slot counts.

    XLA_FLAGS=--xla_dump_to=/tmp/xd python benchmarks/diag/decode_memory.py [S ...]
"""

import glob
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import DecoderConfig
from jaxrl_llm.models.params import graphdef_and_abstract_params
from jaxrl_llm.rollout import JaxEngine, SamplingParams, paged_decode

cfg = DecoderConfig.qwen3_5_9b(dtype="bfloat16", param_dtype="bfloat16")
_, abstract = graphdef_and_abstract_params(cfg)
params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
eng = JaxEngine(cfg, params, dtype="bfloat16", max_num_seqs=1024, max_model_len=1536, max_prompt_length=512,
                warm_programs=False)
spec = eng.paged_spec([[1, 2, 3]], SamplingParams(max_new_tokens=8), np.array([8]))
eng._fix_width(1500)
base = eng._base
for s in [int(x) for x in sys.argv[1:]] or [256, 1024]:
    pool = eng.abstract_pool(spec, 4096, s + s // 4 + 1, base)
    packed = np.zeros((s, eng.ladders.width + paged_decode.DECODE_COLS), np.int32)
    args = eng._abstract((base.params, pool, packed), base.mesh)
    with jax.set_mesh(base.mesh):
        c = JaxEngine._decode.lower(eng, *args, spec=spec).compile()
    m = c.memory_analysis()
    print(f"S={s}: temp {m.temp_size_in_bytes / 2**30:.2f} GiB, out {m.output_size_in_bytes / 2**30:.2f}, alias "
          f"{m.alias_size_in_bytes / 2**30:.2f}, args {m.argument_size_in_bytes / 2**30:.2f}", flush=True)
dump = os.environ.get("XLA_FLAGS", "")
if "xla_dump_to" in dump:
    d = re.search(r"xla_dump_to=(\S+)", dump).group(1)
    for f in sorted(glob.glob(os.path.join(d, "*jit__decode*buffer-assignment.txt")))[-1:]:
        text = open(f).read()
        vals = re.findall(r"value: <\d+ ([^ >]+)[^>]*>.*?size=(\d+),offset=(\d+)", text)
        for name, size, off in sorted(vals, key=lambda v: -int(v[1]))[:25]:
            print(f"  {int(size) / 2**20:9.1f} MiB @ {int(off) / 2**30:6.2f} GiB  {name}")
