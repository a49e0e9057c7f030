"""`moepack` console script. Parses arguments and calls format_spec / packer / runtime; nothing else lives here.

Every command takes --json (one JSON object on stdout). Failures a user can cause print one line
`moepack: error: ...` on stderr (and {"ok": false, "error": ...} with --json) and exit with status 1.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from dataclasses import replace

import click

from moepack import __version__, families
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.layout import DEFAULT_STRIPE_EXPERTS, MAX_PARTS
from moepack.runtime.limits import MAX_BUNDLE_EXPERTS, MAX_CHUNK_TOKENS, MAX_QUEUE_DEPTH

from .chat import chat
from .common import (CHECKPOINT_FILE, EXIT_ERROR, EXIT_INTERRUPTED, PATH_TEXT, PREFILL_MEMORY_HINT, Dtype,
                     FiniteFloat, check_container_path, check_prefill_context, check_threads, container_argument,
                     continued_tokens, emit, force_option, json_option, layer_progress, model_run_options,
                     one_line_warnings, prompt_options, quiet_native_logs, refuse_existing, refuse_existing_kv,
                     reports_errors, sigterm_as_interrupt, untrusted_argv_types)
from .generate import generate
from .perplexity import perplexity
from .plan_bench import bench, plan
from .serve import serve



@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moepack")
def cli():
    """Stream a huge Mixture-of-Experts checkpoint from NVMe: convert it to a read-order container, verify it,
    and prefill long prompts layer by layer with the routed experts left on disk."""


def _each_family(describe) -> str:
    """The registry's families, each named with what describe(entry) says of it (help texts name no family)."""
    return "; ".join(f"{e.name}: {describe(e)}" for e in families.family_entries())


@cli.command(help="Write a random checkpoint (Hugging Face layout) of a model family (--family) to OUT_DIR.")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--preset", type=click.Choice(families.SYNTH_PRESETS), default="tiny", show_default=True,
              help=f"The model's size ({_each_family(lambda e: ', '.join(e.synth_presets))}).")
@click.option("--layout", type=click.Choice(["release", "bf16", "f32"]), default="release", show_default=True,
              help=f"release: as the family's releases store their weights "
                   f"({_each_family(lambda e: e.synth_release_layout)}).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--tokenizer", "tokenizer", type=click.Path(exists=True),
              help="Embed this tokenizer.json (or a directory holding tokenizer.json + tokenizer_config.json), e.g. "
                   "the release's, instead of the tiny byte-level one; vocab_size grows to fit it.")
@click.option("--family", type=click.Choice(families.FAMILY_NAMES), default=families.DEFAULT_FAMILY,
              show_default=True, help=f"The model family, by the transformers architecture it writes "
                                      f"({_each_family(lambda e: ', '.join(e.architectures))}).")
@force_option
@json_option
@reports_errors
def synth(out_dir, preset, layout, seed, tokenizer, family, force, as_json):
    from moepack.packer.synth import synth_checkpoint

    refuse_existing(force, out_dir, inputs=(tokenizer,), writes=CHECKPOINT_FILE)  # synth keeps what it does not write
    result = synth_checkpoint(out_dir, preset=preset, layout=layout, seed=seed, progress=not as_json,
                              overwrite=force, tokenizer=tokenizer, family=family)
    named = "" if family == families.DEFAULT_FAMILY else f"{family} "
    emit(as_json, result, lambda r: click.echo(
        f"wrote {r['dir']}: {named}{preset} {layout}, {r.get('params', 0) / 1e6:.1f}M params, "
        f"{r.get('bytes', 0) / 2**20:.1f} MiB in {len(r.get('files', []))} files"))


_POLICY_FLAGS = (
    ("fp4", "Routed experts MXFP4 (lossless from the release's FP4), other linears Q8_0."),
    ("nvfp4", "Routed experts NVFP4, other linears Q8_0."),
    ("q8", "All linears Q8_0."),
    ("q2", "Routed gate/up IQ2_XXS, down Q2_K (~2.25 bits/weight), other linears Q8_0."),
    ("bf16", "FP8/FP4 weights widened to BF16 (lossless); the reference path."),
    ("keep", "Every tensor in its source storage type (lossless)."),
)


