"""Allocation traces of public model code (Hugging Face transformers, timm, torchvision, diffusers),
as a GPU would allocate them, recorded without a GPU, for replaying allocator policies on them.

    python benchmarks/public_models.py [--scale small|medium] [--models a,b,...]
                                       [--out-dir build/traces/public] [--seed N] [--list] [--force]

None of the model code is cudapool's: each workload builds a library's own model class from an
explicit config with random initialisation (no weights are downloaded: ``HF_HUB_OFFLINE=1``,
``pretrained=False``) and runs it the way a training or generation script would. Each runs under
``cudapool.fakegpu.tracer.Tracer(device="cuda", fake=True)`` (fake CUDA tensors: CUDA's kernel choices
and autocast rules, no GPU used) as ``benchmarks/workloads/_common.py``'s ``capture_training``
does: the model and optimizer are built inside the block, so their allocations are in the trace,
and dropped at its end. Training steps: forward (bf16 autocast or fp32, as the trace's meta says
under ``dtype``), loss, backward, AdamW (``foreach=True``) step, gradients set to None.

How the models are built: transformers, torchvision and diffusers models are constructed
directly on fake CUDA (under ``torch.device("cuda")`` inside the block). timm models are
constructed on meta before the block (their constructors call ``.item()`` on a CPU tensor for the
drop-path rates, which fake tensors cannot answer) and moved with ``to_empty(device="cuda")``
inside it: the parameters are allocated in the trace, their initialisation is not run (no value
matters on fake tensors). Building on the CPU and moving with ``.to("cuda")`` does not work
under fake mode. Without a GPU, scaled_dot_product_attention takes its math path (it keeps the
attention map for backward; a GPU's flash kernel would keep less). cuBLAS/cuDNN workspaces are
not in the traces (see the tracer's notes). The libraries' classes are looked up before the
tracer starts: their lazy imports make module-level tensors (diffusers' do), which would be
recorded as allocations never freed.

Workloads (``--list`` prints them with their settings):

- ``gpt2-train``: transformers GPT2LMHeadModel, causal LM loss, fixed sequence length, fp32.
- ``gpt2-train-varlen``: the same with the sequence length drawn per step (multiples of 64).
- ``llama-train``: transformers LlamaForCausalLM (grouped-query attention), bf16 autocast.
- ``llama-generate``: LlamaForCausalLM with bf16 weights under ``torch.inference_mode``: rounds of
  greedy decoding with a DynamicCache (prefill, then one token per step, the ids concatenated as
  ``generate`` does), each round a batch of prompts of one drawn length and a drawn number of
  new tokens (``model.generate`` itself cannot run on fake tensors: its stopping checks read
  values).
- ``bert-mlm``: transformers BertForMaskedLM, 15% of tokens predicted, length per step, bf16 autocast.
- ``t5-train``: transformers T5ForConditionalGeneration, encoder and decoder lengths per step, fp32.
- ``vit-timm``: timm ViT at 224 px, bf16 autocast; ``vit-timm-multires``: ``dynamic_img_size=True``,
  the (square) resolution drawn per step, multiples of 16.
- ``convnext-timm``: timm ConvNeXt at 224 px, fp32; ``convnext-timm-multires``: resolution per step.
- ``resnet50-tv``: torchvision resnet50 at 224 px, fp32; ``resnet50-tv-multires``: resolution per step.
- ``unet-diffusers``: diffusers UNet2DConditionModel, one denoising training step per batch
  (latents noised at random timesteps of a linear beta schedule, noise-prediction MSE, random
  ``encoder_hidden_states``), bf16 autocast.

Scales: ``small`` (peaks of 0.25..4 GiB; up to ~40 s a trace to capture on two CPU cores) and
``medium`` (peaks of roughly 4..40 GiB: wider, deeper, bigger batches; up to ~3 min a trace).
Capture time grows with the number of operations (depth, steps), not with tensor sizes. Writes
``<out-dir>/<name>-<scale>.cptrace`` (skipping traces that exist, unless --force) and prints
each trace's events, allocations, frees, peak live bytes and capture time. Needs
``pip install -e '.[models]'`` (transformers, timm, diffusers, torchvision); a workload whose
package is missing is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

try:
    from .workloads import _common
except ImportError:  # run as a script
    from workloads import _common

from cudapool._units import format_bytes
from cudapool.lab.trace import Trace, save

INSTALL = "pip install -e '.[models]'"
DEFAULT_OUT = os.path.join(_common.ROOT, "build", "traces", "public")

_TRAIN = dict(optimizer="adamw", lr=1e-4, weight_decay=0.01, device="cuda")
_VISION = dict(optimizer="adamw", lr=1e-3, weight_decay=0.05, device="cuda", classes=1000)

# fmt: off
GPT2 = {
    "small": dict(n_layer=4, n_embd=512, n_head=8, vocab=50257, batch=4, seq=512, steps=8, dtype="fp32", **_TRAIN),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab=50257, batch=4, seq=1024, steps=6, dtype="fp32",
                   **_TRAIN),
}
GPT2_VARLEN = {
    "small": dict(n_layer=4, n_embd=512, n_head=8, vocab=50257, batch=4, min_seq=128, max_seq=768, multiple=64,
                  steps=12, dtype="fp32", **_TRAIN),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab=50257, batch=4, min_seq=128, max_seq=1024, multiple=64,
                   steps=12, dtype="fp32", **_TRAIN),
}
LLAMA = {
    "small": dict(hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=2, vocab=32000, batch=8, seq=512,
                  steps=8, dtype="bf16-autocast", **_TRAIN),
    "medium": dict(hidden=2048, intermediate=5632, layers=12, heads=16, kv_heads=4, vocab=32000, batch=8, seq=1024,
                   steps=6, dtype="bf16-autocast", **_TRAIN),
}
LLAMA_GEN = {
    "small": dict(hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=16, vocab=32000, batch=32,
                  prompt_lens=(128, 256, 512), min_new=64, max_new=128, rounds=3, dtype="bf16", device="cuda"),
    "medium": dict(hidden=2048, intermediate=5632, layers=16, heads=16, kv_heads=16, vocab=32000, batch=32,
                   prompt_lens=(256, 512, 1024), min_new=64, max_new=128, rounds=3, dtype="bf16", device="cuda"),
}
BERT = {
    "small": dict(hidden=512, layers=4, heads=8, intermediate=2048, vocab=30522, batch=8, min_seq=64, max_seq=512,
                  multiple=32, mask_prob=0.15, steps=12, dtype="bf16-autocast", **_TRAIN),
    "medium": dict(hidden=1024, layers=24, heads=16, intermediate=4096, vocab=30522, batch=16, min_seq=128,
                   max_seq=512, multiple=32, mask_prob=0.15, steps=12, dtype="bf16-autocast", **_TRAIN),
}
T5 = {
    "small": dict(d_model=512, d_ff=2048, layers=4, heads=8, d_kv=64, vocab=32128, batch=12, min_src=64,
                  max_src=512, min_tgt=16, max_tgt=128, multiple=16, steps=12, dtype="fp32", **_TRAIN),
    "medium": dict(d_model=1024, d_ff=4096, layers=12, heads=16, d_kv=64, vocab=32128, batch=20, min_src=128,
                   max_src=512, min_tgt=32, max_tgt=256, multiple=16, steps=12, dtype="fp32", **_TRAIN),
}
VIT = {
    "small": dict(arch="vit_small_patch16_224", batch=48, image=224, steps=8, dtype="bf16-autocast", **_VISION),
    "medium": dict(arch="vit_base_patch16_224", batch=256, image=224, steps=6, dtype="bf16-autocast", **_VISION),
}
VIT_MULTIRES = {
    "small": dict(arch="vit_small_patch16_224", batch=32, min_image=160, max_image=320, multiple=16, steps=12,
                  dtype="bf16-autocast", **_VISION),
    "medium": dict(arch="vit_base_patch16_224", batch=128, min_image=160, max_image=320, multiple=16, steps=12,
                   dtype="bf16-autocast", **_VISION),
}
CONVNEXT = {
    "small": dict(arch="convnext_tiny", batch=24, image=224, steps=8, dtype="fp32", **_VISION),
    "medium": dict(arch="convnext_base", batch=128, image=224, steps=6, dtype="fp32", **_VISION),
}
CONVNEXT_MULTIRES = {
    "small": dict(arch="convnext_tiny", batch=16, min_image=160, max_image=320, multiple=32, steps=12, dtype="fp32",
                  **_VISION),
    "medium": dict(arch="convnext_base", batch=64, min_image=160, max_image=320, multiple=32, steps=12,
                   dtype="fp32", **_VISION),
}
RESNET = {
    "small": dict(batch=32, image=224, steps=8, dtype="fp32", **_VISION),
    "medium": dict(batch=256, image=224, steps=6, dtype="fp32", **_VISION),
}
RESNET_MULTIRES = {
    "small": dict(batch=16, min_image=128, max_image=320, multiple=32, steps=12, dtype="fp32", **_VISION),
    "medium": dict(batch=128, min_image=128, max_image=320, multiple=32, steps=12, dtype="fp32", **_VISION),
}
UNET = {
    "small": dict(block_out_channels=(64, 128, 256, 256), layers_per_block=1, attention_head_dim=8,
                  cross_attention_dim=256, latent=32, latent_channels=4, text_len=77, batch=8, timesteps=1000,
                  steps=8, dtype="bf16-autocast", **_TRAIN),
    "medium": dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, attention_head_dim=8,
                   cross_attention_dim=768, latent=64, latent_channels=4, text_len=77, batch=4, timesteps=1000,
                   steps=6, dtype="bf16-autocast", **_TRAIN),
}
# fmt: on


# ---- shared pieces ---------------------------------------------------------------------------


def source(*packages: str) -> str:
    """``"transformers 5.25.0, torch 2.14.1"``: the versions of the code traced."""
    import importlib.metadata as md

    return ", ".join(f"{p} {md.version(p)}" for p in (*packages, "torch"))


def amp(dtype: str) -> Any:
    """bf16 autocast for CUDA when ``dtype`` is "bf16-autocast", else nothing."""
    import torch

    if dtype == "bf16-autocast":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def draw(rng: random.Random, cfg: Dict[str, Any], lo: str, hi: str, multiple: str = "multiple") -> int:
    """A multiple of ``cfg[multiple]`` in ``cfg[lo]..cfg[hi]``."""
    _common.check_range(cfg, lo, hi)
    return _common.draw_multiple(rng, cfg[lo], cfg[hi], cfg[multiple])


def train(
    name: str,
    scale: str,
    seed: int,
    cfg: Dict[str, Any],
    make: Callable[[], Any],
    items: List[Any],
    loss_of: Callable[[Any, Any], Any],
    packages: Tuple[str, ...],
    build: str = "fake-cuda",
    **meta: Any,
) -> Trace:
    """Trace AdamW training of ``make()``'s model with ``_common.capture_training``: one step per
    item, ``loss_of(model, item)`` under the autocast of ``cfg["dtype"]``.

    ``build``: "fake-cuda" (``make`` constructs the model under ``torch.device("cuda")`` inside the
    tracer) or "meta+to_empty" (``make`` is called before the tracer and returns a meta model,
    moved with ``to_empty(device="cuda")`` inside it).
    """
    import torch

    held: List[Any] = []
    if build == "meta+to_empty":
        with torch.device("meta"):
            held.append(make())
    elif build != "fake-cuda":
        raise ValueError(f"unknown build {build!r}")

    def build_model(device: str) -> Tuple[Any, Any]:
        if held:
            model = held.pop().to_empty(device=device)  # popped: no reference outlives the block
        else:
            with torch.device(device):
                model = make()
        model.train()
        return model, _common.make_optimizer(cfg["optimizer"], model.parameters(), cfg["lr"], cfg["weight_decay"])

    def step(model: Any, item: Any) -> Any:
        with amp(cfg["dtype"]):
            loss = loss_of(model, item)
        return loss

    return _common.capture_training(
        name, scale, seed, cfg, build_model, items, step, source=source(*packages), dtype=cfg["dtype"], built=build,
        **meta,
    )  # fmt: skip


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


# ---- transformers ----------------------------------------------------------------------------


def _gpt2(name: str, scale: str, seed: int, cfg: Dict[str, Any], lengths: List[int]) -> Trace:
    import torch
    import transformers

    _quiet_transformers()
    config = transformers.GPT2Config(
        n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"], vocab_size=cfg["vocab"],
        n_positions=max(lengths),
    )  # fmt: skip

    def loss_of(model: Any, seq: int) -> Any:
        ids = torch.randint(0, cfg["vocab"], (cfg["batch"], seq), device="cuda")
        return model(input_ids=ids, labels=ids).loss

    return train(
        name, scale, seed, cfg, partial(transformers.GPT2LMHeadModel, config), lengths, loss_of, ("transformers",),
        shapes=lengths, attn_implementation=config._attn_implementation,
    )  # fmt: skip


def gpt2_train(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    return _gpt2("gpt2-train", scale, seed, cfg, [cfg["seq"]] * cfg["steps"])


def gpt2_train_varlen(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    rng = random.Random(seed)
    lengths = [draw(rng, cfg, "min_seq", "max_seq") for _ in range(cfg["steps"])]
    return _gpt2("gpt2-train-varlen", scale, seed, cfg, lengths)


def _llama_config(cfg: Dict[str, Any], max_len: int) -> Any:
    import transformers

    _quiet_transformers()
    return transformers.LlamaConfig(
        hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
        max_position_embeddings=max_len, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def llama_train(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    import torch
    import transformers

    config = _llama_config(cfg, cfg["seq"])

    def loss_of(model: Any, seq: int) -> Any:
        ids = torch.randint(0, cfg["vocab"], (cfg["batch"], seq), device="cuda")
        return model(input_ids=ids, labels=ids).loss

    lengths = [cfg["seq"]] * cfg["steps"]
    return train(
        "llama-train", scale, seed, cfg, partial(transformers.LlamaForCausalLM, config), lengths, loss_of,
        ("transformers",), shapes=lengths, attn_implementation=config._attn_implementation,
    )  # fmt: skip


def llama_generate(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    """Greedy decoding with a KV cache, written out as ``generate``'s loop is (see the module notes)."""
    import torch
    import transformers
    from cudapool.fakegpu.tracer import Tracer

    rng = random.Random(seed)
    _common.check_range(cfg, "min_new", "max_new")
    rounds = [
        (rng.choice(cfg["prompt_lens"]), rng.randint(cfg["min_new"], cfg["max_new"])) for _ in range(cfg["rounds"])
    ]
    config = _llama_config(cfg, max(p + n for p, n in rounds))
    llama, dynamic_cache = transformers.LlamaForCausalLM, transformers.DynamicCache  # imported before the block
    torch.manual_seed(seed)
    with Tracer(device="cuda", fake=True) as tr, torch.inference_mode():
        with torch.device("cuda"):
            model = llama._from_config(config, dtype=torch.bfloat16)
        model.eval()
        # The cache's argument: "cache" in recent transformers, "past_key_values" before.
        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        for prompt, new in rounds:
            ids = torch.randint(3, cfg["vocab"], (cfg["batch"], prompt), device="cuda")
            cache = dynamic_cache(config=config)
            step_ids = ids
            for _ in range(new):
                out = model(input_ids=step_ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
                step_ids = out.logits[:, -1, :].float().argmax(dim=-1, keepdim=True)
                del out
                ids = torch.cat([ids, step_ids], dim=-1)
            del cache, ids, step_ids
        del model
    meta = {
        "workload": "llama-generate", "scale": scale, "seed": seed, "config": cfg, "source": source("transformers"),
        "dtype": cfg["dtype"], "built": "fake-cuda", "rounds": rounds, "attn_implementation": config._attn_implementation,
    }  # fmt: skip
    return tr.trace(meta=meta)


def bert_mlm(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    import torch
    import transformers

    _quiet_transformers()
    config = transformers.BertConfig(
        hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        intermediate_size=cfg["intermediate"], vocab_size=cfg["vocab"], max_position_embeddings=cfg["max_seq"],
    )  # fmt: skip
    rng = random.Random(seed)
    lengths = [draw(rng, cfg, "min_seq", "max_seq") for _ in range(cfg["steps"])]

    def loss_of(model: Any, seq: int) -> Any:
        ids = torch.randint(0, cfg["vocab"], (cfg["batch"], seq), device="cuda")
        predict = torch.rand(cfg["batch"], seq, device="cuda") < cfg["mask_prob"]
        labels = torch.where(predict, ids, -100)
        inputs = torch.where(predict, 103, ids)  # [MASK]
        del ids, predict
        return model(input_ids=inputs, labels=labels).loss

    return train(
        "bert-mlm", scale, seed, cfg, partial(transformers.BertForMaskedLM, config), lengths, loss_of,
        ("transformers",), shapes=lengths, attn_implementation=config._attn_implementation,
    )  # fmt: skip


def t5_train(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    import torch
    import transformers

    _quiet_transformers()
    config = transformers.T5Config(
        d_model=cfg["d_model"], d_ff=cfg["d_ff"], num_layers=cfg["layers"], num_heads=cfg["heads"], d_kv=cfg["d_kv"],
        vocab_size=cfg["vocab"], pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    rng = random.Random(seed)
    shapes = [(draw(rng, cfg, "min_src", "max_src"), draw(rng, cfg, "min_tgt", "max_tgt")) for _ in range(cfg["steps"])]

    def loss_of(model: Any, shape: Tuple[int, int]) -> Any:
        src = torch.randint(2, cfg["vocab"], (cfg["batch"], shape[0]), device="cuda")
        tgt = torch.randint(2, cfg["vocab"], (cfg["batch"], shape[1]), device="cuda")
        return model(input_ids=src, labels=tgt).loss

    return train(
        "t5-train", scale, seed, cfg, partial(transformers.T5ForConditionalGeneration, config), shapes, loss_of,
        ("transformers",), shapes=shapes, attn_implementation=config._attn_implementation,
    )  # fmt: skip


# ---- vision ----------------------------------------------------------------------------------


def _classify(cfg: Dict[str, Any]) -> Callable[[Any, int], Any]:
    """loss_of for image classification on square images of the step's resolution."""
    import torch
    import torch.nn.functional as F

    def loss_of(model: Any, image: int) -> Any:
        images = torch.randn(cfg["batch"], 3, image, image, device="cuda")
        labels = torch.randint(0, cfg["classes"], (cfg["batch"],), device="cuda")
        return F.cross_entropy(model(images), labels)

    return loss_of


def _resolutions(seed: int, cfg: Dict[str, Any]) -> List[int]:
    if "image" in cfg:
        return [cfg["image"]] * cfg["steps"]
    rng = random.Random(seed)
    return [draw(rng, cfg, "min_image", "max_image") for _ in range(cfg["steps"])]


def _timm(name: str, scale: str, seed: int, cfg: Dict[str, Any], **model_kw: Any) -> Trace:
    import timm

    sizes = _resolutions(seed, cfg)

    def make() -> Any:
        return timm.create_model(cfg["arch"], pretrained=False, num_classes=cfg["classes"], **model_kw)

    return train(
        name, scale, seed, cfg, make, sizes, _classify(cfg), ("timm",), build="meta+to_empty", shapes=sizes,
        model_kwargs=model_kw,
    )  # fmt: skip


def vit_timm(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    return _timm("vit-timm", scale, seed, cfg)


def vit_timm_multires(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    return _timm("vit-timm-multires", scale, seed, cfg, dynamic_img_size=True)


def convnext_timm(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    return _timm("convnext-timm", scale, seed, cfg)


def convnext_timm_multires(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    return _timm("convnext-timm-multires", scale, seed, cfg)


def _resnet50(name: str, scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    import torchvision

    sizes = _resolutions(seed, cfg)
    return train(
        name, scale, seed, cfg, partial(torchvision.models.resnet50, num_classes=cfg["classes"]), sizes,
        _classify(cfg), ("torchvision",), shapes=sizes,
    )  # fmt: skip


def resnet50_tv(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    return _resnet50("resnet50-tv", scale, seed, cfg)


def resnet50_tv_multires(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    return _resnet50("resnet50-tv-multires", scale, seed, cfg)


def unet_diffusers(scale: str, seed: int, cfg: Dict[str, Any]) -> Trace:
    """Noise-prediction training of a UNet2DConditionModel (DDPM's add_noise, written out)."""
    import diffusers
    import torch
    import torch.nn.functional as F

    depth = len(cfg["block_out_channels"])
    down = ("CrossAttnDownBlock2D",) * (depth - 1) + ("DownBlock2D",)
    up = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (depth - 1)

    unet = diffusers.UNet2DConditionModel  # imported before the block (see the module notes)

    def make() -> Any:
        return unet(
            sample_size=cfg["latent"], in_channels=cfg["latent_channels"], out_channels=cfg["latent_channels"],
            down_block_types=down, up_block_types=up, block_out_channels=tuple(cfg["block_out_channels"]),
            layers_per_block=cfg["layers_per_block"], cross_attention_dim=cfg["cross_attention_dim"],
            attention_head_dim=cfg["attention_head_dim"],
        )  # fmt: skip

    def loss_of(model: Any, _step: int) -> Any:
        b, c, s = cfg["batch"], cfg["latent_channels"], cfg["latent"]
        # DDPMScheduler's linear betas; its add_noise moves alphas_cumprod to the device per call.
        alphas = torch.cumprod(1.0 - torch.linspace(1e-4, 0.02, cfg["timesteps"], device="cuda"), dim=0)
        latents = torch.randn(b, c, s, s, device="cuda")
        noise = torch.randn_like(latents)
        t = torch.randint(0, cfg["timesteps"], (b,), device="cuda")
        a = alphas[t].view(b, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        del alphas, a, latents
        text = torch.randn(b, cfg["text_len"], cfg["cross_attention_dim"], device="cuda")
        pred = model(noisy, t, encoder_hidden_states=text).sample
        return F.mse_loss(pred.float(), noise.float())

    return train(
        "unet-diffusers", scale, seed, cfg, make, list(range(cfg["steps"])), loss_of, ("diffusers",),
        down_block_types=down, up_block_types=up,
    )  # fmt: skip


# ---- the list and the command line -----------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    package: str  # the import the workload needs
    capture: Callable[[str, int, Dict[str, Any]], Trace]
    scales: Dict[str, Dict[str, Any]]


WORKLOADS: List[Workload] = [
    Workload("gpt2-train", "transformers", gpt2_train, GPT2),
    Workload("gpt2-train-varlen", "transformers", gpt2_train_varlen, GPT2_VARLEN),
    Workload("llama-train", "transformers", llama_train, LLAMA),
    Workload("llama-generate", "transformers", llama_generate, LLAMA_GEN),
    Workload("bert-mlm", "transformers", bert_mlm, BERT),
    Workload("t5-train", "transformers", t5_train, T5),
    Workload("vit-timm", "timm", vit_timm, VIT),
    Workload("vit-timm-multires", "timm", vit_timm_multires, VIT_MULTIRES),
    Workload("convnext-timm", "timm", convnext_timm, CONVNEXT),
    Workload("convnext-timm-multires", "timm", convnext_timm_multires, CONVNEXT_MULTIRES),
    Workload("resnet50-tv", "torchvision", resnet50_tv, RESNET),
    Workload("resnet50-tv-multires", "torchvision", resnet50_tv_multires, RESNET_MULTIRES),
    Workload("unet-diffusers", "diffusers", unet_diffusers, UNET),
]
BY_NAME = {w.name: w for w in WORKLOADS}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="public_models.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--scale", default="small", choices=["small", "medium"], help="preset (default: small)")
    p.add_argument("--models", help=f"comma-separated (default: all): {', '.join(BY_NAME)}")
    p.add_argument("--out-dir", default=DEFAULT_OUT, help="where the traces go (default: build/traces/public)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the workloads and their settings, and exit")
    p.add_argument("--force", action="store_true", help="capture traces that exist again")
    args = p.parse_args(argv)

    if args.list:
        for w in WORKLOADS:
            print(f"{w.name} ({w.package}): {w.scales[args.scale]}")
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()] if args.models else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown model(s): {', '.join(unknown)} (known: {', '.join(BY_NAME)})")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random init from configs: never download
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.makedirs(args.out_dir, exist_ok=True)
    failed: List[str] = []
    t_all = time.perf_counter()
    for i, name in enumerate(names, 1):
        w = BY_NAME[name]
        path = os.path.join(args.out_dir, f"{name}-{args.scale}.cptrace")
        if os.path.exists(path) and not args.force:
            print(f"{name}: {path} exists, skipped (--force captures it again)")
            continue
        if importlib.util.find_spec(w.package) is None:
            print(f"{name}: skipped, needs {w.package}: {INSTALL}")
            continue
        print(f"[{i}/{len(names)}] capturing {name} ({args.scale}) ...", flush=True)
        t0 = time.perf_counter()
        try:
            trace = w.capture(args.scale, args.seed, dict(w.scales[args.scale]))
        except Exception as e:  # report and go on with the others
            traceback.print_exc()
            print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
            failed.append(name)
            continue
        secs = time.perf_counter() - t0
        allocs, frees = _common.counts(trace)
        peak = _common.peak_live_bytes(trace)
        save(trace, path)
        print(
            f"{name}: scale={args.scale} seed={args.seed} events={len(trace)} allocs={allocs} frees={frees} "
            f"peak live bytes={peak} ({format_bytes(peak, largest='GiB')}) capture_s={secs:.1f} -> {path}",
            flush=True,
        )
    print(f"total {time.perf_counter() - t_all:.1f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
