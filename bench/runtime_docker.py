"""Start latency with the Docker runtime (issue "Containers").

:func:`measure_docker_start`: on an idle embedded platform with ``runtime="docker"`` (no Prefect;
a generated 2-node x 8-GPU simulated cluster), the mnist example's image built and pushed to the
platform's registry first, ``samples`` 1-GPU jobs naming ``openpai/pai.example.pytorch`` (the
image map resolves it to the registry image) and running ``sleep 0.2`` are submitted one at a time
through the REST API, each after the previous one's task started. Latency = the task's
``startTime`` (the container's ``State.StartedAt``, read by the agent) minus the job's
``submissionTime`` (control-plane clock at acceptance); ``warmup`` jobs first, not counted (the
first one pulls the image from the registry into dockerd's store).

Runs alone too: ``.venv/bin/python bench/runtime_docker.py [--samples N]`` (prints, writes nothing).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
for _p in (str(_BENCH.parent / "platform"), str(_BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from apiary.images.build import build_example  # noqa: E402
from apiary.images.daemons import docker_client, ensure_dockerd  # noqa: E402
from lifecycle import _wait_started, job_yaml, parse_iso, percentile, start_platform  # noqa: E402

IMAGE = "openpai/pai.example.pytorch"


@dataclass
class DockerStart:
    samples: list[float] = field(default_factory=list)
    nodes: int = 2
    gpus_per_node: int = 8
    image: str = ""

    def to_dict(self) -> dict:
        return {
            "docker_start_p50_s": round(percentile(self.samples, 50), 3),
            "docker_start_p99_s": round(percentile(self.samples, 99), 3),
            "docker_start_max_s": round(max(self.samples), 3),
            "docker_start_samples": len(self.samples),
            "docker_start_image": self.image,
        }


def measure_docker_start(samples: int = 50, *, warmup: int = 2, nodes: int = 2, gpus_per_node: int = 8,
                         per_job_timeout_s: float = 120.0) -> DockerStart:
    """See the module doc. Needs root, dockerd (started if it does not answer), docker-registry
    and the ``apiary/base:bookworm`` image (``apiary image build-base``)."""
    ensure_dockerd(Path("/tmp/apiary-bench-dockerd.log"))
    res = DockerStart(nodes=nodes, gpus_per_node=gpus_per_node)
    plat = start_platform(nodes, gpus_per_node, prefect=False, runtime="docker")
    try:
        assert plat.emb.registry is not None
        res.image = build_example(docker_client(), "mnist", plat.emb.registry.address)
        stamp = int(time.time())
        for i in range(warmup + samples):
            job = plat.client.submit(job_yaml(f"dock-{stamp}-{i:04d}", "sleep 0.2", image=IMAGE))
            started = _wait_started(plat.client, job["id"], per_job_timeout_s, 0.02)
            if i >= warmup:
                res.samples.append(parse_iso(started["tasks"][0]["startTime"]) - parse_iso(started["submissionTime"]))
        return res
    finally:
        plat.close()


def method(section: dict) -> str:
    return (f"docker_start_p50_s/p99_s/max_s: over {section.get('docker_start_samples')} jobs, "
            + " ".join((__doc__ or "").split("\n\n")[1].split()))


if __name__ == "__main__":
    import argparse
    import logging

    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=50)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    for k, v in measure_docker_start(args.samples).to_dict().items():
        print(f"{k}: {v}")
