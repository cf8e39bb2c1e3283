"""The `eaglet` command line: one subcommand per stage, plus keys and status.

Each stage command writes to its current keyed path (or `--out`) and prints that path.
User errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from eaglet import __version__
from eaglet.errors import EagletError


def _params(args: argparse.Namespace):
    from eaglet import params

    return params.load(args.params)


def _checked(args: argparse.Namespace, stage: str):
    """Params of a stage command; with --key, refuse to build under a key that is not current."""
    from eaglet.graph.keys import Keys, check_code

    check_code(stage)  # an edited kernel whose version stayed stops here
    params = _params(args)
    name = getattr(args, "dataset", None) or args.drafter
    if args.key:
        current = Keys(params).key(stage, name)
        if args.key != current:
            raise EagletError(
                f"{stage}/{name}: key {args.key} is not the current key {current} "
                "(params or code changed since the graph was planned)"
            )
    return params


def build(stage: str, params, name: str, out: Path | None = None, **opts):
    """graph.keys.build; a write the filesystem refused also says what the build kept for the
    rerun (shards, a checkpoint) and how to go on."""
    from eaglet.atomic import WriteFailed
    from eaglet.graph import keys

    try:
        return keys.build(stage, params, name, out=out, **opts)
    except WriteFailed as e:
        from eaglet.reports.status import kept

        path = Path(out) if out else keys.Keys(params).path(stage, name)
        fix = "make it writable" if "read-only" in e.reason.lower() else "free space"
        rerun = keys.COMMANDS[stage].format(name)
        raise e.keeping(f"{kept(path, stage)}; {fix}, then rerun: {rerun}") from None


def cmd_prompts(args: argparse.Namespace) -> None:
    print(build("prompts", _checked(args, "prompts"), args.dataset, out=args.out))


def cmd_generate(args: argparse.Namespace) -> None:
    params = _checked(args, "responses")
    if args.dry_run:
        from eaglet.stages.responses import preflight

        preflight.show(preflight.preflight(params, args.dataset))
        return
    opts = {"threads": args.threads, "quiet": args.quiet}
    print(build("responses", params, args.dataset, out=args.out, **opts))


def cmd_hidden(args: argparse.Namespace) -> None:
    import json

    params = _checked(args, "hidden")
    if args.verify:
        from eaglet.stages.hidden.verify import verify

        report = verify(
            params, args.dataset, path=args.out, samples=args.samples, threads=args.threads
        )
        print(json.dumps(report))
    else:
        opts = {"threads": args.threads, "quiet": args.quiet}
        print(build("hidden", params, args.dataset, out=args.out, **opts))


def cmd_vocab(args: argparse.Namespace) -> None:
    print(build("vocab", _checked(args, "vocab"), args.drafter, out=args.out))


def cmd_train(args: argparse.Namespace) -> None:
    params = _checked(args, "train")
    opts = {"threads": args.threads, "quiet": args.quiet}
    out = build("train", params, args.drafter, out=args.out, **opts)
    if int(os.environ.get("RANK", "0")) == 0:
        print(out)


def cmd_evaluate(args: argparse.Namespace) -> None:
    params = _checked(args, "evaluate")
    opts = {"threads": args.threads, "quiet": args.quiet}
    out = build("evaluate", params, args.drafter, out=args.out, **opts)
    print(out)


def cmd_export(args: argparse.Namespace) -> None:
    out, command = build(args.to, _checked(args, args.to), args.drafter, out=args.out)
    print(f"eaglet: {args.to} export validated; serve with:\n  {command}", file=sys.stderr)
    print(out)


def cmd_import_responses(args: argparse.Namespace) -> None:
    from eaglet.stages.responses import imported

    s = imported.import_file(_params(args), args.dataset, args.file)
    cost = f", ${s['cost']:.4f}" if s["cost"] else ""
    schemas = ", ".join(f"{n} {k}" for k, n in sorted(s["schemas"].items()))
    print(
        f"{args.file}: {s['records']} records ({schemas}), {s['new']} new in the store, "
        f"{s['in_dataset']} are prompts of {args.dataset}; "
        f"{s['completion_tokens']:,} completion tokens{cost}"
    )
    d = s["token_drift"]
    if d["records"]:
        w = d["worst"]
        worst = f"; worst {w['id']}: {w['stored']} stored, {w['server']} in the file" if w else ""
        print(
            f"{args.dataset}: generated tokens drift {d['drift']:.2%} from the file's counts over "
            f"{d['records']} answers ({d['stored_tokens']:,} stored, {d['server_tokens']:,} "
            f"counted){worst}"
        )
    u = s["unwritable"]
    if u["count"]:
        first = u["first"][0]
        print(
            f"{args.dataset}: {u['count']} answers cannot be written as the target's stream "
            f"and are left out of the samples (first {first['id']}: {first['reason']})"
        )


def cmd_plan(args: argparse.Namespace) -> None:
    import json

    from eaglet.reports import plan

    free = args.free_disk * 1e9 if args.free_disk is not None else None
    report = plan.plan(_params(args), args.target_config, args.gpu_memory * 2**30, free)
    print(json.dumps(report, indent=2) if args.json else plan.render(report))


def cmd_code(args: argparse.Namespace) -> None:
    from eaglet.graph import code
    from eaglet.graph.keys import STAGES

    stages = {name: st.module for name, st in STAGES.items()}
    if args.lock:
        found = code.lock(stages, tuple(args.same_bytes))
        print(f"eaglet: {code.LOCK.name}: {len(found)} stages recorded")
    problems = []
    for s in code.states(stages):
        problem = s.problem()
        problems += [problem] if problem else []
        state = "ok" if not problem else "bumped" if s.bumped else "EDITED"
        print(f"{s.code.stage:<10} version {s.code.version:<3} kernel {s.digest}  {state}")
    if problems:
        raise EagletError("; ".join(problems))


def cmd_status(args: argparse.Namespace) -> None:
    from eaglet.reports import status

    status.show(_params(args), as_json=args.json)


def cmd_keys(args: argparse.Namespace) -> None:
    import json

    from eaglet.errors import AwaitedFile
    from eaglet.graph.artifacts import names
    from eaglet.graph.keys import STAGES, Keys

    params = _params(args)
    keys = Keys(params)
    rows = []
    for stage, st in STAGES.items():
        for name in names(keys, stage):
            try:
                keys.key(stage, name)
            except AwaitedFile as e:  # no key yet: the row says what it waits for
                rows.append(
                    {
                        "stage": stage,
                        "name": name,
                        "kind": st.kind,
                        "key": "-" * 12,
                        "path": f"waits for {e.file} ({e.field})",
                    }
                )
                continue
            rel = {
                "path": os.path.relpath(keys.path(stage, name), params.root),
                "sidecar": os.path.relpath(keys.sidecar(stage, name), params.root),
            }
            rows.append({**keys.provenance(stage, name), "name": name, "kind": st.kind, **rel})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['stage']:<10} {r['name']:<24} {r['key']}  {r['path']}")


def cmd_gc(args: argparse.Namespace) -> None:
    from eaglet.graph.artifacts import gc
    from eaglet.graph.keys import Keys

    params = _params(args)
    removed = gc(Keys(params), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for a in removed:
        print(f"{verb} {os.path.relpath(a.path)} ({a.state}, {a.size() / 1e6:.1f} MB)")
    print(f"{verb} {len(removed)} non-current artifacts", file=sys.stderr)


def cmd_snapshot(args: argparse.Namespace) -> None:
    from eaglet.formats.store import Store, store_path

    params = _params(args)
    source = store_path(params.root)
    if not source.exists():
        raise EagletError(f"{source}: no response store yet (nothing generated)")
    store = Store(source)
    try:
        out = store.snapshot(params.root / "data" / "store" / source.name)
    finally:
        store.close()
    print(os.path.relpath(out))


def cmd_publish(args: argparse.Namespace) -> None:
    from eaglet.reports.publish import publish

    for path in publish(_params(args)):
        print(path)


def cmd_compare(args: argparse.Namespace) -> None:
    from eaglet.reports.compare import compare, dvc_diffs, render

    repo = Path(args.repo).resolve()
    tables = compare(repo, args.rev_a, args.rev_b, args.params)
    print(render(tables, args.rev_a, args.rev_b, md=args.md))
    extra = dvc_diffs(repo, args.rev_a, args.rev_b, md=args.md)
    if extra:
        print(extra)


def cmd_report(args: argparse.Namespace) -> None:
    from eaglet.reports import report

    print(report.write(_params(args), args.drafter, args.out))


def cmd_path(args: argparse.Namespace) -> None:
    from eaglet.graph.keys import STAGES, Keys, stage_named

    exports = f"eaglet path sglang {args.name} or eaglet path vllm {args.name}"
    kind = stage_named(args.stage, exports).kind
    params = _params(args)
    names = {"dataset": params.datasets, "drafter": params.drafters}
    if args.name not in names[kind]:
        known = ", ".join(names[kind]) or "none"
        other = "drafter" if kind == "dataset" else "dataset"
        stages = ", ".join(s for s, st in STAGES.items() if st.kind == other)
        hint = f"; '{args.name}' is a {other}, its stages: {stages}" * (args.name in names[other])
        raise EagletError(f"{params.path}: no {kind} '{args.name}' (known: {known}){hint}")
    print(Keys(params).path(args.stage, args.name))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        default=os.environ.get("EAGLET_PARAMS", "params.yaml"),
        help="params file (default: $EAGLET_PARAMS or ./params.yaml)",
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eaglet", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"eaglet {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    _stage_commands(sub)
    _view_commands(sub)
    _upkeep_commands(sub)
    _publish_commands(sub)
    return ap


def _run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, help="torch threads (Snakemake passes {threads})")
    p.add_argument("--quiet", action="store_true", help="log lines instead of a live bar")


def _stage_commands(sub: argparse._SubParsersAction) -> None:
    """One command per stage of the pipeline, each building one artifact."""

    def stage(name: str, fn: Callable, help: str, what: str = "dataset") -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument(what, help=f"{what} name from params.yaml")
        p.add_argument("--out", type=Path, help="write here instead of the keyed path")
        p.add_argument("--key", help="fail unless this is the artifact's current key")
        _add_common(p)
        p.set_defaults(fn=fn)
        return p

    stage("prompts", cmd_prompts, "read a raw dataset into prompt records")
    g = stage("generate", cmd_generate, "regenerate responses with the target")
    _run_flags(g)
    g.add_argument(
        "--dry-run", action="store_true", help="check the backend, say what a run would do"
    )

    p = sub.add_parser("import-responses", help="file a foreign raw_responses.jsonl in the store")
    p.add_argument("dataset", help="dataset name from params.yaml (its backend and sampling)")
    p.add_argument("file", type=Path, help="JSON lines in OpenAI or SGLang shape")
    _add_common(p)
    p.set_defaults(fn=cmd_import_responses)

    h = stage("hidden", cmd_hidden, "store the target's hidden states for the responses")
    _run_flags(h)
    h.add_argument("--verify", action="store_true", help="re-run the target, compare")
    h.add_argument("--samples", type=int, help="records --verify re-runs")
    stage("vocab", cmd_vocab, "pick the draft vocabulary from the assistant tokens", "drafter")
    _run_flags(stage("train", cmd_train, "train the EAGLE-3 drafter (torchrun for DDP)", "drafter"))
    text = "speculative decoding against the target: acceptance"
    _run_flags(stage("evaluate", cmd_evaluate, text, "drafter"))
    g = stage("export", cmd_export, "write and validate an SGLang or vLLM draft folder", "drafter")
    g.add_argument("--to", choices=["sglang", "vllm"], required=True, help="serving engine")


def _view_commands(sub: argparse._SubParsersAction) -> None:
    """The whole graph seen: planned before anything runs, each artifact's state and key."""
    p = sub.add_parser("plan", help="prompts, tokens, dollars and disk before anything runs")
    p.add_argument("--target-config", type=Path, help="the target's config.json, if not local")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--gpu-memory", type=float, default=96, help="GiB per GPU for training (RTX PRO 6000: 96)"
    )
    p.add_argument(
        "--free-disk",
        type=float,
        metavar="GB",
        help="the node's free disk, when planned from elsewhere (default: measured here)",
    )
    _add_common(p)
    p.set_defaults(fn=cmd_plan)

    for name, fn, text, json_help in [
        (
            "status",
            cmd_status,
            "every artifact: current key, built or missing, stats",
            "machine-readable output",
        ),
        (
            "keys",
            cmd_keys,
            "every artifact's current key and the inputs that make it",
            "full provenance as JSON",
        ),
    ]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true", help=json_help)
        _add_common(p)
        p.set_defaults(fn=fn)

    p = sub.add_parser("path", help="print the current keyed path of an artifact")
    p.add_argument("stage")
    p.add_argument("name")
    _add_common(p)
    p.set_defaults(fn=cmd_path)


