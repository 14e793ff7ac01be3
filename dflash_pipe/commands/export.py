"""``dflash-pipe export`` and ``serve-command``: a trained drafter in the reference format, and the
command that serves it beside its target."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_pipe.commands import console


@click.command()
@click.argument("checkpoint", type=click.Path(exists=True, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
def export(checkpoint: Path, out_dir: Path) -> None:
    """Export a checkpoint (or the latest of a run dir or its checkpoints/) to the DFlash reference format.

    \b
    Writes OUT_DIR/config.json (with dflash_config and auto_map) and OUT_DIR/model.safetensors, which
    the reference DFlashDraftModel loads next to the target, OUT_DIR/modeling_dflash.py (so that
    AutoModel.from_pretrained(OUT_DIR, trust_remote_code=True) loads it and its spec_generate speculates)
    and OUT_DIR/manifest.json (their sizes and sha256, checked by eval and on loading). The checkpoint is
    verified against its manifest first; a running run can be exported; a checkpoint trained 0 steps is
    refused. Ends with the vLLM command that serves it (dflash-pipe serve-command for the others). Examples:
      dflash-pipe export runs/q8b out/qwen3-8b-dflash
      dflash-pipe export runs/q8b/checkpoints/step-00001000 out/q8b-step1000
    """
    from dflash_pipe.drafter import export_checkpoint
    from dflash_pipe.drafter.serve import plan_from_export, run_settings, serve_command
    from dflash_pipe.run.locate import held_checkpoint

    try:
        with held_checkpoint(checkpoint) as checkpoint:  # a running run prunes none of it meanwhile
            target, template_kwargs = run_settings(checkpoint)
            export_checkpoint(checkpoint, out_dir, chat_template_kwargs=template_kwargs)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    except OSError as exc:  # OUT_DIR not writable, a full disk: one line, no traceback
        raise click.ClickException(f"cannot write the export to {out_dir}: {exc}") from None
    console.print(f"exported {checkpoint} -> {out_dir}")
    plan = plan_from_export(out_dir, target=target)
    console.print(
        f"Serve it with vLLM (for SGLang or the reference: dflash-pipe serve-command {out_dir} --engine "
        "sglang|reference):",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    console.print(serve_command(plan, "vllm"), end="", markup=False, highlight=False, soft_wrap=True)


@click.command("serve-command")
@click.argument(
    "path", metavar="RUN_OR_EXPORT", type=click.Path(exists=True, file_okay=False, path_type=Path)
)
@click.option(
    "--engine",
    type=click.Choice(["vllm", "sglang", "reference"]),
    default="vllm",
    show_default=True,
    help="Which server (or the reference's Python loop) the command is for.",
)
@click.option(
    "--target",
    help="The target model path or Hub id to serve beside the drafter (default: a run's own target; an "
    "export does not record it); a GGUF file is served from its converted folder.",
)
def serve_command_cmd(path: Path, engine: str, target: str | None) -> None:
    """Print the exact command that serves a drafter beside its target, every setting from the export.

    \b
    RUN_OR_EXPORT: a `dflash-pipe export` directory, or a run dir / checkpoint (its latest checkpoint; the
    export command to run first is printed too). From the export's config.json: the draft-token count
    (vLLM: block_size - 1, SGLang: block_size), vLLM's V2 model runner for a drafter mixing sliding and full
    layers, and the chat template arguments it was trained with. Examples:
      dflash-pipe serve-command out/q8b --target /models/Qwen3-8B
      dflash-pipe serve-command runs/q8b --engine sglang
      dflash-pipe serve-command out/q8b --engine reference --target Qwen/Qwen3-8B
    """
    from dflash_pipe.drafter.serve import plan_from_path, serve_command
    from dflash_pipe.target.gguf import is_gguf, resolve_target

    try:
        if is_gguf(target):  # the engines serve its converted folder
            target = str(resolve_target(target, flag="--target", say=None))
        plan = plan_from_path(path, target=target)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(serve_command(plan, engine), nl=False)