def _policy_options(fn):
    """--fp4, --q8, ... and the same as --policy NAME (for scripts that pick one by name), given to the command as
    `policy`. Two different policies (--fp4 --q8, --fp4 --policy q8) are a usage error naming both."""
    names = [name for name, _ in _POLICY_FLAGS]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        chosen = [f"--{name}" for name in names if kwargs.pop(f"policy_{name}")]
        by_name = kwargs.pop("policy")
        if by_name is not None and f"--{by_name}" not in chosen:
            chosen.append(f"--policy {by_name}")
        if len(chosen) > 1:
            raise click.UsageError(f"{' and '.join(chosen)} conflict: choose one precision policy")
        policy = by_name or (chosen[0][2:] if chosen else None)
        return fn(*args, policy=policy, **kwargs)

    wrapper = click.option("--policy", "policy", type=click.Choice(names),
                           help="The precision policy by name (the same as its flag).")(wrapper)
    for name, help_text in reversed(_POLICY_FLAGS):
        wrapper = click.option(f"--{name}", f"policy_{name}", is_flag=True, help=help_text)(wrapper)
    return wrapper


@cli.command(help="Convert SRC (a hub repo id such as owner/name, a local checkpoint directory, or a llama.cpp GGUF "
                   "file, the first of its splits for a split one) of a model family into a container (families: "
                   f"{_each_family(lambda e: ', '.join(e.architectures) + ', GGUF ' + ', '.join(e.gguf_architectures))}"
                   "). Rerunning an interrupted conversion resumes it.")
@click.argument("src")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False),
              help="Container to write (default: ./<name>-<policy>.moepack, e.g. Model-fp4.moepack for a SRC of "
                   "owner/Model).")
@_policy_options
@click.option("--revision", help="Hub branch, tag or commit (resolved to a commit and recorded).")
@click.option("--workers", type=click.IntRange(min=1), callback=check_threads,
              help="CPU threads for (de)quantization (default: all).")
@click.option("--drop-mtp", is_flag=True, help="Leave out the multi-token-prediction block(s) (prefill never reads them).")
@click.option("--parts", type=click.IntRange(min=1, max=MAX_PARTS), default=1, show_default=True,
              help="Write the container as P files, OUT and OUT.part1 .. OUT.part<P-1>, each layer's experts striped "
                   "over them (one file per SSD: reads of the parts run side by side).")
@click.option("--stripe-experts", type=click.IntRange(min=1), default=DEFAULT_STRIPE_EXPERTS, show_default=True,
              help="With --parts: experts [k*S, (k+1)*S) of each layer go to part k mod P.")
@click.option("--part-dir", "part_dirs", type=PATH_TEXT, multiple=True, metavar="K=DIR",
              help="With --parts: write part K into DIR (e.g. another SSD's mount) and leave a symlink at "
                   "OUT.part<K>. Repeatable.")
@click.option("--no-keep-source", "no_keep_source", is_flag=True,
              help="Hub repos: download the shards into a scratch folder beside OUT (not the Hugging Face cache) and "
                   "delete each once converted: the disk holds the output plus a few shards, not the whole source.")
@force_option
@json_option
@reports_errors
def convert(src, out, policy, revision, workers, drop_mtp, parts, stripe_experts, part_dirs, no_keep_source, force,
            as_json):
    from moepack.packer.convert import convert_checkpoint

    if policy is None:
        raise click.UsageError("choose a precision policy: --fp4, --nvfp4, --q8, --q2, --bf16 or --keep")
    if out is None:
        name = re.sub(r"(-\d{5}-of-\d{5})?\.gguf$", "", os.path.basename(os.path.normpath(src)))
        out = f"{name}-{policy}.moepack"
    if part_dirs and parts < 2:
        raise click.UsageError("--part-dir needs --parts 2 or more")
    refuse_existing(force, out, *(f"{out}.part{k}" for k in range(1, parts)), inputs=(src,))
    result = convert_checkpoint(src, out, policy=policy, progress=not as_json, revision=revision, workers=workers,
                                drop_mtp=drop_mtp, parts=parts, stripe_experts=stripe_experts,
                                part_dirs=_parse_part_dirs(part_dirs), keep_source=not no_keep_source)
    emit(as_json, result, lambda r: click.echo(
        f"wrote {r['output']} ({policy}): {r['tensors']} tensors in {r['regions']} regions, "
        f"{r['bytes_out'] / 2**20:.1f} MiB, {r['seconds']:.1f} s ({r['in_mb_per_s']:.0f} MB/s in, "
        f"{r['out_mb_per_s']:.0f} MB/s out); experts {r['expert_bits_per_weight']} bits/weight"
        + (f", resumed after {r['resumed_regions']} regions" if r["resumed_regions"] else "")
        + f"; peak disk use {r['disk']['peak_bytes'] / 2**20:.1f} MiB"
        + ("".join(_part_lines(r["parts"])) if len(r["parts"]) > 1 else "")))


