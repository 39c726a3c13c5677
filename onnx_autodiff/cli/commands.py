"""The commands on model files: lower, make-training, export, export-step, export-adapter, rules, demo."""
from __future__ import annotations

import os
import sys

from ..driver.progress import stage
from ..model.carrier import open_model
from ..model.io import check_output_path
from .common import PROG, CliError, load_onnx

# ---- lower --------------------------------------------------------------------------------------

def cmd_lower(args) -> int:
    from ..passes.pipeline import lower_light
    from ..passes.training import training_nodes_left

    check_output_path(args.output, "output", not_same_as=(args.input,))
    light = open_model(args.input)
    before = len(training_nodes_left(light.proto))
    with stage(f"lowering {args.input}"):
        out = lower_light(light, target_opset=args.target_opset)
    out.save(args.output)
    graph, infos = out.proto.graph, out.proto.training_info
    print(f"lowered {before} training node(s) (Gradient, GraphCall, optimizers) to standard ONNX; wrote "
          f"{args.output} ({len(graph.node)} nodes in the graph, {len(infos)} training_info)")
    return 0


# ---- make-training ------------------------------------------------------------------------------

def _parse_losses(specs: list[str]):
    """``NAME`` | ``PATH.onnx`` | ``OUTPUT=NAME[:WEIGHT]`` -> (loss for make_training_model, loss_weights)."""
    def one(text: str):
        if text.endswith(".onnx"):
            return load_onnx(text, "loss graph").graph
        return text

    if len(specs) == 1 and "=" not in specs[0]:
        return one(specs[0]), None
    losses, weights = {}, {}
    for spec in specs:
        if "=" not in spec:
            raise CliError(f"--loss {spec!r}: with several losses each one is OUTPUT=LOSS[:WEIGHT]",
                           "for example --loss logits=cross_entropy --loss aux=mse:0.5")
        out, rest = spec.split("=", 1)
        weight = 1.0
        if ":" in rest:
            head, tail = rest.rsplit(":", 1)
            try:
                weight = float(tail)
                rest = head
            except ValueError:
                pass
        losses[out] = one(rest)
        weights[out] = weight
    return losses, weights


def named_sizes(specs: list[str] | None, flag: str = "--budget-dim") -> dict[str, int]:
    """``NAME=SIZE`` pairs -> {NAME: SIZE}."""
    dims = {}
    for spec in specs or []:
        name, _, size = spec.partition("=")
        if not name or not size.isdigit() or int(size) <= 0:
            raise CliError(f"{flag} {spec!r}: expected NAME=SIZE with a positive integer size",
                           f"for example {flag} batch=32 {flag} sequence=128")
        dims[name] = int(size)
    return dims


