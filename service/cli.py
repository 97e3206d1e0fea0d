"""The `rnnserve` command: convert, inspect, serve."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from . import __version__
from .errors import RNNServeError


def _convert(args: argparse.Namespace) -> int:
    from .loaders import convert

    options = {}
    if args.recurrent_activation:
        options["recurrent_activation"] = args.recurrent_activation
    model = convert(args.source, format=args.format, select=args.select, cell=args.cell,
                    verify=not args.no_verify, **options)
    stored_diff = None
    if args.dtype != "float32":
        from .loaders.verify import storage_difference

        stored_diff = storage_difference(model, args.dtype)
        model.provenance.setdefault("verification", {})["stored"] = {"dtype": args.dtype,
                                                                     "max_abs_diff_from_float32": stored_diff}
    out = model.save(args.repository, args.name, args.version, dtype=args.dtype, replace=args.overwrite)
    prov = model.provenance
    print(f"converted {prov['source']} ({prov['format']}, selection: {', '.join(prov['selection']) or '-'})")
    for note in prov.get("notes", []):
        print(f"note: {note}")
    for k, blk in enumerate(model.spec.blocks):
        variant = f", variant {', '.join(blk.variant_names)}" if blk.variant_names else ""
        print(f"block {k}: {blk.cell} I={blk.input_size} H={blk.hidden_size}"
              f"{f' proj={blk.proj_size}' if blk.proj_size else ''} layers={blk.num_layers} "
              f"{'bidirectional' if blk.bidirectional else 'unidirectional'}{variant}")
    ver = prov.get("verification", {})
    if ver.get("checked"):
        scope = f" ({ver['scope']})" if ver.get("scope") else ""
        print(f"verified against {prov['format']}{scope}: max abs difference {ver['max_abs_diff']:.3g} "
              f"on a probe batch (lengths {ver['probe']['lengths']})")
        whole = ver.get("whole_file")
        if whole is not None:
            print(_whole_file_line(whole))
            states = whole.get("state_inputs", {})
            if states.get("as_sent"):
                print(f"the file, run with random values in its state and lengths inputs, reads "
                      f"{', '.join(states['as_sent'])} as sent (the notes say how)")
            if whole.get("state_inputs_unchecked"):
                print(f"state or lengths inputs not checked on the file ({whole['state_inputs_unchecked']}): the "
                      f"notes on them are the graph's reading only")
    else:
        print(f"not verified: {ver.get('reason', 'verification disabled')}")
    if stored_diff is not None:
        print(f"stored as {args.dtype}: outputs move by up to {stored_diff:.3g} from the float32 model on that probe "
              f"(rounded weights)")
    print(f"wrote {out} ({model.parameter_count} parameters, {args.dtype})")
    _say_if_config_is_broken(out.parent.parent)
    return 0


def _say_if_config_is_broken(model_dir: Path) -> None:
    """A model folder's existing config.json is kept as it is; one the server will refuse is said now, not at serve
    time (the conversion succeeded and the model then failed to load)."""
    from .errors import InvalidInput
    from .repository import load_config

    try:
        load_config(model_dir)
    except InvalidInput as exc:
        print(f"warning: the model folder's config.json, kept as it was, will not load: {exc.message}; fix it "
              f"before serving this model", file=sys.stderr)


def _whole_file_line(whole: dict) -> str:
    """What running the whole source file found (ONNX: service.loaders.onnx_file_check; TorchScript:
    service.loaders.torchscript_check)."""
    if not whole.get("ran"):
        return f"the whole file was not run: {whole.get('reason', '')}; its recurrent layers were checked on their own"
    runtime = whole.get("runtime", "onnxruntime")
    if whole.get("compared"):
        within = f" within {whole['within']}" if whole.get("within") else ""
        return (f"the whole file ran in {runtime} and its output(s) {', '.join(repr(n) for n in whole['compared'])} "
                f"match the converted model{within}")
    why = whole.get("not_compared", "its outputs come from more than the served stack")
    return f"the whole file ran in {runtime}; {why}, so they were not compared"


def _inspect(args: argparse.Namespace) -> int:
    from .engines import create_engine
    from .packing import block_layout, block_param_count
    from .repository import load_model
    from .scheduler import MemoryBudget

    model = load_model(args.model)
    info = {
        "name": model.name, "version": model.version, "storage_dtype": model.storage_dtype,
        "parameters": model.parameter_count, "provenance": model.provenance,
        "blocks": [b.to_dict() for b in model.spec.blocks], "config": model.config.model_dump(),
    }
    engine_info = engine = None
    if args.device:
        engine = create_engine(model, args.device)
        engine_info = engine.describe()
        info["engine"] = engine_info
    # what max_batch_memory_mb means for this model (model config.json only: the server's flag may override it)
    budget = MemoryBudget.of(model.spec, model.config.max_batch_memory_mb, engine)
    info["memory"] = {"step_bytes": budget.step_bytes, "limit_bytes": budget.limit_bytes,
                      "max_sequence_steps": budget.max_steps}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"model {model.name} version {model.version}: {model.parameter_count} parameters, stored {model.storage_dtype}")
    print(f"source: {model.provenance.get('source')} ({model.provenance.get('format')}), "
          f"sha256 {str(model.provenance.get('sha256', ''))[:16]}..., {model.provenance.get('converter')}")
    for k, blk in enumerate(model.spec.blocks):
        print(f"\nblock {k}: cell={blk.cell} input_size={blk.input_size} hidden_size={blk.hidden_size} "
              f"proj_size={blk.proj_size} num_layers={blk.num_layers} bidirectional={blk.bidirectional} "
              f"variant={blk.variant or '-'}  ({block_param_count(blk)} floats)")
        print(f"  {'kind':<7}{'pseudo':>7}{'layer':>6}{'dir':>4}{'id':>4}  {'name':<8}{'shape':<12}{'offset':>10}")
        for e in block_layout(blk):
            layer, d = divmod(e.pseudo_layer, blk.directions)
            shape = "x".join(map(str, e.shape))
            print(f"  {e.kind:<7}{e.pseudo_layer:>7}{layer:>6}{d:>4}{e.lin_id:>4}  {e.describe(blk.cell):<8}{shape:<12}{e.offset:>10}")
        for name, arr in model.block_extras(k).items():
            print(f"  extra {name}: shape {list(arr.shape)}")
    source = (f"max_batch_memory_mb {model.config.max_batch_memory_mb}" if model.config.max_batch_memory_mb
              else "max_batch_memory_mb 0: a quarter of this machine's memory" + (" or GPU's" if engine else ""))
    print(f"\nmemory: about {budget.step_bytes:,} bytes of engine working memory per sequence step; {source} is "
          f"{budget.limit_bytes / 2**20:,.0f} MiB, at most {budget.max_steps:,} sequence steps (rows x longest "
          f"length) per engine call")
    if engine_info is not None:
        _print_engine(engine_info)
    return 0


def _print_engine(info: dict) -> None:
    """Engine facts; for the cuDNN engine, the algorithm the autotuner chose per block and batch bucket."""
    algos = info.get("algorithms") or []
    rest = {k: v for k, v in info.items() if k not in ("algorithms", "layouts")}
    print(f"\nengine: {', '.join(f'{k}={v}' for k, v in rest.items() if not isinstance(v, (list, dict)))}")
    layouts = {row.get("bucket"): row.get("layout") for row in info.get("layouts") or []}
    for block in algos:
        short, long = block.get("steps", "?"), block.get("long_steps", "?")
        # launch ms: the host time of that call uncaptured (a ragged batch), when graphs are timed
        print(f"  block {block.get('block')}: {'bucket':>6}  {'algorithm at T=' + str(short):<24}{'ms':>9}  "
              f"{'algorithm at T=' + str(long):<24}{'ms':>9}{'launch ms':>11}  io layout")
        for row in block.get("buckets", []):
            long_ms, host_ms = row.get("long_ms"), row.get("long_host_ms")
            print(f"  {'':9}{row.get('bucket'):>6}  {row.get('algo'):<24}{row.get('time_ms') or 0:>9.4f}  "
                  f"{row.get('algo_long', '-'):<24}{'-' if long_ms is None else f'{long_ms:.4f}':>9}"
                  f"{'-' if host_ms is None else f'{host_ms:.4f}':>11}  {layouts.get(row.get('bucket'), '-')}")
    timed = [row for row in info.get("layouts") or [] if "timed" in row]
    if timed:
        # the whole model per bucket in each IO layout; replayed where graphs are on (what served calls cost)
        print(f"  io layouts, whole model: {'bucket':>6}  {'timed':<11}{'batch-major ms':>16}{'seq-major ms':>14}  chosen")
        for row in timed:
            pairs = []
            for name in ("batch_major", "seq_major"):
                short, long = row.get(f"{name}_ms"), row.get(f"{name}_long_ms")
                pairs.append("error" if short is None else f"{short:.3f}" + ("" if long is None else f"/{long:.3f}"))
            print(f"  {'':25}{row.get('bucket'):>6}  {row.get('timed'):<11}{pairs[0]:>16}{pairs[1]:>14}  "
                  f"{row.get('layout')}")


def _folder(text: str) -> Path:
    """A folder argument; an empty one is refused (``Path("")`` would quietly be the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; name a folder (default ./models)")
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for `rnnserve` (serve's flags come from the settings class)."""
    parser = argparse.ArgumentParser(prog="rnnserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rnnserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="convert a PyTorch/Keras/ONNX file into the model repository")
    conv.add_argument("source", type=Path, help="model file: .pt .pth .safetensors TorchScript .keras .h5 .onnx")
    conv.add_argument("--name", required=True, help="model name in the repository")
    conv.add_argument("--repository", type=_folder, default=Path("models"), help="model repository (default ./models)")
    conv.add_argument("--version", type=int, default=1, help="version number (default 1)")
    conv.add_argument("--format", choices=["auto", "torch", "keras", "onnx"], default="auto")
    conv.add_argument("--select", help="submodule prefix (torch), layer names (keras) or node names (onnx), comma separated")
    conv.add_argument("--cell", choices=["lstm", "gru", "rnn_tanh", "rnn_relu"],
                      help="cell type where the shapes cannot tell (rnn_relu vs rnn_tanh)")
    conv.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                      help="storage precision of the weights (default float32)")
    conv.add_argument("--recurrent-activation", choices=["sigmoid", "hard_sigmoid"],
                      help="Keras weights-only files: override the assumed recurrent activation")
    conv.add_argument("--no-verify", action="store_true", help="skip running the source framework on a probe input")
    conv.add_argument("--overwrite", action="store_true",
                      help="replace the model if that version exists already (default: refuse)")
    conv.set_defaults(func=_convert)

    insp = sub.add_parser("inspect", help="show a converted model: spec, blocks, parameter count, layout table")
    insp.add_argument("model", help="REPO/NAME (latest version) or REPO/NAME/VERSION")
    insp.add_argument("--device", choices=["cpu", "cuda", "auto"], help="also build the engine and show its facts")
    insp.add_argument("--json", action="store_true", help="print JSON")
    insp.set_defaults(func=_inspect)

    srv = sub.add_parser("serve", help="serve a model repository over REST and gRPC", add_help=False)
    srv.set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rnnserve` console script."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "serve":
        from .app import serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RNNServeError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`rnnserve inspect ... | head`): no traceback, and none again when Python
        # flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