def _parse_part_dirs(values) -> dict[int, str]:
    dirs: dict[int, str] = {}
    for value in values:
        number, sep, directory = value.partition("=")
        if not sep or not number.strip().isdigit() or not directory:
            raise click.UsageError(f"--part-dir {value!r}: expected K=DIR, e.g. 1=/mnt/ssd2")
        dirs[int(number)] = directory
    return dirs


def _part_lines(parts: list[dict]) -> list[str]:
    return [f"\n  part {p['part']}: {p['path']}, {p['bytes'] / 2**20:.1f} MiB ({p['expert_bytes'] / 2**20:.1f} MiB "
            f"of experts)" for p in parts]


@cli.command(help="Write a container back out: a Hugging Face checkpoint (dequantized) that transformers loads, or "
                   "a GGUF file that llama.cpp's architecture of the container's family loads (--format gguf).")
@container_argument
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(),
              help="Directory to write (hf: must not exist, or be empty), or the .gguf file (gguf: must not exist).")
@click.option("--format", "fmt", type=click.Choice(["hf", "gguf"]), default="hf", show_default=True,
              help="hf: a Hugging Face checkpoint transformers loads; gguf: a GGUF file of the family's llama.cpp "
                   f"architecture ({_each_family(lambda e: ', '.join(e.gguf_architectures))}).")
@click.option("--dtype", type=Dtype(("bfloat16", "float32"), give="short"), default=None,
              help="hf only: the dtype of dequantized weights (default bfloat16).")
@click.option("--split-max-size", metavar="SIZE",
              help="gguf only: split the file as llama.cpp does (OUT-00001-of-0000N.gguf), at most SIZE of tensor "
                   "data each (bytes, or with K / M / G / T, e.g. 50G).")
@force_option
@json_option
@reports_errors
def export(file, out_dir, fmt, dtype, split_max_size, force, as_json):
    if fmt == "gguf" and dtype is not None:  # (llama.cpp's types follow the stored ones: nothing to choose)
        raise click.UsageError("--dtype applies to --format hf")
    dtype = dtype or "bf16"
    check_container_path(file)
    refuse_existing(force, out_dir, inputs=(file,))
    if fmt == "gguf":
        from moepack.packer.gguf_export import export_gguf, parse_size

        size = None if split_max_size is None else parse_size(split_max_size)
        result = export_gguf(file, out_dir, progress=not as_json, split_max_size=size, force=force)
        emit(as_json, result, lambda r: click.echo(
            f"wrote {r['output']}" + (f" (+{len(r['files']) - 1} more splits)" if len(r["files"]) > 1 else "")
            + f": {r['tensors']} tensors, {r['bytes'] / 2**20:.1f} MiB (GGUF, {r['architecture']})"))
        return
    if split_max_size is not None:
        raise click.UsageError("--split-max-size applies to --format gguf")
    from moepack.packer.export import export_container

    result = export_container(file, out_dir, dtype=dtype, progress=not as_json, force=force)
    emit(as_json, result, lambda r: click.echo(
        f"wrote {r['output']}: {r['tensors']} tensors in {r['shards']} shards, {r['bytes'] / 2**20:.1f} MiB ({dtype})"))


