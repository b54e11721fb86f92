"""Diagnostics: the decode step of Qwen3.5's linear layers at the 9B's heads, timed on the GPU, in the forms the
engine could run (kernels/gdn_decode.py's launch shape; the conv window's scatter into its slots).

The 9B's generation profile on an H100 (BENCHMARKS.md, 2026-11-27) put 5.05 s of its 17.3 s in the in-place decode
kernel (22,752 calls, 0.22 ms each) and 1.56 s in one scatter fusion a linear layer a step: the conv window's
`conv.at[slot].set(...)`, whose indices repeat (finished rows all write the scratch slot 0), so XLA cannot take
them as unique. This times, in one process on real random data:

* the kernel at each (block_v, num_warps, skip_dead) form, in place, over `rows` rows of which a `dead` share sit
  in the scratch slot; its error against the jnp reference on the live rows; and the bandwidth it reaches (a live
  row's state read and written once; skip_dead off also moves the dead rows');
* the conv window's scatter, with and without `unique_indices`.

Each timing is the median of 5 runs of a jitted loop of `steps` calls that carries the pool (donated), so the
in-place forms update the pool's own buffer as the engine's decode loop does.

    python benchmarks/diag/gdn_decode_tune.py [rows ...]       # default 256 545; prints one JSON line a form
"""

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels import gdn_decode

NS, HK, HV, DK, DV, E, STEPS, DEAD = 682, 16, 32, 128, 128, 8192, 20, 0.25
FORMS = [(32, 4, False), (32, 4, True), (64, 4, True), (64, 8, True), (128, 4, True), (128, 8, True),
         (16, 4, True), (32, 2, True), (64, 2, True)]


def timed(fn, *args, repeats: int = 5) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        args = (out[0], *args[1:]) if isinstance(out, tuple) else (out, *args[1:])
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    rows_list = [int(a) for a in sys.argv[1:]] or [256, 545]
    on_gpu = jax.default_backend() == "gpu"
    ns, steps = (NS, STEPS) if on_gpu else (40, 2)
    rng = np.random.default_rng(0)
    state0 = jnp.asarray(rng.normal(0, 0.1, (ns, HV, DK, DV)), jnp.bfloat16)
    state_bytes = HV * DK * DV * 2  # one row's state of one layer, bf16
    for rows in rows_list if on_gpu else [12]:
        live = rng.permutation(np.arange(1, ns))[:rows]
        dead = rng.random(rows) < DEAD
        slots = jnp.asarray(np.where(dead, 0, live), jnp.int32)
        n_live = int((~dead).sum())
        unit = lambda *s: jnp.asarray(rng.normal(0, 1, s), jnp.bfloat16)
        q, k = (x / jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True).astype(jnp.bfloat16)
                for x in (unit(rows, HK, DK), unit(rows, HK, DK)))
        v = unit(rows, HV, DV)
        g = jnp.asarray(-rng.random((rows, HV)), jnp.float32)
        beta = jnp.asarray(rng.random((rows, HV)), jnp.bfloat16)
        ref_o, ref_s = gdn_decode.gdn_decode_step_reference(state0, slots, q, k, v, g, beta, in_place=True)
        keep = np.asarray(~dead)
        for block_v, warps, skip in FORMS:
            if block_v > DV:
                continue
            step = functools.partial(gdn_decode._step, interpret=not on_gpu, in_place=True, block_v=block_v,
                                     num_warps=warps, skip_dead=skip)
            try:
                o, s = jax.jit(step)(jnp.array(state0), slots, q, k, v, g, beta)
                err_o = float(jnp.max(jnp.abs(o[keep] - ref_o[keep])))
                err_s = float(jnp.max(jnp.abs(s[slots[keep]].astype(jnp.float32)
                                              - ref_s[slots[keep]].astype(jnp.float32))))

                @functools.partial(jax.jit, donate_argnums=0)
                def loop(pool, slots, q, k, v, g, beta, step=step):
                    def body(_, c):
                        o, pool = step(c[1], slots, q, k, v, g, beta)
                        return c[0] + o[0, 0, 0], pool
                    return jax.lax.fori_loop(0, steps, body, (jnp.float32(0), pool))[::-1]

                sec = timed(loop, jnp.array(state0), slots, q, k, v, g, beta) / steps
                moved = 2 * state_bytes * (n_live if skip else rows)
                print(json.dumps(dict(section="gdn_decode", rows=rows, live=n_live, block_v=block_v, num_warps=warps,
                                      skip_dead=skip, ms=round(sec * 1e3, 4), gb_s=round(moved / sec / 1e9, 1),
                                      err_o=err_o, err_state=err_s)), flush=True)
            except Exception as e:  # a form Triton cannot take: say so, go on
                print(json.dumps(dict(section="gdn_decode", rows=rows, block_v=block_v, num_warps=warps,
                                      skip_dead=skip, error=f"{type(e).__name__}: {str(e)[:300]}")), flush=True)
        conv0 = jnp.asarray(rng.normal(0, 1, (ns, 3, E)), jnp.bfloat16)
        upd = jnp.asarray(rng.normal(0, 1, (rows, 3, E)), jnp.bfloat16)
        for unique in (False, True):
            @functools.partial(jax.jit, donate_argnums=0)
            def scat(conv, slots, upd, unique=unique):
                def body(i, c):
                    return c.at[slots].set(upd + i.astype(upd.dtype), unique_indices=unique)
                return jax.lax.fori_loop(0, steps, body, conv)

            sec = timed(scat, jnp.array(conv0), slots, upd) / steps
            print(json.dumps(dict(section="conv_scatter", rows=rows, unique_indices=unique,
                                  ms=round(sec * 1e3, 4), gb_s=round(rows * 3 * E * 2 / sec / 1e9, 1))), flush=True)

        # a K/V page write of an attention layer (the 7B's: 4 kv heads of 128, 16-token pages), dead rows in the
        # scratch page 0
        pages0 = jnp.zeros((4, 40000 if on_gpu else 64, 16, 128), jnp.bfloat16)
        page = jnp.asarray(np.where(dead, 0, rng.integers(1, pages0.shape[1], rows)), jnp.int32)[:, None]
        off = jnp.asarray(rng.integers(0, 16, rows), jnp.int32)[:, None]
        new = jnp.asarray(rng.normal(0, 1, (rows, 1, 4, 128)), jnp.bfloat16)
        for unique in (False, True):
            @functools.partial(jax.jit, donate_argnums=0)
            def write(pages, page, off, new, unique=unique):
                def body(i, c):
                    return c.at[:, page, off].set((new + i.astype(new.dtype)).transpose(2, 0, 1, 3),
                                                  unique_indices=unique)
                return jax.lax.fori_loop(0, steps, body, pages)

            sec = timed(write, pages0, page, off, new) / steps
            pages0 = jnp.zeros_like(pages0)
            print(json.dumps(dict(section="kv_write", rows=rows, unique_indices=unique, ms=round(sec * 1e3, 4))),
                  flush=True)


if __name__ == "__main__":
    main()
