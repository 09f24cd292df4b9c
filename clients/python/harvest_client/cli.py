"""The ``harvest`` command: models, submit, status, cancel, download, stream and export, with human output by
default and ``--json`` for scripts. Errors print one line and exit 1 (2 for bad usage)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from . import errors
from .client import Client, Job


def read_prompts(path: Path) -> List[str]:
    """Prompts from a file: JSONL (one JSON string, or an object with ``prompt`` or ``text``,
    per line), JSON (a list of strings, or ``{"prompts": [...]}``), or plain text (one prompt
    per non-empty line). The format comes from the extension (``.jsonl``/``.ndjson``,
    ``.json``, ``.txt``), else from the content. A line that does not parse is named."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise errors.HarvestError(f"{path}: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise errors.HarvestError(
            f"{path} line {line}: not UTF-8 text (byte {data[error.start]:#04x}): give a JSONL, JSON or text file"
        ) from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise errors.HarvestError(f"{path} line {line}: a NUL byte: this looks like a binary file, not JSONL, JSON or text")
    suffix = path.suffix.lower()
    stripped = text.lstrip()
    if suffix in (".jsonl", ".ndjson") or (suffix not in (".json", ".txt") and stripped[:1] in ('"', "{") and "\n" in stripped.strip()):
        return _jsonl(path, text)
    if suffix == ".json" or (suffix != ".txt" and stripped[:1] in ("[", "{", '"')):
        return _json(path, text)
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise errors.HarvestError(f"{path} holds no prompts")
    return prompts


