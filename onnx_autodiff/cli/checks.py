"""The commands that check: ``check`` (gradients against central differences; ``--target``: whether the model
trains on a runtime), ``gradcheck`` (the same check with the backward on any runtime) and ``conformance`` (every
rule case and random graphs through runtimes: the tables of onnx_autodiff/data/conformance/)."""
from __future__ import annotations

import sys

import numpy as np

from ..model.carrier import open_model
from .common import CHECK_LIMIT, PROG, CliError


def cmd_check(args) -> int:
    if args.target:
        return cmd_check_target(args)
    return _gradcheck(args, "auto", "check")


def cmd_gradcheck(args) -> int:
    return _gradcheck(args, args.runtime, "gradcheck")


def _gradcheck(args, runtime: str, command: str) -> int:
    import onnx

    from ..gradcheck import OWN_RUNTIMES, gradcheck
    from ..graph import FLOAT_TYPES

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
    wrt = [t.name for t in m.graph.initializer if t.data_type in FLOAT_TYPES]
    if not wrt:
        raise CliError("the model has no floating-point initializer to differentiate by",
                       f"{command} differentiates the first float output w.r.t. the float initializers")
    elsewhere = runtime not in OWN_RUNTIMES
    rtol = args.rtol if args.rtol is not None else (1e-2 if args.float32 else None)
    eps = args.eps if args.eps else (1e-3 if args.float32 else 1e-6)
    report = gradcheck(m, of=of, wrt=wrt, float64=not args.float32, raise_on_failure=False, seed=args.seed,
                       rtol=rtol, eps=eps, runtime=runtime)
    print(report)
    if report.ok:
        where = f" (the backward on {runtime}, in float32)" if elsewhere else ""
        print(f"ok: {len(report.checks)} tensor(s) agree with central differences{where}")
        return 0
    worst = report.worst
    print(f"{PROG} {command}: error: the gradient of {of!r} w.r.t. {worst.name!r} disagrees with finite differences "
          f"(relative error {worst.rel_err:.2e}){f' on {runtime}' if elsewhere else ''}; hint: find the op with "
          "--debug or gradcheck one node at a time", file=sys.stderr)
    return 1


def cmd_check_target(args) -> int:
    from ..runners.check import check_target

    result = check_target(open_model(args.model), args.target)
    print("\n".join(result.lines))
    return 0 if result.ok else 1


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
    tables = conformance(args.runtime, graphs=args.graphs, seed=args.seed, ops=ops, progress=not args.quiet)
    for table in tables.values():
        print(text(table))
        if args.out:
            print(f"wrote {', '.join(str(p) for p in write_table(table, args.out))}")
        if args.write:
            print(f"wrote {', '.join(str(p) for p in write_table(table))} (the checked-in table)")
    return 0


__all__ = ["cmd_check", "cmd_check_target", "cmd_gradcheck", "cmd_conformance"]
