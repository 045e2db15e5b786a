"""`tracetop control --collector ADDR --run RUN <command>`: a person's command to a running job.

    set-micro-batch N     a new micro-batch size on every rank, the global batch kept (sent at once)
    offload on|off        optimizer-state offload (ZeRO 1/2/3 runs)
    rebalance N,N,...     samples per data-parallel replica each step, summing to the global batch
                          (straggler mitigation, docs/control.md); equal counts: back to balanced
    approve ID            send a proposal (the controller's, in advise mode)
    reject ID             drop a proposal; nothing is sent
    rollback ID           undo an applied action on every rank (a new action)

The collector refuses a command the run cannot apply at once, with the reason (exit 2), and
sends nothing. Otherwise it prints the action's id and state; `tracetop actions` follows it.
"""

from __future__ import annotations

import argparse

from collector.control import client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", default="", help="the run id (required except for approve/reject/rollback)")
    parser.add_argument("command", choices=("set-micro-batch", "offload", "rebalance", "approve", "reject", "rollback"))
    parser.add_argument("value", help="N for set-micro-batch, on|off for offload, N,N,... for rebalance, the action id "
                        "otherwise")
    client.add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import grpc

    from tracetop import env
    from tracetop.wire import tracetop_pb2 as pb
    from tracetop.wire import tracetop_pb2_grpc as pb_grpc

    req = pb.ControlRequest(run_id=args.run, reason=args.reason, by=client.who(args.by))
    if args.command in ("set-micro-batch", "offload", "rebalance"):
        if not args.run:
            return _fail(f"{args.command} needs --run RUN (the run id, see `tracetop query ... \"SELECT * FROM runs\"`)")
        req.op, req.approve, req.rule = pb.PROPOSE, True, "manual"
        if args.command == "rebalance":
            parts = args.value.split(",")
            if len(parts) < 2 or not all(p.strip().isdigit() for p in parts):
                return _fail(f"rebalance {args.value!r}: give the samples of each data-parallel replica, comma-separated, "
                             "e.g. 18,18,17,11 (summing to the global batch)")
            counts = [int(p) for p in parts]
            # the replica relieved: the one given least (-1: equal counts, back to balanced)
            relieved = -1 if len(set(counts)) == 1 else min(range(len(counts)), key=counts.__getitem__)
            req.kind, req.int_value = pb.REBALANCE, relieved
            req.values.extend(counts)
        elif args.command == "set-micro-batch":
            if not args.value.isdigit() or int(args.value) < 1:
                return _fail(f"set-micro-batch {args.value!r}: give a positive whole number of samples, e.g. 2")
            req.kind, req.int_value = pb.SET_MICRO_BATCH, int(args.value)
        else:
            if args.value not in ("on", "off"):
                return _fail(f"offload {args.value!r}: use on or off")
            req.kind, req.int_value = pb.OFFLOAD_OPTIMIZER, int(args.value == "on")
    else:
        req.op = {"approve": pb.APPROVE, "reject": pb.REJECT, "rollback": pb.ROLLBACK}[args.command]
        req.action_id = args.value
    from tracetop.wire.auth import AuthSetupError, client_auth_from_args

    try:
        auth = client_auth_from_args(args)
    except AuthSetupError as e:
        return _fail(str(e))
    addr = env.collector(args.collector)
    with auth.channel(addr) as channel:
        try:
            reply = pb_grpc.ControlStub(channel).Submit(req, timeout=30, metadata=auth.metadata())
        except grpc.RpcError as e:
            return client.rpc_failure("control", e, addr)
    print(f"action {reply.action_id}: {reply.state}" + (f" ({reply.message})" if reply.message else ""))
    return 0


def _fail(msg: str) -> int:
    return client.fail("control", msg)
