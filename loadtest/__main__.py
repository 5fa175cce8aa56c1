"""``python -m loadtest <command>``: ``run`` (live load test, :mod:`loadtest.run`),
``replay`` (live trace replay through the gateway and peer routers, :mod:`loadtest.replay`),
``simulate`` (the cluster simulator, :mod:`loadtest.simulate`), ``chaos`` (the fault
catalogue, :mod:`loadtest.chaos`), ``fuzz`` (schemathesis against a live gateway,
:mod:`loadtest.fuzz`) or ``admission`` (cost of keys and limits, :mod:`loadtest.admission`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m loadtest {run,replay,simulate,chaos,fuzz,admission} [options]

  run        live load test: workers + gateway per policy, locust headless, report + plots
  replay     live closed-loop trace replay: gateway (and --peers) on the same workers
  simulate   cluster simulator (same as python -m loadtest.simulate)
  chaos      fault catalogue under steady load: kills, stops, Redis faults, drains, aborts
  fuzz       schemathesis against a live gateway: every status counted, 0 5xx expected
  admission  latency of keys and limits side by side; how a 64-prompt batch is counted

python -m loadtest run --help   for the options
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "run":
        from loadtest.run import main as run_main

        return run_main(rest)
    if command == "replay":
        from loadtest.replay import main as replay_main

        return replay_main(rest)
    if command == "admission":
        from loadtest.admission import main as admission_main

        return admission_main(rest)
    if command == "fuzz":
        from loadtest.fuzz import main as fuzz_main

        return fuzz_main(rest)
    if command == "simulate":
        from loadtest.simulate import main as simulate_main

        return simulate_main(rest)
    if command == "chaos":
        from loadtest.chaos import main as chaos_main

        return chaos_main(rest)
    print(f"python -m loadtest: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