def _prompt_of(path: Path, where: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for key in ("prompt", "text"):
            if isinstance(value.get(key), str):
                return value[key]
        raise errors.HarvestError(f"{path} {where}: an object without a string \"prompt\" or \"text\" field")
    raise errors.HarvestError(f"{path} {where}: a {type(value).__name__}, not a string prompt")


def read_conversations(path: Path) -> Optional[List[Any]]:
    """The conversations of a JSONL file whose lines are ``{"messages": [...]}`` (as the
    harvester reads them too), or None where its lines are prompts. A file of both is named."""
    if path.suffix.lower() not in (".jsonl", ".ndjson"):
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    conversations, prompts = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            return None
        if isinstance(value, dict) and "messages" in value:
            if not isinstance(value["messages"], list):
                raise errors.HarvestError(f"{path} line {number}: \"messages\" must be a list of {{\"role\", \"content\"}} messages")
            conversations.append(value["messages"])
        else:
            prompts += 1
        if conversations and prompts:
            raise errors.HarvestError(f"{path} line {number}: the file mixes prompts and conversations (\"messages\"): give a job one kind")
    return conversations or None


def _jsonl(path: Path, text: str) -> List[str]:
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise errors.HarvestError(f"{path} line {number}: not JSON ({error.msg} at column {error.colno})") from None
        prompts.append(_prompt_of(path, f"line {number}", value))
    if not prompts:
        raise errors.HarvestError(f"{path} holds no prompts")
    return prompts


def _json(path: Path, text: str) -> List[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise errors.HarvestError(f"{path} line {error.lineno}: not JSON ({error.msg} at column {error.colno})") from None
    if isinstance(value, dict) and "prompts" in value:
        value = value["prompts"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise errors.HarvestError(f'{path}: JSON must be a list of prompts or {{"prompts": [...]}}')
    return [_prompt_of(path, f"item {i}", v) for i, v in enumerate(value)]


def _layers(text: Optional[str]) -> Union[None, str, List[int]]:
    if text is None:
        return None
    if text == "all":
        return "all"
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise errors.HarvestError(f"--layers {text!r}: give block indices like 8,16,24, or all") from None


def _print_job(job: Job, as_json: bool) -> None:
    if as_json:
        print(json.dumps(job.data, indent=2))
        return
    data = job.data
    line = f"{job.id}  {job.status:<9}  {data.get('model')}  {data.get('n_prompts')} prompts  layers {data.get('layers')}"
    print(line)
    progress = data.get("progress")
    if progress and job.status == "running":
        print(f"  progress: {describe_progress(progress)}")
    if data.get("tokens") is not None:
        print(f"  tokens charged: {data['tokens']}")
    if job.error:
        print(f"  error: {job.error}")
    if job.result:
        result = job.result
        print(f"  {result['n_shards']} shards, {result.get('bytes_written', 0)} bytes; links expire {data.get('urls_expire_at')}")


def _models(client: Client, args: argparse.Namespace) -> int:
    models = client.models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    print(f"{'name':<24} {'lane':<6} {'layers':>6} {'hidden':>7} {'max_tokens':>10}  default layers")
    for m in models:
        if m.get("available", True) is False:
            print(f"{m['name']:<24} {m['lane']:<6} unavailable: {m.get('unavailable_reason', 'no reason given')}")
            continue
        print(f"{m['name']:<24} {m['lane']:<6} {m['layers']:>6} {m['hidden_size']:>7} {m['max_tokens']:>10}  {m['default_layers']}")
    return 0


def _slice(text: Optional[str]) -> Optional[List[int]]:
    if text is None:
        return None
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise errors.HarvestError(f"--positions {text!r}: write START:END, for example 1:512") from None
    return [start, end]


def _roles(text: Optional[str]) -> Optional[List[str]]:
    """``--roles assistant,user`` as a list of names (None when not given)."""
    if text is None:
        return None
    return [role.strip() for role in text.split(",") if role.strip()]


def _submit(client: Client, args: argparse.Namespace) -> int:
    conversations = read_conversations(Path(args.prompts))
    prompts = None if conversations is not None else read_prompts(Path(args.prompts))
    if args.add_generation_prompt and conversations is None:
        raise errors.HarvestError("--add-generation-prompt applies to a file of conversations ({\"messages\": [...]} lines)")
    directions = None
    if args.project_onto:
        import numpy as np

        try:
            directions = np.load(args.project_onto, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise errors.HarvestError(f"--project-onto {args.project_onto}: not a .npy array ({error})") from None
    request = dict(
        model=args.model,
        layers=_layers(args.layers),
        sites=[site.strip() for site in args.sites.split(",") if site.strip()] if args.sites else None,
        exclude_special_tokens=True if args.exclude_special_tokens else None,
        positions=_slice(args.positions),
        roles=_roles(args.roles),
        sample_rate=args.sample_rate,
        seed=args.seed,
        max_norm_multiple=args.max_norm_multiple,
        layout=args.layout,
        rows_per_file=args.rows_per_file,
        max_prompt_tokens=args.max_prompt_tokens,
        shard_size=args.shard_size,
        add_special_tokens=not args.no_special_tokens,
        project_onto=directions,
    )
    if conversations is not None:
        request.update(conversations=conversations, add_generation_prompt=True if args.add_generation_prompt else None)
    if args.dry_run:
        estimate = client.estimate(prompts, **request)
        if args.json:
            print(json.dumps(estimate, indent=2))
        else:
            seconds = estimate.get("estimated_seconds")
            when = f"about {seconds:.0f} s" if seconds is not None else "no time estimate yet (no job of this model ran here)"
            print(
                f"{estimate['n_prompts']} prompts, {estimate['tokens']} tokens, {estimate['files']['shards']['count']} shards, "
                f"{estimate['total_bytes']} bytes; {when}"
            )
        return 0
    job = client.submit(prompts, **request, retry=args.retry)
    if not args.json:
        count = f"{len(conversations)} conversations" if conversations is not None else f"{len(prompts)} prompts"
        print(f"submitted {job.id} ({count}, {job.data.get('reserved_tokens')} tokens reserved)", file=sys.stderr)
    if args.wait or args.download:
        job.wait(progress=not args.json)
    if args.download:
        report = job.download(args.download)
        if not args.json:
            print(f"downloaded to {report.directory} ({report.fetched_bytes} bytes fetched)", file=sys.stderr)
    _print_job(job, args.json)
    return 0


def _status(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    if args.wait:
        job.wait(progress=not args.json, raise_on_failure=False)
    _print_job(job, args.json)
    return 0 if job.status != "failed" else 1


def _cancel(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    job.cancel()
    _print_job(job, args.json)
    return 0


def _download(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    report = job.download(args.directory, workers=args.workers, progress=not args.json)
    summary: Dict[str, Any] = {
        "directory": str(report.directory),
        "fetched_bytes": report.fetched_bytes,
        "kept": report.kept,
        "resumed": report.resumed,
        "refetched": report.refetched,
        "renewed_links": report.renewed_links,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{report.directory}: {report.fetched_bytes} bytes fetched, {len(report.kept)} files already complete, "
            f"{len(report.resumed)} resumed, {len(report.refetched)} fetched again"
        )
    return 0


def _stream(client: Client, args: argparse.Namespace) -> int:
    from .stream import StreamReport

    job = client.job(args.job_id)
    report = StreamReport()
    batches = job.stream(
        args.layer,
        args.batch_size,
        shuffle_buffer=args.shuffle_buffer,
        seed=args.seed,
        drop_bos=not args.keep_bos,
        site=args.site,
        poll_s=args.poll,
        report=report,
        roles=_roles(args.roles),
    )
    shown = 0.0
    for _ in batches:
        if args.batches and report.batches >= args.batches:
            break
        if not args.json and time.monotonic() - shown >= args.every:
            shown = time.monotonic()
            print(
                f"{report.rows} rows in {report.batches} batches, {report.rows_per_second():,.0f} rows/s; "
                f"{report.shards} shards read ({report.early_shards} while the job ran)",
                file=sys.stderr,
            )
    summary = {
        "job_id": job.id,
        "rows": report.rows,
        "batches": report.batches,
        "rows_per_s": round(report.rows_per_second(), 1),
        "seconds": round(time.monotonic() - report.started, 3),
        "shards": report.shards,
        "early_shards": report.early_shards,
        "fetched_bytes": report.fetched_bytes,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{summary['rows']} rows in {summary['batches']} batches in {summary['seconds']} s: {summary['rows_per_s']:,.0f} rows/s "
            f"({summary['shards']} shards, {summary['early_shards']} read while the job ran)"
        )
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import export

    summary = export(
        args.directory,
        args.out,
        format=args.format,
        layer=args.layer,
        site=args.site,
        context_size=args.context_size,
        hook=args.hook_name,
        drop_bos=not args.keep_bos,
        roles=_roles(args.roles),
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    elif args.format == "saelens":
        print(
            f"{summary['out']}: {summary['rows']} rows of {summary['context_size']} tokens in column {summary['hook_name']} "
            f"(d_in {summary['width']}); {summary['left_out_tokens']} tokens past the last full row left out"
        )
    else:
        print(f"{summary['out']}: {summary['rows']} token rows of width {summary['width']}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="harvest", description="Harvest residual-stream activations through a harvest server.")
    top.add_argument("--base-url", help="the API base, ending in /v1 (default: $ACS_API_BASE)")
    top.add_argument("--api-key", help="the API key (default: $ACS_API_KEY)")
    top.add_argument("--json", action="store_true", help="print JSON for scripts instead of text")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands.add_parser("models", help="list the models").set_defaults(run=_models)

    submit = commands.add_parser("submit", help="submit a prompt file as a job")
    submit.add_argument(
        "prompts",
        help='a .jsonl, .json or .txt file of prompts, or a .jsonl of conversations ({"messages": [{"role": "user", "content": "..."}, ...]} per line)',
    )
    submit.add_argument(
        "--add-generation-prompt",
        action="store_true",
        help="with conversations: end each with the chat template's opening of the assistant's turn",
    )
    submit.add_argument("--model", required=True)
    submit.add_argument("--layers", help="block indices like 8,16,24, or all (default: the model's quartiles)")
    submit.add_argument(
        "--sites",
        help="hook sites of each kept block, like attn_out,mlp_out,resid_post (default: resid_post); "
        "router (or router_logits) adds a MoE model's expert choices",
    )
    submit.add_argument("--shard-size", type=int, help="prompts per shard file (default 32)")
    submit.add_argument("--exclude-special-tokens", action="store_true", help="keep no token the tokenizer marks special")
    submit.add_argument("--positions", metavar="START:END", help="keep positions START to END (exclusive) of each prompt")
    submit.add_argument("--roles", metavar="ROLE,...", help="for conversations: keep only these roles' tokens (template, system, user, assistant, tool)")
    submit.add_argument("--sample-rate", type=float, help="keep each token with this probability (seeded)")
    submit.add_argument("--seed", type=int, help="the seed of --sample-rate and of --layout shuffled (default 0)")
    submit.add_argument("--max-norm-multiple", type=float, help="drop tokens whose norm exceeds this many running medians")
    submit.add_argument("--layout", choices=["by_prompt", "shuffled"], help="shards by prompt (default) or shuffled training files")
    submit.add_argument("--rows-per-file", type=int, help="rows per training file of --layout shuffled (default 65536)")
    submit.add_argument("--max-prompt-tokens", type=int, help="cut each prompt to its first N tokens (special tokens included)")
    submit.add_argument("--no-special-tokens", action="store_true", help="add no BOS: tokenize the text verbatim")
    submit.add_argument("--project-onto", metavar="DIRS.npy", help="project onto these directions [n, hidden]")
    submit.add_argument("--retry", action="store_true", help="retry while the lane is full or counting is busy")
    submit.add_argument("--dry-run", action="store_true", help="only say what the job would be: tokens, bytes, time")
    submit.add_argument("--wait", action="store_true", help="wait for the job to end")
    submit.add_argument("--download", metavar="DIR", help="wait, then download the files into DIR")
    submit.set_defaults(run=_submit)

    status = commands.add_parser("status", help="show a job")
    status.add_argument("job_id")
    status.add_argument("--wait", action="store_true", help="wait for it to end")
    status.set_defaults(run=_status)

    cancel = commands.add_parser("cancel", help="cancel a pending or running job")
    cancel.add_argument("job_id")
    cancel.set_defaults(run=_cancel)

    download = commands.add_parser("download", help="download and verify a done job's files")
    download.add_argument("job_id")
    download.add_argument("directory")
    download.add_argument("--workers", type=int, default=4, help="files fetched at once (default 4)")
    download.set_defaults(run=_download)

    stream = commands.add_parser("stream", help="read a job's rows as training batches while it runs, and report rows/s")
    stream.add_argument("job_id")
    stream.add_argument("--layer", type=int, required=True, help="a kept block")
    stream.add_argument("--site", default="resid_post", help="a kept hook site (default resid_post)")
    stream.add_argument("--batch-size", type=int, default=4096, help="rows per batch (default 4096)")
    stream.add_argument("--shuffle-buffer", type=int, default=65536, help="rows mixed at once; 0 keeps shard order (default 65536)")
    stream.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default 0)")
    stream.add_argument("--keep-bos", action="store_true", help="keep each prompt's leading BOS")
    stream.add_argument("--roles", metavar="ROLE,...", help="for conversations: keep only these roles' tokens (template, system, user, assistant, tool)")
    stream.add_argument("--batches", type=int, help="stop after this many batches")
    stream.add_argument("--poll", type=float, default=1.0, help="seconds between asks while no shard is ready (default 1)")
    stream.add_argument("--every", type=float, default=5.0, help="seconds between progress lines (default 5)")
    stream.set_defaults(run=_stream)

    export = commands.add_parser("export", help="write a downloaded job as a SAELens cache or a Hugging Face dataset")
    export.add_argument("directory", help="a downloaded job (harvest download)")
    export.add_argument("--format", choices=["saelens", "hf"], required=True)
    export.add_argument("--layer", type=int, required=True, help="a kept block")
    export.add_argument("--site", default="resid_post", help="a kept hook site (default resid_post)")
    export.add_argument("--out", required=True, help="a new or empty directory")
    export.add_argument("--context-size", type=int, default=128, help="tokens per SAELens row (default 128, SAELens's default)")
    export.add_argument("--hook-name", help="the SAELens column (default blocks.LAYER.hook_SITE)")
    export.add_argument("--keep-bos", action="store_true", help="keep each prompt's leading BOS")
    export.add_argument("--roles", metavar="ROLE,...", help="for conversations: keep only these roles' tokens (template, system, user, assistant, tool)")
    export.set_defaults(run=_export, offline=True)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        if getattr(args, "offline", False):
            return int(args.run(args))
        client = Client(args.base_url, args.api_key)
        return int(args.run(client, args))
    except errors.HarvestError as error:
        print(f"harvest: {error}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as error:
        print(f"harvest: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


def describe_progress(progress: dict) -> str:
    """A running job's progress in words: the weights being read, or the prompts and tokens done."""
    if progress.get("phase") == "loading" and progress.get("bytes_total"):
        loaded, total = progress.get("bytes_loaded", 0) / 1e9, progress["bytes_total"] / 1e9
        return f"loading the model's weights, {loaded:.1f}/{total:.1f} GB"
    return f"{progress['prompts_done']}/{progress['prompts_total']} prompts, {progress['tokens_done']} tokens"