@cli.command()
@container_argument
@json_option
@reports_errors
def inspect(file, as_json):
    """Describe a container: version, model, layers, experts, sizes, storage types."""
    from moepack.format_spec.reader import Container
    from moepack.format_spec.summary import summarize

    check_container_path(file)
    with Container(file) as c:
        result = summarize(c)
        result.update(parts=c.parts_summary(), stripe_experts=c.stripe_experts, total_bytes=c.total_bytes)
    emit(as_json, result, _print_summary)


def _print_summary(s: dict) -> None:
    click.echo(f"{s['path']}: moepack {s['format_version']}, {s['architecture']} ({s['policy']} policy)")
    click.echo(f"  layers {s['layers']} (+{s['mtp_layers']} mtp), experts/layer {s['experts_per_layer']}, "
               f"hidden {s['hidden_size']}, vocab {s['vocab_size']}")
    total = s.get("total_bytes", s["file_bytes"])  # every part file's bytes (`inspect` adds it)
    click.echo(f"  {s['regions']} regions, {s['tensors']} tensors, {total / 2**20:.1f} MiB; "
               f"experts {s['expert_bits_per_weight']} bits/weight")
    for kind, n in s["bytes_by_region_kind"].items():
        click.echo(f"  {kind:>12}: {n / 2**20:10.1f} MiB")
    for dtype, v in s["storage_types"].items():
        click.echo(f"  {dtype:>12}: {v['tensors']:6d} tensors {v['bytes'] / 2**20:10.1f} MiB")
    if len(s.get("parts", [])) > 1:
        click.echo(f"  {len(s['parts'])} part files, experts striped {s['stripe_experts']} at a time:"
                   + "".join(_part_lines(s["parts"])))


@cli.command()
@container_argument
@click.option("--source", help="Also compare every tensor with this checkpoint (hub id, directory, or GGUF file).")
@click.option("--revision", help="Revision of --source on the hub.")
@json_option
@reports_errors
def verify(file, source, revision, as_json):
    """Check a container's structure and every checksum (reads the whole file), and that it holds every tensor its
    config's model uses, of the config's shape; with --source, also dequantize every tensor and compare it with the
    checkpoint it was converted from."""
    from moepack.format_spec.reader import Container
    from moepack.format_spec.verify import verify_container
    from moepack.packer.progress import progress_bar

    from moepack.families import check_container

    # the cheap checks first, a broken file fails before any bar shows: the structure, and what prefill checks
    # before it reads (the config's model and its tensors)
    check_container_path(file)
    with Container(file) as c:
        total = c.total_bytes
        family, _ = check_container(c, computable=False)
        refused = family.refusal(c.config)
    with progress_bar(total, "verify", not as_json) as bar:
        result = verify_container(file, on_bytes=bar.update).as_dict()
    result["prefill"] = f"refused: {refused}" if refused else "ok"
    if source is not None:
        from moepack.packer.fidelity import compare_with_source, raise_on_failures

        result["source_check"] = compare_with_source(file, source, revision=revision, progress=not as_json)
        if as_json and not result["source_check"]["ok"]:
            click.echo(json.dumps({**result, "ok": False}, indent=1, default=str))
            sys.exit(EXIT_ERROR)
        raise_on_failures(result["source_check"])
    emit(as_json, result, _print_verify)


def _print_verify(r: dict) -> None:
    parts = f" in {r['parts']} part files" if r.get("parts", 1) > 1 else ""
    click.echo(f"{r['path']}: OK ({r['regions']} regions{parts}, {r['tensors']} tensors, "
               f"{r['bytes_read'] / 2**20:.1f} MiB at {r['gb_per_s']:.2f} GB/s); every tensor its config's model "
               f"uses is there, of its shape")
    if r.get("prefill", "ok") != "ok":
        click.echo(f"  prefill: {r['prefill']}")
    s = r.get("source_check")
    if s:
        click.echo(f"  matches {s['source']}: {s['bit_identical']} tensors bit-identical, {s['value_identical']} "
                   f"value-identical, {s['lossy']} within their thresholds")
        for t, agg in s["by_type"].items():
            click.echo(f"  {t:>8}: {agg['tensors']} tensors, worst relative RMSE {agg['max_rel_rmse']:.4f}")
        for w in s["worst"][:5]:
            click.echo(f"    {w['tensor']}: {w['stored']} rel RMSE {w['rel_rmse']:.4f}, max abs {w['max_abs_error']:.3g}")


