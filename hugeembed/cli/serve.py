"""hugeembed serve: predictions over HTTP from an exported artifact (POST /predict, /healthz, /metrics, /reload)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an exported model over HTTP", description=__doc__)
    p.add_argument("artifact", metavar="PATH", help="directory written by `hugeembed export`")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--max-wait-ms", type=float, default=0.0,
                   help="longest a model call waits for more requests (0: requests queued while the previous call "
                        "ran join it, a lone one does not wait)")
    p.add_argument("--max-batch-rows", type=int, default=4096, help="rows per model call")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                   help="look for new deltas under PATH/deltas this often (default 0: never)")
    p.add_argument("--admin-token", metavar="FILE", help="a file holding the token that POST /reload must present "
                   "(Authorization: Bearer <token>); without it POST /reload is off. The file: yours, mode 600")
    p.add_argument("--delta-key", metavar="FILE", help="apply only deltas signed with this key (export --delta "
                   "--delta-key FILE signs them): a key file of yours, mode 600")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import ConfigError
    from ..serving import ServingModel
    from ..serving._server import ServerConfig, serve

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.max_wait_ms < 0 or args.max_batch_rows < 1 or args.watch < 0:
        raise ConfigError("--max-wait-ms and --watch must be >= 0 and --max-batch-rows >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..serving._trust import read_secret

    token = read_secret(args.admin_token, "--admin-token").decode(errors="replace").strip() if args.admin_token \
        else None
    if args.admin_token and not token:
        raise ConfigError(f"--admin-token {args.admin_token} holds no token")
    key = read_secret(args.delta_key, "--delta-key") if args.delta_key else None
    model = ServingModel.load(args.artifact, delta_key=key)
    if model.refused is not None:  # served: the longest valid prefix of the chain
        print(f"hugeembed serve: {model.refused}; serving {model.version}", file=sys.stderr, flush=True)
    print(f"serving {args.artifact} ({model.dtype}, version {model.version}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    serve(model, host=args.host, port=args.port,
          cfg=ServerConfig(max_wait_ms=args.max_wait_ms, max_batch_rows=args.max_batch_rows, watch_s=args.watch,
                           admin_token=token))
    return 0
