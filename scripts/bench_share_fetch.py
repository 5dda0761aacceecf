"""Planning from headers and fetching by shares, timed (issue 35; not in CI).

    python -m scripts.bench_share_fetch MODEL.gguf [--parts 3] [--stages 1 2 3]

Splits MODEL into ``--parts`` files (scripts/gguf_split.py), serves them from the hub
stand-in (tests/helpers/hub_standin.py, on loopback), then reports, on this machine:

- planning: the time and the bytes to pin the model and plan it from its headers
  (`pin_hub_model`, `read_model`, `build_plan` with each stage's share);
- for each stage count N: each stage's share (MB) and the time its node's host takes to
  fetch it into an empty cache, against the time the same link takes to move as many bytes
  of one plain download of the whole files (the fetch's own overhead: range requests,
  sparse writes, the record, the header checks), and the bytes fetched against the share.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: scripts/ and the packages importable
    sys.path.insert(0, str(REPO_ROOT))

from activities.gguf_facts import read_model  # noqa: E402
from activities.planning import with_shares  # noqa: E402
from mvp_core.models import HubModel  # noqa: E402
from mvp_core.planner import build_plan  # noqa: E402
from mvp_io.model_store import pin_hub_model  # noqa: E402
from mvp_io.share_fetch import fetch_share  # noqa: E402
from scripts.gguf_split import split_gguf  # noqa: E402
from scripts.host_cpu import cpu_model  # noqa: E402
from tests.helpers.hub_standin import HubStandin  # noqa: E402

REPO = "bench/model-GGUF"


def plain_download_rate(hub: HubStandin, parts: list[Path], commit: str) -> float:
    """Bytes per second of plain whole-file GETs of every part over the same link."""
    moved, t0 = 0, time.perf_counter()
    for part in parts:
        url = f"{hub.url}/{REPO}/resolve/{commit}/{part.name}"
        with urllib.request.urlopen(url, timeout=60) as resp:
            while chunk := resp.read(1 << 20):
                moved += len(chunk)
    return moved / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", type=Path)
    ap.add_argument("--parts", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-share-"))
    try:
        (work / "src").mkdir()
        parts = split_gguf(args.model, work / "src" / args.model.stem, args.parts)
        size = sum(p.stat().st_size for p in parts)
        print(f"{args.model.name}: {size / 1e9:.2f} GB in {len(parts)} parts; {cpu_model()}")
        with HubStandin() as hub:
            commit = ""
            for part in parts:
                commit = hub.add_file(REPO, part.name, part)
            rate = plain_download_rate(hub, parts, commit)
            print(f"plain whole-file download over the stand-in: {rate / 1e6:.0f} MB/s")
            os.environ["HF_ENDPOINT"] = hub.url
            for stages in args.stages:
                os.environ["MVP_MODELS_DIR"] = str(work / f"planner-{stages}")
                sent0 = hub.bytes_sent()
                t0 = time.perf_counter()
                paths, pin = pin_hub_model(HubModel(repo=REPO, file=parts[0].name))
                facts, _files, header = read_model(paths[0])
                plan = build_plan(
                    run_id=1,
                    orchestrator_node_id=0,
                    base_node_id=1,
                    stage_count=stages,
                    max_context=None,
                    facts=facts,
                    model_path=paths[0],
                    tokenizer_path=paths[0],
                )
                plan = with_shares(plan.model_copy(update={"model_files": paths}), header, pin)
                planning_s = time.perf_counter() - t0
                print(
                    f"{stages} stage(s): planning {planning_s:.2f} s, "
                    f"{(hub.bytes_sent() - sent0) / 1e6:.1f} MB read (headers)"
                )
                for stage in plan.stages:
                    share = plan.share_of(stage.stage_index)
                    assert share is not None
                    host = work / f"host-{stages}-{stage.stage_index}"
                    share = share.model_copy(
                        update={"paths": [str(host / part.file) for part in pin.parts]}
                    )
                    sent0 = hub.bytes_sent()
                    t0 = time.perf_counter()
                    fetched = fetch_share(share.model_dump(mode="json"))
                    took = time.perf_counter() - t0
                    own = share.size / rate
                    print(
                        f"  stage {stage.stage_index} (layers {stage.layers.start}-"
                        f"{stage.layers.end - 1}): share {share.size / 1e6:.1f} MB "
                        f"({100 * share.size / size:.0f}% of the model), fetched "
                        f"{fetched / 1e6:.1f} MB, sent {(hub.bytes_sent() - sent0) / 1e6:.1f} "
                        f"MB in {took:.2f} s; its bytes by plain download {own:.2f} s "
                        f"({took / own:.2f}x)"
                    )
                    shutil.rmtree(host)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