@cli.command()
@container_argument
@prompt_options
@click.option("--kv-out", type=click.Path(file_okay=False),
              help="Directory for the KV cache, written layer by layer (with --force, a KV there is replaced from "
                   "the first layer on).")
@click.option("--continue-from", type=click.Path(file_okay=False),
              help="A KV directory of an earlier prefill on this container: the prompt continues it.")
@click.option("--kv-no-fsync", is_flag=True, help="Do not fsync each KV layer file as it is written (once at the end).")
@click.option("--logits-out", type=click.Path(dir_okay=False),
              help="safetensors file for the last position's logits (key 'logits', float32 [vocab]).")
@click.option("--bundle-experts", type=click.IntRange(1, MAX_BUNDLE_EXPERTS), default=None,
              help="Experts per read (default: the best setting `moepack bench io` measured, else 4).")
@click.option("--queue-depth", type=click.IntRange(1, MAX_QUEUE_DEPTH), default=None,
              help="Reads in flight (default: as measured by `moepack bench io`, else 4).")
@click.option("--experts", "expert_selection", type=click.Choice(["auto", "all", "routed"]), default="auto",
              show_default=True, help="Read every expert of a layer, only the routed ones, or choose per layer.")
@click.option("--query-chunk", type=click.IntRange(1, MAX_CHUNK_TOKENS), default=None,
              help="At most this many queries per attention chunk inside a layer (bounds memory for long prompts). "
                   "Default: the model family's own: 1024 on a GPU; on a CPU two sliding windows (128 queries at "
                   "least) for a family with sliding-window layers, else 1024.")
@click.option("--expert-dtype", type=Dtype(("float32", "bfloat16")), default=None,
              help="The routed experts' matmuls (default: --compute-dtype).")
@click.option("--order", type=click.Choice(["layer", "chunk"]), default="layer", show_default=True,
              help="layer: every token through a layer before the next (each weight read once). chunk: the usual "
                   "chunked prefill (reads the model ceil(N / --chunk-tokens) times), for comparison.")
@click.option("--chunk-tokens", type=click.IntRange(1, MAX_CHUNK_TOKENS), default=2048, show_default=True,
              help="Tokens per chunk with --order chunk.")
@click.option("--expert-parallel", is_flag=True,
              help="Run as one rank of `torchrun --nproc-per-node P -m moepack prefill ...`: each rank reads and "
                   "computes its own contiguous share of every layer's experts.")
@click.option("--expert-ownership", type=click.Choice(["contiguous", "balanced"]), default="contiguous",
              show_default=True,
              help="With --expert-parallel: contiguous expert ranges of equal size, or of equal routed load measured "
                   "on this prompt per layer (the layer's reads then wait for its router).")
@click.option("--container-per-rank", is_flag=True,
              help="With --expert-parallel: FILE contains '{rank}', and each rank reads its own copy.")
@click.option("--dist-timeout", type=FiniteFloat(min=1), default=120.0, show_default=True,
              help="Seconds a rank waits for its peers before giving up with an error.")
@click.option("--no-verify-reads", is_flag=True, help="Skip the per-region checksum of every read.")
@click.option("-c", "--max-context", type=click.IntRange(min=1), default=None,
              help="Cap on the prompt's tokens, a KV continued included (default: the model's context, "
                   "max_position_embeddings): a longer prompt is refused.")
@model_run_options(unused={"cache_gib": "prefill reads every expert once per layer and keeps no expert cache (the "
                                          "cache is the decode's: generate, chat, serve)"})
