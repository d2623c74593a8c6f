"""hugeembed serve: predictions over HTTP from an exported artifact (POST /predict, /healthz, /metrics, /reload)."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an exported model over HTTP", description=__doc__, allow_abbrev=False)
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
    # requests are bounded: their size, rows, waiting rows, time and count
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger bodies get 413 (default 8 MiB)")
    p.add_argument("--max-request-rows", type=int, help="rows of one request; more get 413 (default: --max-batch-rows)")
    p.add_argument("--max-queue-rows", type=int,
                   help="rows that may wait for the model; a request that does not fit gets 503 with Retry-After "
                        "(default: 4 x --max-batch-rows)")
    p.add_argument("--request-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request not answered this long after it arrived gets 504")
    p.add_argument("--limit-concurrency", type=int, default=64,
                   help="connections and requests at once; more get 503 (uvicorn)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a name the Host header may give besides localhost, 127.0.0.1, ::1 and --host (repeat it; "
                        "'*': any). Other names get 400, so a web page cannot reach the server by DNS rebinding")


def _passive_openmp(argv: list[str]) -> None:
    """Runs this command again with OMP_WAIT_POLICY=PASSIVE, unless an OpenMP wait policy is set already.

    The model calls run on one thread of their own; alone in OpenMP with --threads 2 on 2 CPUs that
    other processes also use, each call took 40-140 ms instead of 1-8 (measured: libgomp's workers
    spin at full count while the threads it manages fit the CPUs, and a spinning worker holds the CPU
    its master waits for).  PASSIVE workers sleep at once.  libgomp reads the variable when it loads
    (with torch, before this runs): hence the new process image (same pid)."""
    if os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT"):
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "hugeembed", *argv])


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import ConfigError
    from ..serving import ServingModel
    from ..serving._server import LOOPBACK_HOSTS, ServerConfig, serve

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.max_wait_ms < 0 or args.max_batch_rows < 1 or args.watch < 0:
        raise ConfigError("--max-wait-ms and --watch must be >= 0 and --max-batch-rows >= 1")
    from ..serving._trust import read_secret

    token = read_secret(args.admin_token, "--admin-token").decode(errors="replace").strip() if args.admin_token \
        else None
    if args.admin_token and not token:
        raise ConfigError(f"--admin-token {args.admin_token} holds no token")
    key = read_secret(args.delta_key, "--delta-key") if args.delta_key else None
    wildcard = args.host in ("0.0.0.0", "::", "")
    allowed = (*LOOPBACK_HOSTS, *(() if wildcard else (args.host,)), *args.allow_host)
    cfg = ServerConfig(max_wait_ms=args.max_wait_ms, max_batch_rows=args.max_batch_rows, watch_s=args.watch,
                       admin_token=token,
                       max_body_bytes=args.max_body_bytes, max_request_rows=args.max_request_rows,
                       max_queue_rows=args.max_queue_rows, request_timeout_s=args.request_timeout,
                       allowed_hosts=allowed, limit_concurrency=args.limit_concurrency)
    if args.argv == sys.argv[1:]:  # the command line's own process (not main([...]) called in another)
        _passive_openmp(args.argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .._native import tune_malloc

    tune_malloc()  # batch-sized buffers (a 4096-row call's pooled rows: 27 MB at d64) reused, not faulted in afresh
    model = ServingModel.load(args.artifact, delta_key=key)
    if model.refused is not None:  # served: the longest valid prefix of the chain
        print(f"hugeembed serve: {model.refused}; serving {model.version}", file=sys.stderr, flush=True)
    print(f"serving {args.artifact} ({model.dtype}, version {model.version}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    if wildcard and not args.allow_host:
        print(f"note: requests must name {', '.join(allowed)} in their Host header; add --allow-host NAME for the "
              f"names clients reach this machine by", file=sys.stderr, flush=True)
    serve(model, host=args.host, port=args.port, cfg=cfg)
    return 0
