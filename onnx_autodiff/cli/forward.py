"""The forward-mode commands: ``jvp``, ``hvp`` and ``jacobian`` (docs/forward_mode.md)."""
from __future__ import annotations

from ..model.io import check_output_path
from .common import save_output


def add_parsers(sub, common) -> None:
    """The three subcommands, on the parser's ``sub`` (subparsers) with the ``common`` options."""
    s = sub.add_parser("jvp", parents=[common],
                       help="add Jacobian-vector products: a <w>.tangent input per --wrt, a <y>.tangent output per "
                            "float output")
    _files(s)
    s.add_argument("--wrt", nargs="+", required=True, metavar="NAME", help="float graph inputs or initializers")
    s.set_defaults(run=cmd_jvp)
    s = sub.add_parser("hvp", parents=[common],
                       help="a scalar output, its gradient <w>.grad and Hessian-vector product <w>.hvp (inputs "
                            "<w>.tangent)")
    _files(s)
    s.add_argument("--wrt", nargs="+", required=True, metavar="NAME", help="float graph inputs or initializers")
    s.add_argument("--of", metavar="NAME", help="the scalar output (default: the only output)")
    s.set_defaults(run=cmd_hvp)
    s = sub.add_parser("jacobian", parents=[common],
                       help="add dense Jacobians d<of>/d<w> (shape of.shape + w.shape) as outputs")
    _files(s)
    s.add_argument("--of", nargs="+", required=True, metavar="NAME", help="float graph outputs")
    s.add_argument("--wrt", nargs="+", required=True, metavar="NAME", help="float graph inputs or initializers")
    s.set_defaults(run=cmd_jacobian)


def _files(s) -> None:
    s.add_argument("input", metavar="MODEL", help="the model (.onnx)")
    s.add_argument("output", metavar="OUT", help="where the model with the new outputs goes (.onnx)")


def _refuse_overwrite(args) -> None:
    """Refuse OUT when it is MODEL, before any work (as ``lower`` does)."""
    check_output_path(args.output, "output", not_same_as=(args.input,))


def _done(out, args) -> int:
    save_output(out, args.output)
    print(f"wrote {args.output}: {len(out.graph.node)} nodes; inputs {', '.join(i.name for i in out.graph.input)}; "
          f"outputs {', '.join(o.name for o in out.graph.output)}")
    return 0


def cmd_jvp(args) -> int:
    from ..forward import jvp

    _refuse_overwrite(args)
    return _done(jvp(args.input, args.wrt), args)


def cmd_hvp(args) -> int:
    from ..forward import hvp

    _refuse_overwrite(args)
    return _done(hvp(args.input, args.wrt, of=args.of), args)


def cmd_jacobian(args) -> int:
    from ..forward import jacobian

    _refuse_overwrite(args)
    return _done(jacobian(args.input, args.of, args.wrt), args)