@force_option
@json_option
@reports_errors(out_of_memory_hint=PREFILL_MEMORY_HINT)
def prefill(file, prompt, prompt_file, token_ids_file, kv_out, continue_from, kv_no_fsync, logits_out,
            bundle_experts, queue_depth, expert_selection, query_chunk, expert_dtype, order, chunk_tokens,
            expert_parallel, expert_ownership, container_per_rank, dist_timeout, no_verify_reads, max_context, run,
            force, as_json):
    """Prefill a prompt layer by layer with the routed experts streamed from FILE; print the greedy next token."""
    from moepack.format_spec.reader import Container
    from moepack.runtime.engine import prefill as run_prefill
    from moepack.serve.tokenizer import PromptTokenizer, read_prompt_file, read_token_ids

    if sum(x is not None for x in (prompt, prompt_file, token_ids_file)) != 1:
        raise click.UsageError("give exactly one of --prompt, --prompt-file, --token-ids")
    if prompt == "" and continue_from is None:
        raise MoepackError("empty prompt")
    inputs = (file, prompt_file, token_ids_file)
    from moepack.families.kv_directory import KV_FILE

    refuse_existing(force, logits_out, inputs=(*inputs, (continue_from, KV_FILE)))
    refuse_existing_kv(force, kv_out, continue_from, inputs=inputs)
    if logits_out:
        from moepack.runtime.outputs import check_output_path

        check_output_path(logits_out)  # before the prefill, not after it
    pattern = file
    if container_per_rank:
        if not expert_parallel or "{rank}" not in file:
            raise click.UsageError("--container-per-rank needs --expert-parallel and '{rank}' in FILE")
        file = file.replace("{rank}", os.environ.get("RANK", "0"))
    check_container_path(file)
    with Container(file) as c:
        tokenizer = PromptTokenizer(c) if token_ids_file is None else None
        config, past = c.config, continued_tokens(continue_from, c)
    if token_ids_file is not None:
        ids = read_token_ids(token_ids_file)
    else:
        if prompt_file is not None:
            prompt = read_prompt_file(prompt_file)
        if continue_from is not None:
            tokenizer.add_special_tokens = False  # a continuation: no BOS in the middle of the conversation
        ids = tokenizer.encode(prompt)
    check_prefill_context(config, max_context, past + len(ids))
    if bundle_experts is None or queue_depth is None:
        from moepack.runtime.tuning import tuned_defaults

        tuned = tuned_defaults(file) or (4, 4)  # what `moepack bench io` measured for this file, if it did
        bundle_experts, queue_depth = bundle_experts or tuned[0], queue_depth or tuned[1]
    options = run.prefill_options(bundle_experts=bundle_experts, queue_depth=queue_depth, query_chunk=query_chunk,
                                  expert_selection=expert_selection, verify_reads=not no_verify_reads,
                                  expert_dtype=expert_dtype, load_progress=not as_json,
                                  expert_ownership=expert_ownership)
    with layer_progress(not as_json) as on_layer:
        result = run_prefill(pattern, ids, replace(options, on_layer=on_layer), kv_out=kv_out,
                             continue_from=continue_from, kv_dtype=run.kv_dtype, kv_sync=not kv_no_fsync,
                             chunk_tokens=chunk_tokens if order == "chunk" else None,
                             expert_parallel=expert_parallel, dist_timeout_s=dist_timeout, kv_overwrite=force)
    if result.stats.get("rank", 0) != 0:
        return  # rank 0 speaks for the job
    if logits_out:
        from moepack.runtime.outputs import write_logits

        write_logits(logits_out, result.logits)
    text = None
    if tokenizer is None:
        with Container(file) as c:
            try:
                tokenizer = PromptTokenizer(c)
            except MoepackError:
                tokenizer = None
    if tokenizer is not None:
        text = tokenizer.decode([result.next_token])
    out = {"next_token": result.next_token, "next_token_text": text, **result.stats,
           "layers": [vars(s) for s in result.layers]}
    s = result.stats
    emit(as_json, out, lambda r: click.echo(
        f"next token: {r['next_token']} {r['next_token_text']!r}\n"
        f"{s['tokens']} tokens in {s['seconds']:.2f} s ({s['tokens_per_s']:.1f} tokens/s); read "
        f"{s['bytes_read'] / 2**20:.1f} MiB ({s['io_mode']}), io busy {s['io_busy_s']:.2f} s, compute "
        f"{s['compute_busy_s']:.2f} s, overlap {s['overlap']:.2f}; peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB"
        + (f", peak device {s['peak_device_bytes'] / 2**30:.2f} GiB" if s.get("peak_device_bytes") is not None else "")
        # a shared VM's host took CPU time from this run: why it may be slower than its parts
        + (f"; the hypervisor took {s['steal_s']:.2f} s of CPU" if (s.get("steal_s") or 0) >= 0.01 else "")
        + ("; read per part file " + " / ".join(f"{b / 2**20:.1f}" for b in s["bytes_read_per_part"]) + " MiB"
           if len(s.get("bytes_read_per_part", [])) > 1 else "")))


