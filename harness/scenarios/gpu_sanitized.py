"""Run the ordering scenarios under PyTorch's CUDA stream sanitizer (CSAN); started by
test_sanitizer.py as `TORCH_CUDA_SANITIZER=1 python -m kvgate.harness.scenarios.gpu_sanitized --mode M`.

  --mode ordered   every scenario with the real engine (torch path): CSAN must stay
                   silent and every page must be byte-exact.
  --mode control   every scenario with its ordering edge dropped: CSAN must flag each.
One line per scenario: `SCENARIO <name> valid=<...>` / `CSAN-FLAGGED <name>: ...` /
`CSAN-SILENT <name>`. The pool daemon runs in a thread of this process.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ordered", "control"), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--delay-cycles", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    if not os.environ.get("TORCH_CUDA_SANITIZER"):
        print("TORCH_CUDA_SANITIZER is not set: nothing would be checked", file=sys.stderr)
        return 2

    import torch
    from torch.cuda._sanitizer import CUDASanitizerErrors

    from kvgate.faults.gpu_controls import UnorderedTransferEngine
    from kvgate.harness.system.pool import DEFAULT_TENANT, thread_pool
    from kvpool.client.pool_client import PoolClient
    from kvpool.gpu.config import CopyPath
    from kvpool.gpu.transfer import TransferEngine
    from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, POOL_PAGE, Scenario, namespace, run_scenario

    daemon = thread_pool(page_size=POOL_PAGE, num_pages=128, token="csan")
    client = PoolClient(f"unix:{daemon.unix_path}", DEFAULT_TENANT, "csan")
    geom = GEOMETRIES["nfirst-16k"]
    failures = 0
    try:
        for i, scenario in enumerate(Scenario):
            ns = namespace(geom, f"csan-{args.mode}-{i}")

            def make(layers, drop, ns=ns):  # noqa: ANN001, ANN202
                cfg = geom.config(CopyPath.TORCH, graphs=False)  # the sanitizer sees no kernel inside a graph
                if drop is None:
                    return TransferEngine(client, ns, layers, cfg)
                return UnorderedTransferEngine(client, ns, layers, cfg, drop=drop)

            try:
                verdict = run_scenario(scenario, geom, make, client, ns, args.seed + i, args.delay_cycles, copies=2,
                                       drop=args.mode == "control")
            except CUDASanitizerErrors as exc:
                first = str(exc.errors[0]).strip().splitlines()
                print(f"CSAN-FLAGGED {scenario.value}: {' | '.join(first[:3])}", flush=True)
                if args.mode == "ordered":
                    print("\n".join(str(e) for e in exc.errors), flush=True)
                    failures += 1
                torch.cuda.synchronize()
                continue
            print(f"SCENARIO {scenario.value} valid={verdict.valid} {verdict.reason} {verdict.evidence}", flush=True)
            if args.mode == "control":
                print(f"CSAN-SILENT {scenario.value}", flush=True)
                failures += 1
            elif verdict.valid is not True:
                failures += 1
    finally:
        client.close()
        daemon.stop_thread()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
