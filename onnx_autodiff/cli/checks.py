"""The commands that check: ``check`` (gradients against central differences; ``--target``: whether the model
trains on a runtime), ``gradcheck`` (the same check with the backward on any runtime) and ``conformance`` (every
rule case and random graphs through runtimes: the tables of onnx_autodiff/data/conformance/)."""
from __future__ import annotations

import sys

import numpy as np

from ..model.carrier import open_model
from .commands import named_sizes
from .common import CHECK_LIMIT, PROG, CliError


def cmd_check(args) -> int:
    if args.target:
        return cmd_check_target(args)
    return _gradcheck(args, "auto", "check")


def cmd_gradcheck(args) -> int:
    return _gradcheck(args, args.runtime, "gradcheck")


def _check_inputs(m, seed: int, dims: dict | None = None) -> dict:
    """gradcheck's inputs for a decoder reading its past through an attention op: the batch the training driver
    feeds (``input_dims.probe_feeds``: token ids over the vocabulary, the KV cache empty, masks all ones)."""
    from ..check.input_dims import probe_feeds

    return probe_feeds(m, seed, dims)


def _chain(*steps):
    """One ``expand`` applying each of ``steps`` that is not None, in order (None when none is)."""
    steps = [f for f in steps if f is not None]
    if not steps:
        return None

    def expand(model):
        for f in steps:
            model = f(model)
        return model

    return expand


def _unjudged_in_float64(m, command: str) -> bool:
    """Whether ``m`` holds a contrib op with no float64 reference here (no standard-ONNX form): then the check runs in
    float32 on onnxruntime's kernels, and says which op it could not judge in float64."""
    from ..check.contrib_forms import expand_contrib, has_contrib_ops
    from ..check.llm_files import dequantized, has_quantized_ops
    from ..errors import GradcheckError

    if not has_contrib_ops(m):
        return False
    try:
        expand_contrib(dequantized(m) if has_quantized_ops(m) else m)
    except GradcheckError as e:
        print(f"{command}: not judged in float64: {str(e).split(';')[0]}; the whole check runs in float32 on "
              "onnxruntime's kernels (rtol 1e-2, as --float32)")
        return True
    return False


def _run_gradcheck(m, feeds: dict, **kwargs):
    """``gradcheck``; a CliError naming the inputs' sizes when an evaluator cannot run the model on them (onnx's
    reference evaluator raises numpy's errors: 'negative dimensions are not allowed' for an image smaller than a
    kernel)."""
    from ..check.gradcheck import gradcheck
    from ..errors import OnnxAutodiffError

    try:
        return gradcheck(m, feeds, **kwargs)
    except OnnxAutodiffError:
        raise
    except Exception as e:  # each evaluator raises its own types
        sizes = ", ".join(f"{k} {tuple(np.shape(v))}" for k, v in feeds.items())
        text = str(e).strip()
        raise CliError(f"the model could not run on the check's inputs ({sizes}): "
                       f"{text.splitlines()[0] if text else type(e).__name__}",
                       "give the sizes the model takes: --dim NAME=N for its symbolic dims") from e


def _dims(m, args) -> dict[str, int]:
    """Sizes of the model's symbolic input dims: ``--dim`` ones, and those its graph allows (``input_dims``)."""
    from ..check.input_dims import fitted_dims, symbolic_dims

    given = named_sizes(getattr(args, "dim", None), "--dim")
    unknown = sorted(set(given) - symbolic_dims(m))
    if unknown:
        raise CliError(f"--dim names {', '.join(map(repr, unknown))}, not a symbolic dim of the model's inputs",
                       f"its symbolic dims: {', '.join(sorted(symbolic_dims(m))) or 'none'}")
    dims = fitted_dims(m, given, args.seed)
    found = {k: v for k, v in dims.items() if k not in given}
    if found:
        print(f"sized from the graph: {', '.join(f'{k}={v}' for k, v in sorted(found.items()))} (--dim NAME=N sets "
              "one)")
    return dims


