"""``make bench-scrape``: what scraping the metrics endpoint costs a training node.

Two lone ``tiny`` nodes run one after the other for the same number of outer steps (H = 50,
synchronous, one thread each): one untouched, one scraped ``--rate`` times a second (0: back to
back) until at least ``--scrapes`` scrapes, each parsed with prometheus_client's parser. Reports
scrape errors, the median and p99 latency, and the median tokens/s of the rounds of each run (the
daemon's own per-round figure). The scraper runs on the same machine, so back to back it also
takes CPU from the node; Prometheus scrapes every 15 s by default.

    python -m bench.scrape --rate 10 --scrapes 1000
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tests.harness.localswarm import REPO, LocalNode, leave_all

ARGS = ["--model", "tiny", "--inner-steps", "50", "--warmup-steps", "5", "--min-replicas", "1",
        "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0",
        "--announce-period", "2", "--eval-batches", "1"]


def scrape_loop(url: str, stop: threading.Event, out: dict, rate: float) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    while not stop.is_set():
        if rate > 0:
            time.sleep(max(0.0, 1 / rate - (time.monotonic() - out.get("last", 0.0))))
        t = out["last"] = time.monotonic()
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            families = {f.name for f in text_string_to_metric_families(text)}
            if "dilocox_outer_step" not in families:
                raise ValueError("dilocox_outer_step missing")
            out["latencies"].append(time.monotonic() - t)
        except Exception as e:  # counted: the figure is how many scrapes fail
            out["errors"].append(repr(e))


def run_one(workdir: Path, outer_steps: int, scrape: bool, rate: float = 0.0, scrapes: int = 0) -> dict:
    node = LocalNode("scraped" if scrape else "quiet", workdir, ARGS + ["--run-id", f"scrape-{int(scrape)}"])
    node.wait_started()
    out: dict = dict(latencies=[], errors=[])
    stop = threading.Event()
    try:
        if scrape:
            url = next(line.split()[-1] for line in node.out_path.read_text().splitlines()
                       if line.startswith("metrics:"))
            thread = threading.Thread(target=scrape_loop, args=(url, stop, out, rate), daemon=True)
            thread.start()
        node.wait_for(lambda n: len(n.metrics()) >= outer_steps and len(out["latencies"]) + len(out["errors"])
                      >= scrapes,
                      60 * outer_steps + 10 * scrapes, f"{outer_steps} outer steps and {scrapes} scrapes")
    finally:
        stop.set()
        leave_all([node])
    rounds = node.metrics()[1:]  # the first round holds the start-up
    return dict(scrape=scrape, tokens_per_second=statistics.median(r["tokens_per_second"] for r in rounds),
                scrapes=len(out["latencies"]), errors=len(out["errors"]), first_errors=out["errors"][:3],
                median_ms=1000 * statistics.median(out["latencies"]) if out["latencies"] else None,
                p99_ms=1000 * sorted(out["latencies"])[int(0.99 * len(out["latencies"]))] if out["latencies"] else None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outer-steps", type=int, default=20)
    ap.add_argument("--rate", type=float, default=10.0, help="scrapes per second (0: back to back)")
    ap.add_argument("--scrapes", type=int, default=1000, help="at least this many scrapes")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "scrape.json")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dilocox-scrape-"))
    try:
        quiet = run_one(work / "quiet", a.outer_steps, scrape=False)
        scraped = run_one(work / "scraped", a.outer_steps, scrape=True, rate=a.rate, scrapes=a.scrapes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = scraped["tokens_per_second"] / quiet["tokens_per_second"]
    report = dict(rate=a.rate, quiet=quiet, scraped=scraped, tokens_per_second_ratio=round(ratio, 4))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"{scraped['scrapes']} scrapes at {a.rate:g}/s, {scraped['errors']} errors, "
          f"median {scraped['median_ms']:.1f} ms, "
          f"p99 {scraped['p99_ms']:.1f} ms; tokens/s median {quiet['tokens_per_second']:.0f} quiet vs "
          f"{scraped['tokens_per_second']:.0f} scraped ({100 * (ratio - 1):+.1f}%) -> {a.out}")


if __name__ == "__main__":
    main()
