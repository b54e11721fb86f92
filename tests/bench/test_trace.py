"""Sorting a profile's device time into matmul, attention, collectives (exposed, overlapped), elementwise, the
optimizer and gaps: by hand on made-up GPU kernels, then on a real trace of XLA:CPU's ops."""

import numpy as np
import pytest

from jaxrl_llm.bench import trace


def _kernel(pid, name, start, end, **args):
    return {"ph": "X", "pid": pid, "tid": 1, "ts": start, "dur": end - start, "name": name, "args": args}


def test_a_devices_time_by_category():
    meta = [{"ph": "M", "pid": p, "name": "process_name", "args": {"name": n}}
            for p, n in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (3, "/host:CPU"))]
    kernels = []
    for pid in (1, 2):  # two devices, the same timeline (microseconds)
        kernels += [_kernel(pid, "sm90_xmma_gemm_bf16", 0, 10_000, hlo_module="jit_step", hlo_op="dot.3"),
                    _kernel(pid, "ncclDevKernel_AllGather_RING_LL", 5_000, 15_000, hlo_op="all-gather-start"),
                    _kernel(pid, "cudnn_generated_fort_native_sdpa", 20_000, 25_000, hlo_op="custom-call.2"),
                    _kernel(pid, "loop_multiply_fusion", 25_000, 27_000, hlo_module="jit_step", hlo_op="fusion.7"),
                    _kernel(pid, "loop_add_fusion", 30_000, 32_000, hlo_module="jit_apply", hlo_op="fusion.1")]
    host = [_kernel(3, "PjitFunction(step)", 0, 40_000)]  # host events are not a device's
    got = trace.sort_trace(meta + kernels + host)
    want = {"devices": 2, "span_ms": 32.0, "matmul_ms": 10.0, "collectives_ms": 10.0, "attention_ms": 5.0,
            "elementwise_ms": 2.0, "optimizer_ms": 2.0, "collectives_overlapped_ms": 5.0,
            "collectives_exposed_ms": 5.0, "gaps_ms": 8.0}  # 32 less the kernels' union: 15 + 7 + 2
    assert got == pytest.approx(want)


def test_a_cpu_trace_of_a_sharded_step(tmp_path):
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    x = jax.device_put(np.ones((256, 128), np.float32), NamedSharding(mesh, P("fsdp")))
    w = jax.device_put(np.full((128, 128), 0.01, np.float32), NamedSharding(mesh, P(None, "fsdp")))

    @jax.jit
    def step(x, w):  # FSDP-like: the weight is gathered for the matmul
        h = jnp.tanh(x @ jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())))
        return h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)

    @jax.jit
    def apply(w, g):  # what the optimizer program is called in the trainer
        return w - 1e-3 * g / (jnp.abs(g) + 1e-8)

    step(x, w).block_until_ready()
    apply(w, w).block_until_ready()
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    for _ in range(2):
        step(x, w).block_until_ready()
        apply(w, w).block_until_ready()
    jax.profiler.stop_trace()
    got = trace.sort_trace(trace.load_trace(str(tmp_path)))
    assert got["devices"] == 4
    for k in ("matmul_ms", "collectives_ms", "elementwise_ms", "optimizer_ms"):
        assert got[k] > 0, (k, got)
    assert got["collectives_exposed_ms"] + got["collectives_overlapped_ms"] == pytest.approx(got["collectives_ms"])
    assert 0 <= got["gaps_ms"] < got["span_ms"]