def _gradcheck(args, runtime: str, command: str) -> int:
    import onnx

    from ..check.contrib_forms import expand_contrib, has_contrib_ops
    from ..check.llm_files import dequantized, feed_sets, has_quantized_ops
    from ..driver.kv_cache import ATTENTION_PAST
    from ..graph import FLOAT_TYPES, normalize_domain
    from ..runtimes.targets import FLOAT64_RUNTIMES
    from ..training.trainable import default_frozen

    light = open_model(args.model)
    size = sum(np.asarray(a).nbytes for a in light.arrays.values())
    if size > CHECK_LIMIT:
        raise CliError(f"{command} promotes every weight to float64 in one model; {args.model!r} holds "
                       f"{size / 2**30:.1f} GiB of tensors, past what one ONNX model (2 GiB) can hold",
                       "gradcheck a smaller model with the same ops, or one layer of it (onnx.utils.extract_model)")
    m = light.whole()
    del m.training_info[:]
    infos = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(m).graph.output}
    floats = [o.name for o in m.graph.output if infos.get(o.name, o).type.tensor_type.elem_type in FLOAT_TYPES]
    if not floats:
        raise CliError("the model has no floating-point output to differentiate", f"{command} takes a float model")
    of = args.output or floats[0]
    # what takes no gradient by design: the quantization constants a kernel needs as constants and the constants
    # an exporter stores as initializers (rotary tables, batch-norm statistics, masks): training leaves them out too
    constant = default_frozen(m)
    wrt = [t.name for t in m.graph.initializer if t.data_type in FLOAT_TYPES and t.name not in constant]
    if not wrt:
        raise CliError("the model has no floating-point initializer to differentiate by",
                       f"{command} differentiates the first float output w.r.t. the float initializers")
    left = sorted({t.name for t in m.graph.initializer if t.name in constant and t.data_type in FLOAT_TYPES})
    if left:
        kinds = ", ".join(sorted({constant[n] for n in left}))
        print(f"left out {len(left)} float initializer(s) that take no gradient by design ({kinds})")
    elsewhere = runtime not in FLOAT64_RUNTIMES
    float32 = args.float32 or _unjudged_in_float64(m, command)
    rtol = args.rtol if args.rtol is not None else (1e-2 if float32 else None)
    eps = args.eps if args.eps else (1e-3 if float32 else 1e-6)
    contrib = expand_contrib if not float32 and has_contrib_ops(m) else None
    # float64 has no quantized kernels, and the dynamic int8 product is a step function of its input: a float
    # reference of the quantized ops (llm_files.dequantized), then the contrib ops' standard forms
    reference = (lambda model: dequantized(model, computed=not float32)) if has_quantized_ops(m) else None
    expand = _chain(reference, contrib)
    # an attention op reading the past (the model builder's GroupQueryAttention) is checked over an empty cache (its
    # standard form takes no other, check/contrib_forms.py); a past concatenated in standard ops (Optimum's
    # exports) gets 2 positions and a mask over past + sequence (llm_files.feed_sets)
    attention_past = any((normalize_domain(n.domain), n.op_type) in ATTENTION_PAST for n in m.graph.node)
    dims = _dims(m, args)
    sets = [("", _check_inputs(m, args.seed, dims))] if attention_past else feed_sets(m, args.seed, args.padding, dims)
    failed = None
    for label, feeds in sets:
        report = _run_gradcheck(m, feeds, of=of, wrt=wrt, float64=not float32, raise_on_failure=False,
                                seed=args.seed, rtol=rtol, eps=eps, expand=expand, runtime=runtime)
        if label:
            print(f"with {label}:")
        print(report)
        if not report.ok:
            failed = failed or report
    if failed is None:
        forms = " (onnxruntime's contrib ops in float64 through their standard-ONNX forms)" if contrib else ""
        where = f" (the backward on {runtime}, in float32)" if elsewhere else ""
        print(f"ok: {len(report.checks)} tensor(s) agree with central differences{forms}{where}")
        return 0
    worst = failed.worst
    print(f"{PROG} {command}: error: the gradient of {of!r} w.r.t. {worst.name!r} disagrees with finite differences "
          f"(relative error {worst.rel_err:.2e}){f' on {runtime}' if elsewhere else ''}; hint: find the op with "
          "--debug or gradcheck one node at a time", file=sys.stderr)
    return 1


def cmd_check_target(args) -> int:
    from ..passes.standard_forms import float32_text
    from ..runtimes.check import check_target
    from ..runtimes.targets import get_target
    from ..training.lora.merge import lora_record

    light = open_model(args.model)
    result = check_target(light, args.target, named_sizes(args.dim, "--dim") or None)
    lines = result.lines
    lora = lora_record(light.proto) or {}
    if not result.ok and lora.get("dropout") and any("Dropout" in line for line in lines):
        lines.insert(-1, f"hint: that Dropout is the LoRA adapters' (dropout {float32_text(lora['dropout'])}): make "
                         "the training model with --lora-dropout 0 (lora={..., 'dropout': 0}) to train on "
                         f"{args.target}")
    if get_target(args.target).ep is not None:
        lines = lines[:-1] + _fallback_lines(light, args.target, named_sizes(args.dim, "--dim") or None) + lines[-1:]
    print("\n".join(lines))
    return 0 if result.ok else 1


def _fallback_lines(light, target: str, dims) -> list[str]:
    """What onnxruntime's execution provider of the target does with the step (or model): the nodes it would run on
    the CPU (runtimes/placement.py)."""
    from ..runtimes.placement import placement_lines

    return placement_lines(light, target, dims)


def cmd_conformance(args) -> int:
    from ..conformance import conformance, docs_section, write_table
    from ..conformance.tables import text

    if args.markdown:
        sys.stdout.write(docs_section())
        return 0
    if not args.runtime:
        raise CliError("name the runtime(s) to run: --runtime R (repeat for several)",
                       "for example --runtime openvino --runtime tract")
    if args.graphs < 0:
        raise CliError("--graphs must be 0 or more", "the default is 300")
    ops = [o for o in args.ops.split(",") if o] if args.ops else None
    from ..conformance.subjects import SOURCES

    tables = conformance(args.runtime, graphs=args.graphs, seed=args.seed, ops=ops, progress=not args.quiet,
                         source=SOURCES[args.graphs_from])
    for table in tables.values():
        print(text(table))
        if args.out:
            print(f"wrote {', '.join(str(p) for p in write_table(table, args.out))}")
        if args.write:
            print(f"wrote {', '.join(str(p) for p in write_table(table))} (the checked-in table)")
    return 0


__all__ = ["cmd_check", "cmd_check_target", "cmd_gradcheck", "cmd_conformance"]
