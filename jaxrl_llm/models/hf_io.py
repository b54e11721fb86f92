"""Hugging Face checkpoints in and out: config.json + (index-sharded) safetensors + tokenizer files.

Import reads memory-mapped tensors straight into each device's shard (`make_array_from_callback`),
so a 7B model is never whole on one device. Export streams one layer at a time to the host. Both walk
the rows of `hf_table.param_table`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl_llm.models.config import ConfigError, DecoderConfig
from jaxrl_llm.models.families import hf_prefix, is_critic_hf
from jaxrl_llm.models.hf_table import IGNORED_HF_SUFFIXES, ParamRow, get_path, param_table, set_path
from jaxrl_llm.models.params import graphdef_and_abstract_params, param_shardings
from jaxrl_llm.models.safetensors_io import SafetensorsError, SafetensorsFile, save_file

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A HF model directory we cannot load; the message names the file or tensor."""


# ---- import ------------------------------------------------------------------------------------


def _open_tensors(path: str) -> dict[str, SafetensorsFile]:
    """name -> open file, from the index if there is one, else every *.safetensors in the dir."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory; pass a local HF model directory")
    index_path = os.path.join(path, INDEX_NAME)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index_path}: unreadable index ({e!r})") from None
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files (and no {INDEX_NAME})")
    opened: dict[str, SafetensorsFile] = {}
    for name in files:
        fpath = os.path.join(path, name)
        if not os.path.exists(fpath):
            raise CheckpointError(f"{fpath}: listed in {INDEX_NAME} but missing")
        try:
            opened[name] = SafetensorsFile(fpath)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
    by_tensor: dict[str, SafetensorsFile] = {}
    for fname, sf in opened.items():
        for t in sf.names():
            if weight_map is not None and weight_map.get(t) not in (None, fname):
                continue
            by_tensor[t] = sf
    return by_tensor


class _Alias:
    """A tensor of a file read under another name (a Qwen3.5 checkpoint's `model.language_model.` prefix)."""

    def __init__(self, sf: SafetensorsFile, name: str):
        self.sf, self.name = sf, name

    def get(self, _):
        return self.sf.get(self.name)

    def shape(self, _):
        return self.sf.shape(self.name)


# Tensors of a Qwen3.5 vision-language checkpoint that are not its language model: skipped with one log line.
_SKIPPED_PREFIXES = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction head"}


def _language_model_tensors(tensors: dict, path: str) -> dict:
    """The tensors under our HF names: a Qwen3.5 checkpoint's `model.language_model.X` read as `model.X`, its vision
    tower and MTP head left out (logged); any other checkpoint's as they are."""
    if not any(n.startswith("model.language_model.") for n in tensors):
        return tensors
    out, skipped = {}, {}
    for name, sf in tensors.items():
        what = next((w for p, w in _SKIPPED_PREFIXES.items() if name.startswith(p)), None)
        if what is not None:
            skipped[what] = skipped.get(what, 0) + 1
        elif name.startswith("model.language_model."):
            out["model." + name[len("model.language_model."):]] = _Alias(sf, name)
        else:
            out[name] = sf
    if skipped:
        log.info("%s: loading the language model; skipped %s", path,
                 ", ".join(f"{what} ({n} tensors)" for what, n in skipped.items()))
    return out


def _check_names_and_shapes(cfg: DecoderConfig, rows: list[ParamRow], tensors: dict, where: str,
                            critic: bool) -> None:
    expected = {}
    for row in rows:
        for name in row.hf_names():
            expected[name] = row.hf_shape(cfg)
    missing = [n for n in expected if n not in tensors]
    if missing:
        hint = " (is this a critic/token-classification checkpoint?)" if "lm_head.weight" in missing else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r}{hint}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    for name, shape in expected.items():
        if tensors[name].shape(name) != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(tensors[name].shape(name))}, "
                                  f"config.json implies {list(shape)}")
    for name in tensors:
        if name in expected or name.endswith(IGNORED_HF_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings and not critic:
            continue  # some exports store the tied head too; HF ignores it
        raise CheckpointError(f"{where}: unexpected tensor {name!r} (not part of a {cfg.model_type} "
                              f"{'critic' if critic else 'causal LM'} with this config.json)")


def _row_reader(row: ParamRow, tensors: dict, dtype):
    """index (tuple of slices into our layout) -> numpy block, read lazily from the mapped files."""
    names = row.hf_names()

    def one(name, idx):
        arr = tensors[name].get(name)
        if row.transpose:
            arr = arr.T
        return np.asarray(arr[idx], dtype=dtype)

    def read(index):
        if not row.stacked:
            return one(names[0], tuple(index))
        layers = range(len(row.layers))[index[0]]
        if not row.experts:
            return np.stack([one(names[i], tuple(index[1:])) for i in layers])
        experts = range(row.experts)[index[1]]
        return np.stack([np.stack([one(names[i * row.experts + j], tuple(index[2:])) for j in experts])
                         for i in layers])

    return read


def is_critic_checkpoint(path: str | os.PathLike) -> bool:
    """Whether a HF directory holds a value model (the family's `*ForTokenClassification`)."""
    config_path = os.path.join(os.fspath(path), "config.json")
    try:
        with open(config_path) as f:
            return is_critic_hf(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_path}: cannot read config.json ({e})") from None


def load_params(path: str, cfg: DecoderConfig, *, mesh: Mesh | None = None, critic: bool = False):
    """Reads a HF directory into a params dict placed with the table's shardings."""
    tensors = _language_model_tensors(_open_tensors(path), path)
    rows = param_table(cfg, critic=critic)
    _check_names_and_shapes(cfg, rows, tensors, path, critic)
    shardings = param_shardings(cfg, mesh, critic=critic)
    dtype = np.dtype(jax.numpy.dtype(cfg.param_dtype))
    params: dict = {}
    for row in rows:
        shape = row.shape(cfg)
        arr = jax.make_array_from_callback(shape, get_path(shardings, row.path),
                                           _row_reader(row, tensors, dtype))
        set_path(params, row.path, arr)
    return params


def load_hf(path: str | os.PathLike, *, dtype: str = "float32", param_dtype: str | None = None,
            mesh: Mesh | None = None, critic: bool = False, **config_overrides) -> nnx.Module:
    """Loads a local HF checkpoint of a supported family (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama 3.x) as a
    (sharded) Flax model.

    Args:
      path: directory with config.json and model.safetensors (or an index + shards).
      dtype: compute dtype. param_dtype: storage dtype (defaults to `dtype`).
      mesh: place params with the logical-axis rules on this mesh (None: the first device).
      critic: load the family's `*ForTokenClassification` (value model) instead of a causal LM.
    """
    path = os.fspath(path)
    cfg = DecoderConfig.from_hf(path, dtype=dtype, param_dtype=param_dtype or dtype, **config_overrides)
    params = load_params(path, cfg, mesh=mesh, critic=critic)
    graphdef, _ = graphdef_and_abstract_params(cfg, critic=critic)
    return nnx.merge(graphdef, params)


# ---- export ------------------------------------------------------------------------------------


def iter_hf_tensors(params, cfg: DecoderConfig, *, critic: bool = False,
                    dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array in HF layout) for every tensor, one layer slice at a time, cast to `dtype` (a
    dtype or its name, "bfloat16" included) when given."""
    for row in param_table(cfg, critic=critic):
        arr = get_path(params, row.path)
        out_dtype = np.dtype(jax.numpy.dtype(dtype)) if dtype is not None else np.dtype(arr.dtype)
        names = iter(row.hf_names())
        for piece in ([arr[i] for i in range(len(row.layers))] if row.stacked else [arr]):
            host = np.asarray(jax.device_get(piece)).astype(out_dtype, copy=False)  # a view when it can be
            for tensor in (host if row.experts else [host]):  # a layer's experts: one HF tensor each
                yield next(names), (np.ascontiguousarray(tensor.T) if row.transpose else tensor)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = size.strip().upper()
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def write_hf_dir(params, cfg: DecoderConfig, out_dir: str | os.PathLike, *, critic: bool = False,
                 tokenizer_dir: str | None = None, dtype: str | None = None,
                 max_shard_size: int | str = "5GB") -> str:
    """Writes config.json, generation_config.json, safetensors (sharded with an index above
    `max_shard_size`) and the tokenizer files of `tokenizer_dir` if it has any."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    limit = _parse_size(max_shard_size)
    # Tensors are grouped greedily into shards, and each shard is written as soon as it is full, so
    # the host holds at most one shard at a time.
    current: list[tuple[str, np.ndarray]] = []
    written: list[tuple[str, list[str]]] = []
    size = total = 0

    def flush():
        nonlocal current, size
        if current:
            tmp = os.path.join(out_dir, f".shard-{len(written):05d}.tmp.safetensors")
            save_file(current, tmp, metadata={"format": "pt"})
            written.append((tmp, [n for n, _ in current]))
        current, size = [], 0

    hf_cfg = cfg.to_hf(critic=critic)
    prefix = hf_prefix(hf_cfg)  # a Qwen3.5 value model keeps its language model under model.language_model.
    for name, arr in iter_hf_tensors(params, cfg, critic=critic, dtype=dtype):
        if prefix != "model." and name.startswith("model."):
            name = prefix + name[len("model."):]
        if current and size + arr.nbytes > limit:
            flush()
        current.append((name, arr))
        size += arr.nbytes
        total += arr.nbytes
    flush()

    for stale in glob.glob(os.path.join(out_dir, "model*.safetensors")) + [os.path.join(out_dir, INDEX_NAME)]:
        if os.path.exists(stale):
            os.remove(stale)
    if len(written) == 1:
        os.replace(written[0][0], os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map = {}
        n = len(written)
        for i, (tmp, names) in enumerate(written):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(out_dir, fname))
            weight_map.update({t: fname for t in names})
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    if dtype:
        hf_cfg["torch_dtype"] = str(np.dtype(jax.numpy.dtype(dtype)).name)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, out_dir)
    gen_path = os.path.join(out_dir, "generation_config.json")
    if not os.path.exists(gen_path):
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
        if cfg.pad_token_id is not None:
            gen["pad_token_id"] = cfg.pad_token_id
        with open(gen_path, "w") as f:
            json.dump(gen, f, indent=2)
    return out_dir


def copy_tokenizer(tokenizer_dir: str, out_dir: str) -> None:
    """The tokenizer files (and generation config) of `tokenizer_dir` that exist, into `out_dir`."""
    for fname in TOKENIZER_FILES + ("generation_config.json",):
        src = os.path.join(tokenizer_dir, fname)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(out_dir, fname))


def save_hf(model: nnx.Module, out_dir: str | os.PathLike, *, tokenizer_dir: str | None = None,
            dtype: str | None = None, max_shard_size: int | str = "5GB") -> str:
    """Exports a model (causal LM or critic) as a HF directory that transformers and vLLM load."""
    from jaxrl_llm.models.qwen2 import DecoderCritic

    params = nnx.to_pure_dict(nnx.state(model))
    return write_hf_dir(params, model.cfg, out_dir, critic=isinstance(model, DecoderCritic),
                        tokenizer_dir=tokenizer_dir, dtype=dtype, max_shard_size=max_shard_size)


__all__ = ["CheckpointError", "ConfigError", "copy_tokenizer", "is_critic_checkpoint", "iter_hf_tensors", "load_hf",
           "load_params", "save_hf", "write_hf_dir"]
