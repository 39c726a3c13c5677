"""``onnx-autodiff federated simulate``: a Flower simulation of a training model over a folder of partitions."""
from __future__ import annotations

import os

import numpy as np

from .common import CliError

STRATEGY_NAMES = ("fedavg", "fedprox", "fedadam", "fedyogi", "fedadagrad", "fedmedian", "fedtrimmedavg", "krum")


def add_parsers(sub, common) -> None:
    """``federated simulate`` on the parser's ``sub`` (subparsers) with the ``common`` options."""
    fed = sub.add_parser("federated", parents=[common], help="federated learning on Flower (the federated extra)")
    verbs = fed.add_subparsers(dest="verb", required=True, metavar="VERB",
                               help="simulate (a Flower simulation) or new (a Flower App folder)")
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
    s.add_argument("--secure-aggregation", action="store_true",
                   help="the rounds through Flower's SecAgg+ (the server sees only the sum of the updates; "
                   "fedavg, fedprox, fedadam, fedyogi, fedadagrad)")
    s.set_defaults(run=cmd_simulate)
    s = verbs.add_parser("new", parents=[common],
                         help="write a Flower App folder (ServerApp and ClientApp of a training model) for flwr run")
    s.add_argument("dir", metavar="DIR", help="the folder to write (must not exist)")
    s.add_argument("--model", required=True, metavar="MODEL", help="the training model (.onnx)")
    s.add_argument("--data-dir", required=True, metavar="DIR", help="client-<i>.npz files, one per node's partition")
    s.add_argument("--clients", type=int, default=2, metavar="N",
                   help="simulated SuperNodes, and the clients a round needs (default: %(default)s)")
    s.add_argument("--min-clients", type=int, default=None, metavar="N",
                   help="the good replies a round needs, so that a run outlives nodes that die (default: --clients;"
                   " run config min-clients)")
    s.add_argument("--rounds", type=int, default=3, metavar="N", help="federated rounds (default: %(default)s)")
    s.add_argument("--strategy", default="fedavg", choices=STRATEGY_NAMES,
                   help="Flower's strategy (default: %(default)s)")
    s.add_argument("--local-epochs", type=int, default=1, metavar="N",
                   help="epochs each client trains per round (default: %(default)s; run config local-epochs)")
    s.add_argument("--batch-size", type=int, default=32, metavar="N",
                   help="local batch size (default: %(default)s; run config batch-size)")
    s.add_argument("--out", metavar="DIR", default=None,
                   help="where the server keeps the global model (default: DIR/global)")
    s.add_argument("--superlink", default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="the SuperLink of the local-deployment connection printed (default: %(default)s, "
                   "flower-superlink's own)")
    s.set_defaults(run=cmd_new)


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
    secure = getattr(args, "secure_aggregation", False)
    if secure:
        from flwr.client.mod import secaggplus_mod
    client = client_app(args.model, args.data_dir, runtime=args.runtime, local_epochs=args.local_epochs,
                        batch_size=args.batch_size, mods=[secaggplus_mod] if secure else None)
    server = server_app(args.model, args.strategy, rounds=args.rounds, min_clients=clients, evaluate=test,
                        out=args.out, log=(lambda s: None) if quiet else (lambda s: print(s, flush=True)),
                        secure_aggregation=True if secure else None, **options)
    run_simulation(server_app=server, client_app=client, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1}}, verbose_logging=False)
    if len(server.history) == 0:
        raise CliError("the simulation ran no round (see Flower's log above)", "")
    return 0


