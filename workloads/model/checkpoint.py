"""Hugging Face checkpoints: `config.json` (Qwen3-MoE, `model_type: qwen3_moe`) and safetensors shards with one
tensor per expert projection (`mlp.experts.{j}.gate_proj.weight`), the layout published Qwen3-MoE checkpoints,
transformers, vLLM and SGLang read. In memory the experts are fused per layer ([E, 2I, h] and [E, h, I])."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from moe_rl_eks.core.hf_config import CheckpointError, hf_config, model_config
from moe_rl_eks.core.run import ModelConfig

from ..moe.parallel import ExpertParallel
from .safetensors_io import CHECKSUM, IntegrityError, Into, Source, fill, plan_files, read_files, write_file
from .transformer import MoETransformer, weights_dtype

INDEX_FILE = "model.safetensors.index.json"
FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_hf_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Fused experts -> one tensor per expert projection; a tied lm_head is not written."""
    out = {}
    width = config.moe_intermediate_size
    for name, tensor in state.items():
        match = FUSED.match(name)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for j in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                out[f"{prefix}.{j}.gate_proj.weight"] = tensor[j, :width]
                out[f"{prefix}.{j}.up_proj.weight"] = tensor[j, width:]
            else:
                out[f"{prefix}.{j}.down_proj.weight"] = tensor[j]
    return {name: t.detach().contiguous() for name, t in out.items()}


def from_hf_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, experts: range | None = None
                    ) -> dict[str, torch.Tensor]:
    """One tensor per expert projection (or transformers 5's fused layout) -> our fused state dict; with
    `experts`, the per-expert tensors given are those of that slice (one EP rank's; fused ones come sliced)."""
    experts = range(config.num_experts) if experts is None else experts
    state, per_expert = {}, {}
    for name, tensor in tensors.items():
        match = PER_EXPERT.match(name)
        if match is None:
            state[name] = tensor
        else:
            prefix, j, kind = match.groups()
            per_expert.setdefault(prefix, {})[(int(j), kind)] = tensor
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        parts = per_expert.get(prefix, {})
        if f"{prefix}.down_proj" in state:  # fused in the file
            continue
        missing = [f"{prefix}.{j}.{kind}.weight" for j in experts
                   for kind in ("gate_proj", "up_proj", "down_proj") if (j, kind) not in parts]
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} expert tensors, e.g. {missing[0]}")
        state[f"{prefix}.gate_up_proj"] = fuse([t for j in experts for t in (parts[(j, "gate_proj")],
                                                                               parts[(j, "up_proj")])], 2)
        state[f"{prefix}.down_proj"] = fuse([parts[(j, "down_proj")] for j in experts], 1)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


# Kept in float32 whatever the model's dtype, as transformers keeps them: a sigmoid router's correction bias moves
# by ~1e-3 per update, which bf16 (8 bits of mantissa) would round away.
FLOAT32_TENSORS = ("e_score_correction_bias",)
# The store's manifest (workloads/rl/weights.py writes it): when a checkpoint directory holds one, load_hf checks
# every byte it reads against it.
MANIFEST = "manifest.json"


def published_dtype(name: str, dtype: torch.dtype, serving: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` (now `dtype`) is published and served in, for a model served in `serving`."""
    if not dtype.is_floating_point:
        return dtype
    return torch.float32 if name.endswith(FLOAT32_TENSORS) else serving


def cast_for_serving(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)`, except the FLOAT32_TENSORS (buffers), which keep their float32 values."""
    kept = {(module, name): buf.float() for module in model.modules()
            for name, buf in module.named_buffers(recurse=False) if name.endswith(FLOAT32_TENSORS)}
    model.to(dtype=dtype)
    for (module, name), value in kept.items():
        module._buffers[name] = value.to(module._buffers[name].device)
    return model


def empty_model(config: ModelConfig, ep: ExpertParallel | None, compute: str, device: torch.device
                ) -> MoETransformer:
    """A model to serve (or to score as served), its tensors allocated on `device` in the serving dtypes and left
    uninitialized: the first version overwrites every one of them, so no random initialization is paid (for the
    whole 30B model, minutes of a CPU and float32's twice the served bytes in host memory)."""
    with torch.device("meta"):
        model = cast_for_serving(MoETransformer(config, ep=ep, compute=compute), weights_dtype(config))
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty made each module its own parameter: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def hf_sources(shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], config: ModelConfig,
               experts: range | None = None) -> list[Source]:
    """How our state (name -> (published dtype, shape); fused experts [E_local, ...]) is laid out as Hugging Face
    tensors: one Source per tensor we hold, its pieces the per-expert tensors (global expert numbers from
    `experts`, default 0..). A fused gate_up_proj [E, 2I, h] is, byte for byte, expert 0's gate_proj [I, h] and
    up_proj [I, h], then expert 1's ..., so it needs no re-layout. A tied lm_head is not written."""
    width = config.moe_intermediate_size
    first = experts.start if experts is not None else 0
    sources = []
    for name, (dtype, shape) in shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        match = FUSED.match(name)
        if match is None:
            sources.append(Source(name, dtype, tuple(shape), ((name, tuple(shape)),)))
            continue
        prefix, kind = match.groups()
        pieces = []
        for j in range(shape[0]):
            g = first + j
            if kind == "gate_up_proj":
                pieces += [(f"{prefix}.{g}.gate_proj.weight", (width, shape[2])),
                           (f"{prefix}.{g}.up_proj.weight", (width, shape[2]))]
            else:
                pieces.append((f"{prefix}.{g}.down_proj.weight", tuple(shape[1:])))
        sources.append(Source(name, dtype, tuple(shape), tuple(pieces)))
    return sources


def shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def index_json(facts: dict[str, dict]) -> str:
    """model.safetensors.index.json from the written files' facts (transformers and vLLM find shards by it)."""
    shards = {name: f for name, f in facts.items() if name.endswith(".safetensors")}
    weight_map = {tensor: name for name, f in sorted(shards.items()) for tensor in f[CHECKSUM]}
    total = sum(f["data_bytes"] for f in shards.values())
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)