def cmd_make_training(args) -> int:
    from ..training import LossSpec, MemoryBudget, OptimizerSpec, build_training_model, builder_record

    check_output_path(args.output_path, "output", not_same_as=(args.input,))
    light = open_model(args.input)
    loss, weights = _parse_losses(args.loss or ["cross_entropy"])
    for text in args.loss or []:
        _say_alias(text.split("=", 1)[1].rsplit(":", 1)[0] if "=" in text else text)
    options = {}
    for key in ("momentum", "dampening", "weight_decay", "eps", "lr_decay"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.betas is not None:
        options["betas"] = tuple(args.betas)
    label = args.label
    if label and len(label) == 1 and "=" not in label[0]:
        label = label[0]
    elif label:
        label = dict(x.split("=", 1) for x in label)
    spec = LossSpec(loss, outputs=args.output, label=label, weights=weights, options=_loss_options(args))
    budget = None if args.memory_budget is None else MemoryBudget(args.memory_budget, named_sizes(args.budget_dim))
    with stage(f"building the training model of {args.input}"):
        out = build_training_model(light, spec, OptimizerSpec(args.optimizer, options), lr=args.lr,
                                   trainable=args.trainable, frozen=args.frozen, lora=_lora(args),
                                   memory_budget=budget, precision=args.precision)
    out.save(args.output_path)
    rec = builder_record(out.proto)
    floats = {t.name for t in light.proto.graph.initializer if t.data_type in (1, 10, 11, 16)}
    shown = ", ".join(rec["trainable"][:8]) + (", ..." if len(rec["trainable"]) > 8 else "")
    print(f"loss on {', '.join(rec['outputs'])} (label input(s): {', '.join(rec['labels'])}); optimizer "
          f"{rec['optimizer']}, lr {rec['lr']:g} (input {rec['learning_rate']!r})")
    added = [n for n in rec["trainable"] if n not in floats]  # LoRA's adapters: not initializers of the model
    print(f"trainable: {len(rec['trainable']) - len(added)} of the model's {len(floats)} float initializers"
          + (f" and {len(added)} LoRA adapter tensors" if added else "") + f" ({shown})")
    if args.memory_budget is not None:
        from ..passes.pipeline import lower_light
        from ..passes.remat import remat_summary
        print(remat_summary(lower_light(out).proto))  # the plan the lowering of every run will make
    print(f"wrote {args.output_path}; train it with: {PROG} train {args.output_path} --data DATA.npz --checkpoint DIR")
    return 0


def _say_alias(name: str) -> None:
    """Say which loss an alias (``--loss crossentropy``) stands for: aliases are accepted, and said."""
    from ..training.losses import find_loss

    loss = None if name.endswith(".onnx") else find_loss(name)
    if loss is not None and loss.name != name:
        print(f"--loss {name}: an alias of {loss.name}")


def _loss_options(args) -> dict | None:
    """``--loss-option KEY=VALUE`` (repeated) -> a dict; integer values become ints."""
    out = {}
    for text in args.loss_option or []:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise CliError(f"--loss-option {text!r}: expected KEY=VALUE", "for example --loss-option axis=-1")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out or None


def _lora(args) -> dict | None:
    if args.lora_rank is None:
        if args.lora_targets or args.lora_alpha is not None or args.lora_dropout is not None \
                or getattr(args, "lora_base_backward", None) is not None:
            raise CliError("--lora-targets/--lora-alpha/--lora-dropout/--lora-base-backward need --lora-rank",
                           "for example "
                           "--lora-rank 8 --lora-alpha 16 --lora-targets q_proj,v_proj")
        return None
    if not args.lora_targets:
        raise CliError("--lora-rank needs --lora-targets", "for example --lora-targets q_proj,v_proj")
    spec = {"rank": args.lora_rank, "targets": args.lora_targets}
    if args.lora_alpha is not None:
        spec["alpha"] = args.lora_alpha
    if args.lora_dropout is not None:
        spec["dropout"] = args.lora_dropout
    if getattr(args, "lora_base_backward", None) is not None:
        spec["base_backward"] = args.lora_base_backward
    return spec


# ---- export, rules, demo -----------------------------------------------------------------

def cmd_export(args) -> int:
    from ..driver.session import TrainingSession
    from ..training.lora.merge import lora_record

    check_output_path(args.output, "export: OUT", not_same_as=(args.model,))
    light = open_model(args.model, base=args.base)
    if not len(light.proto.training_info):
        raise CliError(f"{args.model!r} has no training_info: it already is an inference model",
                       "export takes a training model or a checkpoint written by train")
    sess = TrainingSession(light)
    sess.export_inference(args.output, adapters=args.adapters)
    lora = "" if lora_record(light.proto) is None else (
        ", LoRA adapters merged" if args.adapters == "merged" else ", LoRA adapters as inputs (zero by default)")
    print(f"wrote {args.output}: the inference graph with the trained weights ({sess.steps} steps{lora}), "
          "no training_info")
    return 0


def cmd_export_step(args) -> int:
    from ..driver.bundle import export_step

    path = export_step(open_model(args.model, base=args.base), args.out_dir, target=args.target,
                       dims=named_sizes(args.dim, "--dim") or None)
    print(f"wrote the step bundle for target {args.target!r}: {path} (step.onnx, init.onnx beside it)")
    _symbolic_dims_note(path, args.target)
    return 0


def _symbolic_dims_note(manifest_path, target: str) -> None:
    """For a target that is an onnxruntime execution provider (WebGPU): the symbolic dims of the feeds leave shape
    arithmetic to the CPU, which ``--dim`` avoids (docs/gpu.md)."""
    import json

    from ..runtimes.targets import get_target

    if get_target(target).ep is None:
        return
    with open(manifest_path) as f:
        feeds = json.load(f)["feeds"]
    dims = sorted({d for f in feeds for d in f["shape"] or [] if isinstance(d, str)})
    if dims:
        fix = " ".join(f"--dim {d}=SIZE" for d in dims)
        print(f"note: the feeds have the symbolic dim(s) {', '.join(dims)}: onnxruntime's {target} execution provider "
              f"runs their shape arithmetic on the CPU (check --target {target} lists the nodes); export again with "
              f"{fix} (the batch size you train with) to fold it into constants")


def cmd_export_adapter(args) -> int:
    from ..training.lora.adapters import export_adapter
    from ..training.lora.merge import lora_record

    light = open_model(args.model, base=args.base)
    record = lora_record(light.proto)
    if record is None:
        raise CliError(f"{args.model!r} has no LoRA adapters (no onnx_autodiff.lora metadata)",
                       f"build the training model with {PROG} make-training ... --lora-rank R --lora-targets ...")
    if os.path.isfile(args.out_dir):
        raise CliError(f"OUT_DIR {args.out_dir!r} is a file", "name a directory")
    if args.genai_folder and args.format != "genai":
        raise CliError("--genai-folder names the onnxruntime-genai folder of --format genai",
                       "drop --genai-folder, or add --format genai")
    if args.family and args.format != "peft":
        raise CliError("--family names the Hugging Face family of --format peft's module names",
                       "drop --family, or add --format peft")
    if args.format == "genai":
        from ..training.genai_folder import export_genai

        named = [os.path.dirname(os.path.abspath(args.base))] if args.base else []
        paths = export_genai(light, args.out_dir, args.genai_folder, trusted=named)  # the base the user named
    else:
        paths = export_adapter(light, args.out_dir, args.format, prefix=args.prefix or "", base=args.base,
                               family=args.family)
    print(f"wrote {', '.join(paths)}: {len(record['layers'])} LoRA layers, rank {record['rank']}")
    if args.format == "genai":
        print(f"{args.out_dir} is the onnxruntime-genai folder: og.Adapters(og.Model({args.out_dir!r})).load("
              f"{paths[-1]!r}, NAME), then generator.set_active_adapter(adapters, NAME)")
    if args.format == "onnxruntime":
        print(f"the model that reads them: {PROG} export {args.model} MODEL.onnx --adapters inputs")
    return 0


def cmd_rules(args) -> int:
    from ..engine.coverage import coverage_markdown, coverage_rows

    if args.markdown:
        sys.stdout.write(coverage_markdown())
        return 0
    rows = coverage_rows()
    widths = [max(len(r[k]) for r in rows + [("domain", "op", "status", "detail")]) for k in range(3)]
    print(f"{'domain':{widths[0]}}  {'op':{widths[1]}}  {'status':{widths[2]}}  detail")
    for d, op, status, detail in rows:
        print(f"{d:{widths[0]}}  {op:{widths[1]}}  {status:{widths[2]}}  {detail}")
    n_rule = sum(r[2] == "rule" for r in rows)
    n_fn = sum(r[2] == "function body" and "no rule" not in r[3] for r in rows)
    n_none = sum(r[2] == "no gradient" for r in rows)
    print(f"{n_rule} op types with a gradient rule, {n_fn} more differentiated through their schema's function "
          f"body, {n_none} declared without gradient (as in docs/operators.md)")
    return 0


def cmd_demo(args) -> int:
    from . import demo

    if args.epochs < 1:
        raise CliError("--epochs must be at least 1", "the default is 12")
    if args.web:
        import time

        from ..web import demo_page

        demo_page.serve(os.path.join(args.out, "web"), args.port, args.ort_web, seed=args.seed, epochs=args.epochs)
        while True:  # the server runs in a thread; Ctrl-C ends the command
            time.sleep(3600)
    demo.run(args.out, epochs=args.epochs, seed=args.seed, progress=not args.quiet)
    return 0
