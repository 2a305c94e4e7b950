"""Host metrics through psutil."""

from __future__ import annotations

from tests.monitoring.helpers import parse, scrape, value

from apiary.monitoring.host import HostCollector


def test_host_metrics_present():
    collector = HostCollector("node-h")
    scrape(collector)  # the CPU ratio of the second scrape is a delta
    s = parse(scrape(collector))
    assert 0 <= value(s, "apiary_host_cpu_utilization_ratio", Hostname="node-h") <= 1
    total = value(s, "apiary_host_memory_total_bytes", Hostname="node-h")
    used = value(s, "apiary_host_memory_used_bytes", Hostname="node-h")
    avail = value(s, "apiary_host_memory_available_bytes", Hostname="node-h")
    assert total > 0 and used > 0 and avail > 0 and used + avail == total
    assert value(s, "apiary_host_memory_used_ratio", Hostname="node-h") == used / total
    assert 0 < value(s, "apiary_host_disk_used_ratio", Hostname="node-h", mountpoint="/") < 1
    assert value(s, "apiary_host_disk_free_bytes", Hostname="node-h", mountpoint="/") > 0
    assert s["apiary_host_network_receive_bytes_total"]
    assert s["apiary_host_network_transmit_bytes_total"]
    for name in ("apiary_host_network_receive_bytes_total", "apiary_host_network_transmit_bytes_total"):
        assert all(x.labels["Hostname"] == "node-h" and x.labels["device"] != "lo" for x in s[name])


def test_explicit_mountpoints_skip_missing(tmp_path):
    s = parse(scrape(HostCollector("node-h", mountpoints=[str(tmp_path), "/does/not/exist"])))
    assert [x.labels["mountpoint"] for x in s["apiary_host_disk_used_ratio"]] == [str(tmp_path)]
