"""An 8B-shaped model classified on a 24 GB CPU machine, its layers offloaded to disk.

LLaMA-3.1-8B's shape (32 layers x 32 query heads, 8 KV heads, d_model 4,096, FFN 14,336,
a 128,256-token vocabulary, untied output matrix: 8.03B parameters) with random weights
(normal, std 0.02), in bfloat16: 16 GB of safetensors, written one tensor at a time (the
whole model is never in memory), SmolLM2's tokenizer (its ids fit the vocabulary). Loaded
with ``max_memory`` (``--cpu-gib``, 8 by default: half the weights) so that accelerate puts
the other layers on disk (``offload_folder``), then ``classify`` with one type on short
prose. Reports where the layers went, the load and classify times and the peak resident
memory (file pages of mapped weights included: they are reclaimable).

The weights are random: the catalog means nothing; this measures whether and how fast the
shape runs, not what its heads do. It needs about 25 GB of free disk beside ``--folder``
(16 GB of weights, 8 GB offloaded), checked before anything is written; both are deleted
afterwards unless ``--keep``.

Usage: python benchmarks/bench_8b_offload.py [--folder /tmp/llama8b-random] [--cpu-gib 8]
    [--type previous_token] [--n-sentences 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from common import add_arguments, peak_rss_mb, record, reset_peak, rss_mb, start

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
SHARD_BYTES = 2 * 2**30
NEEDED_GIB = 25  # the weights (15 GiB) and accelerate's offloaded copy (8 GiB)


def write_random(folder: Path) -> int:
    """The 8B-shaped model's config, tokenizer and random bf16 weights in shards of about
    2 GB; returns the parameter count. Skipped if the folder is already complete."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from headmech.models import bundled

    config = LlamaConfig(**LLAMA_8B, torch_dtype="bfloat16")  # type: ignore[arg-type]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    n = sum(int(torch.Size(s).numel()) for s in shapes.values())
    if (folder / "model.safetensors.index.json").is_file():
        return n
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    index: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size, k = 0, 0

    def flush() -> None:
        nonlocal shard, size, k
        if shard:
            name = f"model-{k:05d}.safetensors"
            save_file(shard, folder / name, metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            shard, size, k = {}, 0, k + 1

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    flush()
    total = sum(int(torch.Size(s).numel()) * 2 for s in shapes.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": index}
    config.save_pretrained(folder)
    bundled.smollm2_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap, model=None)
    ap.add_argument("--folder", default="/tmp/llama8b-random")
    ap.add_argument("--cpu-gib", type=float, default=8.0)
    ap.add_argument("--type", default="previous_token")
    ap.add_argument("--n-sentences", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the 16 GB of weights afterwards")
    args = ap.parse_args()
    start(args)
    import headmech

    folder = Path(args.folder)
    free = shutil.disk_usage(folder.parent).free / 2**30
    if free < NEEDED_GIB and not (folder / "model.safetensors.index.json").is_file():
        sys.exit(f"bench_8b_offload: {free:.0f} GiB free under {folder.parent}, needs {NEEDED_GIB}")
    t0 = time.perf_counter()
    n_params = write_random(folder)
    write_s = time.perf_counter() - t0
    print(f"{n_params / 1e9:.2f}B parameters written in {write_s:.0f} s", file=sys.stderr)
    offload = folder.with_name(folder.name + "-offload")
    reset_peak(None)
    t0 = time.perf_counter()
    model = headmech.load_model(
        str(folder), dtype="bfloat16", max_memory={"cpu": f"{args.cpu_gib}GiB"},
        offload_folder=str(offload),
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    placed = model.original_model.hf_device_map
    on_disk = sorted({k for k, v in placed.items() if v == "disk"})
    layers_on_disk = sum(1 for k in on_disk if k.startswith("model.layers."))
    loaded_mb = rss_mb()
    print(
        f"loaded in {load_s:.0f} s, {layers_on_disk} of 32 layers on disk, RSS {loaded_mb:.0f} MB",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    cat = headmech.classify(model, [args.type], n_sentences=args.n_sentences, n_boot=20)
    classify_s = time.perf_counter() - t0
    peak = peak_rss_mb()
    tokens = cat.provenance.get("probes", {}).get("prose", {}).get("n_tokens")
    heads = len(cat.types[args.type].heads)
    print(
        f"classify {args.type} on {args.n_sentences} sentences ({tokens} tokens): {classify_s:.0f} s, "
        f"peak RSS {peak:.0f} MB ({heads} heads labelled, random weights)",
        file=sys.stderr,
    )
    record(
        "bench_8b_offload",
        None,
        [
            {
                "figure": "scale/8b-offload",
                "what": f"classify {args.type} on an 8B-shaped LLaMA (random bf16 weights), "
                f"{layers_on_disk} of 32 layers offloaded to disk (max_memory cpu {args.cpu_gib} GiB)",
                "result": f"{classify_s:.0f} s, peak RSS {peak / 1024:.1f} GB",
                "target": "runs on 24 GB",
                "met": True,
                "values": {
                    "params": n_params,
                    "write_s": write_s,
                    "load_s": load_s,
                    "classify_s": classify_s,
                    "peak_rss_mb": peak,
                    "loaded_rss_mb": loaded_mb,
                    "layers_on_disk": layers_on_disk,
                    "tokens": tokens,
                    "n_sentences": args.n_sentences,
                    "threads": torch.get_num_threads(),
                },  # fmt: skip
            }
        ],
    )
    if not args.keep:
        shutil.rmtree(offload, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
