"""The soak's figure: over the run, the pool's cells (held and cached, against its size), the
requests running, waiting and parked, and the server's resident memory against the warm-up's
level and the 10 % line the verdict allows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpark.bench.report import pyplot
from kvpark.bench.soak.judge import RSS_SLACK


def write_soak_plot(path: Path, doc: dict[str, Any]) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    series: list[dict[str, float]] = doc["series"]
    t = [row["t_s"] for row in series]

    def column(name: str) -> list[float]:
        return [row.get(name, float("nan")) for row in series]

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    cells = axes[0]
    cells.plot(t, column("kvpark_kv_cells_used"), label="held by requests")
    cells.plot(t, column("kvpark_kv_cells_cached"), label="cached pages")
    cells.axhline(doc["config"]["kv_cells"], color="grey", linestyle=":", label="pool size")
    cells.set_ylabel("KV cells")
    cells.legend(loc="upper right", fontsize=8)
    requests = axes[1]
    for name, label in (("running", "running"), ("waiting", "waiting"), ("preempted", "parked")):
        requests.plot(t, column(f"kvpark_requests_{name}"), label=label)
    requests.set_ylabel("requests")
    requests.legend(loc="upper right", fontsize=8)
    rss = axes[2]
    rss.plot(t, [v / 2**20 for v in column("rss_bytes")], label="resident memory")
    warm = doc["end"]["rss_warm_bytes"] / 2**20
    rss.axhline(warm, color="grey", linestyle=":", label="after warm-up")
    rss.axhline(warm * (1 + RSS_SLACK), color="red", linestyle=":", label="+10 %")
    rss.set_ylabel("MiB")
    rss.set_xlabel("seconds")
    rss.legend(loc="lower right", fontsize=8)
    verdict = "passed" if doc["verdict"]["passed"] else "FAILED"
    ran = doc["verdict"]["fates"]
    fig.suptitle(f"kvpark soak: {sum(ran.values())} requests, {verdict} ({doc['machine']['cpu']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