APP_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "Federated training of {model_name} with onnx-autodiff"
license = "Apache-2.0"
# Only flwr: Flower installs an App's other dependencies from its package index into a fresh environment per run
# (uv sync), so onnx-autodiff must be installed where the SuperLink and the SuperNodes run
dependencies = ["flwr>=1.42,<2"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "onnx-autodiff"

[tool.flwr.app.components]
serverapp = "{name}.server_app:app"
clientapp = "{name}.client_app:app"

# The run config: override with flwr run DIR --run-config 'num-server-rounds=5 min-clients=2'
[tool.flwr.app.config]
num-server-rounds = {rounds}
min-clients = {min_clients}
fraction-evaluate = 1.0
round-timeout = 3600.0
local-epochs = {local_epochs}
batch-size = {batch_size}
"""

SERVER_APP = """\"\"\"The ServerApp: {strategy} over the training model, the global model in {out!r}.

Flower's run config (pyproject.toml's [tool.flwr.app.config], or flwr run --run-config) sets the rounds, the good
replies a round needs (min-clients), the share of nodes that evaluate (0.0: none), how long a round waits, and
what each client's round trains (local-epochs, batch-size: sent to the clients with every round).
\"\"\"
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from onnx_autodiff.federated import server_app

MODEL = {model!r}
OUT = {out!r}
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    run = server_app(MODEL, {strategy!r}, rounds=int(config["num-server-rounds"]),
                     min_clients=int(config["min-clients"]), timeout=float(config["round-timeout"]),
                     fraction_evaluate=float(config["fraction-evaluate"]), out=OUT, log=print,
                     train_config={{"local-epochs": int(config["local-epochs"]),
                                   "batch-size": int(config["batch-size"])}})
    run(grid, context)
"""

CLIENT_APP = """\"\"\"The ClientApp: each node trains its partition, DATA/client-<partition-id>.npz (a round's
epochs and batch size come from the server, by the run config's local-epochs and batch-size).\"\"\"
from onnx_autodiff.federated import client_app

MODEL = {model!r}
DATA = {data!r}
app = client_app(MODEL, DATA)
"""

CONNECTIONS = """[superlink.local-simulation]
address = ":local:"
options.num-supernodes = {clients}

[superlink.local-deployment]
address = "{superlink}"
insecure = true
"""


def cmd_new(args) -> int:
    from ..federated import FederatedModel
    from ..model.io import write_atomic

    folder = os.path.abspath(args.dir)
    if os.path.exists(folder):
        raise CliError(f"{args.dir!r} exists", "give a new folder")
    FederatedModel(args.model)  # a model that cannot federate fails here
    min_clients = args.min_clients if args.min_clients is not None else args.clients
    if not 1 <= min_clients <= args.clients:
        raise CliError(f"--min-clients {min_clients} is not in 1..--clients ({args.clients})", "")
    for flag, value in (("--local-epochs", args.local_epochs), ("--batch-size", args.batch_size)):
        if value < 1:
            raise CliError(f"{flag} {value}: give a positive number", "")
    name = "".join(c if c.isalnum() else "_" for c in os.path.basename(folder).lower()).strip("_") or "app"
    if name[0].isdigit():
        name = "app_" + name
    values = {"name": name, "model": os.path.abspath(args.model), "model_name": os.path.basename(args.model),
              "data": os.path.abspath(args.data_dir), "rounds": args.rounds, "clients": args.clients,
              "min_clients": min_clients, "strategy": args.strategy, "superlink": args.superlink,
              "local_epochs": args.local_epochs, "batch_size": args.batch_size,
              "out": os.path.abspath(args.out or os.path.join(folder, "global"))}
    os.makedirs(os.path.join(folder, name))
    write_atomic(os.path.join(folder, "pyproject.toml"), APP_PYPROJECT.format(**values).encode())
    write_atomic(os.path.join(folder, name, "__init__.py"), b"")
    write_atomic(os.path.join(folder, name, "server_app.py"), SERVER_APP.format(**values).encode())
    write_atomic(os.path.join(folder, name, "client_app.py"), CLIENT_APP.format(**values).encode())
    print(f"wrote the Flower App {args.dir}/ ({name}.server_app:app, {name}.client_app:app); run it with: "
          f"flwr run {args.dir}")
    print("Flower reads its SuperLink connections from $FLWR_HOME/config.toml (default ~/.flwr/config.toml); "
          f"with these in it, flwr run {args.dir} local-simulation | local-deployment:\n")
    print(CONNECTIONS.format(**values))
    return 0