@cli.group()
def kv():
    """KV directories a prefill wrote (--kv-out): inspect them."""


@kv.command("inspect")
@click.argument("kv_dir", type=click.Path(file_okay=False))
@click.option("--container", type=click.Path(dir_okay=False), help="Also check the KV was made with this container.")
@click.option("--token-ids", "token_ids_file", type=click.Path(dir_okay=False),
              help="Also check the KV holds exactly this prompt (JSON array or whitespace-separated ids).")
@click.option("--no-verify", is_flag=True, help="Read the manifest only; do not hash the layer files.")
@json_option
@reports_errors
def kv_inspect(kv_dir, container, token_ids_file, no_verify, as_json):
    """Layers, tokens, bytes and completeness of a KV directory; every complete layer file is checked (size,
    xxh3, tensors). Fails on a missing, truncated or damaged layer file, another model's KV, another prompt."""
    from moepack.families.kv_directory import identity_of_container, inspect_kv
    from moepack.format_spec.reader import Container
    from moepack.families import kv_format_for
    from moepack.serve.tokenizer import read_token_ids

    identity = None
    if container is not None:
        with Container(container) as c:
            identity = identity_of_container(c)
    expect = read_token_ids(token_ids_file) if token_ids_file else None
    report = inspect_kv(kv_dir, kv_format_for, expect_identity=identity, expect_prompt=expect, verify=not no_verify)

    def human(r):
        state = "complete" if r["complete"] else f"INCOMPLETE ({r['layers_complete']}/{r['num_layers']} layers; " \
                                                  f"missing {r['incomplete_layers']})"
        click.echo(f"{r['path']}: moepack KV {r['format_version']}, {state}")
        click.echo(f"  model: {r['architecture']}, container index xxh3 {r['container_index_xxh3']}, "
                   f"config xxh3 {r['config_xxh3']}")
        click.echo(f"  tokens: {r['tokens']} (continued from {r['start_token']}), ids xxh3 {r['token_ids_xxh3']}; "
                   f"next token {r['next_token']}")
        click.echo(f"  {r['bytes'] / 2**20:.2f} MiB {r['dtype']} ({r['bytes_per_token']:.0f} B/token)"
                   f"{'' if r['verified'] else ', files not verified'}")
        for kind, t in r["by_type"].items():
            click.echo(f"  {kind}: {t['layers']} layers, {t['bytes'] / 2**20:.2f} MiB")

    emit(as_json, report, human)


@cli.command()
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where the checkpoint, container and KV go (default: moepack's cache folder, "
                   "$MOEPACK_CACHE_DIR, else $XDG_CACHE_HOME/moepack or ~/.cache/moepack, + /demo: never the "
                   "current directory, a checkout).")
@click.option("--preset", type=click.Choice(["tiny", "small", "medium"]), default="small", show_default=True,
              help="The synthesized model's size (synth's --preset).")
@click.option("--prompt", default="Layer-major prefill reads every weight exactly once.", show_default=True,
              help="The text prefilled.")
