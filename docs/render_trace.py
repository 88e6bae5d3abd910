"""Draw docs/trace.png from real exported spans: runs ``quire up --once`` with the OTEL_*
variables pointing at a loopback OTLP receiver (tests/otlp_receiver.py), then renders the trace
of its example request as a waterfall, the way Jaeger or Tempo lay it out.

    python -m docs.render_trace [--out docs/trace.png] [-- extra `quire up` flags]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from tests.otlp_receiver import OTLPReceiver, ReceivedSpan

_COLORS = {"quire-router": "#4c72b0", "quire-engine": "#dd8452"}


def collect(up_flags: list[str]) -> list[ReceivedSpan]:
    receiver = OTLPReceiver().start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint}
        subprocess.run([sys.executable, "-m", "quire_cli", "up", "--once", "true",
                        "--router-port", "0", "--http-port", "0", *up_flags],
                       check=True, env=env)
        return receiver.spans()
    finally:
        receiver.stop()


def _label(span: ReceivedSpan) -> list[str]:
    a = span.attributes
    if span.service == "quire-router":
        scores = ", ".join(f"{c} {s:.3f}" for c, s in zip(a["quire.routing.candidates"],
                                                          a["quire.routing.scores"]))
        return [f"policy {a['quire.routing.policy']}; scores: {scores}",
                f"chosen {a['quire.routing.engine_id']}, predicted cached tokens "
                f"{a['quire.routing.predicted_cached_tokens']} of "
                f"{a['quire.routing.num_prompt_tokens']}, attempts {a['quire.routing.attempts']}"]
    return [f"{a['gen_ai.request.model']}: {a['gen_ai.usage.input_tokens']} in "
            f"({a['quire.usage.cached_tokens']} cached), {a['gen_ai.usage.output_tokens']} out, "
            f"finish {a['gen_ai.response.finish_reasons']}",
            f"queue {a['quire.queue_time_s'] * 1e3:.1f} ms, time to first token "
            f"{a['quire.time_to_first_token_s'] * 1e3:.1f} ms"]


def render(spans: list[ReceivedSpan], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    root = next(s for s in spans if s.service == "quire-router")
    trace = sorted((s for s in spans if s.trace_id == root.trace_id), key=lambda s: s.start_ns)
    t0 = root.start_ns
    total_ms = (max(s.end_ns for s in trace) - t0) / 1e6
    row_height = 2.4
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.9 * len(trace)))
    for row, span in enumerate(trace):
        y = -row * row_height
        start_ms, end_ms = (span.start_ns - t0) / 1e6, (span.end_ns - t0) / 1e6
        ax.barh(y, end_ms - start_ms, left=start_ms, height=0.5,
                color=_COLORS.get(span.service, "#999"))
        ax.text(0, y + 0.4, f"{span.service}  {span.name}  ({end_ms - start_ms:.1f} ms)",
                fontsize=9, weight="bold")
        level, last_ms = 0, None
        for name, time_ns, _ in span.events:  # event names under the bar, staggered if close
            at_ms = (time_ns - t0) / 1e6
            level = level + 1 if last_ms is not None and at_ms - last_ms < total_ms / 12 else 0
            last_ms = at_ms
            ax.plot([at_ms, at_ms], [y - 0.25, y + 0.25], color="black", lw=1.2)
            ax.text(at_ms, y - 0.45 - 0.25 * level, name, fontsize=7, ha="left")
        for i, line in enumerate(_label(span)):
            ax.text(0, y - 1.25 - 0.27 * i, line, fontsize=8, color="#333")
    ax.set_yticks([])
    ax.set_xlabel("ms since the router received the request")
    ax.set_ylim(-row_height * (len(trace) - 1) - 1.9, 0.8)
    ax.set_title(f"trace {root.trace_id}: `quire up` example request, spans as exported over "
                 f"OTLP", fontsize=10)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/trace.png")
    parser.add_argument("up_flags", nargs="*", help="passed to `quire up`")
    ns = parser.parse_args()
    render(collect(ns.up_flags), ns.out)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