def _upkeep_commands(sub: argparse._SubParsersAction) -> None:
    """The graph kept honest and small: code versions, old artifacts, the store's copy."""
    p = sub.add_parser("code", help="each stage's code version and kernel digest against the lock")
    p.add_argument("--lock", action="store_true", help="record versions and digests in the lock")
    p.add_argument(
        "--same-bytes",
        action="append",
        default=[],
        metavar="STAGE",
        help="with --lock: STAGE's kernel changed but writes the same bytes (no version bump)",
    )
    p.set_defaults(fn=cmd_code)

    p = sub.add_parser("gc", help="remove non-current keyed artifacts (DVC's cache keeps them)")
    p.add_argument("--dry-run", action="store_true", help="only list what would go")
    _add_common(p)
    p.set_defaults(fn=cmd_gc)

    p = sub.add_parser(
        "snapshot", help="copy the response store (every paid answer) to data/store/ for DVC"
    )
    _add_common(p)
    p.set_defaults(fn=cmd_snapshot)


def _publish_commands(sub: argparse._SubParsersAction) -> None:
    """What the graph made, shown to others: metrics for DVC, two versions side by side, a
    drafter's page."""
    p = sub.add_parser("publish", help="write current metrics at stable paths for DVC")
    _add_common(p)
    p.set_defaults(fn=cmd_publish)

    p = sub.add_parser("compare", help="compare two pipeline versions (git revs or workspace)")
    p.add_argument("rev_a")
    p.add_argument("rev_b", nargs="?", default="workspace")
    p.add_argument("--md", action="store_true", help="Markdown tables")
    p.add_argument("--repo", default=".", help="git repository (default: .)")
    p.add_argument(
        "--params", default="params.yaml", help="params file, relative to the repository"
    )
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("report", help="one HTML page: acceptance, training curves, provenance")
    p.add_argument("drafter", help="drafter name from params.yaml")
    p.add_argument("--out", type=Path, help="write here (default: reports/<drafter>.html)")
    _add_common(p)
    p.set_defaults(fn=cmd_report)


def _refused(e: Exception) -> int:
    """A write the filesystem refused where no eaglet write named its file: one line, exit 2;
    any other error is a bug, with its traceback."""
    from eaglet.atomic import write_failure

    reason = write_failure(e, Path.cwd())
    if reason is None:
        raise e
    fix = "make it writable" if "read-only" in reason.lower() else "free space"
    print(f"eaglet: error: cannot write ({reason}): {fix}, then rerun", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except EagletError as e:
        print(f"eaglet: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only or full filesystem, a path that is not a folder ...
        if e.filename is None:
            return _refused(e)
        where = f"{e.filename} -> {e.filename2}" if e.filename2 else e.filename
        print(f"eaglet: error: {where}: {e.strerror or e}", file=sys.stderr)
        return 2
    except Exception as e:  # safetensors', torch's wrappers of a refused write
        return _refused(e)
    except KeyboardInterrupt:
        print("eaglet: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