def fuse(pieces: list[torch.Tensor], per_expert: int) -> torch.Tensor:
    """Stack per-expert tensors ([n, ...] each, `per_expert` of them an expert, stacked along dim 0 of the
    expert's [per_expert * n, ...] block) into [E, per_expert * n, ...]: a view when they already lie back to
    back in one buffer (files we wrote), else a copy."""
    first = pieces[0]
    shape = (len(pieces) // per_expert, per_expert * first.shape[0], *first.shape[1:])
    step = first.numel() * first.element_size()
    base = first.data_ptr()
    if all(p.is_contiguous() and p.shape == first.shape and p.dtype == first.dtype
           and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and p.data_ptr() == base + i * step for i, p in enumerate(pieces)):
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
    return torch.cat(pieces).view(shape)


def save_hf(model_or_state_dict: nn.Module | dict[str, torch.Tensor], config: ModelConfig, directory: str | Path,
            *, max_shard_bytes: int = 5 * 2**30) -> dict[str, dict]:
    """Write config.json and safetensors shards (with an index when there is more than one) into `directory`;
    returns each file's manifest facts (size, checksums), computed while writing. A module is saved through its
    state_dict(): pass `parallelize.gather_state(model)` (a collective) from EP ranks. Files are written under temporary
    names and renamed, so a crash leaves no half-written checkpoint."""
    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    state = {name: t.detach() for name, t in state.items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sources = hf_sources({name: (t.dtype, tuple(t.shape)) for name, t in state.items()}, config)
    layouts = plan_files(sources, shard_name, max_file_bytes=max_shard_bytes)
    facts = {}
    for layout in layouts:
        image = torch.empty(layout.size, dtype=torch.uint8)
        fill(image, layout, state)
        facts[layout.name] = write_file(directory / f".{layout.name}.tmp", memoryview(image.numpy()), layout)
    files = {"config.json": json.dumps(hf_config(config), indent=2)}
    if len(layouts) > 1:
        files[INDEX_FILE] = index_json(facts)
    for name, text in files.items():
        (directory / f".{name}.tmp").write_text(text)
    for name in [layout.name for layout in layouts] + list(files):
        os.replace(directory / f".{name}.tmp", directory / name)
    return facts


def load_hf(directory: str | Path, *, experts: range | None = None, device: str | torch.device = "cpu",
            drop_cache: bool = False, into: Into | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face Qwen3-MoE checkpoint -> (ModelConfig, state dict with fused experts), straight onto
    `device` (files in parallel, through pinned buffers; no host copy of the whole model). With `experts` (an EP
    rank's contiguous slice) only those experts' bytes are read. When the directory holds the store's manifest,
    every byte read is checked against it (IntegrityError otherwise). Dtypes are kept as stored. `into` reads
    each file into a host buffer the caller supplies instead (safetensors_io.read_file)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json; expected a Hugging Face checkpoint directory")
    config = model_config(json.loads(config_path.read_text()), source=str(config_path))
    index = directory / INDEX_FILE
    shard_names = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                   else ["model.safetensors"])
    for name in shard_names:
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory}: missing weights file {name}")
    manifest = directory / MANIFEST
    facts = json.loads(manifest.read_text())["files"] if manifest.is_file() else None
    if facts is not None:
        missing = [name for name in shard_names if name not in facts]
        if missing:
            raise IntegrityError(f"{directory}: {missing[0]} is not in the manifest")
    wanted_experts = range(config.num_experts) if experts is None else experts

    def wanted(key: str) -> bool:
        match = PER_EXPERT.match(key)
        return match is None or int(match.group(2)) in wanted_experts

    tensors = read_files([directory / name for name in shard_names], wanted, torch.device(device), facts,
                         drop_cache, into)
    if experts is not None:  # transformers 5's fused layout: read whole, then cut to this rank's slice
        tensors = {k: t[experts.start:experts.stop] if FUSED.match(k) else t for k, t in tensors.items()}
    return config, from_hf_tensors(tensors, config, experts)


def load_model(directory: str | Path, *, ep=None, compute: str = "torch", device: str | torch.device = "cpu"):
    """A MoETransformer from a Hugging Face checkpoint, in bf16 on CUDA (unless config.dtype is float32) and
    float32 on the CPU; under EP (`ep`, an ExpertParallel) each rank keeps its own slice of the experts."""
    from .transformer import MoETransformer

    config, state = load_hf(directory)
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" and config.dtype == "bfloat16" else torch.float32
    model = MoETransformer(config, ep=ep, compute=compute)
    model.load_full_state_dict(state)
    return model.to(device, dtype)
