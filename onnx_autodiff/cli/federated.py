"""``onnx-autodiff federated simulate``: a Flower simulation of a training model over a folder of partitions."""
from __future__ import annotations

import os

import numpy as np

from .common import CliError

STRATEGY_NAMES = ("fedavg", "fedprox", "fedadam", "fedyogi", "fedadagrad", "fedmedian", "fedtrimmedavg", "krum")


def add_parsers(sub, common) -> None:
    """``federated simulate`` on the parser's ``sub`` (subparsers) with the ``common`` options."""
    fed = sub.add_parser("federated", parents=[common], help="federated learning on Flower (the federated extra)")
    verbs = fed.add_subparsers(dest="verb", required=True, metavar="VERB")
    s = verbs.add_parser("simulate", parents=[common],
                         help="simulate a federation: one client per DIR/client-<i>.npz, a line per round")
    s.add_argument("model", metavar="MODEL", help="the training model (.onnx, from make-training)")
    s.add_argument("--data-dir", required=True, metavar="DIR", help="client-0.npz, client-1.npz, ...: one per client")
    s.add_argument("--clients", type=int, default=None, metavar="N",
                   help="how many clients (default: the number of client-<i>.npz files)")
    s.add_argument("--rounds", type=int, default=3, metavar="N", help="federated rounds (default: %(default)s)")
    s.add_argument("--strategy", default="fedavg", choices=STRATEGY_NAMES,
                   help="Flower's strategy (default: %(default)s)")
    s.add_argument("--proximal-mu", type=float, default=None, metavar="MU",
                   help="FedProx's mu (with --strategy fedprox; default: Flower's)")
    s.add_argument("--local-epochs", type=int, default=1, metavar="N",
                   help="epochs each client trains per round (default: %(default)s)")
    s.add_argument("--batch-size", type=int, default=32, metavar="N", help="local batch size (default: %(default)s)")
    s.add_argument("--runtime", default="onnxruntime", metavar="NAME",
                   help="the clients' runtime, any train --runtime takes (default: %(default)s)")
    s.add_argument("--test", metavar="NPZ", help="held-out arrays (inputs and labels): loss and accuracy per round")
    s.add_argument("--out", metavar="DIR", help="the global model: checkpoint.onnx after every round (a rerun "
                   "resumes), model.onnx at the end (default: none written)")
    s.set_defaults(run=cmd_simulate)


def _count(folder: str) -> int:
    if not os.path.isdir(folder):
        raise CliError(f"--data-dir {folder!r} is not a folder", "give the folder of client-<i>.npz files")
    n = 0
    while os.path.exists(os.path.join(folder, f"client-{n}.npz")):
        n += 1
    if n == 0:
        raise CliError(f"{folder!r} holds no client-0.npz", "write one client-<i>.npz per client, i from 0")
    return n


def cmd_simulate(args) -> int:
    try:
        from flwr.simulation import run_simulation

        from ..federated import client_app, server_app
    except ImportError as e:
        raise CliError(f"Flower is not installed ({e})", "pip install 'onnx-autodiff[federated]'") from None
    clients = args.clients or _count(args.data_dir)
    test = None
    if args.test:
        with np.load(args.test, allow_pickle=False) as z:
            test = {k: z[k] for k in z.files}
    options = {"proximal_mu": args.proximal_mu} if args.proximal_mu is not None else {}
    quiet = getattr(args, "quiet", False)
    client = client_app(args.model, args.data_dir, runtime=args.runtime, local_epochs=args.local_epochs,
                        batch_size=args.batch_size)
    server = server_app(args.model, args.strategy, rounds=args.rounds, min_clients=clients, evaluate=test,
                        out=args.out, log=(lambda s: None) if quiet else (lambda s: print(s, flush=True)), **options)
    run_simulation(server_app=server, client_app=client, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1}}, verbose_logging=False)
    if len(server.history) == 0:
        raise CliError("the simulation ran no round (see Flower's log above)", "")
    return 0