@json_option
@reports_errors(out_of_memory_hint=PREFILL_MEMORY_HINT)
def demo(workdir, preset, prompt, as_json):
    """The main job on the embedded default model: synthesize a checkpoint of the default family (`synth`'s) in
    the release layout (FP8 dense, FP4 experts), convert it with --fp4, verify it against its source, prefill a
    prompt with the experts streamed from disk (KV written layer by layer), and print the stats."""
    from moepack.format_spec.reader import Container
    from moepack.format_spec.summary import summarize
    from moepack.format_spec.verify import verify_container
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.fidelity import compare_with_source, raise_on_failures
    from moepack.packer.synth import synth_checkpoint
    from moepack.runtime.engine import prefill as run_prefill
    from moepack.runtime.tuning import cache_dir
    from moepack.serve.tokenizer import PromptTokenizer

    if not prompt:  # (refused as prefill refuses it, before the minutes of work: a prompt of BOS alone is no one's)
        raise MoepackError("empty prompt")
    workdir = workdir or os.path.join(cache_dir(), "demo")
    os.makedirs(workdir, exist_ok=True)
    src = os.path.join(workdir, f"{preset}-release")
    out = os.path.join(workdir, f"{preset}-fp4.moepack")
    kv_dir = os.path.join(workdir, "kv")
    quiet = as_json
    steps = {"workdir": workdir}
    if os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        steps["synth"] = {"dir": src, "reused": True}
    else:
        steps["synth"] = synth_checkpoint(src, preset=preset, layout="release", seed=0, progress=not quiet)
    steps["convert"] = convert_checkpoint(src, out, policy="fp4", progress=not quiet)
    steps["verify"] = verify_container(out).as_dict()
    steps["verify"]["source_check"] = compare_with_source(out, src, progress=not quiet)
    raise_on_failures(steps["verify"]["source_check"])
    with Container(out) as c:
        steps["inspect"] = summarize(c)
        tokenizer = PromptTokenizer(c)
    ids = tokenizer.encode(prompt)
    if os.path.exists(kv_dir):
        import shutil

        shutil.rmtree(kv_dir)
    result = run_prefill(out, ids, kv_out=kv_dir)
    steps["prefill"] = {"prompt": prompt, "next_token": result.next_token,
                        "next_token_text": tokenizer.decode([result.next_token]), "kv_out": kv_dir, **result.stats}
    if as_json:
        emit(True, steps, None)
        return
    p = steps["prefill"]
    check = steps["verify"]["source_check"]
    click.echo(f"workdir: {workdir}")
    click.echo(f"synth:   {src}")
    click.echo(f"convert: {out} (--fp4) in {steps['convert']['seconds']:.2f} s, experts "
               f"{steps['convert']['expert_bits_per_weight']} bits/weight")
    click.echo(f"verify:  OK, {steps['verify']['bytes_read'] / 2**20:.1f} MiB at {steps['verify']['gb_per_s']} GB/s; "
               f"vs source: {check['bit_identical']} bit-identical, {check['value_identical']} lossless, "
               f"{check['lossy']} within thresholds")
    _print_summary(steps["inspect"])
    click.echo(f"prefill: {p['tokens']} tokens in {p['seconds']:.2f} s ({p['tokens_per_s']:.1f} tokens/s), read "
               f"{p['bytes_read'] / 2**20:.1f} MiB ({p['io_mode']}), io busy {p['io_busy_s']:.2f} s, compute "
               f"{p['compute_busy_s']:.2f} s, overlap {p['overlap']:.2f}")
    click.echo(f"         next token {p['next_token']} {p['next_token_text']!r}; KV in {kv_dir} "
               f"({p.get('kv_bytes', 0) / 2**10:.0f} KiB)")


cli.add_command(bench)
cli.add_command(chat)
cli.add_command(generate)
cli.add_command(perplexity)
cli.add_command(plan)
cli.add_command(serve)
untrusted_argv_types(cli)


def main() -> None:
    """The console entry: click's own handling, except that a usage error under --json also prints the JSON error
    object (a machine reading stdout sees {"ok": false, ...} whatever went wrong)."""
    sigterm_as_interrupt()
    one_line_warnings()
    quiet_native_logs()
    try:
        code = cli.main(prog_name="moepack", standalone_mode=False)
    except click.ClickException as e:  # usage errors (bad flags, values out of range) and click's own failures
        if "--json" in sys.argv[1:]:
            click.echo(json.dumps({"ok": False, "error": e.format_message(), "usage_error": True}))
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:  # Ctrl-C at a prompt
        click.echo("moepack: error: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
